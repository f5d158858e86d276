"""``lzero.state_dict.ShardedTensor``, the name the README has long given it; it lives in lzero/checkpoint/state_dict.py."""

from lzero.checkpoint.state_dict import ShardedTensor

__all__ = ["ShardedTensor"]
