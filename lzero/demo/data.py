"""``TextDataModule``: byte-level next-token windows over the corpus bundled in the package.

Bytes are the tokens (vocabulary 256), so no tokenizer or download is involved.
Training sample ``i`` is a window at a pseudo-random offset seeded by ``i`` alone. The
sampler decides which indices a rank sees, so a run on 1 process with batch ``W * B``
and a run on ``W`` processes with batch ``B`` consume the same windows per step,
which lets ZeRO runs be compared against DDP across world sizes.
"""

from __future__ import annotations

from importlib import resources

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

VOCAB_SIZE = 256


def load_corpus() -> torch.Tensor:
    """The bundled corpus as a 1D uint8 tensor of byte values."""
    raw = resources.files("lzero.demo").joinpath("data/corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class RandomWindows(Dataset):
    """``length`` windows at offsets that are a pure function of the sample index."""

    def __init__(self, tokens: torch.Tensor, block_size: int, length: int) -> None:
        if tokens.numel() <= block_size:
            raise ValueError(
                f"Training text has {tokens.numel()} tokens, not more than block_size={block_size}."
                " HINT: lower block_size or val_fraction."
            )
        self.tokens = tokens  # (N,) uint8
        self.block_size = block_size
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # A generator seeded by the index, not a shared RNG, so the window does not
        # depend on which worker or rank asks for it, nor in which order.
        gen = torch.Generator().manual_seed(i)
        start = int(torch.randint(self.tokens.numel() - self.block_size, (1,), generator=gen))
        chunk = self.tokens[start : start + self.block_size + 1].long()  # (T + 1,)
        return chunk[:-1], chunk[1:]  # inputs (T,), targets shifted by one (T,)


class ContiguousWindows(Dataset):
    """Non-overlapping windows in order, covering the text once."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens = tokens  # (N,) uint8
        self.block_size = block_size

    def __len__(self) -> int:
        # Each window needs block_size + 1 tokens because targets are shifted by one.
        return max(0, (self.tokens.numel() - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1].long()  # (T + 1,)
        return chunk[:-1], chunk[1:]


class TextDataModule(LightningDataModule):
    """Byte-level language-modelling data from ``lzero/demo/data/corpus.txt``.

    Args:
        block_size: Tokens per training/validation window.
        batch_size: Windows per batch on each process.
        val_fraction: Share of the corpus, taken from its end, held out for validation.
        num_workers: DataLoader worker processes.
        steps_per_epoch: Optimizer steps per training epoch at any world size; ``None``
            sizes an epoch as one pass of non-overlapping windows over the training text.
    """

    vocab_size: int = VOCAB_SIZE

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 8,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}. HINT: try 0.1.")
        self.save_hyperparameters()
        self.train_set: RandomWindows | None = None
        self.val_set: ContiguousWindows | None = None

    @override
    def setup(self, stage: str) -> None:
        tokens = load_corpus()
        n_train = int(tokens.numel() * (1.0 - self.hparams.val_fraction))
        train, val = tokens[:n_train], tokens[n_train:]
        block_size = self.hparams.block_size
        if self.hparams.steps_per_epoch is None:
            length = n_train // block_size
        else:
            # The distributed sampler splits the dataset across the data-parallel ranks (the world size, or
            # less under tensor or pipeline parallel), so scale by them to keep steps_per_epoch a per-process
            # step count.
            replicas = self.trainer.world_size if self.trainer is not None else 1
            sampler = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
            replicas = (sampler or {}).get("num_replicas", replicas)
            length = self.hparams.steps_per_epoch * self.hparams.batch_size * replicas
        self.train_set = RandomWindows(train, block_size, length)
        self.val_set = ContiguousWindows(val, block_size)

    @override
    def train_dataloader(self) -> DataLoader:
        # shuffle=False: randomness lives in the dataset's offsets; Lightning wraps this in
        # a DistributedSampler that keeps the order when running on several processes.
        return self._loader(self.train_set, drop_last=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, drop_last=False)

    def _loader(self, dataset: Dataset, drop_last: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=False,
            drop_last=drop_last,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
        )
