"""References for MoonEP: the constructive fill in plain Python, and the single-process dense MoE.

``plan_reference`` is App. E's fill written as the proof states it, over Python lists (small R, E); the
tensor planner ``planner.plan`` must give the same plan. ``dense_moe`` is what every EP layout must
equal: all tokens on one process, every expert's rows through one ``expert_ffn`` call.
"""
from __future__ import annotations

import torch

from k3lab.moonep.ep import check_routed
from k3lab.moonep.planner import Plan, check_counts, finish_plan


def plan_reference(counts: torch.Tensor, S: int, K: int) -> Plan:
    """App. E's constructive fill over Python lists; the same ``Plan`` as ``planner.plan``.

    Args:
        counts (Tensor): [R, E] integer, rows summing to S*K.
        S, K (int): tokens per rank, experts per token.

    Raises:
        ValueError: bad shapes (as ``plan``), a negative count, or a row that does not sum to S*K.
    """
    R, E, L = check_counts(counts, S, K)
    C = S * K
    c = counts.tolist()
    negative = [(r, e) for r, row in enumerate(c) for e, x in enumerate(row) if x < 0]
    if negative or any(sum(row) != C for row in c):
        raise ValueError(f"counts must be >= 0 with every row summing to S*K = {C}, got row sums "
                         f"{[sum(row) for row in c]}" + (f" and negative counts at [rank, expert] {negative[:8]}"
                                                        if negative else ""))
    keep = [sum(c[r][e] for r in range(R)) for e in range(E)]
    load = [sum(keep[h * L:(h + 1) * L]) for h in range(R)]
    give = [[0] * L for _ in range(R)]
    donor = list(range(R))
    fills = 0
    while min(load) < C:
        fills += 1
        assert fills <= R - 1, "each fill brings a new rank to C for good, the last one two ranks"
        # Least-loaded receiver, most-loaded donor, lowest index on ties.
        u = min(range(R), key=lambda r: (load[r], r))
        d = max(range(R), key=lambda r: (load[r], -r))
        need = C - load[u]
        assert donor[u] == u and load[d] > C, "a receiver is filled once, from a rank above C"
        for j in sorted(range(L), key=lambda j: (-keep[d * L + j], j)):
            take = min(keep[d * L + j], need)
            keep[d * L + j] -= take
            give[u][j] += take
            need -= take
        assert need == 0, "the donor holds more than C pairs of its own experts"
        donor[u] = d
        load[d] -= C - load[u]
        load[u] = C
    dev = counts.device
    return finish_plan(torch.tensor(keep, device=dev), torch.tensor(give, device=dev).view(R, L),
                       torch.tensor(donor, device=dev), S, K)


def dense_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w_gate: torch.Tensor,
              w_up: torch.Tensor, w_down: torch.Tensor, ffn=None, **ffn_kwargs) -> torch.Tensor:
    """The routed-expert sum on one process: out[t] = sum_k topk_weight[t, k] * FFN_{topk_idx[t, k]}(x[t]).

    Args:
        x (Tensor): [N, d] float, the weights' dtype.
        topk_idx (Tensor): [N, K] int64 in [0, E) (not checked: no host sync).
        topk_weight (Tensor): [N, K] float, taken in x's dtype.
        w_gate, w_up (Tensor): [E, d, h]; w_down (Tensor): [E, h, d].
        ffn: ``expert_ffn``-like callable (default ``k3lab.moe.experts.expert_ffn``), given ``ffn_kwargs``.

    Returns:
        Tensor [N, d], x's dtype.

    Raises:
        ValueError: shapes or dtypes that do not fit together (``check_routed``).
    """
    topk_weight = check_routed(x, topk_idx, topk_weight, w_gate, w_up, w_down)
    if ffn is None:
        from k3lab.moe.experts import expert_ffn as ffn  # noqa: PLC0415
    N, K = topk_idx.shape
    E = w_gate.shape[0]
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    # Pairs as repeat_interleave then a permutation: the gradient sums a token's K pairs in k order, as
    # every EP path does, so EP = 1 can match bit for bit.
    y_sorted = ffn(x.repeat_interleave(K, dim=0)[order], counts.cumsum(0).to(torch.int32), w_gate, w_up, w_down,
                   **ffn_kwargs)
    y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
    # The width named, not -1: with N = 0 a view of [0, K, -1] is ambiguous.
    return (y.view(N, K, x.shape[1]) * topk_weight.unsqueeze(-1)).sum(1)
