"""DeepSpeed compatibility: a DeepSpeed JSON configuration translated into lzero's (``config``, every key
honoured or refused by name, ``keys`` lists them), its ``optimizer`` and ``scheduler`` blocks (``optim``,
``schedules``), and DeepSpeed checkpoints converted (``convert``).
"""
