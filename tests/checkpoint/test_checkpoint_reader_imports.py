"""The storage side of lzero/checkpoint/ opens a checkpoint without a run: importing the reader (and
``lzero consolidate``'s module, the DeepSpeed folder's reader and ``lzero import-deepspeed``'s module) in a fresh
interpreter loads neither Lightning, nor torch.distributed beyond what ``import torch`` loads itself, nor the engine,
the optimizer or the strategy; and their sources name none of them."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORAGE = ["pieces.py", "reader.py", "formats.py", "files.py", "tree.py", "stream.py", "consolidate.py", "__init__.py",
           "deepspeed_files.py", "deepspeed_checkpoint.py", "deepspeed_import.py"]
FORBIDDEN = ("lightning", "pytorch_lightning", "torch.distributed", "lzero.engine.engine", "lzero.optimizer",
             "lzero.lightning", "lzero.engine.collectives", "lzero.checkpoint.sharded", "lzero.checkpoint.resume")

# lzero/__init__.py imports the engine for its public names; an empty stand-in package takes its place,
# so that what is loaded below is what the reader itself imports.
FRESH = r"""
import json, sys, types
package = types.ModuleType("lzero")
package.__path__ = [sys.argv[1]]
sys.modules["lzero"] = package
import torch
with_torch = set(sys.modules)
import lzero.checkpoint.reader, lzero.checkpoint.consolidate, lzero.checkpoint.deepspeed_checkpoint
import lzero.checkpoint.formats
import lzero.checkpoint.deepspeed_import
print(json.dumps({"torch_loads_distributed": "torch.distributed" in with_torch,
                  "new": sorted(set(sys.modules) - with_torch)}))
"""


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_reader_imports_no_run_machinery() -> None:
    proc = subprocess.run([sys.executable, "-c", FRESH, str(ROOT / "lzero")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "lzero.checkpoint.reader" in loaded["new"]
    assert [m for m in loaded["new"] if _forbidden(m)] == []
    print("import torch loads torch.distributed:", loaded["torch_loads_distributed"])


def test_storage_sources_import_no_run_machinery() -> None:
    for name in STORAGE:
        tree = ast.parse((ROOT / "lzero" / "checkpoint" / name).read_text())
        imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        imported += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
        assert [m for m in imported if _forbidden(m)] == [], name
