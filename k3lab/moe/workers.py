"""Per-rank functions for chapter 05's distributed checks (``k3lab.dist.launch`` runs them).

They live in the package because spawned processes cannot unpickle functions defined in a
notebook cell or a test module's closure.
"""
from __future__ import annotations

import torch

from k3lab.moe.balance import Balancing
from k3lab.moe.router import route


def histogram_worker(rank: int, world_size: int, group, n_shards: int, m: int = 600, E: int = 16,
                     K: int = 2, micro_batches: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of histogram Quantile Balancing over ``n_shards`` x ``micro_batches`` fixed batches.

    With ``group`` None and ``world_size`` 1 the process counts every shard itself (the pooled
    reference); otherwise rank r counts shards r, r + R, ... and the step's update all-reduces.

    Returns:
        (load [E] int64, new bias [E] float32), identical on every rank.
    """
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(m, E, generator=gen) * 2 + torch.linspace(-2, 2, E)
               for _ in range(n_shards * micro_batches)]
    bias = torch.randn(E, generator=gen) * 0.1
    balancing = Balancing("qb", E, K)
    for i, logits in enumerate(batches):
        if (i // micro_batches) % world_size == rank:
            balancing.record(route(logits, bias, K), bias)
    load = balancing.update(bias, group)
    return load, bias
