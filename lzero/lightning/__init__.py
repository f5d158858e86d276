"""The Lightning glue: lzero's two front doors over one engine, layered as Lightning layers its own.

- Both doors: ``args.py`` (what the strategies' constructors accept), ``precision.py`` (the precision plugin, a
  ``lightning.fabric`` plugin), ``wiring.py`` (meta device, engine start, the ``stage="auto"`` choice, generation).
- Fabric's door, over them, importing nothing of ``lightning.pytorch``: ``fabric_strategy.py``
  (:class:`lzero.ZeroFabricStrategy`) and ``fabric_model.py`` (a model it set up).
- The Trainer's door, over both: ``trainer_strategy.py`` (:class:`lzero.ZeroStrategy`), ``trainer_precision.py``
  (:class:`lzero.ZeroPrecision`), ``trainer_wiring.py`` (callbacks, hooks, the DataLoader) and ``trainer_kept.py``
  (the model a fit leaves sharded).

``tests/test_layers.py`` checks the floors and that Fabric's door reaches no ``lightning.pytorch``."""

import logging

_root, _lzero = logging.getLogger(), logging.getLogger("lzero")
_lzero.setLevel(logging.INFO)  # lzero's lines (lzero/log.py) show as Lightning's own do
if not _root.hasHandlers():
    _lzero.addHandler(logging.StreamHandler())
    _lzero.propagate = False
