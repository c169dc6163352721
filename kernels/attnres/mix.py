"""Triton kernels for Block AttnRes training, two-phase (the math is in ``k3lab.attnres.mix``, whose
PyTorch functions take the same arguments and return the same values).

- ``store_block``: a block representation written to its buffer slot and, in the same pass, its
  logits for every query (a [tokens, d] x [d, Q] product in float32) and its r (the RMSNorm scale).
- ``phase1_fwd`` / ``phase1_bwd``: the inter-block depth softmax of all S sublayers of a block
  at once. Forward takes the logits from the table and reads each block once, by d tiles (all S
  queries per program). Backward reads the blocks once more, whole rows (G queries per program),
  with the logits and r from the tables, each dO_l and the per-token offsets delta_l = dO_l . o_l -
  dlse_l that the merges' backward leaves (FlashAttention's "D"; for query 0 it is dh . h, formed here
  from h), and adds the blocks' gradients into the accumulator.
- ``merge_fwd`` / ``merge_bwd``: one sublayer's merge of the inter-block part with its partial sum
  (per-token scalars times two vectors); the forward optionally forms the partial sum p = prev + v
  first, the backward adds the partial sum's incoming gradient.

All kernels are memory-bound. The merge kernels and phase 1's backward read whole rows of d (the
merges' RMSNorm keys and logits, and the backward's dO_l . b_i, need them); the store walks d in
chunks and phase 1's forward works in d tiles. On a CPU-only machine ``k3lab.setup()`` must run
before this module is imported (TRITON_INTERPRET=1); the interpreter cannot do bf16 arithmetic, so
every block is upcast to float32 right after its load, and autotuning is off (one config).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.attnres.mix import check_merge, check_phase1, check_phase1_grads, check_phase1_tables, check_store
from k3lab.kernels import interpreting

INTERPRET = interpreting()


@triton.jit
def _score(b_v, b_w, D, eps):
    # r = rsqrt(mean(v^2) + eps), s = r * w^T v, for each row of b_v [BM, BD]; b_w [BD].
    b_r = 1.0 / tl.sqrt(tl.sum(b_v * b_v, axis=1) / D + eps)
    return b_r, tl.sum(b_v * b_w[None, :], axis=1) * b_r


def _prune(configs, nargs, **_):
    # Keep the register tile within budget and G no larger than the block's sublayer count needs.
    bd, s_pad = triton.next_power_of_2(nargs["D"]), triton.next_power_of_2(nargs["S"])
    kept = [c for c in configs if c.kwargs["G"] * c.kwargs["BM"] * bd <= _TILE_BUDGET and c.kwargs["G"] <= s_pad]
    return kept or [min(configs, key=lambda c: c.kwargs["G"] * c.kwargs["BM"])]


# Elements of one [G, BM, BD] register tile (the G queries' accumulators); more spills on an H200.
_TILE_BUDGET = 16384
# (G, BM, num_warps) of the backward. Offline sm_90 compiles (tests/sm90_compile.py's ``compile_sm90``,
# d = 2048): (8, 1, 8), (4, 2, 8) and (2, 2, 8) use 255 registers and the first two spill (296 and 384
# bytes of stack); 16 warps cap registers at 128 and spill more. On an H200 at M = 8192, d = 2048, n = 8,
# S = 6 (float32 blocks, bf16 dO, each option forced through the autotuner) the backward is fastest at
# (4, 2, 8): 1.062 ms, against 1.164 for (8, 1, 8), 1.342 for (2, 2, 8) and 4.4-6.0 for the 16-warp ones.
# The other backward layouts that were timed (two passes, token tiles, two kernels) lost; docs/attnres.md.
_BWD_OPTIONS = [(8, 1, 8), (4, 1, 8), (4, 2, 8), (2, 1, 8), (2, 2, 8), (1, 1, 8), (1, 1, 16), (1, 1, 32)]


def _configs(names: str, options, interpreted):
    """Autotune configs from tuples (values of ``names``..., num_warps); the one ``interpreted`` (small,
    to cover several tiles) when interpreting."""
    keys = names.split()
    return [triton.Config(dict(zip(keys, opt[:-1])), num_warps=opt[-1])
            for opt in ([interpreted] if INTERPRET else options)]


# (tokens, channels per step, warps); sm_90 compiles (Q <= 64, tf32x3) use 148 registers at (32, 16, 4),
# 190 at (64, 16, 4), 194 at (64, 32, 8), 240 at (32, 32, 4), 255 and a spill at (32, 64, 4).
@triton.autotune(configs=_configs("BM BK", [(64, 32, 8), (32, 32, 4), (64, 16, 4), (32, 16, 4), (128, 32, 8)],
                                  (16, 16, 4)), key=["D", "Q"])
@triton.jit
def attnres_store_kernel(
    a,  # [M, D] the block (or its first term)
    b,  # [M, D] its second term (read when HAS_B)
    dst,  # [M, D] the buffer slot (written when WRITE)
    W,  # [Q, D] queries
    scores,  # [Q, M] float32 output (rows stride_q apart): s_q = r w_q . dst
    rstd,  # [M] float32 output: r (written when HAS_R)
    M, D, Q, stride_q,
    eps,
    HAS_B: tl.constexpr,
    WRITE: tl.constexpr,
    HAS_R: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,  # channels per step
    BQ: tl.constexpr,  # >= Q, >= 16 (tl.dot)
):
    i_m = tl.program_id(0)
    o_m = i_m * BM + tl.arange(0, BM)
    o_q = tl.arange(0, BQ)
    m_m, m_q = o_m < M, o_q < Q
    b_ss = tl.zeros([BM], tl.float32)
    b_s = tl.zeros([BM, BQ], tl.float32)
    for k0 in range(0, D, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < D
        m_mk = m_m[:, None] & m_k[None, :]
        o_mk = o_m[:, None].to(tl.int64) * D + o_k[None, :]
        b_x = tl.load(a + o_mk, mask=m_mk, other=0.0).to(tl.float32)
        if HAS_B:
            b_x += tl.load(b + o_mk, mask=m_mk, other=0.0).to(tl.float32)
        if WRITE:
            # The logits of the value as stored (rounded to the buffer's dtype), as the backward sees it.
            b_x = b_x.to(dst.dtype.element_ty)
            tl.store(dst + o_mk, b_x, mask=m_mk)
            b_x = b_x.to(tl.float32)
        b_ss += tl.sum(b_x * b_x, axis=1)
        b_w = tl.load(W + o_q[None, :] * D + o_k[:, None], mask=m_k[:, None] & m_q[None, :], other=0.0)
        # tf32x3: float32 accuracy from three tensor-core products ("ieee", FMA loops, took 0.32 ms for
        # 8192 x 2048 x 49 on an H200, against 0.067 for the add alone).
        b_s += tl.dot(b_x, b_w.to(tl.float32), input_precision="tf32x3")
    b_r = 1.0 / tl.sqrt(b_ss / D + eps)
    tl.store(scores + o_q[None, :] * stride_q + o_m[:, None], b_s * b_r[:, None], mask=m_m[:, None] & m_q[None, :])
    if HAS_R:
        tl.store(rstd + o_m, b_r, mask=m_m)


# (BM, BD, num_warps) of the forward: on an H200 at M = 8192, d = 2048, n = 8, S = 6 these five took
# 0.242-0.259 ms, (1, 512, 4) the fastest; 8 warps took 0.28-0.45.
@triton.autotune(configs=_configs("BM BD", [(1, 512, 4), (1, 1024, 4), (2, 256, 4), (2, 512, 4), (4, 256, 4)],
                                  (2, 16, 4)), key=["D", "S"])
@triton.jit
def attnres_phase1_fwd_kernel(
    buf,  # [S_max, M, D] block representations; slots 0..n_src-1 are read
    scores,  # [S, n_src, M] float32 logits (strides stride_sq, stride_si, 1)
    h,  # [M, D] output: query 0's read (the block's first sublayer input), h's dtype
    o,  # [S - 1, M, D] output: queries 1..S-1's inter-block parts, o's dtype
    lse,  # [S, M] float32 output: log-sum-exp of each query's inter-block logits
    M, D, n_src, S, stride_s, stride_sq, stride_si,  # tokens, width, blocks read, queries, strides
    BS: tl.constexpr,  # >= S
    BM: tl.constexpr,  # tokens per program
    BD: tl.constexpr,  # channels per program
):
    i_m, i_d = tl.program_id(0), tl.program_id(1)
    o_l = tl.arange(0, BS)
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = i_d * BD + tl.arange(0, BD)
    m_l, m_m, m_d = o_l < S, o_m < M, o_d < D
    m_lm = m_l[:, None] & m_m[None, :]
    m_md = m_m[:, None] & m_d[None, :]
    o_md = o_m[:, None].to(tl.int64) * D + o_d[None, :]
    p_s = scores + o_l[:, None] * stride_sq + o_m[None, :]
    # The softmax over depth from the logits alone (per-token scalars), then one pass over the blocks.
    b_max = tl.full([BS, BM], float("-inf"), tl.float32)
    b_sum = tl.zeros([BS, BM], tl.float32)
    for i in range(0, n_src):
        b_s = tl.load(p_s + i * stride_si, mask=m_lm, other=0.0)
        b_new = tl.maximum(b_max, b_s)
        b_sum = b_sum * tl.exp(b_max - b_new) + tl.exp(b_s - b_new)
        b_max = b_new
    b_acc = tl.zeros([BS, BM, BD], tl.float32)
    p_src = buf
    for i in tl.range(0, n_src, num_stages=3):
        b_a = tl.exp(tl.load(p_s + i * stride_si, mask=m_lm, other=0.0) - b_max) / b_sum
        b_v = tl.load(p_src + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_acc += b_a[:, :, None] * b_v[None, :, :]
        p_src += stride_s
    b_h = tl.sum(tl.where((o_l == 0)[:, None, None], b_acc, 0.0), axis=0)
    tl.store(h + o_md, b_h.to(h.dtype.element_ty), mask=m_md)
    m_o = (m_l & (o_l > 0))[:, None, None] & m_md[None, :, :]
    p_o = o + (o_l[:, None, None] - 1).to(tl.int64) * M * D + o_md[None, :, :]
    tl.store(p_o, b_acc.to(o.dtype.element_ty), mask=m_o)
    if i_d == 0:
        tl.store(lse + o_l[:, None] * M + o_m[None, :], b_max + tl.log(b_sum), mask=m_lm)


@triton.autotune(configs=_configs("G BM", _BWD_OPTIONS, (2, 2, 4)), key=["D", "S"],
                 prune_configs_by={"early_config_prune": _prune}, restore_value=["dacc"])
@triton.jit
def attnres_phase1_bwd_kernel(
    buf,  # [S_max, M, D] block representations
    W,  # [S, D]
    lse,  # [S, M] float32 from the forward
    h,  # [M, D] query 0's read (the forward's h)
    dh,  # [M, D] gradient of query 0's read
    dO,  # [S - 1, M, D] gradients of queries 1..S-1's inter-block parts (when HAS_REST)
    delta,  # [S, M] float32 dO_l . o_l - dlse_l of queries 1..S-1 (row 0 unused; when HAS_REST)
    dacc,  # [>= n_src, M, D] the blocks' gradients: written, or added to when ACCUMULATE
    dW,  # [n_programs, S, D] float32 output: per-program partial sums of dW
    scores,  # [S, n_src, M] float32 logits (strides stride_sq, stride_si, 1), as the forward used them
    rstd,  # [n_src, M] float32 the blocks' r
    M, D, n_src, S, stride_s, stride_sq, stride_si,
    HAS_REST: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # 0 or 1
    BD: tl.constexpr,
    G: tl.constexpr,
    BM: tl.constexpr,
):
    # Persistent: program i_p handles token tiles i_p, i_p + n_p, ... for each group of G queries
    # in turn (groups after the first add into dacc rows this program wrote), keeping dW in registers.
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    for i_g in range(0, tl.cdiv(S, G)):
        o_l = i_g * G + tl.arange(0, G)
        m_l = o_l < S
        b_W = tl.load(W + o_l[:, None] * D + o_d[None, :], mask=m_l[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_dW = tl.zeros([G, BD], tl.float32)
        do_acc = (i_g + ACCUMULATE) > 0
        for i_t in range(i_p, tl.cdiv(M, BM), n_p):
            o_m = i_t * BM + tl.arange(0, BM)
            m_m = o_m < M
            m_md = m_m[:, None] & m_d[None, :]
            o_md = o_m[:, None].to(tl.int64) * D + o_d[None, :]
            m_lm = m_l[:, None] & m_m[None, :]
            o_lm = o_l[:, None] * M + o_m[None, :]
            b_dO = tl.load(dh + o_md[None, :, :] + 0 * o_l[:, None, None],
                           mask=(o_l == 0)[:, None, None] & m_md[None, :, :], other=0.0).to(tl.float32)
            b_h = tl.load(h + o_md, mask=m_md & (i_g == 0), other=0.0).to(tl.float32)
            b_delta = tl.sum(b_dO * b_h[None, :, :], axis=2)
            if HAS_REST:
                p_dO = dO + (o_l[:, None, None] - 1).to(tl.int64) * M * D + o_md[None, :, :]
                m_dO = (m_l & (o_l > 0))[:, None, None] & m_md[None, :, :]
                b_dO += tl.load(p_dO, mask=m_dO, other=0.0).to(tl.float32)
                b_delta += tl.load(delta + o_lm, mask=m_lm & (o_l > 0)[:, None], other=0.0)
            b_lse = tl.load(lse + o_lm, mask=m_lm, other=0.0)
            # ds_{l,i} = a (dO_l . b_i - delta_l); db_i = sum_l [a dO_l + r ds (w_l - s r / D b_i)]. The
            # logits and r come from the tables: dO_l . b_i is the only sum over d per block.
            p_src, p_dsrc = buf, dacc
            p_s = scores + o_l[:, None] * stride_sq + o_m[None, :]
            for i in tl.range(0, n_src, num_stages=3):
                b_v = tl.load(p_src + o_md, mask=m_md, other=0.0).to(tl.float32)
                b_s = tl.load(p_s + i * stride_si, mask=m_lm, other=0.0)
                b_r = tl.load(rstd + i * M + o_m, mask=m_m, other=0.0)
                b_a = tl.where(m_lm, tl.exp(b_s - b_lse), 0.0)
                b_ds = b_a * (tl.sum(b_dO * b_v[None, :, :], axis=2) - b_delta)
                b_dv = (tl.sum(b_a[:, :, None] * b_dO, axis=0)
                        + b_r[:, None] * tl.sum(b_ds[:, :, None] * b_W[:, None, :], axis=0)
                        - (b_r * b_r / D * tl.sum(b_ds * b_s, axis=0))[:, None] * b_v)
                b_dv += tl.load(p_dsrc + o_md, mask=m_md & do_acc, other=0.0).to(tl.float32)
                tl.store(p_dsrc + o_md, b_dv.to(dacc.dtype.element_ty), mask=m_md)
                b_dW += tl.sum((b_ds * b_r[None, :])[:, :, None] * b_v[None, :, :], axis=1)
                p_src += stride_s
                p_dsrc += M * D
        tl.store(dW + (i_p * S + o_l[:, None]) * D + o_d[None, :], b_dW, mask=m_l[:, None] & m_d[None, :])


@triton.jit
def attnres_merge_fwd_kernel(
    prev,  # [M, D] previous partial sum (read when HAS_PREV)
    v,  # [M, D] the last sublayer's output (read when ADD)
    p,  # [M, D] partial sum: written (= prev + v) when ADD, else read
    o,  # [M, D] inter-block part
    lse,  # [M] float32 its log-sum-exp
    w,  # [D] pseudo-query
    h,  # [M, D] output, p's dtype
    M, D, eps,
    ADD: tl.constexpr,
    HAS_PREV: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    m_m, m_d = o_m < M, o_d < D
    m_md = m_m[:, None] & m_d[None, :]
    o_md = o_m[:, None].to(tl.int64) * D + o_d[None, :]
    if ADD:
        b_p = tl.load(v + o_md, mask=m_md, other=0.0).to(tl.float32)
        if HAS_PREV:
            b_p += tl.load(prev + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_p = b_p.to(p.dtype.element_ty)
        tl.store(p + o_md, b_p, mask=m_md)
        b_p = b_p.to(tl.float32)
    else:
        b_p = tl.load(p + o_md, mask=m_md, other=0.0).to(tl.float32)
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_r, b_s = _score(b_p, b_w, D, eps)
    b_lse = tl.load(lse + o_m, mask=m_m, other=0.0)
    b_mx = tl.maximum(b_lse, b_s)
    b_ea, b_eb = tl.exp(b_lse - b_mx), tl.exp(b_s - b_mx)
    b_o = tl.load(o + o_md, mask=m_md, other=0.0).to(tl.float32)
    b_h = (b_ea[:, None] * b_o + b_eb[:, None] * b_p) / (b_ea + b_eb)[:, None]
    tl.store(h + o_md, b_h.to(h.dtype.element_ty), mask=m_md)


@triton.jit
def attnres_merge_bwd_kernel(
    dh,  # [M, D] gradient of h
    dp_in,  # [M, D] gradient of p from its other uses (read when HAS_DP)
    p, o,  # [M, D] partial sum, inter-block part
    lse,  # [M] float32
    w,  # [D]
    dp,  # [M, D] output: total gradient of p, p's dtype (when WRITE_DP)
    dv,  # [M, D] output: the same in v's dtype (when WRITE_DV)
    dO,  # [M, D] output: gradient of o (the block's slot, in o's dtype)
    delta,  # [M] float32 output: dO . o - dlse (phase 1's backward offset)
    dw,  # [n_programs, D] float32 output: per-program partial sums of dw
    M, D, eps,
    HAS_DP: tl.constexpr,
    WRITE_DP: tl.constexpr,
    WRITE_DV: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
):
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BD], tl.float32)
    for i_t in range(i_p, tl.cdiv(M, BM), n_p):
        o_m = i_t * BM + tl.arange(0, BM)
        m_m = o_m < M
        m_md = m_m[:, None] & m_d[None, :]
        o_md = o_m[:, None].to(tl.int64) * D + o_d[None, :]
        b_g = tl.load(dh + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_p = tl.load(p + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_o = tl.load(o + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_lse = tl.load(lse + o_m, mask=m_m, other=0.0)
        b_r, b_s = _score(b_p, b_w, D, eps)
        b_mx = tl.maximum(b_lse, b_s)
        b_ea, b_eb = tl.exp(b_lse - b_mx), tl.exp(b_s - b_mx)
        b_alpha, b_beta = b_ea / (b_ea + b_eb), b_eb / (b_ea + b_eb)
        b_ds = b_alpha * b_beta * tl.sum(b_g * (b_p - b_o), axis=1)
        # delta from dO as stored (rounded to its dtype), as phase 1's backward reads it.
        b_dO = (b_alpha[:, None] * b_g).to(dO.dtype.element_ty)
        tl.store(dO + o_md, b_dO, mask=m_md)
        tl.store(delta + o_m, tl.sum(b_dO.to(tl.float32) * b_o, axis=1) + b_ds, mask=m_m)
        b_dp = b_beta[:, None] * b_g + (b_r * b_ds)[:, None] * (b_w[None, :] - (b_s * b_r / D)[:, None] * b_p)
        if HAS_DP:
            b_dp += tl.load(dp_in + o_md, mask=m_md, other=0.0).to(tl.float32)
        if WRITE_DP:
            tl.store(dp + o_md, b_dp.to(dp.dtype.element_ty), mask=m_md)
        if WRITE_DV:
            tl.store(dv + o_md, b_dp.to(dv.dtype.element_ty), mask=m_md)
        b_dw += tl.sum((b_ds * b_r)[:, None] * b_p, axis=0)
    tl.store(dw + i_p * D + o_d, b_dw, mask=m_d)


def _rows(D: int, elems: int) -> tuple[int, int, int]:
    block_d = triton.next_power_of_2(D)
    block_m = max(1, min(16, elems // block_d))
    return block_m, block_d, 4 if block_m * block_d <= 4096 else 8


def _n_programs(device: torch.device, n_tiles: int) -> int:
    return min(n_tiles, 4 if INTERPRET else 4 * torch.cuda.get_device_properties(device).multi_processor_count)


def _check_phase1(buf: torch.Tensor, n: int, W: torch.Tensor, scores: torch.Tensor | None) -> None:
    if not buf.is_contiguous():
        raise ValueError("buf must be contiguous")
    check_phase1(buf, n, W, scores)


def store_block(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, W: torch.Tensor, eps: float,
                scores: torch.Tensor, rstd: torch.Tensor | None = None) -> None:
    """Triton store; as ``k3lab.attnres.mix.store_block_torch``: ``dst`` = a + b (or a),
    ``scores`` [Q, ...] = r w_q^T dst and ``rstd`` [...] = r (when given) in one pass (``dst`` may be
    ``a``: logits only).

    Raises:
        ValueError: a, b or dst not [..., d] alike, non-contiguous dst, W not [Q, d], scores not [Q, ...]
            float32 with contiguous rows, rstd not [...] float32 contiguous.
    """
    check_store(dst, a, b, W, scores, rstd)
    D, Q = a.shape[-1], W.shape[0]
    M = a.numel() // D
    if not dst.is_contiguous():
        raise ValueError("dst must be contiguous")
    if scores.dtype != torch.float32 or not scores[0].is_contiguous():
        raise ValueError(f"scores must be float32 with each query's row contiguous, got {scores.dtype} with "
                         f"strides {scores.stride()}")
    if rstd is not None and not rstd.is_contiguous():
        raise ValueError("rstd must be contiguous")
    attnres_store_kernel[lambda meta: (triton.cdiv(M, meta["BM"]),)](
        a.contiguous(), b.contiguous() if b is not None else a, dst, W.contiguous(), scores,
        rstd if rstd is not None else scores, M, D, Q, scores.stride(0), eps, HAS_B=b is not None,
        WRITE=dst is not a, HAS_R=rstd is not None, BQ=max(16, triton.next_power_of_2(Q)),
    )


def _tables(buf: torch.Tensor, n: int, W: torch.Tensor, eps: float, scores: torch.Tensor | None,
            rstd: torch.Tensor | None = None, need_rstd: bool = False):
    """The logits as [S, n, M] (a view of the table's slice) and the blocks' r as [n, M] (when
    ``need_rstd``; the caller gives both or neither), both formed here by one more pass over the blocks
    when scores is None."""
    S, D = W.shape[0], buf.shape[-1]
    if scores is None:
        scores = torch.empty((n, S, *buf.shape[1:-1]), dtype=torch.float32, device=buf.device).transpose(0, 1)
        rstd = torch.empty((n, *buf.shape[1:-1]), dtype=torch.float32, device=buf.device)
        for i in range(n):
            store_block(buf[i], buf[i], None, W, eps, scores[:, i], rstd[i])
    # A view for the table's slices; a layout whose tokens cannot be one contiguous run is copied.
    M = buf[0].numel() // D
    scores = scores.reshape(S, n, M)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if scores.dtype != torch.float32 or (need_rstd and rstd.dtype != torch.float32):
        raise ValueError(f"scores and rstd must be float32, got {scores.dtype} and {getattr(rstd, 'dtype', None)}")
    return scores, rstd.reshape(n, M).contiguous() if need_rstd else None


def phase1_fwd(buf: torch.Tensor, n: int, W: torch.Tensor, eps: float, h_dtype: torch.dtype | None = None,
               o_dtype: torch.dtype | None = None, scores: torch.Tensor | None = None):
    """Triton phase-1 forward; arguments and returns as ``k3lab.attnres.mix.phase1_fwd_torch``
    (buf [S_max, ..., d] contiguous; scores [S, n, ...] float32 from ``store_block``, any strides (a
    layout whose tokens are not one contiguous run is copied), or None: formed here by one more pass
    over the blocks; returns h [..., d], o [S - 1, ..., d] or None, lse [S, ...] float32).

    Raises:
        ValueError: non-contiguous buf, n out of range, W not [S, d], scores not float32 [S, n, ...].
    """
    _check_phase1(buf, n, W, scores)
    S, D = W.shape[0], buf.shape[-1]
    M = buf[0].numel() // D
    scores, _ = _tables(buf, n, W, eps, scores)
    h = torch.empty(buf.shape[1:], dtype=h_dtype or buf.dtype, device=buf.device)
    o = torch.empty((S - 1, *buf.shape[1:]), dtype=o_dtype or h.dtype, device=buf.device) if S > 1 else None
    lse = torch.empty((S, *buf.shape[1:-1]), dtype=torch.float32, device=buf.device)
    grid = lambda meta: (triton.cdiv(M, meta["BM"]), triton.cdiv(D, meta["BD"]))  # noqa: E731
    attnres_phase1_fwd_kernel[grid](buf, scores, h, o if o is not None else h, lse, M, D, n, S, M * D,
                                    scores.stride(0), scores.stride(1), BS=triton.next_power_of_2(S))
    return h, o, lse


def phase1_bwd(buf: torch.Tensor, n: int, W: torch.Tensor, lse: torch.Tensor, h: torch.Tensor, dh: torch.Tensor,
               dO: torch.Tensor | None, delta: torch.Tensor | None, eps: float, dacc: torch.Tensor,
               accumulate: bool = True, scores: torch.Tensor | None = None,
               rstd: torch.Tensor | None = None) -> torch.Tensor:
    """Triton phase-1 backward; as ``k3lab.attnres.mix.phase1_bwd_torch`` (the blocks' gradients go
    into ``dacc[:n]``, written or added; the logits and r from the tables ``scores`` [S, n, ...] and
    ``rstd`` [n, ...] (float32, given together), formed here by one more pass over the blocks when
    None; returns dW [S, d] in W's dtype).

    Raises:
        ValueError: non-contiguous buf or dacc, n out of range, shape mismatch (``check_phase1_grads``),
            the tables as ``check_phase1_tables`` says, lse, scores or rstd not float32.
    """
    _check_phase1(buf, n, W, scores)
    check_phase1_tables(buf, n, scores, rstd)
    S, D = W.shape[0], buf.shape[-1]
    M = buf[0].numel() // D
    if dacc.shape[1:] != buf.shape[1:] or dacc.shape[0] < n:
        raise ValueError(f"dacc must be [>= {n}, {', '.join(map(str, buf.shape[1:]))}], got {list(dacc.shape)}")
    if not dacc.is_contiguous():
        raise ValueError("dacc must be contiguous (it is written in place)")
    check_phase1_grads(buf, W, lse, h, dh, dO, delta)
    _check_lse(lse)
    scores, rstd = _tables(buf, n, W, eps, scores, rstd, need_rstd=True)
    # Persistent grid, sized for one token per program at most; every program writes its dW rows.
    n_prog = _n_programs(buf.device, M)
    dW = torch.empty((n_prog, S, D), dtype=torch.float32, device=buf.device)
    attnres_phase1_bwd_kernel[(n_prog,)](
        buf, W.contiguous(), lse.contiguous(), h.contiguous(), dh.contiguous(),
        dO.contiguous() if dO is not None else dh, delta.contiguous() if delta is not None else lse, dacc, dW,
        scores, rstd, M, D, n, S, M * D, scores.stride(0), scores.stride(1),
        HAS_REST=S > 1, ACCUMULATE=int(accumulate), BD=triton.next_power_of_2(D),
    )
    return dW.sum(0).to(W.dtype)


def _check_lse(lse: torch.Tensor) -> None:
    # The kernels read lse as float32 (a float64 one, as the PyTorch phase 1 gives for float64 blocks,
    # was read as garbage).
    if lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 for the Triton kernels, got {lse.dtype}")


def merge_fwd(p: torch.Tensor | None, o: torch.Tensor, lse: torch.Tensor, w: torch.Tensor, eps: float,
              prev: torch.Tensor | None = None, v: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """Triton merge forward; as ``k3lab.attnres.mix.merge_fwd_torch``: with ``v`` given, p = prev + v
    (or v) is formed in ``dtype`` first; returns (p, h).

    Raises:
        ValueError: shape mismatch (p, prev, v like o; lse o.shape[:-1]; w [d]), lse not float32, or not
            exactly one of p and v given.
    """
    if (p is None) == (v is None):
        raise ValueError("give exactly one of p (read) and v (p = prev + v formed here)")
    check_merge(o, lse, w, p=p, prev=prev, v=v)
    _check_lse(lse)
    D = o.shape[-1]
    M = o.numel() // D
    if v is not None:
        p = torch.empty(v.shape, dtype=dtype or (prev.dtype if prev is not None else v.dtype), device=v.device)
    p_slot = p if v is not None else p.contiguous()  # written when formed here, else read
    h = torch.empty(o.shape, dtype=p.dtype, device=o.device)
    block_m, block_d, num_warps = _rows(D, 4096)
    attnres_merge_fwd_kernel[(triton.cdiv(M, block_m),)](
        prev.contiguous() if prev is not None else p, v.contiguous() if v is not None else p, p_slot, o.contiguous(),
        lse.contiguous(), w.contiguous(), h, M, D, eps,
        ADD=v is not None, HAS_PREV=prev is not None, BM=block_m, BD=block_d, num_warps=num_warps,
    )
    return p, h


def merge_bwd(dh: torch.Tensor, dp_in: torch.Tensor | None, p: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
              w: torch.Tensor, eps: float, dO: torch.Tensor, delta: torch.Tensor, v_dtype: torch.dtype | None = None,
              need_dp: bool = True):
    """Triton merge backward; as ``k3lab.attnres.mix.merge_bwd_torch``: writes dO and delta in place,
    returns (dp, dv, dw) (dp None when not ``need_dp`` and dv is written in another dtype).

    Raises:
        ValueError: shape mismatch (dh, dp_in, p, dO like o; delta and lse o.shape[:-1]; w [d]), lse not
            float32, or non-contiguous output slots.
    """
    check_merge(o, lse, w, p=p, dh=dh, dp_in=dp_in, dO=dO)
    if delta.shape != p.shape[:-1]:
        raise ValueError(f"delta must be {list(p.shape[:-1])}, got {list(delta.shape)}")
    _check_lse(lse)
    if not (dO.is_contiguous() and delta.is_contiguous() and p.is_contiguous()):
        raise ValueError("p, dO and delta must be contiguous")
    D = p.shape[-1]
    M = p.numel() // D
    write_dv = v_dtype is not None and v_dtype != p.dtype
    write_dp = need_dp or not write_dv
    dp = torch.empty_like(p) if write_dp else None
    dv = torch.empty(p.shape, dtype=v_dtype, device=p.device) if write_dv else dp
    block_m, block_d, num_warps = _rows(D, 2048)
    n_prog = _n_programs(p.device, triton.cdiv(M, block_m))
    dw = torch.empty((n_prog, D), dtype=torch.float32, device=p.device)
    attnres_merge_bwd_kernel[(n_prog,)](
        dh.contiguous(), dp_in.contiguous() if dp_in is not None else dh, p, o.contiguous(), lse.contiguous(),
        w.contiguous(), dp if write_dp else dv, dv, dO, delta, dw, M, D, eps,
        HAS_DP=dp_in is not None, WRITE_DP=write_dp, WRITE_DV=write_dv, BM=block_m, BD=block_d, num_warps=num_warps,
    )
    return dp, dv, dw.sum(0).to(w.dtype)
