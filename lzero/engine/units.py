"""Stage-3 unit policy: which module instances form units, and which unit each parameter joins.

By default the units are the instances of repeated module classes (transformer blocks), found
automatically: a class qualifies if it has two or more instances holding parameters and none of
its instances sits inside an instance of another qualifying class (so ``Block`` wins over the
``Linear`` layers inside it). Users can name the classes instead. A parameter reachable from two
units (weights shared across blocks) and every parameter outside the units forms the root unit.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

from torch import nn

ROOT = ""
"""The label of the root unit: parameters outside every block."""


def find_blocks(module: nn.Module, class_names: Optional[Sequence[str]] = None) -> dict[str, nn.Module]:
    """Module path -> module for every block instance, outermost only."""
    if class_names is not None:
        unknown = set(class_names) - {type(m).__name__ for m in module.modules()}
        if unknown:
            present = sorted({type(m).__name__ for m in module.modules()})
            raise ValueError(
                f"unit_modules names {sorted(unknown)}, which the model does not contain."
                f" HINT: use class names of the model's modules, e.g. one of {present}."
            )
        chosen = set(class_names)
    else:
        chosen = _repeated_outermost_classes(module)
    blocks = {path: m for path, m in module.named_modules() if path and type(m).__name__ in chosen}
    return {p: m for p, m in blocks.items() if not any(p.startswith(q + ".") for q in blocks)}


def _repeated_outermost_classes(module: nn.Module) -> set[str]:
    holders = {path: m for path, m in module.named_modules() if path and any(True for _ in m.parameters())}
    counts = Counter(type(m).__name__ for m in holders.values())
    repeated = {name for name, n in counts.items() if n >= 2}
    nested = set()
    for path, m in holders.items():
        cls = type(m).__name__
        if cls not in repeated:
            continue
        for outer_path, outer in holders.items():
            if path.startswith(outer_path + ".") and type(outer).__name__ in repeated and type(outer).__name__ != cls:
                nested.add(cls)
    return repeated - nested


def label_parameters(module: nn.Module, blocks: dict[str, nn.Module]) -> dict[str, str]:
    """Canonical parameter name -> the block path it belongs to, or ROOT."""
    owners: dict[int, set[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        owner = next((b for b in blocks if name.startswith(b + ".")), ROOT)
        owners.setdefault(id(p), set()).add(owner)
    labels = {}
    for name, p in module.named_parameters():
        found = owners[id(p)]
        labels[name] = next(iter(found)) if len(found) == 1 else ROOT
    return labels
