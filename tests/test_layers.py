"""The package's floors (see the README's "How it is built"): a module imports only from its own floor or the
floors below, so the tree reads top-down. Every import counts: inside functions (a lazy import is still a
dependency) and under ``if TYPE_CHECKING:`` (a type named from above is a dependency of the reader too)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lzero"

FLOORS = [  # bottom first: (floor, the modules and packages on it)
    ("configuration", ["lzero.errors", "lzero.log", "lzero.config", "lzero.presets", "lzero.auto_sizes"]),
    ("offload", ["lzero.offload"]),
    ("engine", ["lzero.engine"]),
    ("memory", ["lzero.memory"]),
    ("checkpoint", ["lzero.checkpoint", "lzero.state_dict"]),
    ("optimizer", ["lzero.optimizer", "lzero.grad_norms"]),
    ("deepspeed", ["lzero.deepspeed"]),
    ("hugging face", ["lzero.hf"]),
    ("lightning: both doors", ["lzero.lightning", "lzero.lightning.args", "lzero.lightning.precision",
                               "lzero.lightning.wiring"]),
    ("lightning: Fabric's door", ["lzero.lightning.fabric_strategy", "lzero.lightning.fabric_model"]),
    ("lightning: the Trainer's door", ["lzero.lightning.trainer_strategy", "lzero.lightning.trainer_precision",
                                       "lzero.lightning.trainer_wiring", "lzero.lightning.trainer_kept",
                                       "lzero.lightning.trainer_pipeline"]),
    ("entry points", ["lzero.cli", "lzero.demo", "lzero"]),
]


def floor_of(module: str) -> int:
    best = (-1, -1)  # (length of the matching prefix, floor)
    for i, (_, members) in enumerate(FLOORS):
        for m in members:
            if (module == m or module.startswith(m + ".")) and len(m) > best[0]:
                best = (len(m), i)
    assert best[1] >= 0, f"{module} is on no floor: add it to FLOORS"
    return best[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, imported module) of every ``lzero`` import."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "lzero")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lzero":
            for a in node.names:  # `from lzero.engine import gather` imports lzero.engine.gather
                sub = f"{node.module}.{a.name}"
                found.append((node.lineno, sub if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                              else node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_no_module_imports_from_a_floor_above_its_own() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        for line, target in imports(ast.parse(path.read_text())):
            if floor_of(target) > floor_of(me):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({FLOORS[floor_of(me)][0]}) imports"
                              f" {target} ({FLOORS[floor_of(target)][0]})")
    assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


def test_every_module_is_on_a_floor() -> None:
    for path in PACKAGE.rglob("*.py"):
        floor_of(module_name(path))


FABRIC_DOOR = ["lzero.lightning.fabric_strategy", "lzero.lightning.fabric_model"]


def lightning_pytorch_imports(tree: ast.AST) -> list[int]:
    """Lines importing ``lightning.pytorch`` (or ``pytorch_lightning``, or a name of it through ``lightning``)."""
    trainer_names = {"Trainer", "LightningModule", "LightningDataModule", "Callback", "pytorch"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + ([f"lightning.{a.name}" for a in node.names if a.name in trainer_names]
                                     if node.module == "lightning" else [])
        else:
            continue
        trainer_paths = {f"lightning.{t}" for t in trainer_names}
        if any(n.startswith(("lightning.pytorch", "pytorch_lightning")) or n in trainer_paths for n in names):
            lines.append(node.lineno)
    return lines


def test_fabric_door_reaches_no_lightning_pytorch() -> None:
    """Fabric's door and every lzero module it imports, however deep (lazy imports too), import nothing of
    ``lightning.pytorch``: Fabric stands without the Trainer, as in Lightning itself."""
    seen, todo, found = set(), list(FABRIC_DOOR), []
    while todo:
        me = todo.pop()
        if me in seen:
            continue
        seen.add(me)
        path = PACKAGE.parent / me.replace(".", "/")
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        tree = ast.parse(path.read_text())
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}" for line in lightning_pytorch_imports(tree)]
        for _, target in imports(tree):
            parts = target.split(".")
            todo += [".".join(parts[:i]) for i in range(2, len(parts) + 1)]  # a module runs its packages first
    assert "lzero.lightning.wiring" in seen and "lzero.engine.engine" in seen  # the walk reached the shared floor
    assert not found, "Fabric's door reaches lightning.pytorch:\n" + "\n".join(found)


PLAIN_TORCH = ["lzero.offload", "lzero.engine"]  # the README: the engine needs only torch
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")


def test_engine_and_offload_import_no_lightning() -> None:
    """No module of the engine or the offload stores imports Lightning (lazy imports too): they log through
    lzero/log.py, and what needs Lightning lives on the lightning floor."""
    found = []
    for package in PLAIN_TORCH:
        for path in sorted((PACKAGE.parent / package.replace(".", "/")).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module]
                else:
                    continue
                found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {n}" for n in names
                          if n.split(".")[0] in LIGHTNING]
    assert not found, "Lightning imported below the lightning floor:\n" + "\n".join(found)


def private_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module.name) of every private name (one leading underscore) that ``tree`` takes from an lzero module:
    by ``from lzero... import _name``, or as ``module._name`` of an lzero module it imported."""
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update({a.asname or a.name.split(".")[0]: a.name for a in node.names
                            if a.name.split(".")[0] == "lzero"})
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lzero":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists():
                    modules[a.asname or a.name] = sub
                elif a.name.startswith("_") and not a.name.startswith("__"):
                    found.append((node.lineno, sub))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append((node.lineno, f"{modules[node.value.id]}.{node.attr}"))
    return found


def test_no_module_takes_a_private_name_of_another() -> None:
    """A leading underscore means "this module's own": a name another module needs is public at its definition
    (or the code that needs it moves next to it)."""
    taken = [f"{path.relative_to(PACKAGE.parent)}:{line} takes {name}"
             for path in sorted(PACKAGE.rglob("*.py")) for line, name in private_imports(ast.parse(path.read_text()))]
    assert not taken, "private names taken across modules:\n" + "\n".join(taken)
