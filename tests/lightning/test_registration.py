"""Strategy names without importing lzero: the start-up hook installed with the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import _lzero_startup
import pytest
from _launch import run_script

from lzero.config import ZeroConfig
from lzero.presets import PRESET_CONFIGS

ROOT = Path(__file__).resolve().parents[2]


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
    assert out.read_text().strip() == "lzero.lightning.trainer_strategy.ZeroStrategy stage=2 world_size=2 steps=4 moved=True"


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
        "_lzero_startup.register(StrategyRegistry)\n"
        "s = StrategyRegistry.get('zero1')\n"
        "print(type(s).__name__, s.config.stage)"
    )
    assert out == "ZeroStrategy 1"


def test_strategy_yaml_per_preset() -> None:
    import yaml

    for name in _lzero_startup.PRESETS:
        spec = yaml.safe_load((ROOT / "strategies" / f"{name}.yaml").read_text())
        assert spec["class_path"] == "lzero.ZeroStrategy"
        if PRESET_CONFIGS[name]["stage"] == "auto":  # chosen at setup: no configuration to compare
            assert spec["init_args"]["stage"] == "auto"
            continue
        built, preset = ZeroConfig(**spec["init_args"]["config"]), ZeroConfig(**PRESET_CONFIGS[name])
        for key in PRESET_CONFIGS[name]:  # the YAML means what the registered name means
            assert getattr(built, key) == getattr(preset, key), (name, key)


def test_registered_factories_and_strategies_pickle() -> None:
    import pickle

    from lightning.pytorch.strategies import StrategyRegistry

    import lzero

    # one registration path, the start-up hook's, for both doors; both classes are lzero's public names
    assert "register_strategies" not in vars(lzero.ZeroStrategy)
    assert "register_strategies" not in vars(lzero.ZeroFabricStrategy)
    assert lzero.ZeroFabricStrategy.__module__ == "lzero.lightning.fabric_strategy" and "ZeroFabricStrategy" in lzero.__all__
    for name in _lzero_startup.PRESETS:
        factory = pickle.loads(pickle.dumps(StrategyRegistry[name]["strategy"]))
        if name in _lzero_startup.PRESETS:
            strategy = pickle.loads(pickle.dumps(factory(**StrategyRegistry[name]["init_params"])))
            if PRESET_CONFIGS[name]["stage"] == "auto":
                assert strategy._auto
                continue
            assert strategy.config.stage == PRESET_CONFIGS[name]["stage"]
            assert strategy.config == ZeroConfig(**PRESET_CONFIGS[name])


def test_every_registered_name_has_a_configuration() -> None:
    from lzero.presets import PRESET_CONFIGS

    assert PRESET_CONFIGS.keys() == _lzero_startup.PRESETS.keys()


def test_strategy_yamls_ship_inside_the_package() -> None:
    """The wheel carries strategies/ as lzero/strategies/ (checked by hand with `pip wheel` + `unzip -l`), and
    strategy_file finds each preset's YAML from any working directory."""
    import tomllib

    from lzero.presets import strategy_file

    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["force-include"]["strategies"] == "lzero/strategies"
    for name in _lzero_startup.PRESETS:
        path = strategy_file(name)
        assert path.is_absolute() and path.read_text() == (ROOT / "strategies" / f"{name}.yaml").read_text()
    with pytest.raises(KeyError, match="No preset 'zero4'"):
        strategy_file("zero4")
