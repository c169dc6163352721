"""``k3lab.moonep.layout``'s per-pair and per-row steps (2-5) as one Triton launch.

The torch ``layout`` is about 57 small kernels. After a stable sort of the pairs by expert and four prefix
sums in torch, everything left is per pair or per buffer row, with small gathers (R or 2L values each), so
one launch covers both: programs ``[0, n_pair_blocks)`` take BLOCK pairs each, the rest BLOCK rows each.

    pair p of expert e:  g = base[e] + pos[p]                 (its global number within e)
                         dest = #{v : cum_assign[e, v] <= g}   (the rank whose piece holds g)
                         within = g - (cum_assign[e, dest] - assign[e, dest])
                         dest_row = starts[dest, e % L  (home: dest == e // L)  or  L + e % L] + within
    buffer row i:        slot = #{j : offsets[rank, j] <= i}  (at most 2L - 1);  x = slot_experts[rank, slot]
                         g = cum_assign[x, rank] - assign[x, rank] + i - starts[rank, slot]
                         src = #{r : counts_cum[r, x] <= g}   (at most R - 1)

Every quantity is the torch path's, in the same integers, so the two are equal, not close.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def moonep_layout_kernel(e_ids, pos, base, assign, cum_assign, starts, offsets, slot_experts, counts_cum,
                         dest_rank, dest_row, src_rank, N, C, R, L, rank, n_pair_blocks, BLOCK: tl.constexpr):
    # e_ids, pos: [N] int64 (pair p's expert, its place among this rank's pairs sorted by expert);
    # base: [E] int64; assign, cum_assign: [E, R] int64; starts, offsets, slot_experts: [R, 2L] int64;
    # counts_cum: [R, E] int64; outputs dest_rank, dest_row [N], src_rank [C] int64.
    pid = tl.program_id(0)
    if pid < n_pair_blocks:
        o = pid * BLOCK + tl.arange(0, BLOCK)
        m = o < N
        e = tl.load(e_ids + o, mask=m, other=0)
        g = tl.load(base + e, mask=m, other=0) + tl.load(pos + o, mask=m, other=0)
        dest = tl.zeros([BLOCK], dtype=tl.int64)
        for v in range(0, R):
            dest += (tl.load(cum_assign + e * R + v, mask=m, other=0) <= g).to(tl.int64)
        # dest < R for every real pair (g < the expert's total); padded lanes are masked out of every load.
        ea = e * R + dest
        within = g - tl.load(cum_assign + ea, mask=m, other=0) + tl.load(assign + ea, mask=m, other=0)
        slot = tl.where(dest == e // L, e % L, L + e % L)
        row = tl.load(starts + dest * (2 * L) + slot, mask=m, other=0) + within
        tl.store(dest_rank + o, dest, mask=m)
        tl.store(dest_row + o, row, mask=m)
    else:
        i = (pid - n_pair_blocks) * BLOCK + tl.arange(0, BLOCK)
        m = i < C
        slot = tl.zeros([BLOCK], dtype=tl.int64)
        for j in range(0, 2 * L):
            slot += (tl.load(offsets + rank * (2 * L) + j) <= i).to(tl.int64)
        slot = tl.minimum(slot, 2 * L - 1)
        x = tl.load(slot_experts + rank * (2 * L) + slot, mask=m, other=0)
        g = (tl.load(cum_assign + x * R + rank, mask=m, other=0) - tl.load(assign + x * R + rank, mask=m, other=0)
             + i - tl.load(starts + rank * (2 * L) + slot, mask=m, other=0))
        src = tl.zeros([BLOCK], dtype=tl.int64)
        for r in range(0, R):
            src += (tl.load(counts_cum + r * (R * L) + x, mask=m, other=0) <= g).to(tl.int64)
        tl.store(src_rank + i, tl.minimum(src, R - 1), mask=m)


def layout_rows(e_ids: torch.Tensor, pos: torch.Tensor, base: torch.Tensor, assign: torch.Tensor,
                cum_assign: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor, slot_experts: torch.Tensor,
                counts_cum: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 2-5 of ``k3lab.moonep.layout`` in one launch, from its sort and prefix sums.

    Args:
        e_ids, pos (Tensor): [N] int64, N = S*K: each pair's expert and its place among this rank's pairs
            sorted by expert (stable).
        base (Tensor): [E] int64, ``counts.cumsum(0)[rank] - counts[rank].cumsum(0)``: g = base[e] + pos.
        assign, cum_assign (Tensor): [E, R] int64, the plan's ``assign`` and its row prefix sums.
        starts (Tensor): [R, 2L] int64, each slot's first buffer row; offsets (Tensor): [R, 2L] int32 or
            int64, the plan's slot ends; slot_experts (Tensor): [R, 2L] int64.
        counts_cum (Tensor): [R, E] int64, ``counts.cumsum(0)``.
        rank (int): this rank.

    Returns:
        (dest_rank [N], dest_row [N], src_rank [N]) int64: the buffer holds S*K rows, as many as the pairs.
    """
    N = e_ids.numel()
    R, two_L = offsets.shape
    dev = e_ids.device
    dest_rank = torch.empty(N, dtype=torch.int64, device=dev)
    dest_row = torch.empty(N, dtype=torch.int64, device=dev)
    src_rank = torch.empty(N, dtype=torch.int64, device=dev)
    n_pair_blocks = triton.cdiv(N, BLOCK)
    moonep_layout_kernel[(2 * n_pair_blocks,)](e_ids, pos, base, assign, cum_assign, starts, offsets, slot_experts,
                                               counts_cum, dest_rank, dest_row, src_rank, N, N, R, two_L // 2, rank,
                                               n_pair_blocks, BLOCK=BLOCK)
    return dest_rank, dest_row, src_rank
