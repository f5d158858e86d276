"""lzero checkpoints: what a rank's state is, and how it is saved and restored.

Storage, readable without a run (no Lightning, no torch.distributed, nothing of the engine): ``files``
(safetensors-format tensor files, the atomic JSON manifest), ``tree`` (the pickle-free codec),
``stream`` (streaming writers for consolidated outputs), ``pieces`` (a checkpoint read by flat range, whatever
its format), ``reader`` (lzero's sharded checkpoint directory, validated and read so), a DeepSpeed ZeRO folder read the
same way (``deepspeed_files``, ``deepspeed_checkpoint``) or written as an lzero checkpoint (``deepspeed_import``:
``lzero import-deepspeed``), ``formats`` (a directory's reader, in whichever of the two formats it holds) and
``consolidate`` (``lzero consolidate`` / ``lzero inspect``).

A rank's state, for the ranks of a run: ``rank_state`` (the owned pieces of each parameter, the
optimizers' param groups), ``state_dict`` (the module's parameters out as state dicts and in from
pieces), ``full_state`` (optimizer state in torch's per-parameter format, as DDP saves it),
``sharded`` (sharded save, asynchronous saves, loading optimizer shards) and ``resume`` (opening a
checkpoint, and loading it into the shards: what the strategy's checkpoint methods call).

Every refusal is a :class:`CheckpointError` that names the file (or the key inside a tree), says
what is wrong, and ends with a HINT.

[Note: checkpoint files]
A checkpoint is a directory (``epoch=0-step=100.ckpt/``). Every rank writes its own shard files with
:func:`write_tensors`, then rank 0 writes the manifest with :func:`write_json_atomic`. The manifest is
the commit: a directory without one is a save that did not finish. Every file carries the id of the
save that wrote it (``__metadata__["save_id"]`` in a tensor file, checked by :class:`TensorFile`), and
the manifest names that id, so a shard left over from another or an interrupted save is refused
rather than silently mixed in.

Loading never unpickles. Stock ``torch.distributed.checkpoint`` (DCP) does: ``FileSystemReader.
read_metadata`` calls ``pickle.load`` on ``.metadata``, and ``DefaultLoadPlanner.load_bytes`` calls
``torch.load(weights_only=False)`` on every non-tensor item, so opening a DCP checkpoint from an
untrusted place runs whatever code it holds. Here tensors live in safetensors-format files (8-byte
little-endian header length, a JSON header, raw little-endian bytes): the header is validated in full
before a data byte is read, one tensor or one flat range of it is read with a single seek (a rank at a
new world size reads only its part of another rank's shard), and the files open with the
``safetensors`` package and other tools without lzero. The format is implemented here rather than
imported because it is a page long and lzero adds no dependency. Everything that is not a big tensor
(loop, callback and scheduler state, hyperparameters, RNG states) goes through :func:`encode_tree`, a
JSON codec for a fixed list of types that refuses the rest by the key's path; its tensors are written
to a tensor file like any other. Hosts are assumed little-endian, as every platform torch ships for is.

The consolidated outputs are streamed so that peak memory is near the largest tensor, not the model:
:class:`SafetensorsStreamWriter` writes the header from declared entries up front, and
:class:`TorchStreamWriter` writes each storage into torch's zip format as it arrives and the pickle
of the nesting last (a file ``torch.load(weights_only=True)`` reads). Both write to ``<path>.partial``
and rename on a complete close, so ``path`` never holds half a file.
"""


from lzero.checkpoint.files import (DTYPES, CheckpointError, TensorFile, read_json, write_json_atomic,
                                    write_tensors)
from lzero.checkpoint.stream import SafetensorsStreamWriter, StoredTensor, TorchStreamWriter
from lzero.checkpoint.tree import decode_tree, encode_tree

__all__ = [
    "DTYPES",
    "CheckpointError",
    "SafetensorsStreamWriter",
    "StoredTensor",
    "TensorFile",
    "TorchStreamWriter",
    "decode_tree",
    "encode_tree",
    "read_json",
    "write_json_atomic",
    "write_tensors",
]
