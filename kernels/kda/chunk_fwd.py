"""FlashKDA forward: six Triton kernels and their launchers.

1. ``kda_gate_fwd_kernel`` (K tiles x chunks x value heads): the fused gate
   g = lb * sigmoid(exp(A_log) (z + dt_bias)) and its in-chunk cumsum G (without a backward, with
   16-bit intermediates: G as int16 codes within 16-row sub-tiles, and the sub-tiles' ends).
2. ``kda_scores_fwd_kernel`` (16-row sub-tiles x chunks x value heads, all in parallel): q/k L2 norm, beta
   sigmoid, KG, QG and W's right operand for the sub-tile's rows, and its row of 16x16 sub-tiles of
   (Gamma K)(K / Gamma)^T and (Gamma Q)(K / Gamma)^T on tensor cores (L = Diag(beta) StrictTril(Ks), Aqk).
3. ``kda_inverse_fwd_kernel`` (chunks x value heads): the UT-transform inverse T = (I + L)^-1 by 16x16
   blocks.
4. ``kda_wu_fwd_kernel`` (chunks x value heads): W = T Diag(beta)(Gamma K), U = T Diag(beta) V.
   Without a backward (and with 16-bit intermediates) 3 and 4 run as one kernel,
   ``kda_inverse_wu_fwd_kernel``, and T never goes to memory.
5. ``kda_state_fwd_kernel`` (one program per sequence, value head and V tile; the only sequential
   loop): S_n for every chunk, pseudo-values V~ = U - W S, the output O = (Gamma Q) S + Tril((Gamma Q)
   (K/Gamma)^T) V~ while S and V~ are in registers, then S <- Diag(gamma_C) S + (Gamma_{i->C} K)^T V~.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.kernels.kda.utils import (
    BC, BT, chunk_decay_halves, chunk_span, dot_precision, exp_ftz, grid_log2, l2norm_rows, launch_fitting,
    load_rows, load_vec, sequence_span, state_half, state_halves, state_prefetch, state_tile, store_rows, warp_configs,
)


@triton.jit
def gate_end(E, c, i_hv, I, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """The packed gate's sub-tile ends E [NT, HV, BT // BC, K]: where chunk c, value head i_hv, sub-tile I
    starts."""
    return E + ((c * HV + i_hv) * (BT // BC) + I) * K


@triton.jit
def last_row(G, E, t0, n_t, i_c, i_hv, I, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
             BK: tl.constexpr, PACKED: tl.constexpr):
    """G at the last row of sub-tile I (clamped to the chunk's last token) as a [BK] vector: from G, or
    when PACKED from E, where the gate kernel stored it."""
    o_k = tl.arange(0, BK)
    if PACKED:
        return tl.load(gate_end(E, i_c.to(tl.int64), i_hv, I, HV, K, BT, BC) + o_k, mask=o_k < K, other=0.0)
    o_r = I * BC + BC - 1 + tl.zeros([1], tl.int32)
    return tl.sum(load_rows(G, t0, n_t, o_r, HV * K, i_hv * K, o_k, K, True), 0)


@triton.jit
def gate_rows(G, t0, n_t, o_i, i_hv, b_r, x_scale, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
              PACKED: tl.constexpr):
    """G at rows o_i of one sub-tile (clamped), [BC, BK] float32: loaded, or when PACKED rebuilt from the
    gate kernel's int16 code x, G = r + x_scale (x - 32767) (r = G before the sub-tile)."""
    b_G = load_rows(G, t0, n_t, o_i, HV * K, i_hv * K, tl.arange(0, BK), K, True)
    if PACKED:
        b_G = b_r[None, :] + (b_G - 32767.0) * x_scale
    return b_G


@triton.jit
def row_block(q, k, G, beta, KG, QG, W, t0, n_t, i_h, i_hv, scale, x_scale, b_r, b_e, b_Gl, I,
              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
              PACKED: tl.constexpr):
    """Sub-tile I, with r = G before its first row (0 for I = 0) and e = G at its last row: stores
    KG = k exp(G_last - G), QG = scale q exp(G) and W's right operand Diag(beta) k exp(G) (in W), and
    returns the operands of the decayed scores (k P, scale q P, k Q, sigmoid(beta)); k and q are
    L2-normalised here, once.

    The two exponentials per element are taken at the sub-tile's middle m = (r + e) / 2,
    P = exp(G - m) and Q = exp(m - G), so neither exceeds exp(8 |lb|) (the "1/Gamma in bf16" of the
    lower-bounded gate); the other factors are [BK] vectors. Products that may underflow are formed from
    two factors <= 1 (exp(G - r) = P exp(m - r), then exp(r)): the lost values are below float32's range.
    """
    o_i = I * BC + tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    b_k = l2norm_rows(load_rows(k, t0, n_t, o_i, H * K, i_h * K, o_k, K, False))
    b_q = l2norm_rows(load_rows(q, t0, n_t, o_i, H * K, i_h * K, o_k, K, False)) * scale
    b_m = 0.5 * (b_r + b_e)
    b_G = gate_rows(G, t0, n_t, o_i, i_hv, b_r, x_scale, HV, K, BK, PACKED)
    b_b = tl.where(o_i < n_t, tl.sigmoid(load_vec(beta, t0, n_t, o_i, HV, i_hv)), 0.0)
    b_P = exp_ftz(b_G - b_m[None, :])
    b_kp = b_k * b_P
    b_qp = b_q * b_P
    b_kq = b_k * exp_ftz(b_m[None, :] - b_G)
    # m - r and e - m, not (e - r) / 2: the rounding of m cancels in the exponents' sums.
    b_kh = b_kq * exp_ftz(b_e - b_m)[None, :]
    b_fr = exp_ftz(b_m - b_r)[None, :]
    b_er = exp_ftz(b_r)[None, :]
    store_rows(KG, b_kh * exp_ftz(b_Gl - b_e)[None, :], t0, n_t, o_i, HV * K, i_hv * K, o_k, K)
    store_rows(QG, b_qp * b_fr * b_er, t0, n_t, o_i, HV * K, i_hv * K, o_k, K)
    store_rows(W, b_kp * b_fr * (b_er * b_b[:, None]), t0, n_t, o_i, HV * K, i_hv * K, o_k, K)
    return b_kp, b_qp, b_kq, b_b


@triton.jit
def key_columns(k, G, E, t0, n_t, i_c, i_h, i_hv, J, b_m, x_scale, H: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PACKED: tl.constexpr):
    """The decayed keys of sub-tile J < I as the scores' columns at sub-tile I's middle m:
    k_j exp(m - G_j), L2-normalised, every factor <= 1 (G falls, so G_j >= G before sub-tile I >= m)."""
    o_j = J * BC + tl.arange(0, BC)
    b_rj = tl.zeros([BK], tl.float32)
    if PACKED and J > 0:
        b_rj += last_row(G, E, t0, n_t, i_c, i_hv, J - 1, HV, K, BT, BC, BK, True)
    b_kj = l2norm_rows(load_rows(k, t0, n_t, o_j, H * K, i_h * K, tl.arange(0, BK), K, False))
    return b_kj * exp_ftz(b_m[None, :] - gate_rows(G, t0, n_t, o_j, i_hv, b_rj, x_scale, HV, K, BK, PACKED))


@triton.jit
def score_block(b_kp, b_qp, b_c, b_b, L, Aqk, t0, n_t, i_hv, I, J, HV: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, PREC: tl.constexpr, DIAG: tl.constexpr):
    """Sub-tile (I, J), J <= I, of the two decayed score matrices, both at sub-tile I's middle m: rows
    x_i exp(G_i - m) (``row_block``'s k P and scale q P, already in the dot's dtype), columns
    b_c = k_j exp(m - G_j) (``key_columns``; k Q for J = I). Stores L = Diag(beta) StrictTril(Ks) and Aqk
    (inclusive) for the block. The rows' factor exp(G_i - m) is at most exp(7.5 |lb|) (m sits half a
    sub-tile's decay below the first row, which has already decayed once), so a product whose column factor
    flushes to zero (below 2^-126 = e^-87.3) is below exp(7.5 |lb| - 87.3): 4.4e-6 at the bound lb = -10,
    under 1e-8 from lb = -9 on, beside entries of size up to 1."""
    o_c = tl.arange(0, BC)
    o_i = I * BC + o_c
    b_ct = tl.trans(b_c.to(b_kp.dtype))
    b_Ks = tl.dot(b_kp, b_ct, input_precision=PREC)
    b_Aq = tl.dot(b_qp, b_ct, input_precision=PREC)
    if DIAG:
        b_Ks = tl.where(o_c[:, None] > o_c[None, :], b_Ks, 0.0)
        b_Aq = tl.where(o_c[:, None] >= o_c[None, :], b_Aq, 0.0)
    store_rows(Aqk, b_Aq, t0, n_t, o_i, HV * BT, i_hv * BT + J * BC, o_c, BC)
    store_rows(L, b_b[:, None] * b_Ks, t0, n_t, o_i, HV * BT, i_hv * BT + J * BC, o_c, BC)


@triton.jit
def doubling_step(b_X, b_N, S: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """From X = the inverses of the diagonal S-blocks of I + N (a [4, BC, BC] batch), those of its 2S-blocks:
    with N_S = N's lower-left S-block inside each 2S-block, [[A, 0], [C, B]]^-1 = X - (X N_S) X."""
    o_c = tl.arange(0, BC)
    o_i, o_j = o_c[:, None], o_c[None, :]
    b_Ns = tl.where(((o_i // (2 * S) == o_j // (2 * S)) & (o_i // S > o_j // S))[None, :, :], b_N, 0.0)
    return b_X - tl.dot(tl.dot(b_X, b_Ns, input_precision=PREC), b_X, input_precision=PREC)


@triton.jit
def unit_lower_inverse(b_N0, b_N1, b_N2, b_N3, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + N)^-1 of four strictly lower [BC, BC] blocks (BC = 16) at once, as a [4, BC, BC] batch, by
    recursive doubling: the 2x2 diagonal blocks' inverses are I - N there, then three ``doubling_step``s
    (4x4, 8x8, 16x16), six batched products at input precision ``PREC``.

    The intermediates are inverses of smaller diagonal blocks and the products B^-1 C, never powers of N,
    so they do not form the large terms that cancel in the power form (I - N)(I + N^2)(I + N^4)(I + N^8)
    would form: on near-identical keys (N's entries near 1) N^8 reaches C(14, 7) = 3432, where float32
    products of the powers lose 6e-5 relative and plain TF32 ones 0.65 at most. Doubling in float32
    ("ieee") is at float32's rounding (2.7e-8 relative on identical keys in runs of 8 on an H200, with no
    Newton step), and in three bf16 passes ("bf16x3", which gave the powers 8.1e-3 at most) it leaves T
    at its bf16 rounding (``inverse_precisions``; docs/flash_kda.md)."""
    b_N = tl.permute(tl.reshape(tl.join(tl.join(b_N0, b_N1), tl.join(b_N2, b_N3)), (BC, BC, 4)), (2, 0, 1))
    o_c = tl.arange(0, BC)
    o_i, o_j = o_c[:, None], o_c[None, :]
    b_X = tl.where((o_i == o_j)[None, :, :], 1.0, 0.0) - tl.where((o_i // 2 == o_j // 2)[None, :, :], b_N, 0.0)
    b_X = doubling_step(b_X, b_N, 2, BC, PREC)
    b_X = doubling_step(b_X, b_N, 4, BC, PREC)
    b_X = doubling_step(b_X, b_N, 8, BC, PREC)
    b_X = tl.reshape(tl.permute(b_X, (1, 2, 0)), (BC, BC, 2, 2))
    b_X01, b_X23 = tl.split(b_X)
    b_X0, b_X1 = tl.split(b_X01)
    b_X2, b_X3 = tl.split(b_X23)
    return b_X0, b_X1, b_X2, b_X3


@triton.jit
def dot_at(a, b, PREC: tl.constexpr):
    """tl.dot of two float32 blocks at input precision ``PREC`` (a constexpr chosen by the launcher)."""
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def store_tinv_row(Tinv, b_T0, b_T1, b_T2, b_T3, t0, n_t, i_hv, I: tl.constexpr, HV: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr):
    """Row block I of Tinv (its blocks J <= I given; unused arguments repeat one) and zeros right of it."""
    o_c = tl.arange(0, BC)
    o_i = I * BC + o_c
    s_T = HV * BT
    store_rows(Tinv, b_T0, t0, n_t, o_i, s_T, i_hv * BT, o_c, BC)
    if I >= 1:
        store_rows(Tinv, b_T1, t0, n_t, o_i, s_T, i_hv * BT + BC, o_c, BC)
    if I >= 2:
        store_rows(Tinv, b_T2, t0, n_t, o_i, s_T, i_hv * BT + 2 * BC, o_c, BC)
    if I >= 3:
        store_rows(Tinv, b_T3, t0, n_t, o_i, s_T, i_hv * BT + 3 * BC, o_c, BC)
    if I < BT // BC - 1:
        o_z = (I + 1) * BC + tl.arange(0, BT)
        b_0 = tl.zeros([BC, BT], tl.float32)
        store_rows(Tinv, b_0, t0, n_t, o_i, s_T, i_hv * BT, o_z, BT)


@triton.jit
def kda_gate_fwd_kernel(
    z, A_log, dt_bias, G, E,  # z [T, HV, K]; G fp32 [T, HV, K], or int16 when PACKED; E fp32 [NT, HV, BT // BC, K]
    cu_seqlens, chunk_indices, lower_bound, x_scale,
    HV: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKG: tl.constexpr, EXACT_SUM: tl.constexpr, PACKED: tl.constexpr,
):
    """Per K tile, chunk and value head: G = cumsum in the chunk of g = lb * sigmoid(a (z + bias)), a =
    exp(A_log) (K3 report, Eq. 5). Padded rows get g = 0 (no decay).

    ``PACKED`` (a forward with no backward, 16-bit intermediates): G is not stored but, row by row, the
    int16 code x = (G - r) / x_scale + 32767 with r = G before the row's 16-row sub-tile, half G's bytes;
    E gets G at each sub-tile's last row, from which the scores kernel rebuilds G = r + x_scale (x - 32767)
    to within x_scale / 2 and the state kernel takes the chunk's decay. The walk keeps the running sum in
    registers, one row at a time, so threads exchange nothing (sums across a [64, BK] tile's rows took
    this kernel from 444 to 932 us or more on an H200).

    With ``EXACT_SUM`` (float32 intermediates) the sum runs in float64 and is rounded once: after strong
    decay G is hundreds, where float32 resolves only ~3e-5, and a float32 running sum rounds every small
    gate after it (up to 1.5e-4 in G, 1.4e-4 in the float32 gradients). bf16
    intermediates round at 2^-8 anyway, and on an H200 the float64 sum took this kernel from 436 to 647 us
    at B8 T4096 H64 (forward +4%), so they keep the float32 sum."""
    i_k, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, n_t = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    o_k = i_k * BKG + tl.arange(0, BKG)
    b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_bias = tl.zeros([BKG], tl.float32)
    if HAS_BIAS:
        b_bias += tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)
    if PACKED:
        # Row by row, G a running sum in registers (no exchange between threads): each row goes out as the
        # int16 code of G - r, r = G before its sub-tile, and every 16th row's G (a sub-tile's end) to E.
        b_G = tl.zeros([BKG], tl.float32)
        b_r = tl.zeros([BKG], tl.float32)
        for t in tl.static_range(BT):
            p_t = (t0 + t) * (HV * K) + i_hv * K + o_k
            m_t = (o_k < K) & (t < n_t)
            b_z = tl.load(z + p_t, mask=m_t, other=0.0).to(tl.float32) + b_bias
            b_G += tl.where(m_t, gate_value(b_z, b_a, lower_bound), 0.0)
            b_x = tl.clamp(tl.floor((b_G - b_r) * (1.0 / x_scale) + 0.5) + 32767.0, -32767.0, 32767.0)
            tl.store(G + p_t, b_x.to(tl.int16), mask=m_t)
            if t % BC == BC - 1:
                tl.store(gate_end(E, i_c.to(tl.int64), i_hv, t // BC, HV, K, BT, BC) + o_k, b_G, mask=o_k < K)
                b_r = b_G
    else:
        o_t = tl.arange(0, BT)
        b_z = load_rows(z, t0, n_t, o_t, HV * K, i_hv * K, o_k, K, False) + b_bias[None, :]
        b_g = tl.where((o_t < n_t)[:, None] & (o_k < K)[None, :], gate_value(b_z, b_a, lower_bound), 0.0)
        if EXACT_SUM:
            b_G = tl.cumsum(b_g.to(tl.float64), axis=0)
        else:
            b_G = tl.cumsum(b_g, axis=0)
        store_rows(G, b_G, t0, n_t, o_t, HV * K, i_hv * K, o_k, K)


@triton.jit
def gate_value(b_z, b_a, lower_bound):
    """The lower-bounded gate g = lb * sigmoid(a z) of the biased pre-activation z."""
    return lower_bound / (1.0 + exp_ftz(-b_a * b_z))


@triton.jit
def kda_scores_fwd_kernel(
    q, k, beta, G, E, L, Aqk, W, KG, QG,  # q, k [T, H, K]; G fp32 [T, HV, K] (or the gate kernel's PACKED G and
                                          # E); outputs: L fp32 [T, HV, BT] (the rows of Diag(beta)
                                          # StrictTril(Ks)), Aqk [T, HV, BT], W's right operand Diag(beta) k exp(G),
                                          # KG = k exp(G_last - G), QG = scale q exp(G) [T, HV, K]
    cu_seqlens, chunk_indices, scale, x_scale, grid_log2,  # grid_log2: the autotuned launch's key only
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    PREC: tl.constexpr, REPLAY: tl.constexpr,  # only W's operand, KG and QG (the backward's replay)
    PACKED: tl.constexpr,
):
    """Per 16-row sub-tile I, chunk and value head: ``row_block``'s prep of sub-tile I, and, unless
    replaying, its row of sub-tiles (I, J), J <= I, of the two decayed score matrices, all at sub-tile I's
    middle (``score_block``): the rows' operands are formed once, and sub-tiles J < I are reloaded,
    normalised and decayed again here as columns (``key_columns``)."""
    i_i, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    t0, n_t = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    if i_i * BC >= n_t:
        return
    dt = W.dtype.element_ty
    # r = G before the sub-tile's first row (0 for the first), e = G at its last row, G_last.
    b_r = tl.zeros([BK], tl.float32)
    if i_i > 0:
        b_r += last_row(G, E, t0, n_t, i_c, i_hv, i_i - 1, HV, K, BT, BC, BK, PACKED)
    b_e = last_row(G, E, t0, n_t, i_c, i_hv, i_i, HV, K, BT, BC, BK, PACKED)
    b_Gl = last_row(G, E, t0, n_t, i_c, i_hv, BT // BC - 1, HV, K, BT, BC, BK, PACKED)
    b_kp, b_qp, b_kq, b_b = row_block(q, k, G, beta, KG, QG, W, t0, n_t, i_h, i_hv, scale, x_scale, b_r, b_e, b_Gl,
                                      i_i, H, HV, K, BC, BK, PACKED)
    if not REPLAY:
        b_m = 0.5 * (b_r + b_e)
        b_kp, b_qp = b_kp.to(dt), b_qp.to(dt)
        for i_j in range(0, i_i):
            b_c = key_columns(k, G, E, t0, n_t, i_c, i_h, i_hv, i_j, b_m, x_scale, H, HV, K, BT, BC, BK, PACKED)
            score_block(b_kp, b_qp, b_c, b_b, L, Aqk, t0, n_t, i_hv, i_i, i_j, HV, BT, BC, PREC, False)
        score_block(b_kp, b_qp, b_kq, b_b, L, Aqk, t0, n_t, i_hv, i_i, i_i, HV, BT, BC, PREC, True)
        # Aqk's blocks right of the diagonal are zero (causal).
        o_z = (i_i + 1) * BC + tl.arange(0, BT)
        store_rows(Aqk, tl.zeros([BC, BT], tl.float32), t0, n_t, i_i * BC + tl.arange(0, BC), HV * BT, i_hv * BT,
                   o_z, BT)


@triton.jit
def load_block(L, t0, n_t, i_hv, I: tl.constexpr, J: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr,
               BC: tl.constexpr):
    """Sub-tile (I, J) of a [T, HV, BT] chunk matrix as float32 (rows past the chunk read as zero)."""
    o_c = tl.arange(0, BC)
    return load_rows(L, t0, n_t, I * BC + o_c, HV * BT, i_hv * BT + J * BC, o_c, BC, False)


@triton.jit
def ut_inverse_blocks(L, t0, n_t, i_hv, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      DIAG_PREC: tl.constexpr, BLOCK_PREC: tl.constexpr):
    """The UT-transform inverse T = (I + L)^-1 of one chunk by 16x16 blocks, in float32: the four diagonal
    inverses as one batch (``unit_lower_inverse``), then T_IJ = -T_II sum_{J<=M<I} L_IM T_MJ. Returns
    (T00, T10, T11, T20, T21, T22, T30, T31, T32, T33)."""
    tl.static_assert(BT == 4 * BC)
    b_L00 = load_block(L, t0, n_t, i_hv, 0, 0, HV, BT, BC)
    b_L11 = load_block(L, t0, n_t, i_hv, 1, 1, HV, BT, BC)
    b_L22 = load_block(L, t0, n_t, i_hv, 2, 2, HV, BT, BC)
    b_L33 = load_block(L, t0, n_t, i_hv, 3, 3, HV, BT, BC)
    b_T00, b_T11, b_T22, b_T33 = unit_lower_inverse(b_L00, b_L11, b_L22, b_L33, BC, DIAG_PREC)
    b_L10 = load_block(L, t0, n_t, i_hv, 1, 0, HV, BT, BC)
    b_L21 = load_block(L, t0, n_t, i_hv, 2, 1, HV, BT, BC)
    b_L20 = load_block(L, t0, n_t, i_hv, 2, 0, HV, BT, BC)
    b_L32 = load_block(L, t0, n_t, i_hv, 3, 2, HV, BT, BC)
    b_L31 = load_block(L, t0, n_t, i_hv, 3, 1, HV, BT, BC)
    b_L30 = load_block(L, t0, n_t, i_hv, 3, 0, HV, BT, BC)
    P: tl.constexpr = BLOCK_PREC
    b_T10 = -dot_at(dot_at(b_T11, b_L10, P), b_T00, P)
    b_T21 = -dot_at(dot_at(b_T22, b_L21, P), b_T11, P)
    b_T20 = -dot_at(b_T22, dot_at(b_L20, b_T00, P) + dot_at(b_L21, b_T10, P), P)
    b_T32 = -dot_at(dot_at(b_T33, b_L32, P), b_T22, P)
    b_T31 = -dot_at(b_T33, dot_at(b_L31, b_T11, P) + dot_at(b_L32, b_T21, P), P)
    b_T30 = -dot_at(b_T33, dot_at(b_L30, b_T00, P) + dot_at(b_L31, b_T10, P) + dot_at(b_L32, b_T20, P), P)
    return b_T00, b_T10, b_T11, b_T20, b_T21, b_T22, b_T30, b_T31, b_T32, b_T33


@triton.jit
def side_by_side(a, b, M: tl.constexpr, N: tl.constexpr):
    """[a | b] of two [M, N] blocks, as one [M, 2N] block in registers."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (M, 2 * N))


@triton.jit
def stacked(a, b, M: tl.constexpr, N: tl.constexpr):
    """[a ; b] of two [M, N] blocks, as one [2M, N] block in registers."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * M, N))


@triton.jit
def block_row(b_0, b_1, b_2, b_3, BC: tl.constexpr):
    """Four [BC, BC] blocks side by side: [BC, 4 BC]."""
    return side_by_side(side_by_side(b_0, b_1, BC, BC), side_by_side(b_2, b_3, BC, BC), BC, 2 * BC)


@triton.autotune(configs=warp_configs(4, 2, 8), key=["grid_log2", "HV", "DIAG_PREC", "BLOCK_PREC"])
@triton.jit
def kda_inverse_fwd_kernel(
    L, Tinv,  # L fp32 [T, HV, BT] (from kda_scores_fwd_kernel); Tinv [T, HV, BT] out, in the intermediates' dtype
    cu_seqlens, chunk_indices, grid_log2,  # grid_log2: the autotuner's key only (``grid_log2``)
    HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    DIAG_PREC: tl.constexpr, BLOCK_PREC: tl.constexpr,  # tl.dot input precisions (``inverse_precisions``)
):
    """Per chunk and value head: the UT-transform inverse (``ut_inverse_blocks``), stored in the
    intermediates' dtype (what ``kda_wu_fwd_kernel`` and the backward use). A kernel of its own when T is
    kept, so that the W/U products (82 registers at 4 warps, offline sm_90) do not run at this chain of
    dependent small products' register count: on an H200 the split is 7% faster for float32
    intermediates (intra forward 1.700 against 1.822 ms at B4 T8192 H16) and, for bf16 ones storing T,
    1210 against 1220 us at B8 T4096 H64. Without a backward, ``kda_inverse_wu_fwd_kernel`` runs
    instead."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    t0, n_t = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    b_T00, b_T10, b_T11, b_T20, b_T21, b_T22, b_T30, b_T31, b_T32, b_T33 = ut_inverse_blocks(
        L, t0, n_t, i_hv, HV, BT, BC, DIAG_PREC, BLOCK_PREC)
    store_tinv_row(Tinv, b_T00, b_T00, b_T00, b_T00, t0, n_t, i_hv, 0, HV, BT, BC)
    store_tinv_row(Tinv, b_T10, b_T11, b_T11, b_T11, t0, n_t, i_hv, 1, HV, BT, BC)
    store_tinv_row(Tinv, b_T20, b_T21, b_T22, b_T22, t0, n_t, i_hv, 2, HV, BT, BC)
    store_tinv_row(Tinv, b_T30, b_T31, b_T32, b_T33, t0, n_t, i_hv, 3, HV, BT, BC)


@triton.jit
def apply_ut(b_T, v, beta, W, U, t0, n_t, i_hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """W = T Diag(beta)(Gamma K) (W holds its right operand and is rewritten in place) and
    U = T Diag(beta) V for one chunk, with the whole T as one [BT, BT] operand in W's dtype, in column
    tiles of BV (smaller accumulators)."""
    o_t = tl.arange(0, BT)
    dt = W.dtype.element_ty
    for i_k in range(tl.cdiv(K, BV)):
        o_w = i_k * BV + tl.arange(0, BV)
        b_W = tl.dot(b_T, load_rows(W, t0, n_t, o_t, HV * K, i_hv * K, o_w, K, False).to(dt), input_precision=PREC)
        # W is rewritten in place: every thread's reads of this tile come before any write to it.
        tl.debug_barrier()
        store_rows(W, b_W, t0, n_t, o_t, HV * K, i_hv * K, o_w, K)
    b_b = tl.where(o_t < n_t, tl.sigmoid(load_vec(beta, t0, n_t, o_t, HV, i_hv)), 0.0)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = load_rows(v, t0, n_t, o_t, HV * V, i_hv * V, o_v, V, False)
        b_U = tl.dot(b_T, (b_v * b_b[:, None]).to(dt), input_precision=PREC)
        store_rows(U, b_U, t0, n_t, o_t, HV * V, i_hv * V, o_v, V)


@triton.autotune(configs=warp_configs(4, 2, 8), key=["grid_log2", "HV", "K", "V"], restore_value=["W"])
@triton.jit
def kda_wu_fwd_kernel(
    Tinv, v, beta, W, U,  # Tinv [T, HV, BT]; W [T, HV, K]: W's right operand in, W out; v, U [T, HV, V]
    cu_seqlens, chunk_indices, grid_log2,  # grid_log2: the autotuner's key only (``grid_log2``)
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk and value head: W and U (``apply_ut``) from the stored T."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    t0, n_t = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    o_t = tl.arange(0, BT)
    b_T = load_rows(Tinv, t0, n_t, o_t, HV * BT, i_hv * BT, o_t, BT, False).to(W.dtype.element_ty)
    apply_ut(b_T, v, beta, W, U, t0, n_t, i_hv, HV, K, V, BT, BV, PREC)


@triton.autotune(configs=warp_configs(4, 2, 8), key=["grid_log2", "HV", "K", "V", "DIAG_PREC", "BLOCK_PREC"],
                 restore_value=["W"])
@triton.jit
def kda_inverse_wu_fwd_kernel(
    L, v, beta, W, U,  # as kda_inverse_fwd_kernel's L and kda_wu_fwd_kernel's v, beta, W, U
    cu_seqlens, chunk_indices, grid_log2,  # grid_log2: the autotuner's key only (``grid_log2``)
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
    DIAG_PREC: tl.constexpr, BLOCK_PREC: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk and value head, for a forward with no backward: the UT inverse (``ut_inverse_blocks``)
    assembled in registers as one [BT, BT] operand, rounded to W's dtype as the stored T would be, and
    W and U from it (``apply_ut``); T never goes to memory. The same results as the two kernels, bit for
    bit; on an H200 (bf16) 1143 us at B8 T4096 H64 against 512 + 698 for them, a forward 1.6-1.7%
    faster. float32 intermediates keep the split, whose reason above was measured on them."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    t0, n_t = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    b_T00, b_T10, b_T11, b_T20, b_T21, b_T22, b_T30, b_T31, b_T32, b_T33 = ut_inverse_blocks(
        L, t0, n_t, i_hv, HV, BT, BC, DIAG_PREC, BLOCK_PREC)
    b_0 = tl.zeros([BC, BC], tl.float32)
    b_T = stacked(stacked(block_row(b_T00, b_0, b_0, b_0, BC), block_row(b_T10, b_T11, b_0, b_0, BC), BC, BT),
                  stacked(block_row(b_T20, b_T21, b_T22, b_0, BC), block_row(b_T30, b_T31, b_T32, b_T33, BC), BC, BT),
                  2 * BC, BT)
    apply_ut(b_T.to(W.dtype.element_ty), v, beta, W, U, t0, n_t, i_hv, HV, K, V, BT, BV, PREC)


@triton.jit
def chunk_decay(G, t0, n_t, c, i_hv, o_k1, o_k2, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, GATE_ENDS: tl.constexpr):
    """``chunk_decay_halves`` of chunk c (tokens t0 .. t0 + n_t; none: decay 1), from G, or with
    ``GATE_ENDS`` from the gate kernel's sub-tile ends E [NT, HV, BT // BC, K] passed as G."""
    if GATE_ENDS:
        p_e = gate_end(G, c, i_hv, BT // BC - 1, HV, K, BT, BC)
        b_g1 = tl.load(p_e + o_k1, mask=(o_k1 < K) & (n_t > 0), other=0.0)
        b_g2 = tl.load(p_e + o_k2, mask=(o_k2 < K) & (n_t > 0), other=0.0)
        return tl.exp(b_g1), tl.exp(b_g2)
    return chunk_decay_halves(G, t0, n_t, i_hv, o_k1, o_k2, HV, K)


@triton.jit
def kda_state_fwd_kernel(
    W, U, KG, G, h, Vn, h0, ht,  # W, KG [T, HV, K]; U [T, HV, VU]; Vn [T, HV, V]; G fp32 [T, HV, K] (with
                                 # GATE_ENDS the sub-tile ends E [NT, HV, BT // BC, K]);
                                 # h [NT, HV, K, V] state before each chunk; h0, ht fp32 [N, HV, K, V]
    QG, Aqk, o,  # QG [T, HV, K], Aqk [T, HV, BT], o [T, HV, V] (OUTPUT)
    cu_seqlens, chunk_offsets,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, VU: tl.constexpr, BT: tl.constexpr,
    BKH: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    STORE_STATES: tl.constexpr, OUTPUT: tl.constexpr, PREFETCH: tl.constexpr, PREC: tl.constexpr,
    BC: tl.constexpr, GATE_ENDS: tl.constexpr,
):
    # The state is held as two halves of BKH rows of K (S1 over K rows [0, BKH), S2 over [BKH, 2 BKH)):
    # two independent products per step, half the registers each (measured on an H200 at B4 T8192 H16:
    # 0.62 -> 0.31 ms against one [K, BV] tile).
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, eos, c0, NT = sequence_span(cu_seqlens, chunk_offsets, i_n, BT)
    o_t = tl.arange(0, BT)
    o_k1, o_k2, o_v, o_s1, o_s2, m_1, m_2 = state_halves(i_hv, i_v, K, V, BKH, BV)
    dt = W.dtype.element_ty
    # The values are [0 | U]: the first V - VU columns are zero (the identity-state trick; none when
    # V == VU). Those columns read U's column VU, which the load masks to zero. The plain case keeps
    # contiguous column offsets (vectorised loads).
    if VU == V:
        o_u = o_v
    else:
        o_u = tl.where(o_v >= V - VU, o_v - (V - VU), VU)

    b_S1 = tl.zeros([BKH, BV], tl.float32)
    b_S2 = tl.zeros([BKH, BV], tl.float32)
    if USE_H0:
        p_h0 = h0 + i_n.to(tl.int64) * HV * K * V
        b_S1 += tl.load(p_h0 + o_s1, mask=m_1, other=0.0).to(tl.float32)
        b_S2 += tl.load(p_h0 + o_s2, mask=m_2, other=0.0).to(tl.float32)
    # U and the decay feed elementwise ops on the S -> V~ -> S chain, not a dot, so Triton's pipeliner
    # does not stage their loads; with PREFETCH each chunk's are loaded one chunk ahead (past the end:
    # masked, zeros and decay 1). See ``state_prefetch``.
    if PREFETCH:
        n_t = tl.minimum(eos - bos, BT).to(tl.int32)
        b_u = load_rows(U, bos, n_t, o_t, HV * VU, i_hv * VU, o_u, VU, False).to(dt)
        b_d1, b_d2 = chunk_decay(G, bos, n_t, c0, i_hv, o_k1, o_k2, HV, K, BT, BC, GATE_ENDS)
    for i_j in range(NT):
        t0 = bos + i_j * BT
        n_t = tl.minimum(eos - t0, BT).to(tl.int32)
        if PREFETCH:
            n_n = tl.minimum(eos - t0 - BT, BT).to(tl.int32)
            b_un = load_rows(U, t0 + BT, n_n, o_t, HV * VU, i_hv * VU, o_u, VU, False).to(dt)
            b_dn1, b_dn2 = chunk_decay(G, t0 + BT, n_n, c0 + i_j + 1, i_hv, o_k1, o_k2, HV, K, BT, BC, GATE_ENDS)
        if STORE_STATES:
            p_h = h + (c0 + i_j) * HV * K * V
            tl.store(p_h + o_s1, b_S1.to(h.dtype.element_ty), mask=m_1)
            tl.store(p_h + o_s2, b_S2.to(h.dtype.element_ty), mask=m_2)
        if PREFETCH:
            b_vn = b_u.to(tl.float32)
        else:
            b_vn = load_rows(U, t0, n_t, o_t, HV * VU, i_hv * VU, o_u, VU, False)
        b_vn -= tl.dot(load_rows(W, t0, n_t, o_t, HV * K, i_hv * K, o_k1, K, False).to(dt), b_S1.to(dt),
                       input_precision=PREC)
        b_vn -= tl.dot(load_rows(W, t0, n_t, o_t, HV * K, i_hv * K, o_k2, K, False).to(dt), b_S2.to(dt),
                       input_precision=PREC)
        if STORE_STATES:
            store_rows(Vn, b_vn, t0, n_t, o_t, HV * V, i_hv * V, o_v, V)
        b_v = b_vn.to(dt)
        if OUTPUT:
            b_o = tl.dot(load_rows(Aqk, t0, n_t, o_t, HV * BT, i_hv * BT, o_t, BT, False).to(dt), b_v,
                         input_precision=PREC)
            b_o += tl.dot(load_rows(QG, t0, n_t, o_t, HV * K, i_hv * K, o_k1, K, False).to(dt), b_S1.to(dt),
                          input_precision=PREC)
            b_o += tl.dot(load_rows(QG, t0, n_t, o_t, HV * K, i_hv * K, o_k2, K, False).to(dt), b_S2.to(dt),
                          input_precision=PREC)
            store_rows(o, b_o, t0, n_t, o_t, HV * V, i_hv * V, o_v, V)
        if not PREFETCH:
            b_d1, b_d2 = chunk_decay(G, t0, n_t, c0 + i_j, i_hv, o_k1, o_k2, HV, K, BT, BC, GATE_ENDS)
        b_kg1 = load_rows(KG, t0, n_t, o_t, HV * K, i_hv * K, o_k1, K, False).to(dt)
        b_kg2 = load_rows(KG, t0, n_t, o_t, HV * K, i_hv * K, o_k2, K, False).to(dt)
        b_S1 = b_S1 * b_d1[:, None] + tl.dot(tl.trans(b_kg1), b_v, input_precision=PREC)
        b_S2 = b_S2 * b_d2[:, None] + tl.dot(tl.trans(b_kg2), b_v, input_precision=PREC)
        if PREFETCH:
            b_u, b_d1, b_d2 = b_un, b_dn1, b_dn2
    if STORE_HT:
        p_ht = ht + i_n.to(tl.int64) * HV * K * V
        tl.store(p_ht + o_s1, b_S1, mask=m_1)
        tl.store(p_ht + o_s2, b_S2, mask=m_2)


# The scores kernel at 2 warps, capped at 168 registers (a few spilled) so that 6 programs share an SM
# instead of 4: uncapped it takes 244, and Nsight Compute showed it latency-bound at 12.5% occupancy. On an
# H200 (bf16, K = V = 128) the whole forward went from 1.388 to 1.336 ms at B4 T8192 H16, 1.951 -> 1.898 at
# B1 T32768 H16, 5.431 -> 5.231 at B8 T4096 H64; caps of 144, 152 and 184, 3 stages, and 4 or 8 warps
# with or without a cap were slower.
# Elsewhere the cap would spill more (offline sm_90: 1272 B at K = 256, 456 B with float32
# intermediates), so for K > 128 and float32 intermediates the warps are timed, as for the other kernels.
SCORES_LAUNCH = dict(num_warps=2, num_stages=2, maxnreg=168)
kda_scores_fwd_tuned = triton.autotune(configs=warp_configs(4, 2, 8),
                                       key=["grid_log2", "H", "HV", "K", "REPLAY", "PACKED"])(kda_scores_fwd_kernel)


def inverse_precisions(exact: bool) -> tuple[str, str]:
    """tl.dot input precisions of the UT inverse's diagonal blocks and of the blocks under them: full
    float32 on CUDA cores ("ieee") for float32 intermediates. For bf16 ones, three bf16 passes on tensor
    cores ("bf16x3", about 16 significant bits) for the diagonal blocks' doubling (``unit_lower_inverse``),
    which leaves T's error at that of "ieee" products, bf16's rounding of T: on an H200, keys identical in
    runs of 8 or 16 (weak decay, beta near 1), 8.2e-4 relative and 2.0e-3 at most for both; plain TF32
    there was faster (inverse 109 against 134 us at B4 T8192 H16) but lost 2.2e-3 relative on a block of
    near-identical keys with beta = 1. TF32 for the blocks T_IJ = -T_II (sum L T): on those inputs it
    leaves T's error at that of bf16x3 blocks."""
    return ("ieee", "ieee") if exact else ("bf16x3", "tf32")


def block_sizes(K: int, V: int) -> tuple[int, int]:
    """(BK, BV): K in one tile (<= 256), V tiled by 64 at most."""
    return max(16, triton.next_power_of_2(K)), min(64, max(16, triton.next_power_of_2(V)))


def kda_intra_fwd(q, k, v, z, beta, A_log, dt_bias, scale, lower_bound, cu_seqlens, chunk_indices, dtype,
                  keep_t=True):
    """Launch the intra stage (``kda_gate_fwd``, ``kda_scores_fwd_kernel``, then ``kda_inverse_fwd_kernel``
    and ``kda_wu_fwd_kernel``); inputs flattened to [T, heads, D]; ``dtype`` is the intermediates'
    (``fused.intermediate_dtype``). ``keep_t``: also return T (a backward needs it). When T is not
    kept and the intermediates are 16-bit (an inference forward), the gate is packed and
    ``kda_inverse_wu_fwd_kernel`` runs in place of the last two.

    Returns (G, Tinv or None, Aqk, W, U, KG, QG); G is float32 [T, HV, K], or for the packed gate its
    sub-tile ends E [NT, HV, BT // BC, K] (what ``kda_state_fwd`` then reads)."""
    T, HV, K = z.shape
    inference = not keep_t and dtype != torch.float32
    G, E, x_scale = kda_gate_fwd(z, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices,
                                 exact_sum=dtype == torch.float32, packed=inference)
    L = torch.empty(T, HV, BT, device=z.device, dtype=torch.float32)
    Tinv = None if inference else torch.empty(T, HV, BT, device=z.device, dtype=dtype)
    Aqk = torch.empty(T, HV, BT, device=z.device, dtype=dtype)
    W, U, KG, QG = _launch_intra(q, k, v, beta, G, L, Tinv, Aqk, scale, cu_seqlens, chunk_indices, dtype,
                                 replay=False, E=E, x_scale=x_scale)
    return (G if E is None else E), Tinv, Aqk, W, U, KG, QG


def kda_gate_fwd(z, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, exact_sum, packed):
    """Launch ``kda_gate_fwd_kernel``: the gate's in-chunk cumsum G of z [T, HV, K]. Returns (G, E, step):
    G float32 [T, HV, K] and E None, or when ``packed`` the int16 codes [T, HV, K] of G relative to each
    16-row sub-tile's start, its ends E float32 [NT, HV, BT // BC, K] and the codes' step
    (``packed_gate_scale``). The packed gate halves G's bytes for the scores kernel, which rebuilds G
    from it (on an H200 at B8 T4096 H64, bf16: gate 411 us against 444 for float32 G, scores 1758
    against 1966 us, forward 4.51 against 4.73 ms)."""
    T, HV, K = z.shape
    NT = chunk_indices.shape[0]
    G = torch.empty(T, HV, K, device=z.device, dtype=torch.int16 if packed else torch.float32)
    E = torch.empty(NT, HV, BT // BC, K, device=z.device, dtype=torch.float32) if packed else None
    x_scale = packed_gate_scale(lower_bound)
    # G: K tiles of 64 at 4 warps, on an H200 at K = 128 the fastest of 16-128 x 1-8 warps (B4 T8192 H16:
    # 114.5 us, against 131.7 for tiles of 32). The packed gate's row-by-row walk: tiles of 128 at 2
    # warps, the fastest of 32-256 x 1-4.
    BKG, warps = (min(128, block_sizes(K, K)[0]), 2) if packed else (min(64, block_sizes(K, K)[0]), 4)
    kda_gate_fwd_kernel[(triton.cdiv(K, BKG), NT, HV)](
        z, A_log, dt_bias, G, E, cu_seqlens, chunk_indices, lower_bound, x_scale, HV=HV, K=K,
        HAS_BIAS=dt_bias is not None, BT=BT, BC=BC, BKG=BKG, EXACT_SUM=exact_sum, PACKED=packed, num_warps=warps,
    )
    return G, E, x_scale


def packed_gate_scale(lower_bound: float) -> float:
    """The step of the packed gate's int16 code x = (G - r) / step + 32767 (r: G before the row's 16-row
    sub-tile, so G - r is in [16 lower_bound, 0]): the code's 65535 values cover that with 0.01% to
    spare, so G is rebuilt to within step / 2 (6.1e-4 at -5), a factor exp(+-6.1e-4) in every decay term,
    beside bf16's rounding of the products they enter (up to 3.9e-3)."""
    return 16.0 * abs(lower_bound) * 1.0001 / 65534


def kda_intra_replay(q, k, v, beta, G, Tinv, scale, cu_seqlens, chunk_indices, dtype):
    """``kda_intra_fwd`` again from a forward's saved G and Tinv, for a backward that did not keep its
    intermediates (KCP's, ``k3lab.kcp.flash``): only the cheap part (no sub-tile scores, no UT
    inverse). Returns (W, U, KG, QG) in ``dtype``."""
    # L and Aqk are not touched when replaying: G stands in for them.
    return _launch_intra(q, k, v, beta, G, G, Tinv, G, scale, cu_seqlens, chunk_indices, dtype, replay=True)


def _launch_intra(q, k, v, beta, G, L, Tinv, Aqk, scale, cu_seqlens, chunk_indices, dtype, replay, E=None,
                  x_scale=1.0):
    """The scores, then T and W/U: from ``Tinv`` when replaying, else computed and stored in ``Tinv``, or
    (``Tinv`` None) fused into one kernel that does not store it."""
    T, H, K = k.shape
    HV, V = v.shape[1:]
    NT = chunk_indices.shape[0]
    BK, BV = block_sizes(K, V)
    W, KG, QG = (torch.empty(T, HV, K, device=k.device, dtype=dtype) for _ in range(3))
    U = torch.empty(T, HV, V, device=k.device, dtype=dtype)
    prec = dot_precision(dtype, k.device)
    capped = BK <= 128 and W.element_size() == 2
    scores, launch = (kda_scores_fwd_kernel, SCORES_LAUNCH) if capped else (kda_scores_fwd_tuned, {})
    scores[(BT // BC, NT, HV)](
        q, k, beta, G, E, L, Aqk, W, KG, QG, cu_seqlens, chunk_indices, scale, x_scale,
        grid_log2(NT * HV * BT // BC), H=H, HV=HV, K=K, BT=BT, BC=BC, BK=BK, PREC=prec, REPLAY=replay,
        PACKED=E is not None, **launch,
    )
    grid, log2 = (NT, HV), grid_log2(NT * HV)
    diag, block = inverse_precisions(W.dtype == torch.float32)
    if Tinv is None:
        assert not replay, "a replay needs the forward's saved Tinv"
        kda_inverse_wu_fwd_kernel[grid](L, v, beta, W, U, cu_seqlens, chunk_indices, log2, HV=HV, K=K, V=V, BT=BT,
                                        BC=BC, BV=BV, DIAG_PREC=diag, BLOCK_PREC=block, PREC=prec)
        return W, U, KG, QG
    if not replay:
        kda_inverse_fwd_kernel[grid](L, Tinv, cu_seqlens, chunk_indices, log2, HV=HV, BT=BT, BC=BC, DIAG_PREC=diag,
                                     BLOCK_PREC=block)
    kda_wu_fwd_kernel[grid](Tinv, v, beta, W, U, cu_seqlens, chunk_indices, log2, HV=HV, K=K, V=V, BT=BT, BV=BV,
                            PREC=prec)
    return W, U, KG, QG


def kda_state_fwd(W, U, KG, G, h0, output_final_state, cu_seqlens, chunk_offsets, NT, h=None, Vn=None,
                  lead=0, store_states=True, output=None):
    """Launch ``kda_state_fwd_kernel``. Returns (h [NT, HV, K, V'], Vn [T, HV, V'], final state or None),
    V' = lead + U's width; h and Vn are None when not ``store_states``. ``G``: float32 [T, HV, K], or the
    packed gate's sub-tile ends [NT, HV, BT // BC, K] (``kda_intra_fwd``'s first result either way).

    ``output`` = (QG, Aqk, o): also write the output O = (Gamma Q) S + Aqk V~ of every chunk into ``o``
    [T, HV, V] while its state is in registers; with ``store_states`` too (a training forward) h and V~
    are stored for the backward in the same pass.

    ``cu_seqlens``/``chunk_offsets`` may be a slice [a : b+1] of a layout's tables (sequences a .. b-1,
    chunk offsets still global): then only those sequences' chunks of ``h`` and tokens of ``Vn`` (pass
    the layout's buffers) are written, and h0/final rows are those b - a sequences'. ``lead`` > 0: the
    values are [0 | U] with ``lead`` zero columns first; from h0 = [I | 0] (lead = K) the final state
    is the run's affine map [M | S~] (KCP, ``k3lab.kcp.flash``).
    """
    T, HV, K = W.shape
    VU = U.shape[-1]
    V = lead + VU
    N = cu_seqlens.numel() - 1
    BV = state_tile(N, HV, V, W.device)
    if store_states:
        h = torch.empty(NT, HV, K, V, device=W.device, dtype=W.dtype) if h is None else h
        Vn = torch.empty(T, HV, V, device=W.device, dtype=U.dtype) if Vn is None else Vn
    ht = torch.empty(N, HV, K, V, device=W.device, dtype=torch.float32) if output_final_state else None
    QG, Aqk, o = output if output is not None else (W, W, W)
    launch_fitting(
        kda_state_fwd_kernel, (triton.cdiv(V, BV), N * HV),
        W, U, KG, G, h if store_states else W, Vn if store_states else W, h0, ht, QG, Aqk, o, cu_seqlens,
        chunk_offsets, HV=HV, K=K, V=V, VU=VU, BT=BT, BKH=state_half(K), BV=BV, USE_H0=h0 is not None,
        STORE_HT=output_final_state, STORE_STATES=store_states, OUTPUT=output is not None,
        PREFETCH=state_prefetch(BV, store_states), PREC=dot_precision(W.dtype, W.device), BC=BC,
        GATE_ENDS=G.dim() == 4, num_warps=4, num_stages=3 if W.element_size() == 2 else 2,
    )
    return (h, Vn, ht) if store_states else (None, None, ht)
