"""FlashKDA forward: three Triton kernels and their launchers.

1. ``kda_intra_fwd_kernel`` (one program per chunk and value head, all chunks in parallel): the fused
   gate g = lb * sigmoid(exp(A_log) (z + dt_bias)) and its in-chunk cumsum G, q/k L2 norm, beta
   sigmoid (on [64, 32] tiles of K), the 16x16 sub-tiles of (Gamma K)(K / Gamma)^T and
   (Gamma Q)(K / Gamma)^T on tensor cores (summed over 32-column slices of K), the UT-transform inverse T = (I + Diag(beta) StrictTril(...))^-1 by 16x16 blocks, and
   W = T Diag(beta)(Gamma K), U = T Diag(beta) V.
2. ``kda_state_fwd_kernel`` (one program per sequence, value head and V tile; the only sequential
   loop): S_n for every chunk, pseudo-values V~ = U - W S, S <- Diag(gamma_C) S + (Gamma_{i->C} K)^T V~.
3. ``kda_output_fwd_kernel`` (all chunks in parallel): O = (Gamma Q) S + Tril((Gamma Q)(K/Gamma)^T) V~.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.kernels.kda.utils import (
    BC, BT, chunk_span, dot_precision, load_rows, load_vec, sequence_span, state_tile, store_rows,
    warp_configs,
)


@triton.jit
def score_block(q, k, G, Aqk, t0, n_t, i_h, i_hv, b_rqi, b_rki, b_rkj, I: tl.constexpr, J: tl.constexpr,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, BKT: tl.constexpr, PREC: tl.constexpr):
    """Sub-tile (I, J), J <= I, of the two decayed score matrices of one chunk.

    Ks[i, j] = sum_c k_ic k_jc exp(G_ic - G_jc) (strictly lower on the diagonal) is returned;
    Aqk[i, j] = same with q_i (inclusive) is stored. Both are tensor-core dots of
    (x_i exp(G_i - r)) (k_j exp(r - G_j))^T with a reference r per sub-tile: r = G at the last token
    before sub-tile I when J < I (both factors <= 1), and G at the middle of the sub-tile when
    J == I, so no factor exceeds exp(8 |lb|) (the "1/Gamma in bf16" of the lower-bounded gate).
    K goes in tiles of BKT columns (small register tiles); the rows are scaled by their inverse norms
    b_rqi (with the query scale), b_rki, b_rkj ([BC] each), which the caller computes once per sub-tile.
    """
    dt = Aqk.dtype.element_ty
    o_c = tl.arange(0, BC)
    o_i = I * BC + o_c
    o_j = J * BC + o_c
    if I == J:
        o_r = I * BC + BC // 2 + tl.zeros([1], tl.int32)
    else:
        o_r = I * BC - 1 + tl.zeros([1], tl.int32)
    b_Ks = tl.zeros([BC, BC], tl.float32)
    b_Aq = tl.zeros([BC, BC], tl.float32)
    for i_k in range((K + BKT - 1) // BKT):
        o_k = i_k * BKT + tl.arange(0, BKT)
        b_r = tl.sum(load_rows(G, t0, n_t, o_r, HV * K, i_hv * K, o_k, K, True), 0)
        b_er = tl.exp(load_rows(G, t0, n_t, o_i, HV * K, i_hv * K, o_k, K, True) - b_r[None, :])
        b_ki = load_rows(k, t0, n_t, o_i, H * K, i_h * K, o_k, K, False) * (b_rki[:, None] * b_er)
        b_qi = load_rows(q, t0, n_t, o_i, H * K, i_h * K, o_k, K, False) * (b_rqi[:, None] * b_er)
        b_kr = (load_rows(k, t0, n_t, o_j, H * K, i_h * K, o_k, K, False) * b_rkj[:, None]
                * tl.exp(b_r[None, :] - load_rows(G, t0, n_t, o_j, HV * K, i_hv * K, o_k, K, True))).to(dt)
        b_Ks = tl.dot(b_ki.to(dt), tl.trans(b_kr), acc=b_Ks, input_precision=PREC)
        b_Aq = tl.dot(b_qi.to(dt), tl.trans(b_kr), acc=b_Aq, input_precision=PREC)
    if I == J:
        b_Ks = tl.where(o_c[:, None] > o_c[None, :], b_Ks, 0.0)
        b_Aq = tl.where(o_c[:, None] >= o_c[None, :], b_Aq, 0.0)
    store_rows(Aqk, b_Aq, t0, n_t, o_i, HV * BT, i_hv * BT + J * BC, o_c, BC)
    return b_Ks


@triton.jit
def inverse_norm(x, t0, n_t, o_r, stride, off, K: tl.constexpr, BC: tl.constexpr, BKT: tl.constexpr):
    """1 / sqrt(sum(x^2) + 1e-6) of the BC rows t0 + o_r (zero rows past n_t give 1e3), over K in BKT tiles."""
    b_ss = tl.zeros([BC], tl.float32)
    for i_k in range((K + BKT - 1) // BKT):
        o_k = i_k * BKT + tl.arange(0, BKT)
        b_x = load_rows(x, t0, n_t, o_r, stride, off, o_k, K, False)
        b_ss += tl.sum(b_x * b_x, 1)
    return 1.0 / tl.sqrt(b_ss + 1e-6)


@triton.jit
def unit_lower_inverse(b_N, BC: tl.constexpr):
    """(I + N)^-1 for a strictly lower [BC, BC] block N, by forward substitution on rows:
    X_i = e_i - sum_{j<i} N_ij X_j."""
    o_c = tl.arange(0, BC)
    b_X = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    for i in range(1, BC):
        b_n = tl.sum(tl.where((o_c == i)[:, None], b_N, 0.0), 0)
        b_x = tl.sum(b_n[:, None] * b_X, 0)
        b_X = tl.where((o_c == i)[:, None], b_X - b_x[None, :], b_X)
    return b_X


@triton.jit
def dot32(a, b):
    """A small fp32 product kept in full fp32 on the GPU (the UT inverse is where precision matters)."""
    return tl.dot(a, b, input_precision="ieee")


# 2 warps first: the measured best with float32 intermediates (B1 T8192 H16 on an H200: 8 warps 1.76 ms,
# 4: 1.44, 2: 1.38), when more resident programs hid the latency of the chain of small steps.
@triton.autotune(configs=warp_configs(2, 4, 8), key=["H", "HV", "K", "V", "REPLAY"])
@triton.jit
def kda_intra_fwd_kernel(
    q, k, v, z, beta, A_log, dt_bias,  # inputs: [T, H, K], [T, H, K], [T, HV, V], [T, HV, K], [T, HV], [HV], [HV*K]
    G, Tinv, Aqk, W, U, KG, QG,  # outputs: G fp32 [T, HV, K], Tinv fp32 [T, HV, BT], Aqk [T, HV, BT],
                                 # W, KG = k exp(G_last - G), QG = scale q exp(G) [T, HV, K]; U [T, HV, V]
    cu_seqlens, chunk_indices, scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, HAS_BIAS: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, BKT: tl.constexpr, PREC: tl.constexpr,
    REPLAY: tl.constexpr,  # G and Tinv are inputs (saved by the forward); only KG, QG, W, U are written
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, n_t = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    m_t = o_t < n_t
    dt = W.dtype.element_ty

    # Per BKT columns: the gate activation and its in-chunk cumsum G (padded rows get g = 0: no decay,
    # so row BT - 1 is G at the last token), KG = k exp(G_last - G), QG = scale q exp(G), and W's right
    # operand Diag(beta)(Gamma K) (kept in W), with q and k scaled by their rows' inverse norms.
    b_rq = inverse_norm(q, t0, n_t, o_t, H * K, i_h * K, K, BT, BKT) * scale
    b_rk = inverse_norm(k, t0, n_t, o_t, H * K, i_h * K, K, BT, BKT)
    b_b = tl.where(m_t, tl.sigmoid(load_vec(beta, t0, n_t, o_t, HV, i_hv)), 0.0)
    if not REPLAY:
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    for i_k in range(tl.cdiv(K, BKT)):
        o_k = i_k * BKT + tl.arange(0, BKT)
        if REPLAY:
            b_G = load_rows(G, t0, n_t, o_t, HV * K, i_hv * K, o_k, K, True)
        else:
            b_z = load_rows(z, t0, n_t, o_t, HV * K, i_hv * K, o_k, K, False)
            if HAS_BIAS:
                b_z += tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)[None, :]
            b_G = tl.cumsum(tl.where(m_t[:, None], lower_bound * tl.sigmoid(b_a * b_z), 0.0), axis=0)
            store_rows(G, b_G, t0, n_t, o_t, HV * K, i_hv * K, o_k, K)
        b_Gl = tl.sum(tl.where((o_t == BT - 1)[:, None], b_G, 0.0), 0)
        b_k = load_rows(k, t0, n_t, o_t, H * K, i_h * K, o_k, K, False) * b_rk[:, None]
        b_q = load_rows(q, t0, n_t, o_t, H * K, i_h * K, o_k, K, False) * b_rq[:, None]
        store_rows(KG, b_k * tl.exp(b_Gl[None, :] - b_G), t0, n_t, o_t, HV * K, i_hv * K, o_k, K)
        store_rows(W, b_k * tl.exp(b_G) * b_b[:, None], t0, n_t, o_t, HV * K, i_hv * K, o_k, K)
        store_rows(QG, b_q * tl.exp(b_G), t0, n_t, o_t, HV * K, i_hv * K, o_k, K)
    # G goes through global memory so the sub-tile loads below can read any 16 rows of it.
    tl.debug_barrier()

    s_T = HV * BT
    if not REPLAY:
        # Sub-tiles of L = Diag(beta) StrictTril(Ks) (returned) and Aqk (stored), 4 x 4 blocks of 16.
        b_b0 = tl.where(o_c < n_t, tl.sigmoid(load_vec(beta, t0, n_t, o_c, HV, i_hv)), 0.0)[:, None]
        b_b1 = tl.where(BC + o_c < n_t, tl.sigmoid(load_vec(beta, t0, n_t, BC + o_c, HV, i_hv)), 0.0)[:, None]
        b_b2 = tl.where(2 * BC + o_c < n_t, tl.sigmoid(load_vec(beta, t0, n_t, 2 * BC + o_c, HV, i_hv)), 0.0)[:, None]
        b_b3 = tl.where(3 * BC + o_c < n_t, tl.sigmoid(load_vec(beta, t0, n_t, 3 * BC + o_c, HV, i_hv)), 0.0)[:, None]
        b_rq0 = inverse_norm(q, t0, n_t, o_c, H * K, i_h * K, K, BC, BKT) * scale
        b_rq1 = inverse_norm(q, t0, n_t, BC + o_c, H * K, i_h * K, K, BC, BKT) * scale
        b_rq2 = inverse_norm(q, t0, n_t, 2 * BC + o_c, H * K, i_h * K, K, BC, BKT) * scale
        b_rq3 = inverse_norm(q, t0, n_t, 3 * BC + o_c, H * K, i_h * K, K, BC, BKT) * scale
        b_rk0 = inverse_norm(k, t0, n_t, o_c, H * K, i_h * K, K, BC, BKT)
        b_rk1 = inverse_norm(k, t0, n_t, BC + o_c, H * K, i_h * K, K, BC, BKT)
        b_rk2 = inverse_norm(k, t0, n_t, 2 * BC + o_c, H * K, i_h * K, K, BC, BKT)
        b_rk3 = inverse_norm(k, t0, n_t, 3 * BC + o_c, H * K, i_h * K, K, BC, BKT)
        b_L00 = b_b0 * score_block(q, k, G, Aqk, t0, n_t, i_h, i_hv, b_rq0, b_rk0, b_rk0, 0, 0, H, HV, K, BT, BC, BKT, PREC)
        b_L10 = b_b1 * score_block(q, k, G, Aqk, t0, n_t, i_h, i_hv, b_rq1, b_rk1, b_rk0, 1, 0, H, HV, K, BT, BC, BKT, PREC)
        b_L11 = b_b1 * score_block(q, k, G, Aqk, t0, n_t, i_h, i_hv, b_rq1, b_rk1, b_rk1, 1, 1, H, HV, K, BT, BC, BKT, PREC)
        b_L20 = b_b2 * score_block(q, k, G, Aqk, t0, n_t, i_h, i_hv, b_rq2, b_rk2, b_rk0, 2, 0, H, HV, K, BT, BC, BKT, PREC)
        b_L21 = b_b2 * score_block(q, k, G, Aqk, t0, n_t, i_h, i_hv, b_rq2, b_rk2, b_rk1, 2, 1, H, HV, K, BT, BC, BKT, PREC)
        b_L22 = b_b2 * score_block(q, k, G, Aqk, t0, n_t, i_h, i_hv, b_rq2, b_rk2, b_rk2, 2, 2, H, HV, K, BT, BC, BKT, PREC)
        b_L30 = b_b3 * score_block(q, k, G, Aqk, t0, n_t, i_h, i_hv, b_rq3, b_rk3, b_rk0, 3, 0, H, HV, K, BT, BC, BKT, PREC)
        b_L31 = b_b3 * score_block(q, k, G, Aqk, t0, n_t, i_h, i_hv, b_rq3, b_rk3, b_rk1, 3, 1, H, HV, K, BT, BC, BKT, PREC)
        b_L32 = b_b3 * score_block(q, k, G, Aqk, t0, n_t, i_h, i_hv, b_rq3, b_rk3, b_rk2, 3, 2, H, HV, K, BT, BC, BKT, PREC)
        b_L33 = b_b3 * score_block(q, k, G, Aqk, t0, n_t, i_h, i_hv, b_rq3, b_rk3, b_rk3, 3, 3, H, HV, K, BT, BC, BKT, PREC)

        # Block forward substitution: T_II = (I + L_II)^-1, T_IJ = -T_II sum_{J<=M<I} L_IM T_MJ.
        b_T00 = unit_lower_inverse(b_L00, BC)
        b_T11 = unit_lower_inverse(b_L11, BC)
        b_T22 = unit_lower_inverse(b_L22, BC)
        b_T33 = unit_lower_inverse(b_L33, BC)
        b_T10 = -dot32(dot32(b_T11, b_L10), b_T00)
        b_T21 = -dot32(dot32(b_T22, b_L21), b_T11)
        b_T32 = -dot32(dot32(b_T33, b_L32), b_T22)
        b_T20 = -dot32(b_T22, dot32(b_L20, b_T00) + dot32(b_L21, b_T10))
        b_T31 = -dot32(b_T33, dot32(b_L31, b_T11) + dot32(b_L32, b_T21))
        b_T30 = -dot32(b_T33, dot32(b_L30, b_T00) + dot32(b_L31, b_T10) + dot32(b_L32, b_T20))
        b_0 = tl.zeros([BC, BC], tl.float32)
        store_rows(Tinv, b_T00, t0, n_t, o_c, s_T, i_hv * BT, o_c, BC)
        store_rows(Tinv, b_0, t0, n_t, o_c, s_T, i_hv * BT + BC, o_c, BC)
        store_rows(Tinv, b_0, t0, n_t, o_c, s_T, i_hv * BT + 2 * BC, o_c, BC)
        store_rows(Tinv, b_0, t0, n_t, o_c, s_T, i_hv * BT + 3 * BC, o_c, BC)
        store_rows(Tinv, b_T10, t0, n_t, BC + o_c, s_T, i_hv * BT, o_c, BC)
        store_rows(Tinv, b_T11, t0, n_t, BC + o_c, s_T, i_hv * BT + BC, o_c, BC)
        store_rows(Tinv, b_0, t0, n_t, BC + o_c, s_T, i_hv * BT + 2 * BC, o_c, BC)
        store_rows(Tinv, b_0, t0, n_t, BC + o_c, s_T, i_hv * BT + 3 * BC, o_c, BC)
        store_rows(Tinv, b_T20, t0, n_t, 2 * BC + o_c, s_T, i_hv * BT, o_c, BC)
        store_rows(Tinv, b_T21, t0, n_t, 2 * BC + o_c, s_T, i_hv * BT + BC, o_c, BC)
        store_rows(Tinv, b_T22, t0, n_t, 2 * BC + o_c, s_T, i_hv * BT + 2 * BC, o_c, BC)
        store_rows(Tinv, b_0, t0, n_t, 2 * BC + o_c, s_T, i_hv * BT + 3 * BC, o_c, BC)
        store_rows(Tinv, b_T30, t0, n_t, 3 * BC + o_c, s_T, i_hv * BT, o_c, BC)
        store_rows(Tinv, b_T31, t0, n_t, 3 * BC + o_c, s_T, i_hv * BT + BC, o_c, BC)
        store_rows(Tinv, b_T32, t0, n_t, 3 * BC + o_c, s_T, i_hv * BT + 2 * BC, o_c, BC)
        store_rows(Tinv, b_T33, t0, n_t, 3 * BC + o_c, s_T, i_hv * BT + 3 * BC, o_c, BC)
        # Aqk's upper blocks are zero (causal).
        for I in tl.static_range(3):
            for J in tl.static_range(I + 1, 4):
                store_rows(Aqk, b_0, t0, n_t, I * BC + o_c, s_T, i_hv * BT + J * BC, o_c, BC)
        tl.debug_barrier()

    # W = T Diag(beta)(Gamma K), U = T Diag(beta) V, with the whole T as one [BT, BT] operand.
    b_T = load_rows(Tinv, t0, n_t, o_t, s_T, i_hv * BT, o_t, BT, False).to(dt)
    for i_k in range(tl.cdiv(K, BV)):
        o_w = i_k * BV + tl.arange(0, BV)
        b_W = tl.dot(b_T, load_rows(W, t0, n_t, o_t, HV * K, i_hv * K, o_w, K, False).to(dt), input_precision=PREC)
        tl.debug_barrier()
        store_rows(W, b_W, t0, n_t, o_t, HV * K, i_hv * K, o_w, K)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = load_rows(v, t0, n_t, o_t, HV * V, i_hv * V, o_v, V, False)
        b_U = tl.dot(b_T, (b_v * b_b[:, None]).to(dt), input_precision=PREC)
        store_rows(U, b_U, t0, n_t, o_t, HV * V, i_hv * V, o_v, V)


@triton.jit
def kda_state_fwd_kernel(
    W, U, KG, G, h, Vn, h0, ht,  # W, KG [T, HV, K]; U [T, HV, VU]; Vn [T, HV, V]; G fp32 [T, HV, K];
                                 # h [NT, HV, K, V] state before each chunk; h0, ht fp32 [N, HV, K, V]
    cu_seqlens, chunk_offsets,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, VU: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    STORE_STATES: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, eos, c0, NT = sequence_span(cu_seqlens, chunk_offsets, i_n, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    dt = W.dtype.element_ty
    o_s = i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    # The values are [0 | U]: the first V - VU columns are zero (the identity-state trick; none when
    # V == VU). Those columns read U's column VU, which the load masks to zero.
    o_u = tl.where(o_v >= V - VU, o_v - (V - VU), VU)

    b_S = tl.zeros([BK, BV], tl.float32)
    if USE_H0:
        b_S += tl.load(h0 + i_n.to(tl.int64) * HV * K * V + o_s, mask=m_kv, other=0.0).to(tl.float32)
    for i_j in range(NT):
        t0 = bos + i_j * BT
        n_t = tl.minimum(eos - t0, BT).to(tl.int32)
        if STORE_STATES:
            tl.store(h + (c0 + i_j) * HV * K * V + o_s, b_S.to(h.dtype.element_ty), mask=m_kv)
        b_W = load_rows(W, t0, n_t, o_t, HV * K, i_hv * K, o_k, K, False)
        b_U = load_rows(U, t0, n_t, o_t, HV * VU, i_hv * VU, o_u, VU, False)
        b_vn = b_U - tl.dot(b_W.to(dt), b_S.to(dt), input_precision=PREC)
        if STORE_STATES:
            store_rows(Vn, b_vn, t0, n_t, o_t, HV * V, i_hv * V, o_v, V)
        b_kg = load_rows(KG, t0, n_t, o_t, HV * K, i_hv * K, o_k, K, False)
        b_gl = tl.sum(load_rows(G, t0, n_t, n_t - 1 + tl.zeros([1], tl.int32), HV * K, i_hv * K, o_k, K, True), 0)
        b_S = b_S * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_kg.to(dt)), b_vn.to(dt), input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_n.to(tl.int64) * HV * K * V + o_s, b_S, mask=m_kv)


@triton.jit
def kda_output_fwd_kernel(
    QG, h, Aqk, Vn, o,  # QG [T, HV, K]; h [NT, HV, K, V]; Aqk [T, HV, BT]; Vn, o [T, HV, V]
    cu_seqlens, chunk_indices,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, n_t = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    dt = Vn.dtype.element_ty
    b_qg = load_rows(QG, t0, n_t, o_t, HV * K, i_hv * K, o_k, K, False).to(dt)
    p_h = h + i_c.to(tl.int64) * HV * K * V + i_hv * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(p_h, mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0.0).to(dt)
    b_A = load_rows(Aqk, t0, n_t, o_t, HV * BT, i_hv * BT, o_t, BT, False).to(dt)
    b_vn = load_rows(Vn, t0, n_t, o_t, HV * V, i_hv * V, o_v, V, False).to(dt)
    b_o = tl.dot(b_qg, b_h, input_precision=PREC) + tl.dot(b_A, b_vn, input_precision=PREC)
    store_rows(o, b_o, t0, n_t, o_t, HV * V, i_hv * V, o_v, V)


def block_sizes(K: int, V: int) -> tuple[int, int]:
    """(BK, BV): K in one tile (<= 256), V tiled by 64 at most."""
    return max(16, triton.next_power_of_2(K)), min(64, max(16, triton.next_power_of_2(V)))


def kda_intra_fwd(q, k, v, z, beta, A_log, dt_bias, scale, lower_bound, cu_seqlens, chunk_indices, dtype):
    """Launch ``kda_intra_fwd_kernel``; inputs flattened to [T, heads, D]; ``dtype`` is the intermediates'
    (``flash_kda.intermediate_dtype``). Returns (G, Tinv, Aqk, W, U, KG, QG)."""
    T, HV, K = z.shape
    G = torch.empty(T, HV, K, device=z.device, dtype=torch.float32)
    Tinv = torch.empty(T, HV, BT, device=z.device, dtype=torch.float32)
    Aqk = torch.empty(T, HV, BT, device=z.device, dtype=dtype)
    return (G, Tinv, Aqk, *_launch_intra(q, k, v, z, beta, A_log, dt_bias, G, Tinv, Aqk, scale, lower_bound,
                                         cu_seqlens, chunk_indices, dtype, replay=False))


def kda_intra_replay(q, k, v, beta, G, Tinv, scale, cu_seqlens, chunk_indices, dtype):
    """The backward's ``kda_intra_fwd`` from the forward's saved G and Tinv: only the cheap part (no
    sub-tile scores, no UT inverse). Returns (W, U, KG, QG) in ``dtype``."""
    # z, A_log and Aqk are not touched when replaying: G stands in for them.
    return _launch_intra(q, k, v, G, beta, G, None, G, Tinv, G, scale, 0.0, cu_seqlens, chunk_indices, dtype,
                         replay=True)


def _launch_intra(q, k, v, z, beta, A_log, dt_bias, G, Tinv, Aqk, scale, lower_bound, cu_seqlens, chunk_indices,
                  dtype, replay):
    T, H, K = k.shape
    HV, V = v.shape[1:]
    NT = chunk_indices.shape[0]
    BK, BV = block_sizes(K, V)
    W, KG, QG = (torch.empty(T, HV, K, device=k.device, dtype=dtype) for _ in range(3))
    U = torch.empty(T, HV, V, device=k.device, dtype=dtype)
    kda_intra_fwd_kernel[(NT, HV)](
        q, k, v, z, beta, A_log, dt_bias, G, Tinv, Aqk, W, U, KG, QG, cu_seqlens, chunk_indices,
        scale, lower_bound, H=H, HV=HV, K=K, V=V, HAS_BIAS=dt_bias is not None,
        BT=BT, BC=BC, BV=BV, BKT=min(BK, 32), PREC=dot_precision(dtype, k.device), REPLAY=replay,
    )
    return W, U, KG, QG


def kda_state_fwd(W, U, KG, G, h0, output_final_state, cu_seqlens, chunk_offsets, NT, h=None, Vn=None,
                  lead=0, store_states=True):
    """Launch ``kda_state_fwd_kernel``. Returns (h [NT, HV, K, V'], Vn [T, HV, V'], final state or None),
    V' = lead + U's width; h and Vn are None when not ``store_states``.

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
    BK, _ = block_sizes(K, V)
    BV = state_tile(N, HV, V, W.device)
    if store_states:
        h = torch.empty(NT, HV, K, V, device=W.device, dtype=W.dtype) if h is None else h
        Vn = torch.empty(T, HV, V, device=W.device, dtype=U.dtype) if Vn is None else Vn
    ht = torch.empty(N, HV, K, V, device=W.device, dtype=torch.float32) if output_final_state else None
    kda_state_fwd_kernel[(triton.cdiv(V, BV), N * HV)](
        W, U, KG, G, h if store_states else W, Vn if store_states else W, h0, ht, cu_seqlens, chunk_offsets,
        HV=HV, K=K, V=V, VU=VU, BT=BT, BK=BK, BV=BV, USE_H0=h0 is not None, STORE_HT=output_final_state,
        STORE_STATES=store_states, PREC=dot_precision(W.dtype, W.device), num_warps=4, num_stages=2,
    )
    return (h, Vn, ht) if store_states else (None, None, ht)


def kda_output_fwd(QG, h, Aqk, Vn, cu_seqlens, chunk_indices):
    """Launch ``kda_output_fwd_kernel``. Returns o [T, HV, V] in Vn's dtype."""
    T, HV, K = QG.shape
    V = Vn.shape[-1]
    NT = chunk_indices.shape[0]
    BK, BV = block_sizes(K, V)
    o = torch.empty_like(Vn)
    kda_output_fwd_kernel[(triton.cdiv(V, BV), NT, HV)](
        QG, h, Aqk, Vn, o, cu_seqlens, chunk_indices, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV,
        PREC=dot_precision(Vn.dtype, Vn.device), num_warps=8 if Vn.dtype == torch.float32 else 4,
    )
    return o
