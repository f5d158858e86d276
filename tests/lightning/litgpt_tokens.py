"""A litgpt pretraining DataModule over a fixed random token stream (no download, no litdata): what a user passes as
``litgpt pretrain --data litgpt_tokens.RandomTokens``. Its loaders are resumable (``state_dict``: the batches given),
as litdata's are, which litgpt's pretrain resume relies on."""

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader, Dataset


class _Windows(Dataset):
    def __init__(self, tokens: torch.Tensor, length: int) -> None:
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return self.tokens.numel() // (self.length + 1)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * (self.length + 1): (i + 1) * (self.length + 1)]


class _Loader(DataLoader):
    """Resumable as litdata's loaders are (litgpt's pretrain relies on it): it counts the batches it gave."""

    def __iter__(self) -> Any:
        given = getattr(self, "_given", 0)
        for i, batch in enumerate(super().__iter__()):
            if i < given:
                continue  # a resumed run: the batches the interrupted one consumed
            self._given = i + 1
            yield batch
        self._given = 0

    def state_dict(self) -> dict[str, Any]:
        return {"given": getattr(self, "_given", 0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._given = int(state["given"])


@dataclass
class RandomTokens(DataModule):
    vocab_size: int = 40
    tokens: int = 20000
    seed: int = 0
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int = field(default=-1, init=False, repr=False)

    def connect(self, tokenizer: Optional[Any] = None, batch_size: int = 1, max_seq_length: Optional[int] = None) -> None:
        self.batch_size, self.max_seq_length = batch_size, max_seq_length

    def _loader(self, offset: int) -> DataLoader:
        stream = torch.randint(0, self.vocab_size, (self.tokens,), generator=torch.Generator().manual_seed(self.seed + offset))
        return _Loader(_Windows(stream, self.max_seq_length), batch_size=self.batch_size, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader(0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(1)
