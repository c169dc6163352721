"""The baseline: plain all-to-all expert parallelism with dynamic shapes (Megatron's alltoall dispatcher).

Every expert is processed on its home rank only, so a rank processes however many pairs its experts
drew: from 0 to R*S*K rows. Steps on every rank r (L = E/R experts homed per rank):
  1. count:    pairs per expert [E], sorted by expert (so by destination rank).
  2. exchange: one all-to-all of the counts -> [R, L], pairs of my experts on each source rank.
  3. sync:     the split sizes read back to the host (``.tolist()``): the host sync MoonEP removes.
  4. dispatch: one all-to-all with those uneven splits into a buffer of variable size.
  5. experts:  regroup the received rows by expert (source order inside one), one grouped FFN.
  6. combine:  the reverse all-to-all, unsort, weighted sum over k.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from k3lab.dist import all_to_all_equal, all_to_all_rows
from k3lab.moonep.dispatch import count_pairs


class AllToAllRows(torch.autograd.Function):
    """[sum(in_splits), *] -> [sum(out_splits), *] (``k3lab.dist.all_to_all_rows``).

    Forward collective: one ``all_to_all_single`` with uneven splits.
    Backward collective: the same with the splits swapped.
    """

    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group):
        ctx.in_splits, ctx.out_splits, ctx.group = in_splits, out_splits, group
        return all_to_all_rows(x, in_splits, out_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_rows(grad, ctx.out_splits, ctx.in_splits, ctx.group), None, None, None


def alltoall_step(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w_gate: torch.Tensor,
                  w_up: torch.Tensor, w_down: torch.Tensor, group, ffn, **ffn_kwargs) -> tuple[torch.Tensor, int]:
    """Steps 1-6 of the module docstring on this rank; the unchecked core of ``moonep_experts(mode="alltoall")``.

    Arguments as ``dispatch.moonep_step``. Returns (out [S, d], rows this rank's experts processed).
    """
    R = dist.get_world_size(group)
    S, K = topk_idx.shape
    L = w_gate.shape[0]
    # 1. sort pairs by expert: home ranks are contiguous expert ranges, so this also sorts by destination.
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = count_pairs(topk_idx, R * L).view(R, L)
    # 2-3. counts exchanged, then read on the host to size the buffers.
    recv_counts = all_to_all_equal(counts, group)
    in_splits = counts.sum(1).tolist()
    out_splits = recv_counts.sum(1).tolist()
    # 4. dispatch into a buffer of sum(out_splits) rows: (source rank, expert, pair order).
    recv = AllToAllRows.apply(x.repeat_interleave(K, dim=0)[order], in_splits, out_splits, group)
    # 5. regroup by expert, keeping source order inside an expert (the dense order of a global batch).
    row_expert = torch.arange(L, device=x.device).repeat(R).repeat_interleave(recv_counts.reshape(-1))
    perm = torch.argsort(row_expert, stable=True)
    offsets = recv_counts.sum(0).cumsum(0).to(torch.int32)
    y_sorted = ffn(recv[perm], offsets, w_gate, w_up, w_down, **ffn_kwargs)
    y_recv = torch.empty_like(y_sorted).index_copy(0, perm, y_sorted)
    # 6. back to the source ranks, back to pair order, weighted sum over k.
    back = AllToAllRows.apply(y_recv, out_splits, in_splits, group)
    y = torch.empty_like(back).index_copy(0, order, back)
    # The width from the rows, not -1: a rank with S = 0 (the others' S may differ) has no rows to infer it.
    return (y.view(S, K, y.shape[-1]) * topk_weight.unsqueeze(-1)).sum(1), int(sum(out_splits))
