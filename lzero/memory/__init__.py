"""Memory, predicted and measured: the ZeRO formulas per stage and offload (``estimate``, and its command
``lzero estimate`` in ``estimate_command``), what a running engine holds by kind (``accounting``), the
TensorBoard logger of both (``monitor``), and the ``zero_auto`` choice of stage and offload (``auto``).
"""
