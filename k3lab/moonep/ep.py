"""``moonep_experts``: one expert-parallel MoE step, MoonEP or the all-to-all baseline, chosen by one flag."""
from __future__ import annotations

import torch
import torch.distributed as dist

from k3lab.dist import all_gather_stacked
from k3lab.moonep.alltoall import alltoall_step
from k3lab.moonep.dispatch import moonep_step

MODES = ("moonep", "alltoall")


def _run_ffn(x, offsets, w_gate, w_up, w_down, activation="situ"):
    from k3lab.moe.experts import expert_ffn, naive_expert_ffn  # noqa: PLC0415

    # grouped_mm takes float32/bf16/fp16 only; float64 (references) goes through the loop.
    fn = naive_expert_ffn if x.dtype == torch.float64 else expert_ffn
    return fn(x, offsets, w_gate, w_up, w_down, activation=activation)


def check_routed(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w_gate: torch.Tensor,
                 w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """ValueError unless x [S, d], topk_idx [S, K >= 1] int64, topk_weight [S, K] float and the expert
    weights w_gate, w_up [n, d, h], w_down [n, h, d] (n experts) fit together, x sharing the weights' dtype;
    returns topk_weight in x's dtype (the router's weights are float32; the weighted sum runs in x's dtype).
    The ids' values are not read (that is a host sync)."""
    if w_gate.ndim != 3 or w_up.shape != w_gate.shape or w_down.shape != (w_gate.shape[0], w_gate.shape[2],
                                                                            w_gate.shape[1]):
        raise ValueError(f"experts must hold w_gate, w_up [n, d, h] and w_down [n, h, d] (n experts), got "
                         f"{list(w_gate.shape)}, {list(w_up.shape)}, {list(w_down.shape)}")
    if x.ndim != 2 or x.shape[1] != w_gate.shape[1]:
        raise ValueError(f"x must be [S, d={w_gate.shape[1]}], got {list(x.shape)}")
    if not (x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype):
        raise ValueError(f"x and the expert weights must share one dtype, got x {x.dtype}, weights "
                         f"{w_gate.dtype}/{w_up.dtype}/{w_down.dtype}")
    S = x.shape[0]
    if topk_idx.ndim != 2 or topk_idx.shape[0] != S or topk_idx.shape[1] < 1 or topk_idx.dtype != torch.int64:
        raise ValueError(f"topk_idx must be [S={S}, K] int64 with K >= 1, got {list(topk_idx.shape)} {topk_idx.dtype}")
    if topk_weight.shape != topk_idx.shape or not topk_weight.is_floating_point():
        raise ValueError(f"topk_weight must be [S={S}, K={topk_idx.shape[1]}] float, got "
                         f"{list(topk_weight.shape)} {topk_weight.dtype}")
    return topk_weight.to(x.dtype)


def moonep_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts, group,
                   mode: str = "moonep", pad_mask: torch.Tensor | None = None,
                   check_ids: bool = True) -> torch.Tensor:
    """The routed experts' output for this rank's tokens under expert parallelism over ``group``.

        out[t] = sum_k topk_weight[t, k] * FFN_{topk_idx[t, k]}(x[t])

    with E = R * L experts, rank r holding experts r*L ... r*L + L-1 in ``experts``. ``mode="moonep"``:
    every rank processes exactly S*K pairs on static shapes, hot experts replicated from their home rank
    (K3 report, App. E; ``k3lab.moonep.dispatch``); ``mode="alltoall"``: each expert on its home rank,
    dynamic shapes and a host sync (``k3lab.moonep.alltoall``). Both are differentiable in ``x``,
    ``topk_weight`` and the expert weights; the expert weights' gradients are those of the sum of all
    ranks' losses, replicas' gradients summed onto the home rank.

    Args:
        x (Tensor): [S, d] float32/bfloat16/float16 (float64 via the loop reference), the experts' dtype, this
            rank's tokens. MoonEP needs the same S on every rank (static shapes); S = 0 on every rank gives
            an empty output without communicating. The baseline takes any S per rank, 0 included.
        topk_idx (Tensor): [S, K] int64 expert ids in [0, E), K >= 1; MoonEP needs the same K on every rank.
        topk_weight (Tensor): [S, K] float (cast to x's dtype; the router gives float32).
        experts: ``k3lab.moe.experts.GroupedExperts(L, d, h)`` (or any object with ``w_gate``, ``w_up``
            [L, d, h], ``w_down`` [L, h, d] and optionally ``activation``), this rank's home experts.
        group: the EP process group (R ranks; ``make_mesh(...)["ep"].get_group()``).
        mode (str): "moonep" or "alltoall".
        pad_mask (Tensor | None): [S] bool, True for padding tokens: their ids may be anything (they are
            sent to this rank's own experts, keeping every count static), their weights count as 0 and
            their output is 0.
        check_ids (bool): check the ids, and (MoonEP) that S and K agree across the group, before any
            exchange: one all-gather of three numbers per rank and one host read, so that every rank raises
            the same error instead of one raising while the others wait in a collective. Pass False on a
            hot path whose router cannot produce bad ids and whose ranks run equal batches (the trainer).

    Returns:
        Tensor [S, d], x's dtype.

    Raises:
        ValueError: a shape or dtype disagrees (x and the three weights share one dtype), ``mode`` is
            unknown, E is not R * L; with ``check_ids``, on every rank of the group: an id outside [0, E) on a
            token that is not padding on any rank, or (MoonEP) S or K differing between ranks.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    w_gate, w_up, w_down = experts.w_gate, experts.w_up, experts.w_down
    topk_weight = check_routed(x, topk_idx, topk_weight, w_gate, w_up, w_down)
    L = w_gate.shape[0]
    E = R * L
    S = x.shape[0]
    if pad_mask is not None:
        if pad_mask.shape != (S,) or pad_mask.dtype != torch.bool:
            raise ValueError(f"pad_mask must be [S={S}] bool, got {list(pad_mask.shape)} {pad_mask.dtype}")
        # Padding pairs go to this rank's own experts, spread over them: any valid slot works, since
        # MoonEP balances whatever it is given, and the baseline then sends them nowhere.
        own = rank * L + torch.arange(topk_idx.shape[1], device=topk_idx.device) % L
        topk_idx = torch.where(pad_mask[:, None], own, topk_idx)
        topk_weight = torch.where(pad_mask[:, None], topk_weight.new_zeros(()), topk_weight)
    if check_ids:
        _check_group(topk_idx, mode, E, R, rank, group)
    if S == 0 and mode == "moonep":
        # S is the same on every rank (checked above, or the caller's promise), so no rank has a pair to
        # exchange: an empty batch skips the collectives. The baseline's ranks may hold other S: it runs.
        return x * 0
    step = moonep_step if mode == "moonep" else alltoall_step
    out, _ = step(x, topk_idx, topk_weight, w_gate, w_up, w_down, group, _run_ffn,
                  activation=getattr(experts, "activation", "situ"))
    return out


def _check_group(topk_idx: torch.Tensor, mode: str, E: int, R: int, rank: int, group) -> None:
    """ValueError on every rank of ``group`` at once when any rank holds an id outside [0, E) or (MoonEP)
    the ranks' S or K differ: one all-gather of (S, K, bad ids) per rank, one host read."""
    S, K = topk_idx.shape
    bad = (topk_idx < 0) | (topk_idx >= E)
    mine = torch.stack([torch.tensor(S, device=bad.device), torch.tensor(K, device=bad.device), bad.sum()])
    ranks = all_gather_stacked(mine, R, group).tolist()
    if bad.any():
        raise ValueError(f"topk_idx must lie in [0, E={E}) (E = R={R} ranks x L={E // R} local experts); got "
                         f"{topk_idx[bad][:8].tolist()} at tokens {bad.any(1).nonzero()[:8, 0].tolist()}"
                         + (f" on rank {rank} of the ep group" if R > 1 else ""))
    others = [r for r, (_, _, n) in enumerate(ranks) if n]
    if others:
        raise ValueError(f"topk_idx must lie in [0, E={E}) on every rank of the ep group: ranks {others} hold "
                         f"ids outside it (their own error names them)")
    sizes = [tuple(r[:2]) for r in ranks]
    if mode == "moonep" and len(set(sizes)) > 1:
        raise ValueError(f"mode='moonep' needs the same S tokens and K experts per token on every rank of the ep "
                         f"group (each rank's buffer holds exactly S*K pairs), got (S, K) = {sizes} by rank: pad "
                         f"the batches to one S (pad_mask) or use mode='alltoall'")
