"""Where each unit's state lives (see [Note: shard stores] in ``store.py``): on the compute device, in host
memory (``store``), or in NVMe swap files (``nvme``, ``nvme_store``, checked by ``nvme_checks``); ``placement``
picks the stores a configuration asks for. The bottom floor of the engine: it imports no other part of lzero.
"""
