"""`lzero consolidate` on a ~50 MB checkpoint: peak memory grows by less than 3x its largest tensor.

The checkpoint is written by one process and consolidated by a fresh one, whose peak resident set (VmHWM) is reset
(``/proc/self/clear_refs``) and read after warm-up consolidations of a tiny checkpoint, and again after each real
one (to ``.ckpt``, then ``.safetensors``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SAVE = r"""
import sys
from pathlib import Path
from benchmarks.checkpoint.ckpt_model import build, save

model, engine, zopt = build(n_layers=16, width=880, adam_state=False)  # 16 x 775k params: 49.6 MB of fp32
save(Path(sys.argv[1]), model, engine, zopt)
save(Path(sys.argv[2]), *build(n_layers=1, width=8, adam_state=False))
print("LARGEST", max(p.numel() * 4 for p in model.parameters()))
"""

CONSOLIDATE = r"""
import sys
from lzero.cli import main

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

for suffix in sys.argv[4:]:
    assert main(["consolidate", sys.argv[2], sys.argv[3] + ".warmup" + suffix]) == 0  # one-time costs
for suffix in sys.argv[4:]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from the current one
    before = hwm()
    assert main(["consolidate", sys.argv[1], sys.argv[3] + suffix]) == 0
    print("GROWN", suffix, hwm() - before)
"""


def test_consolidation_streams(tmp_path: Path) -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # freed tensor memory goes back to the OS at once
    big, small = tmp_path / "big.ckpt", tmp_path / "small.ckpt"
    proc = subprocess.run([sys.executable, "-c", SAVE, str(big), str(small)], cwd=ROOT,  # benchmarks: a package there
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    largest = int(proc.stdout.split("LARGEST")[1])
    out = tmp_path / "model"  # one fresh process consolidates both formats, its peak reset before each
    proc = subprocess.run([sys.executable, "-c", CONSOLIDATE, str(big), str(small), str(out), ".ckpt", ".safetensors"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for suffix in (".ckpt", ".safetensors"):
        grown = int(proc.stdout.split(f"GROWN {suffix}")[1].split()[0])
        size = Path(str(out) + suffix).stat().st_size
        print(f"{suffix}: {size / 1e6:.1f} MB written, peak grew {grown / 1e6:.2f} MB, largest tensor"
              f" {largest / 1e6:.2f} MB")
        assert size > 49e6
        assert grown < 3 * largest
