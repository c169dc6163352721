"""``k3lab.moonep.layout``'s per-pair and per-row steps (2-5) as one Triton launch.

The torch ``layout`` is about 57 small kernels. After a stable sort of the pairs by expert and two prefix
sums of the counts (``k3lab.moonep.planner.pair_positions`` and ``count_prefixes``, which need no plan), everything
left is per pair or per buffer row, with small gathers (R or 2L values each), so one launch covers both:
programs ``[0, n_pair_blocks)`` take BLOCK pairs each, the rest BLOCK rows each. The plan's own prefix sums
(``assign.cumsum(1)`` and the slot starts ``offsets - slot_counts``) are formed inside, so after the plan this
launch is the only kernel of the layout.

    pair p of expert e:  g = base[e] + pos[p]                 (its global number within e)
                         cum_v = assign[e, 0] + ... + assign[e, v]
                         dest = #{v : cum_v <= g}              (the rank whose piece holds g)
                         within = g - sum{assign[e, v] : cum_v <= g}
                         dest_row = start[dest, e % L  (home: dest == e // L)  or  L + e % L] + within
    buffer row i:        slot = #{j : offsets[rank, j] <= i}  (at most 2L - 1);  x = slot_experts[rank, slot]
                         g = sum{assign[x, w] : w < rank} + i - start[rank, slot]
                         src = #{r : counts_cum[r, x] <= g}   (at most R - 1)
    start[v, j] = offsets[v, j] - slot_counts[v, j]

``assign`` is non-negative, so cum is non-decreasing along v and {v : cum_v <= g} is the prefix
{0, ..., dest - 1}: ``within`` is the torch path's ``g - (cum[e, dest] - assign[e, dest])``. Every quantity is
the torch path's, in the same integers, so the two are equal, not close.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def moonep_layout_kernel(e_ids, pos, base, assign, slot_counts, offsets, slot_experts, counts_cum,
                         dest_rank, dest_row, src_rank, N, C, R, L, rank, n_pair_blocks, BLOCK: tl.constexpr):
    # e_ids, pos: [N] int64 (pair p's expert, its place among this rank's pairs sorted by expert);
    # base: [E] int64; assign: [E, R] int64; slot_counts, slot_experts: [R, 2L] int64; offsets: [R, 2L] int32
    # or int64; counts_cum: [R, E] int64; all contiguous. Outputs dest_rank, dest_row [N], src_rank [C] int64.
    pid = tl.program_id(0)
    if pid < n_pair_blocks:
        o = pid * BLOCK + tl.arange(0, BLOCK)
        m = o < N
        e = tl.load(e_ids + o, mask=m, other=0)
        # An id outside [0, E) is read nowhere and its pair marked -1 (the ids are not checked on the host).
        bad = (e < 0) | (e >= R * L)
        e = tl.where(bad, 0, e)
        g = tl.load(base + e, mask=m, other=0) + tl.load(pos + o, mask=m, other=0)
        dest = tl.zeros([BLOCK], dtype=tl.int64)
        before = tl.zeros([BLOCK], dtype=tl.int64)
        cum = tl.zeros([BLOCK], dtype=tl.int64)
        for v in range(0, R):
            a = tl.load(assign + e * R + v, mask=m, other=0)
            cum += a
            under = cum <= g
            dest += under.to(tl.int64)
            before += tl.where(under, a, 0)
        # dest < R for every real pair (g < the expert's total); padded lanes are masked out of every load.
        slot = tl.where(dest == e // L, e % L, L + e % L)
        o_slot = dest * (2 * L) + slot
        start = tl.load(offsets + o_slot, mask=m, other=0).to(tl.int64) - tl.load(slot_counts + o_slot, mask=m,
                                                                                   other=0)
        tl.store(dest_rank + o, tl.where(bad, -1, dest), mask=m)
        tl.store(dest_row + o, tl.where(bad, -1, start + g - before), mask=m)
    else:
        i = (pid - n_pair_blocks) * BLOCK + tl.arange(0, BLOCK)
        m = i < C
        slot = tl.zeros([BLOCK], dtype=tl.int64)
        for j in range(0, 2 * L):
            slot += (tl.load(offsets + rank * (2 * L) + j) <= i).to(tl.int64)
        slot = tl.minimum(slot, 2 * L - 1)
        o_slot = rank * (2 * L) + slot
        x = tl.load(slot_experts + o_slot, mask=m, other=0)
        start = tl.load(offsets + o_slot, mask=m, other=0).to(tl.int64) - tl.load(slot_counts + o_slot, mask=m,
                                                                                   other=0)
        g = i - start
        for w in range(0, rank):
            g += tl.load(assign + x * R + w, mask=m, other=0)
        src = tl.zeros([BLOCK], dtype=tl.int64)
        for r in range(0, R):
            src += (tl.load(counts_cum + r * (R * L) + x, mask=m, other=0) <= g).to(tl.int64)
        tl.store(src_rank + i, tl.minimum(src, R - 1), mask=m)


def layout_rows(e_ids: torch.Tensor, pos: torch.Tensor, base: torch.Tensor, assign: torch.Tensor,
                slot_counts: torch.Tensor, offsets: torch.Tensor, slot_experts: torch.Tensor,
                counts_cum: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 2-5 of ``k3lab.moonep.layout`` in one launch, from its sort and the counts' prefix sums; the
    plan's prefix sums are formed inside. Arguments are already checked by ``layout``; all contiguous.

    Args:
        e_ids, pos (Tensor): [N] int64, N = S*K: each pair's expert and its place among this rank's pairs
            sorted by expert (stable, ``pair_positions``).
        base (Tensor): [E] int64, ``counts.cumsum(0)[rank] - counts[rank].cumsum(0)``: g = base[e] + pos.
        assign (Tensor): [E, R] int64, the plan's ``assign``.
        slot_counts (Tensor): [R, 2L] int64; offsets (Tensor): [R, 2L] int32 or int64, the plan's slot ends;
            slot_experts (Tensor): [R, 2L] int64.
        counts_cum (Tensor): [R, E] int64, ``counts.cumsum(0)``.
        rank (int): this rank.

    Returns:
        (dest_rank [N], dest_row [N], src_rank [N]) int64: the buffer holds S*K rows, as many as the pairs; a
        pair whose expert id lies outside [0, E) gets dest_rank and dest_row -1.
    """
    N = e_ids.numel()
    R, two_L = offsets.shape
    dev = e_ids.device
    dest_rank = torch.empty(N, dtype=torch.int64, device=dev)
    dest_row = torch.empty(N, dtype=torch.int64, device=dev)
    src_rank = torch.empty(N, dtype=torch.int64, device=dev)
    n_pair_blocks = triton.cdiv(N, BLOCK)
    moonep_layout_kernel[(2 * n_pair_blocks,)](e_ids, pos, base, assign, slot_counts, offsets, slot_experts,
                                               counts_cum, dest_rank, dest_row, src_rank, N, N, R, two_L // 2, rank,
                                               n_pair_blocks, BLOCK=BLOCK)
    return dest_rank, dest_row, src_rank
