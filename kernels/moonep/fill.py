"""App. E's constructive fill and the plan derived from it (``k3lab.moonep.plan``, steps 1-7) as one Triton
program.

The torch planner runs the fill as R - 1 dependent steps of about 37 small tensor ops each: on a GPU that
is one kernel after another, thousands at R = 64, even inside a CUDA graph. The fill's whole state is
small (E pair counts, R loads, R donors), so one program holds it in registers and runs every step as a
few block reductions, with no launch between steps:

    keep  [BLOCK_R, BLOCK_L]  pairs of expert r*L + l still on its home rank r (padded with zeros)
    give  [BLOCK_R, BLOCK_L]  pairs of expert donor[v]*L + l processed on rank v
    load  [BLOCK_R]           pairs rank r processes now;  donor [BLOCK_R]

    per fill:  u = argmin(load), d = argmax(load)      (first index on ties, as torch)
               need = C - load[u]                       (C = S*K; the loop ends once need <= 0)
               vals = keep[d, :]
               key_l = vals_l * BLOCK_L + (BLOCK_L - 1 - l)          (unique: most pairs first, then
                                                                    the lower expert index)
               before_l = sum_j vals_j [key_j > key_l]               (an [L, L] tile, no sort)
               take_l = min(max(need - before_l, 0), vals_l)
               keep[d] -= take, give[u] += take, donor[u] = d, load[u] += need, load[d] -= need

``take`` is the torch planner's greedy take (its stable descending sort, then a cumulative sum) written
without a sort, so every field is equal, not close. The loop stops at R - 1 fills or once no rank is under
C, whichever comes first: the torch planner's remaining steps are no-ops (need = 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# The tile limits: the [L, L] comparison tile and the [R, L] state tiles stay in one program's registers
# (compiled for sm_90 at ``default_num_warps``: at most 248 registers a thread, no spill).
MAX_BLOCK_L = 128
MAX_TILE = 2048
# Outside any load the fill sees (at most R*S*K): a padded rank's load for argmin / argmax.
BIG = 2**62
BIG32 = 2**30


@triton.jit
def moonep_fill_kernel(counts, keep, give, donor, assign, slot_experts, slot_counts, offsets, R, L, C,
                       BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_RC: tl.constexpr, BIG: tl.constexpr,
                       DT: tl.constexpr):
    # counts: [R, E] int32/int64, contiguous; keep: [E] int64; give: [R, L] int64; donor: [R] int64;
    # assign: [E, R] int64; slot_experts, slot_counts: [R, 2L] int64; offsets: [R, 2L] int32.
    # R, L: ranks and experts per rank (E = R*L); C = S*K. BLOCK_R, BLOCK_L: powers of two >= R, L.
    # DT, BIG: the state's integer type and a load above any real one (``state_dtype``).
    # BLOCK_RC: rows of counts loaded per loop iteration.
    o_r = tl.arange(0, BLOCK_R)
    o_l = tl.arange(0, BLOCK_L)
    m_r = o_r < R
    m_rl = m_r[:, None] & (o_l < L)[None, :]
    o_rl = o_r[:, None] * L + o_l[None, :]
    # 1. global load per expert, as the [R, L] tile of home rank x local index, and per home rank. BLOCK_RC
    #    rows per iteration, unrolled so their loads are in flight together; 2-D loads, so that the state
    #    tiles take the loads' layout (a 3-D load tile would leave them replicated across threads).
    b_keep = tl.zeros([BLOCK_R, BLOCK_L], dtype=DT)
    for r0 in range(0, R, BLOCK_RC):
        for i in tl.static_range(BLOCK_RC):
            b_keep += tl.load(counts + (r0 + i) * (R * L) + o_rl, mask=m_rl & (r0 + i < R), other=0).to(DT)
    b_load = tl.sum(b_keep, axis=1)
    b_give = tl.zeros([BLOCK_R, BLOCK_L], dtype=DT)
    b_donor = o_r.to(DT)
    # The greedy order's tie-break: a lower expert index ranks first among equal counts.
    b_rank_l = (BLOCK_L - 1 - o_l).to(DT)
    # 2. at most R - 1 fills; 3. the least-loaded receiver u (first index on ties).
    lo, u = tl.min(tl.where(m_r, b_load, BIG), axis=0, return_indices=True)
    n_fill = 0
    while (n_fill < R - 1) & (lo < C):
        # 3. the most-loaded donor d (first index on ties) and what u lacks.
        d = tl.argmax(tl.where(m_r, b_load, -BIG), axis=0)
        need = C - lo
        # 4. the donor's experts; before_l: pairs of the experts the greedy order takes before l.
        b_vals = tl.sum(tl.where(o_r[:, None] == d, b_keep, 0), axis=0)
        b_key = b_vals * BLOCK_L + b_rank_l
        b_before = tl.sum(tl.where(b_key[None, :] > b_key[:, None], b_vals[None, :], 0), axis=1)
        # 5. the greedy take up to `need`.
        b_take = tl.minimum(tl.maximum(need - b_before, 0), b_vals)
        # 6. move them: the donor keeps fewer, the receiver's redundant slots hold them.
        b_keep -= tl.where(o_r[:, None] == d, b_take[None, :], 0)
        b_give += tl.where(o_r[:, None] == u, b_take[None, :], 0)
        b_donor = tl.where(o_r == u, d.to(DT), b_donor)
        b_load += tl.where(o_r == u, need, 0) - tl.where(o_r == d, need, 0)
        lo, u = tl.min(tl.where(m_r, b_load, BIG), axis=0, return_indices=True)
        n_fill += 1
    tl.store(keep + o_rl, b_keep, mask=m_rl)
    tl.store(give + o_rl, b_give, mask=m_rl)
    tl.store(donor + o_r, b_donor, mask=m_r)
    # 7. the plan's derived fields (``planner.finish_plan``) from the same tiles. Rank v's buffer: its L
    #    home experts (keep), then L redundant slots of donor[v]'s experts (give); offsets are slot ends.
    o_s = o_r[:, None] * (2 * L) + o_l[None, :]
    b_home_end = tl.cumsum(b_keep, axis=1)
    b_give_end = tl.sum(b_keep, axis=1)[:, None] + tl.cumsum(b_give, axis=1)
    tl.store(slot_counts + o_s, b_keep, mask=m_rl)
    tl.store(slot_counts + o_s + L, b_give, mask=m_rl)
    tl.store(offsets + o_s, b_home_end.to(tl.int32), mask=m_rl)
    tl.store(offsets + o_s + L, b_give_end.to(tl.int32), mask=m_rl)
    tl.store(slot_experts + o_s, o_rl.to(tl.int64), mask=m_rl)
    tl.store(slot_experts + o_s + L, b_donor[:, None] * L + o_l[None, :], mask=m_rl)
    #    assign[h*L + l, v]: keep[h, l] on the home column v = h, give[v, l] on every v whose donor is h
    #    (a rank without a donor has give = 0, so its own column gains nothing).
    for v in range(0, R):
        g_v = tl.sum(tl.where(o_r[:, None] == v, b_give, 0), axis=0)
        d_v = tl.sum(tl.where(o_r == v, b_donor, 0), axis=0)
        col = tl.where(o_r[:, None] == v, b_keep, 0) + tl.where(o_r[:, None] == d_v, g_v[None, :], 0)
        tl.store(assign + o_rl * R + v, col, mask=m_rl)


def _blocks(R: int, L: int) -> tuple[int, int]:
    return triton.next_power_of_2(R), triton.next_power_of_2(L)


def fill_fits(R: int, E: int) -> bool:
    """Whether ``plan_fill`` takes R ranks and E experts (E a multiple of R, L = E/R): next_pow2(L) <=
    MAX_BLOCK_L = 128 and next_pow2(R) * next_pow2(L) <= MAX_TILE = 2048: so E <= 2048, and every E <= 1024
    with L <= 128 fits (E = 896 from R = 7 ranks on)."""
    BLOCK_R, BLOCK_L = _blocks(R, E // R)
    return BLOCK_L <= MAX_BLOCK_L and BLOCK_R * BLOCK_L <= MAX_TILE


def default_num_warps(R: int, L: int) -> int:
    """Warps for the fill: the fewest with at most 8 values of an [R, L] tile and 64 of the [L, L] tile per
    thread (about 150-250 registers, no spill on sm_90); a small tile stays in one warp, where every
    reduction is shuffles, without shared memory or a barrier."""
    BLOCK_R, BLOCK_L = _blocks(R, L)
    return max(1, min(8, max(BLOCK_R * BLOCK_L // 256, BLOCK_L * BLOCK_L // 2048)))


def state_dtype(R: int, L: int, C: int, wide: bool = False) -> dict:
    """The fill state's integer type and its out-of-range load: int32 (BIG = 2^30) where every value the
    fill forms fits, int64 (BIG = 2^62) otherwise. The largest are a load (at most R*C) and an order key
    (a count times BLOCK_L), so int32 needs R * C * next_pow2(L) < 2^30 (E = 896 over 64 ranks at S = 8192,
    K = 16: 2^27). int64 arithmetic is two or more instructions per add, compare and shuffle: the fill's
    R - 1 dependent steps are latency-bound, so the narrower type shortens each. ``wide``: int64 always
    (the benchmark times both)."""
    if not wide and R * C * triton.next_power_of_2(L) < BIG32:
        return dict(DT=tl.int32, BIG=BIG32)
    return dict(DT=tl.int64, BIG=BIG)


def launch_config(R: int, L: int, num_warps: int | None = None) -> dict:
    """The fill's constexprs and launch width for R ranks of L experts: BLOCK_R, BLOCK_L, BLOCK_RC (rows of
    counts loaded per iteration: up to 4, about 16 values per thread in flight) and num_warps (None:
    ``default_num_warps``)."""
    BLOCK_R, BLOCK_L = _blocks(R, L)
    num_warps = num_warps or default_num_warps(R, L)
    BLOCK_RC = max(1, min(4, BLOCK_R, 512 * num_warps // (BLOCK_R * BLOCK_L)))
    return dict(BLOCK_R=BLOCK_R, BLOCK_L=BLOCK_L, BLOCK_RC=BLOCK_RC, num_warps=num_warps)


def plan_fill(counts: torch.Tensor, S: int, K: int, num_warps: int | None = None, wide: bool = False):
    """The whole plan of ``k3lab.moonep.plan`` (the fill, steps 1-6, and its derived fields, step 7) in one
    launch of one program; no host read.

    Args:
        counts (Tensor): [R, E] int64 or int32 on the GPU (or the CPU under TRITON_INTERPRET=1), already
            checked by the caller (``planner.check_counts``) and within ``fill_fits(R, E)``.
        S, K (int): tokens per rank, top-k; C = S*K.
        num_warps (int | None): launch width; None: ``default_num_warps``.
        wide (bool): keep the state in int64 even where int32 fits (``state_dtype``).

    Returns:
        (keep [E] int64, give [R, L] int64, donor [R] int64, assign [E, R] int64, slot_experts [R, 2L]
        int64, slot_counts [R, 2L] int64, offsets [R, 2L] int32): ``Plan``'s tensor fields in its order,
        equal to ``planner.finish_plan`` of the first three.
    """
    R, E = counts.shape
    L = E // R
    counts = counts.contiguous()
    dev = counts.device
    keep = torch.empty(E, dtype=torch.int64, device=dev)
    give = torch.empty(R, L, dtype=torch.int64, device=dev)
    donor = torch.empty(R, dtype=torch.int64, device=dev)
    assign = torch.empty(E, R, dtype=torch.int64, device=dev)
    slot_experts = torch.empty(R, 2 * L, dtype=torch.int64, device=dev)
    slot_counts = torch.empty(R, 2 * L, dtype=torch.int64, device=dev)
    offsets = torch.empty(R, 2 * L, dtype=torch.int32, device=dev)
    moonep_fill_kernel[(1,)](counts, keep, give, donor, assign, slot_experts, slot_counts, offsets, R, L, S * K,
                             **state_dtype(R, L, S * K, wide), **launch_config(R, L, num_warps))
    return keep, give, donor, assign, slot_experts, slot_counts, offsets
