"""Strategy names without importing lzero: the start-up hook installed with the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import _lzero_startup
from _launch import run_script

ROOT = Path(__file__).resolve().parents[1]


def python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_interpreter_start_imports_neither_torch_nor_lzero() -> None:
    out = python("import sys; print('_lzero_startup' in sys.modules, 'torch' in sys.modules, 'lzero' in sys.modules)")
    assert out == "True False False"


def test_import_lightning_registers_names_but_does_not_import_lzero() -> None:
    out = python(
        "import sys, lightning\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print(sorted(k for k in StrategyRegistry if k.startswith('zero')), 'lzero' in sys.modules)"
    )
    assert out == f"{sorted(_lzero_startup.PRESETS)} False"


def test_trainer_by_name_in_fresh_interpreter(tmp_path: Path) -> None:
    out = tmp_path / "result.txt"
    run_script("fresh_interpreter.py", str(out))
    assert out.read_text().strip() == "lzero.strategy.ZeroStrategy stage=2 world_size=2 steps=4 moved=True"


def test_missing_hook_module_never_breaks_start() -> None:
    pth = (ROOT / "lzero_startup.pth").read_text()
    out = python(f"import sys\nsys.modules['_lzero_startup'] = None\nexec({pth!r})\nprint('alive')")
    assert out == "alive"


def test_reregistration_is_harmless() -> None:
    out = python(
        "import _lzero_startup\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "_lzero_startup.register(StrategyRegistry); _lzero_startup.register(StrategyRegistry)\n"
        "import lzero\n"
        "lzero.ZeroStrategy.register_strategies(StrategyRegistry)\n"
        "s = StrategyRegistry.get('zero1')\n"
        "print(type(s).__name__, s.config.stage)"
    )
    assert out == "ZeroStrategy 1"


def test_strategy_yaml_per_preset() -> None:
    import yaml

    for name in _lzero_startup.PRESETS:
        spec = yaml.safe_load((ROOT / "strategies" / f"{name}.yaml").read_text())
        assert spec["class_path"] == "lzero.ZeroStrategy"
        assert spec["init_args"]["config"]["stage"] == int(name[-1])
