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


def aux_ep_worker(rank: int, world_size: int, group, config, state: dict, x: torch.Tensor,
                  g: torch.Tensor) -> dict[str, torch.Tensor]:
    """One backward of an MoE layer with ``config`` (``balance="aux"``) and ``state``, its experts spread over
    ``group`` (rank r holds experts r*E/R ... (r+1)*E/R - 1), on this rank's batch ``x[r]`` [N, d] with the
    loss mean(y * g[r]) + balance_loss, the trainer's data-parallel mean taken by all-reducing the
    replicated parameters' gradients over the ranks.

    Returns:
        {parameter name: gradient}: the replicated parameters' means, and the experts' gradients of this
        rank's home experts (their ``grad_scale`` already makes them the mean).
    """
    import torch.distributed as dist  # noqa: PLC0415

    from k3lab.moe.layer import MoE, balance_loss  # noqa: PLC0415

    m = MoE(config)
    m.load_state_dict(state)
    L = config.n_experts // world_size
    for n in ("w_gate", "w_up", "w_down"):
        setattr(m.experts, n, torch.nn.Parameter(state[f"experts.{n}"][rank * L:(rank + 1) * L].clone()))
    m.ep_group = group
    m.train()
    ((m(x[rank]) * g[rank]).mean() + balance_loss(m)).backward()
    out = {}
    for name, p in m.named_parameters():
        if not name.startswith("experts."):
            dist.all_reduce(p.grad, group=group)
            p.grad /= world_size
        out[name] = p.grad
    return out
