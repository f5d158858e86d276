"""The end of every script that fits: destroy the default process group while the interpreter is still whole. A
gloo group left to interpreter finalization can abort a finished process (SIGABRT, "terminate called without an
active exception", seen once in tests/lightning/trainer_runs.py ws1 after all its fits had passed;
pytorch/pytorch#179291 describes the race). ``lzero fit`` does the same (lzero/cli.py)."""

import torch.distributed as dist


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
