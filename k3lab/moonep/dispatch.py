"""MoonEP's dispatch, expert step and combine on static shapes (K3 report, Sec. 4 and App. E).

One EP MoE step on every rank r at once (S tokens, top-K, C = S*K, L = E/R experts homed per rank):
  1. count:    this rank's pairs per expert [E]; one all-gather -> counts [R, E] (fixed size).
  2. plan:     ``planner.plan_and_layout``: the plan and this rank's layout, the same on every rank from the
               same counts.
  3. dispatch: pair p (token p // K) to row ``dest_row[p]`` of rank ``dest_rank[p]``'s [C, d] buffer, laid
               out as [L local experts, L redundant slots] (``Dispatch``).
  4. fetch:    the redundant slots' weights, from the donor rank (``FetchDonorExperts``).
  5. experts:  one grouped FFN over the buffer, slots ``offsets`` (``k3lab.moe.experts.expert_ffn``).
  6. combine:  every row back to its pair (``Combine``, the transpose of dispatch), then
               out[t] = sum_k topk_weight[t, k] * y[t*K + k].
Backward mirrors it: combine's backward is a dispatch with the same layout, dispatch's a combine, and the
redundant weights' gradients are summed back onto their home rank's.

Static shapes over torch.distributed: every rank sends every rank a [C, d] block (zeros where it has no
pair), one ``all_to_all_single`` with equal splits, and reads its rows from the blocks ``src_rank`` names.
That is R times the bytes of the pairs themselves: the price of fixed split sizes without one-sided
writes (on GPUs, NVSHMEM puts or ``torch.ops.symm_mem.all_to_all_vdev`` write rows straight into the
destination buffer at these offsets). Likewise the fetch all-gathers every rank's expert shard and keeps
the donor's: a stand-in for a one-sided read of L experts from one rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from k3lab.dist import all_gather_stacked, all_to_all_equal, reduce_scatter_sum
from k3lab.moonep.planner import Layout, Plan, plan_and_layout


def _to_buffer(pairs: torch.Tensor, lay: Layout, R: int, group) -> torch.Tensor:
    """[S*K, d] pairs -> [C, d] this rank's buffer (C = S*K): the dispatch."""
    C, d = lay.src_rank.shape[0], pairs.shape[1]
    send = pairs.new_zeros(R, C, d)
    send[lay.dest_rank, lay.dest_row] = pairs
    recv = all_to_all_equal(send, group)
    return recv[lay.src_rank, torch.arange(C, device=pairs.device)]


def _from_buffer(buf: torch.Tensor, lay: Layout, R: int, group) -> torch.Tensor:
    """[C, d] this rank's buffer -> [S*K, d] its own pairs: the combine, the transpose of ``_to_buffer``."""
    C, d = buf.shape
    send = buf.new_zeros(R, C, d)
    send[lay.src_rank, torch.arange(C, device=buf.device)] = buf
    recv = all_to_all_equal(send, group)
    return recv[lay.dest_rank, lay.dest_row]


class Dispatch(torch.autograd.Function):
    """pairs [S*K, d] -> buffer [C, d], rows grouped by slot (``Layout``).

    Forward collective: one ``all_to_all_single`` of [R, C, d] with equal splits.
    Backward collective: the same all-to-all of the buffer's gradient (a combine).
    """

    @staticmethod
    def forward(ctx, pairs, lay, R, group):
        ctx.lay, ctx.R, ctx.group = lay, R, group
        return _to_buffer(pairs, lay, R, group)

    @staticmethod
    def backward(ctx, grad):
        return _from_buffer(grad, ctx.lay, ctx.R, ctx.group), None, None, None


class Combine(torch.autograd.Function):
    """buffer [C, d] -> this rank's pairs [S*K, d] (the transpose of ``Dispatch``).

    Forward collective: one ``all_to_all_single`` of [R, C, d] with equal splits.
    Backward collective: the same all-to-all of the pairs' gradient (a dispatch with the same layout).
    """

    @staticmethod
    def forward(ctx, buf, lay, R, group):
        ctx.lay, ctx.R, ctx.group = lay, R, group
        return _from_buffer(buf, lay, R, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_buffer(grad, ctx.lay, ctx.R, ctx.group), None, None, None


class FetchDonorExperts(torch.autograd.Function):
    """This rank's expert shard [L, F] -> the donor rank's shard [L, F] (F: one expert's weights, flat).

    Forward collective: one all-gather of [L, F] (``all_gather_stacked``), keeping block ``donor``.
    Backward collective: one reduce-scatter (SUM) of [R, L, F] holding the gradient at block ``donor``:
    every rank gets the gradients of its own experts' replicas, summed.
    """

    @staticmethod
    def forward(ctx, w, donor, R, group):
        ctx.donor, ctx.R, ctx.group = donor, R, group
        return all_gather_stacked(w, R, group).index_select(0, donor.view(1))[0]

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros(ctx.R, *grad.shape).index_copy(0, ctx.donor.view(1), grad.unsqueeze(0))
        return reduce_scatter_sum(full, ctx.group), None, None, None


def count_pairs(topk_idx: torch.Tensor, E: int) -> torch.Tensor:
    """[S, K] int64 -> [E] int64 pairs per expert (scatter_add_: bincount syncs on CUDA)."""
    flat = topk_idx.reshape(-1)
    return torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def moonep_step(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w_gate: torch.Tensor,
                w_up: torch.Tensor, w_down: torch.Tensor, group, ffn, **ffn_kwargs) -> tuple[torch.Tensor, Plan]:
    """Steps 1-6 of the module docstring on this rank; the unchecked core of ``moonep_experts``.

    Args:
        x (Tensor): [S, d] this rank's tokens.
        topk_idx (Tensor): [S, K] int64 in [0, E), E = R * L; S and K equal on every rank.
        topk_weight (Tensor): [S, K], x's dtype.
        w_gate, w_up (Tensor): [L, d, h], w_down (Tensor): [L, h, d]: experts rank*L ... rank*L + L-1.
        group: the EP process group (R ranks).
        ffn: ``expert_ffn(x, offsets, w_gate, w_up, w_down, **ffn_kwargs)``.

    Returns:
        (out [S, d], the Plan).
    """
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    S, K = topk_idx.shape
    L = w_gate.shape[0]
    # 1-2. counts and plan (no host sync).
    counts = all_gather_stacked(count_pairs(topk_idx, R * L), R, group)
    p, lay = plan_and_layout(counts, topk_idx, rank, S, K)
    # 3. dispatch: pair t*K + k carries token t.
    pairs = x.repeat_interleave(K, dim=0)
    buf = Dispatch.apply(pairs, lay, R, group)
    # 4. the donor's L experts in the redundant slots: one flat collective for the three weights.
    shapes = (w_gate.shape, w_up.shape, w_down.shape)
    flat = torch.cat([w.reshape(L, -1) for w in (w_gate, w_up, w_down)], 1)
    fetched = FetchDonorExperts.apply(flat, p.donor[rank], R, group)
    parts = fetched.split([s[1] * s[2] for s in shapes], 1)
    weights = [torch.cat([w, f.view(s)]) for w, f, s in zip((w_gate, w_up, w_down), parts, shapes)]
    # 5. one grouped FFN over [local, redundant] slots.
    y_buf = ffn(buf, lay.offsets, *weights, **ffn_kwargs)
    # 6. combine and the weighted sum over k.
    y = Combine.apply(y_buf, lay, R, group)
    return (y.view(S, K, -1) * topk_weight.unsqueeze(-1)).sum(1), p
