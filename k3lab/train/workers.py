"""Functions for ``k3lab.dist.launch`` (tests and the book): spawn cannot pickle a notebook cell's function."""
from __future__ import annotations

from k3lab.train.config import TrainConfig
from k3lab.train.loop import train


def train_worker(rank: int, world_size: int, group, configs: list[dict]) -> list[list[dict]]:
    """Run ``train(TrainConfig(**c))`` for each dict in ``configs``, one after the other in this process
    group (spawning is the slow part); rank 0's step records per config, [] per config elsewhere."""
    return [train(TrainConfig(**c)) for c in configs]
