"""Hugging Face interop: pretrained checkpoints read into shards (``from_pretrained`` under zero3) and sharded
lzero checkpoints exported as a ``save_pretrained`` folder (``lzero export-hf``). Needs ``transformers`` only for
what touches a model class; the checkpoint reading and writing need ``safetensors``."""
