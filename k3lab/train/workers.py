"""Functions for ``k3lab.dist.launch`` (tests and the book): spawn cannot pickle a notebook cell's function."""
from __future__ import annotations

import torch

from k3lab.train.config import TrainConfig
from k3lab.train.loop import build_run, forward_backward, process_group, train


def first_step_grads(config: TrainConfig) -> dict[str, torch.Tensor]:
    """The gradients of the first step's loss for ``config``'s layout (its micro-batches and pipeline
    included), each as its full logical tensor (DTensor shards gathered: experts [E, l, h] in global id
    order), keyed by parameter name; float32 on CPU. A one-rank world builds its own group. Every rank returns
    the parameters of its model or pipeline stages (the union over a pp group's ranks is the whole model)."""
    device = torch.device("cpu")
    with process_group(device):
        par, loader, parts, pipe = build_run(config, device)
        x, y = loader.next_batch(device)
        forward_backward(parts, pipe, x, y, config, par)
        return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                for part in parts for n, p in part.named_parameters() if p.grad is not None}


def train_worker(rank: int, world_size: int, group, configs: list[dict], grad_configs: list[dict] = ()) -> dict:
    """Run ``train(TrainConfig(**c))`` for each dict in ``configs`` and ``first_step_grads`` for each in
    ``grad_configs``, one after the other in this process group (spawning is the slow part).

    Returns:
        {"runs": rank 0's step records per config ([] elsewhere), "grads": per grad config the dict of
        ``first_step_grads``}.
    """
    return {"runs": [train(TrainConfig(**c)) for c in configs],
            "grads": [first_step_grads(TrainConfig(**c)) for c in grad_configs]}


def clocked_train_worker(rank: int, world_size: int, group, config: dict, seconds_per_reading: list[float]) -> dict:
    """``train(TrainConfig(**config))`` with this rank's ``wall_clock`` replaced by one that advances
    ``seconds_per_reading[rank]`` seconds at each reading (ranks whose clocks disagree, for the
    ``stop_after_minutes`` tests).

    Returns:
        {"records": rank 0's step records ([] elsewhere), "stopped_at": this rank's ``TrainRecords.stopped_at``}.
    """
    from k3lab.train import loop  # noqa: PLC0415

    readings = iter(range(1 << 30))
    loop.wall_clock = lambda: next(readings) * seconds_per_reading[rank]
    out = train(TrainConfig(**config))
    return {"records": list(out), "stopped_at": out.stopped_at}
