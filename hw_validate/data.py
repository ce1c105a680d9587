"""The synthetic, seeded, learnable training task: a fixed random next-token mapping.

A permutation ``perm`` of the vocabulary is drawn once from ``seed``; every sequence starts at a
random token and follows ``x[t+1] = perm[x[t]]``. Every target is a deterministic function of the
input token at the same position, so a model that learns the mapping drives the next-token loss
from ``ln(vocab)`` towards 0, while one that learns only the marginal stays at ``ln(vocab)`` (the
marginal of a permutation chain from a uniform start is uniform). Batches depend
only on (seed, step, micro-batch, global rank): the same run gives the same tokens everywhere.
"""

from __future__ import annotations

import torch


class NextTokenTask:
    """Batches of token sequences following a fixed random permutation of the vocabulary."""

    def __init__(self, vocab_size: int, seq_len: int, micro_batch_size: int, seed: int = 0):
        self.vocab_size, self.seq_len, self.micro_batch_size, self.seed = vocab_size, seq_len, micro_batch_size, seed
        g = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(vocab_size, generator=g)

    def batch(self, step: int, micro_batch: int, rank: int) -> torch.Tensor:
        """``(micro_batch_size, seq_len + 1)`` int64 tokens: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
        g = torch.Generator().manual_seed(((self.seed * 1_000_003 + step) * 4099 + micro_batch) * 65_537 + rank + 1)
        b, t = self.micro_batch_size, self.seq_len + 1
        out = torch.empty((b, t), dtype=torch.int64)
        out[:, 0] = torch.randint(0, self.vocab_size, (b,), generator=g)
        for i in range(1, t):
            out[:, i] = self.perm[out[:, i - 1]]
        return out


def split(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of a batch."""
    return tokens[:, :-1], tokens[:, 1:]
