"""FlashKDA backward: six Triton kernels and their launchers, on the forward's W, KG, QG, chunk states h
and pseudo-values V~ (kept when autograd records) and its saved G, T, Aqk. A second backward through a
retained graph, and KCP's backward, rebuild W, KG, QG with ``kda_intra_replay`` and h, V~ with the state
kernel first.

1. ``kda_state_bwd_kernel`` (sequential over chunks, in reverse): dV~ = Aqk^T dO + (Gamma_{i->C} K) dS',
   dS <- Diag(gamma_C) dS' + (Gamma Q)^T dO - W^T dV~; stores dS' per chunk and dV~.
2. ``kda_dqk_bwd_kernel`` (chunks x K tiles, V reduced in-kernel): d(Gamma Q) = dO S^T,
   d(Gamma_{i->C} K) = V~ dS'^T, dW = -dV~ S^T and the decay terms that depend on G_last (sent
   straight to dg as a prefix sum).
3. ``kda_dwv_bwd_kernel`` (chunks): dAqk = dO V~^T; dV, dbeta and dT through U and W; then
   dL = -T^T dT T^T (the inverse's backward), kept strictly lower.
4. ``kda_intra_bwd_kernel`` (16-row sub-tiles x K tiles of 64 x chunks): the gradients of the two
   decayed score matrices for one sub-tile's rows, as rows and as columns; dbeta's score term as one
   partial sum per K tile (measured on an H200, bf16, kernels 4-6 together: B1 T8192 H16 1.19 -> 0.76 ms,
   B4 T8192 H16 4.71 -> 3.08 ms against one program per chunk and K tile).
5. ``kda_gate_bwd_kernel`` (K tiles x chunks): the reverse cumsum of dG in the chunk and the gate
   backward (dz, per-chunk sums for dA_log and ddt_bias).
6. ``kda_qk_norm_bwd_kernel`` (token blocks x q/k heads): the GVA group sum and L2-norm backward of q
   and k, and the beta-sigmoid backward. (5 and 6 fused per chunk were 0.81 ms against 0.31 + 0.31 at
   B4: one [64, K] program per chunk left few warps per SM.)
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from k3lab.kernels.kda.chunk_fwd import block_sizes
from k3lab.kernels.kda.utils import (
    BC, BT, add_rows, chunk_decay_halves, chunk_span, dot_precision, exp_ftz, grid_log2, inverse_norm, l2norm_bwd,
    launch_fitting, load_rows, load_vec, sequence_span, sigmoid_grad, state_half, state_halves, state_prefetch,
    state_tile, store_rows, warp_configs,
)


@triton.jit
def kda_state_bwd_kernel(
    QG, KG, W, G, Aqk, do, dh, dVn, dht, dh0,  # dh [NT, HV, K, V]: dLoss/d(state after each chunk), and dVn
                                               # [T, HV, V], in W's dtype (tensor-core operands after this)
    cu_seqlens, chunk_offsets,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKH: tl.constexpr,
    BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREFETCH: tl.constexpr, PREC: tl.constexpr,
):
    # dS in two halves of BKH rows of K, as the forward's state kernel holds S.
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, eos, c0, NT = sequence_span(cu_seqlens, chunk_offsets, i_n, BT)
    o_t = tl.arange(0, BT)
    o_k1, o_k2, o_v, o_s1, o_s2, m_1, m_2 = state_halves(i_hv, i_v, K, V, BKH, BV)
    dt = W.dtype.element_ty

    b_dS1 = tl.zeros([BKH, BV], tl.float32)
    b_dS2 = tl.zeros([BKH, BV], tl.float32)
    if USE_DHT:
        p_dht = dht + i_n.to(tl.int64) * HV * K * V
        b_dS1 += tl.load(p_dht + o_s1, mask=m_1, other=0.0).to(tl.float32)
        b_dS2 += tl.load(p_dht + o_s2, mask=m_2, other=0.0).to(tl.float32)
    # With PREFETCH the decay (an elementwise operand, not staged by Triton's pipeliner) is loaded a chunk
    # ahead, as in ``kda_state_fwd_kernel``.
    if PREFETCH:
        t0 = bos + (NT - 1) * BT
        b_d1, b_d2 = chunk_decay_halves(G, t0, (eos - t0).to(tl.int32), i_hv, o_k1, o_k2, HV, K)
    for i_r in range(NT):
        i_j = NT - 1 - i_r
        t0 = bos + i_j * BT
        n_t = tl.minimum(eos - t0, BT).to(tl.int32)
        if PREFETCH:
            b_dn1, b_dn2 = chunk_decay_halves(G, t0 - BT, tl.where(i_j > 0, BT, 0), i_hv, o_k1, o_k2, HV, K)
        p_dh = dh + (c0 + i_j) * HV * K * V
        tl.store(p_dh + o_s1, b_dS1.to(dh.dtype.element_ty), mask=m_1)
        tl.store(p_dh + o_s2, b_dS2.to(dh.dtype.element_ty), mask=m_2)
        b_do = load_rows(do, t0, n_t, o_t, HV * V, i_hv * V, o_v, V, False).to(dt)
        b_A = load_rows(Aqk, t0, n_t, o_t, HV * BT, i_hv * BT, o_t, BT, False).to(dt)
        b_dvn = tl.dot(tl.trans(b_A), b_do, input_precision=PREC)
        b_dvn += tl.dot(load_rows(KG, t0, n_t, o_t, HV * K, i_hv * K, o_k1, K, False).to(dt), b_dS1.to(dt),
                        input_precision=PREC)
        b_dvn += tl.dot(load_rows(KG, t0, n_t, o_t, HV * K, i_hv * K, o_k2, K, False).to(dt), b_dS2.to(dt),
                        input_precision=PREC)
        store_rows(dVn, b_dvn, t0, n_t, o_t, HV * V, i_hv * V, o_v, V)
        b_dv = b_dvn.to(dt)
        if not PREFETCH:
            b_d1, b_d2 = chunk_decay_halves(G, t0, n_t, i_hv, o_k1, o_k2, HV, K)
        b_qg1 = load_rows(QG, t0, n_t, o_t, HV * K, i_hv * K, o_k1, K, False).to(dt)
        b_qg2 = load_rows(QG, t0, n_t, o_t, HV * K, i_hv * K, o_k2, K, False).to(dt)
        b_W1 = load_rows(W, t0, n_t, o_t, HV * K, i_hv * K, o_k1, K, False).to(dt)
        b_W2 = load_rows(W, t0, n_t, o_t, HV * K, i_hv * K, o_k2, K, False).to(dt)
        b_dS1 = (b_dS1 * b_d1[:, None] + tl.dot(tl.trans(b_qg1), b_do, input_precision=PREC)
                 - tl.dot(tl.trans(b_W1), b_dv, input_precision=PREC))
        b_dS2 = (b_dS2 * b_d2[:, None] + tl.dot(tl.trans(b_qg2), b_do, input_precision=PREC)
                 - tl.dot(tl.trans(b_W2), b_dv, input_precision=PREC))
        if PREFETCH:
            b_d1, b_d2 = b_dn1, b_dn2
    if STORE_DH0:
        p_dh0 = dh0 + i_n.to(tl.int64) * HV * K * V
        tl.store(p_dh0 + o_s1, b_dS1, mask=m_1)
        tl.store(p_dh0 + o_s2, b_dS2, mask=m_2)


@triton.autotune(configs=warp_configs(4, 8), key=["grid_log2", "H", "HV", "K", "V"])
@triton.jit
def kda_dqk_bwd_kernel(
    q, k, G, h, dh, Vn, dVn, do,  # inputs and recomputed forward pieces
    dqs, dkn, dG, dW, dgx,  # outputs [T, HV, K]: fp32 partial grads of scale*q_hat, k_hat, G; dW in the
                            # intermediates' dtype; fp32 dgx: a part of dg itself (added after the reverse cumsum)
    rq, rk,  # outputs, fp32 [T, HV]: the rows' inverse L2 norms of q and k, for the kernels after this one
    cu_seqlens, chunk_indices, scale, grid_log2,  # grid_log2: the autotuner's key only (``grid_log2``)
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BKK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk and K tile: the products of V-sized operands that end in K columns, reduced over V:
    d(Gamma Q) = dO S^T, d(Gamma_{i->C} K) = V~ dS'^T, dW = -dV~ S^T, and sum_v S * dS'; then the
    column-wise chain to q_hat, k_hat and G."""
    i_k, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    t0, n_t = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    dt = h.dtype.element_ty

    b_dqg = tl.zeros([BT, BK], tl.float32)
    b_dkg = tl.zeros([BT, BK], tl.float32)
    b_dW = tl.zeros([BT, BK], tl.float32)
    b_hdh = tl.zeros([BK], tl.float32)
    o_h = i_c.to(tl.int64) * HV * K * V + i_hv * K * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
        b_h = tl.load(h + o_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0).to(tl.float32)
        b_dh = tl.load(dh + o_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0).to(tl.float32)
        b_vn = load_rows(Vn, t0, n_t, o_t, HV * V, i_hv * V, o_v, V, False).to(dt)
        b_dvn = load_rows(dVn, t0, n_t, o_t, HV * V, i_hv * V, o_v, V, False).to(dt)
        b_do = load_rows(do, t0, n_t, o_t, HV * V, i_hv * V, o_v, V, False).to(dt)
        b_dqg += tl.dot(b_do, tl.trans(b_h.to(dt)), input_precision=PREC)
        b_dkg += tl.dot(b_vn, tl.trans(b_dh.to(dt)), input_precision=PREC)
        b_dW -= tl.dot(b_dvn, tl.trans(b_h.to(dt)), input_precision=PREC)
        b_hdh += tl.sum(b_h * b_dh, 1)
    store_rows(dW, b_dW, t0, n_t, o_t, HV * K, i_hv * K, o_k, K)
    # q_hat and k_hat need the whole row for their norms.
    b_rq = inverse_norm(q, t0, n_t, o_t, H * K, i_h * K, K, BT, BKK)
    b_rk = inverse_norm(k, t0, n_t, o_t, H * K, i_h * K, K, BT, BKK)
    if i_k == 0:
        tl.store(rq + (t0 + o_t) * HV + i_hv, b_rq, mask=o_t < n_t)
        tl.store(rk + (t0 + o_t) * HV + i_hv, b_rk, mask=o_t < n_t)
    b_q = load_rows(q, t0, n_t, o_t, H * K, i_h * K, o_k, K, False) * (b_rq * scale)[:, None]
    b_k = load_rows(k, t0, n_t, o_t, H * K, i_h * K, o_k, K, False) * b_rk[:, None]
    b_G = load_rows(G, t0, n_t, o_t, HV * K, i_hv * K, o_k, K, True)
    b_eG = tl.exp(b_G)
    # QG = scale q_hat exp(G).
    b_dG = b_dqg * b_q * b_eG
    store_rows(dqs, b_dqg * b_eG, t0, n_t, o_t, HV * K, i_hv * K, o_k, K)
    # KG = k_hat exp(G_last - G), and the state decay exp(G_last).
    b_gl = tl.sum(tl.where((o_t == n_t - 1)[:, None], b_G, 0.0), 0)
    b_ekl = tl.exp(b_gl[None, :] - b_G)
    # Both depend on g_t through G_last - G_i = g_{i+1} + ... + g_last, so they go straight to dg_t
    # (an exclusive prefix sum), not through dG and the reverse cumsum, which would cancel large
    # terms against each other and leave float32 noise when decay is strong.
    b_x = b_dkg * b_k * b_ekl
    b_dgx = tl.cumsum(b_x, axis=0) - b_x + (b_hdh * tl.exp(b_gl))[None, :]
    store_rows(dkn, b_dkg * b_ekl, t0, n_t, o_t, HV * K, i_hv * K, o_k, K)
    store_rows(dG, b_dG, t0, n_t, o_t, HV * K, i_hv * K, o_k, K)
    store_rows(dgx, b_dgx, t0, n_t, o_t, HV * K, i_hv * K, o_k, K)


@triton.autotune(configs=warp_configs(4, 8), key=["grid_log2", "H", "HV", "K", "V"], restore_value=["dkn", "dG"])
@triton.jit
def kda_dwv_bwd_kernel(
    k, v, beta, G, Tinv, dW, dVn, do, Vn, rk,  # inputs (dW and rk from kda_dqk_bwd_kernel)
    dkn, dG, db, dv, dAqk, dAkk,  # dkn, dG are added to in place; db fp32 [T, HV]; dv [T, HV, V];
                                  # dAqk, dAkk [T, HV, BT] in the intermediates' dtype
    cu_seqlens, chunk_indices, grid_log2,  # grid_log2: the autotuner's key only (``grid_log2``)
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """Per chunk: everything [BT, BT]-shaped. dAqk = dO V~^T; U = T Diag(beta) V and W = T Diag(beta)
    (Gamma K) give dV, dbeta, dT; then dL = -T^T dT T^T (the inverse's backward), kept strictly lower."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0, n_t = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = o_t < n_t
    dt = Vn.dtype.element_ty

    b_T = load_rows(Tinv, t0, n_t, o_t, HV * BT, i_hv * BT, o_t, BT, False)
    b_b = tl.where(m_t, tl.sigmoid(load_vec(beta, t0, n_t, o_t, HV, i_hv)), 0.0)
    b_dA = tl.zeros([BT, BT], tl.float32)
    b_dT = tl.zeros([BT, BT], tl.float32)
    b_db = tl.zeros([BT], tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        b_vn = load_rows(Vn, t0, n_t, o_t, HV * V, i_hv * V, o_v, V, False).to(dt)
        b_dvn = load_rows(dVn, t0, n_t, o_t, HV * V, i_hv * V, o_v, V, False)
        b_do = load_rows(do, t0, n_t, o_t, HV * V, i_hv * V, o_v, V, False).to(dt)
        b_v = load_rows(v, t0, n_t, o_t, HV * V, i_hv * V, o_v, V, False)
        b_dA += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        b_dbv = tl.dot(tl.trans(b_T.to(dt)), b_dvn.to(dt), input_precision=PREC)
        store_rows(dv, b_dbv * b_b[:, None], t0, n_t, o_t, HV * V, i_hv * V, o_v, V)
        b_db += tl.sum(b_dbv * b_v, 1)
        b_dT += tl.dot(b_dvn.to(dt), tl.trans((b_v * b_b[:, None]).to(dt)), input_precision=PREC)
    m_tt = m_t[:, None] & m_t[None, :]
    store_rows(dAqk, tl.where(m_tt & (o_t[:, None] >= o_t[None, :]), b_dA, 0.0), t0, n_t, o_t, HV * BT, i_hv * BT, o_t, BT)

    # W = T Diag(beta)(Gamma K), in K tiles of BK.
    b_rk = load_vec(rk, t0, n_t, o_t, HV, i_hv)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_dW = load_rows(dW, t0, n_t, o_t, HV * K, i_hv * K, o_k, K, False)
        b_k = load_rows(k, t0, n_t, o_t, H * K, i_h * K, o_k, K, False) * b_rk[:, None]
        b_eG = tl.exp(load_rows(G, t0, n_t, o_t, HV * K, i_hv * K, o_k, K, True))
        b_kb = b_k * b_eG * b_b[:, None]
        b_dT += tl.dot(b_dW.to(dt), tl.trans(b_kb.to(dt)), input_precision=PREC)
        b_dkb = tl.dot(tl.trans(b_T), b_dW, input_precision=PREC)
        b_db += tl.sum(b_dkb * b_k * b_eG, 1)
        add_rows(dkn, b_dkb * b_eG * b_b[:, None], t0, n_t, o_t, HV * K, i_hv * K, o_k, K)
        add_rows(dG, b_dkb * b_kb, t0, n_t, o_t, HV * K, i_hv * K, o_k, K)
    tl.store(db + (t0 + o_t).to(tl.int64) * HV + i_hv, b_db, mask=m_t)
    # T = (I + L)^-1: dL = -T^T dT T^T.
    b_dL = -tl.dot(tl.trans(b_T), tl.dot(b_dT, tl.trans(b_T), input_precision=PREC), input_precision=PREC)
    store_rows(dAkk, tl.where(m_tt & (o_t[:, None] > o_t[None, :]), b_dL, 0.0), t0, n_t, o_t, HV * BT, i_hv * BT, o_t, BT)


@triton.jit
def unit_rows(x, rx, t0, n_t, o_r, stride, off, o_k, i_hv, HV: tl.constexpr, K: tl.constexpr):
    """Rows o_r (columns o_k) of q or k divided by their whole-row L2 norms, from the inverse norms rx
    [T, HV] that ``kda_dqk_bwd_kernel`` wrote."""
    return load_rows(x, t0, n_t, o_r, stride, off, o_k, K, False) * load_vec(rx, t0, n_t, o_r, HV, i_hv)[:, None]


# One program per sub-tile of BC rows, K tile of BKT columns, chunk and value head (4 K/BKT programs per
# chunk): every product below is column-separable except the scores Ks (summed over K for dbeta: each K
# tile writes its partial sum). The reverse cumsum of dG, the gate and the L2-norm backward need whole
# chunks or rows: ``kda_gate_norm_bwd_kernel``, after this one.
@triton.autotune(configs=warp_configs(2, 4), key=["grid_log2", "H", "HV", "K", "BKT"],
                 restore_value=["dqs", "dkn", "dG"])
@triton.jit
def kda_intra_bwd_kernel(
    q, k, beta, G, rq, rk, dAqk, dAkk,  # rq, rk fp32 [T, HV]: inverse norms; dAqk, dAkk [T, HV, BT]
    dqs, dkn, dG, dbeta_part,  # dqs, dkn, dG [T, HV, K] fp32: the other kernels' parts, totals written back;
                               # dbeta_part fp32 [NKT, T, HV]
    cu_seqlens, chunk_indices, scale, T_total, grid_log2,  # grid_log2: the autotuner's key only (``grid_log2``)
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKT: tl.constexpr, PREC: tl.constexpr,
):
    """Sub-tile I's rows of the gradients of the two decayed score matrices Aqk (q_i . k_j exp(G_i - G_j),
    i >= j) and L = Diag(beta) StrictTril(Ks): as the row side (dX_i = sum_{j <= i} dA_ij Y_j exp(G_i -
    G_j)) and as the column side (dY_j = sum_{i >= j} dA_ij X_i exp(G_i - G_j)); and their dG."""
    NC: tl.constexpr = BT // BC
    i_ki, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k, i_i = i_ki // NC, i_ki % NC
    i_h = i_hv // (HV // H)
    t0, n_t = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    if i_i * BC >= n_t:
        return
    o_c = tl.arange(0, BC)
    o_i = i_i * BC + o_c
    o_k = i_k * BKT + tl.arange(0, BKT)
    o_1 = tl.zeros([1], tl.int32)
    # Float32 operands; PREC: tf32 for 16-bit inputs, the float32 emulation for float32 ones.
    dt = tl.float32
    s_A = HV * BT
    s_K = HV * K
    s_Q = H * K
    b_q = unit_rows(q, rq, t0, n_t, o_i, s_Q, i_h * K, o_k, i_hv, HV, K) * scale
    b_k = unit_rows(k, rk, t0, n_t, o_i, s_Q, i_h * K, o_k, i_hv, HV, K)
    b_G = load_rows(G, t0, n_t, o_i, s_K, i_hv * K, o_k, K, True)
    b_b = tl.where(o_i < n_t, tl.sigmoid(load_vec(beta, t0, n_t, o_i, HV, i_hv)), 0.0)

    # Row side, earlier sub-tiles J < I, at the reference r = G before row I*BC: exp(r - G_j) <= 1 and
    # exp(G_i - r) <= 1 (G only decreases).
    b_dq = tl.zeros([BC, BKT], tl.float32)
    b_dk = tl.zeros([BC, BKT], tl.float32)
    if i_i > 0:
        b_r = tl.sum(load_rows(G, t0, n_t, i_i * BC - 1 + o_1, s_K, i_hv * K, o_k, K, True), 0)
        for i_j in range(0, i_i):
            o_j = i_j * BC + o_c
            b_kj = unit_rows(k, rk, t0, n_t, o_j, s_Q, i_h * K, o_k, i_hv, HV, K)
            b_kr = (b_kj * exp_ftz(b_r[None, :] - load_rows(G, t0, n_t, o_j, s_K, i_hv * K, o_k, K, True))).to(dt)
            b_dq += tl.dot(load_rows(dAqk, t0, n_t, o_i, s_A, i_hv * BT + i_j * BC, o_c, BC, False), b_kr,
                           input_precision=PREC)
            b_dk += tl.dot(load_rows(dAkk, t0, n_t, o_i, s_A, i_hv * BT + i_j * BC, o_c, BC, False), b_kr,
                           input_precision=PREC)
        b_er = exp_ftz(b_G - b_r[None, :])
        b_dq *= b_er
        b_dk *= b_er
    # The diagonal sub-tile at its middle row m: both exp(G - m) and exp(m - G) stay below exp(8 |lb|).
    b_m = tl.sum(load_rows(G, t0, n_t, i_i * BC + BC // 2 + o_1, s_K, i_hv * K, o_k, K, True), 0)
    b_P = exp_ftz(b_G - b_m[None, :])
    b_Q = exp_ftz(b_m[None, :] - b_G)
    b_dAq = load_rows(dAqk, t0, n_t, o_i, s_A, i_hv * BT + i_i * BC, o_c, BC, False)
    b_dAk = load_rows(dAkk, t0, n_t, o_i, s_A, i_hv * BT + i_i * BC, o_c, BC, False)
    # Aqk's diagonal (q_i . k_i, no decay) has no gate dependence: kept out of dG (its row and column
    # terms would cancel only up to round-off) and added to dq, dk at the end.
    b_dAqd = tl.sum(tl.where(o_c[:, None] == o_c[None, :], b_dAq, 0.0), 1)
    b_dAq = tl.where(o_c[:, None] > o_c[None, :], b_dAq, 0.0)
    b_kq = (b_k * b_Q).to(dt)
    b_dq += tl.dot(b_dAq, b_kq, input_precision=PREC) * b_P
    b_dk += tl.dot(b_dAk, b_kq, input_precision=PREC) * b_P
    # dbeta_i = sum_j dAkk_ij Ks_ij = <dk_i (before the factor beta_i), k_i> over this tile's columns.
    b_db = tl.sum(b_dk * b_k, 1)
    b_dk *= b_b[:, None]
    b_dGr = b_q * b_dq + b_k * b_dk

    # Column side, later sub-tiles J > I, at the reference r = G at row I's last row: exp(G_j - r) <= 1
    # and exp(r - G_i) <= 1.
    b_dkc = tl.zeros([BC, BKT], tl.float32)
    if i_i * BC + BC < n_t:
        b_r = tl.sum(load_rows(G, t0, n_t, i_i * BC + BC - 1 + o_1, s_K, i_hv * K, o_k, K, True), 0)
        for i_j in range(i_i + 1, tl.cdiv(n_t, BC)):
            o_j = i_j * BC + o_c
            b_ej = exp_ftz(load_rows(G, t0, n_t, o_j, s_K, i_hv * K, o_k, K, True) - b_r[None, :])
            b_qj = unit_rows(q, rq, t0, n_t, o_j, s_Q, i_h * K, o_k, i_hv, HV, K) * (b_ej * scale)
            b_kj = unit_rows(k, rk, t0, n_t, o_j, s_Q, i_h * K, o_k, i_hv, HV, K) * b_ej
            b_bj = tl.where(o_j < n_t, tl.sigmoid(load_vec(beta, t0, n_t, o_j, HV, i_hv)), 0.0)
            b_dAqj = load_rows(dAqk, t0, n_t, o_j, s_A, i_hv * BT + i_i * BC, o_c, BC, False)
            b_dAkj = load_rows(dAkk, t0, n_t, o_j, s_A, i_hv * BT + i_i * BC, o_c, BC, False) * b_bj[:, None]
            b_dkc += tl.dot(tl.trans(b_dAqj), b_qj.to(dt), input_precision=PREC)
            b_dkc += tl.dot(tl.trans(b_dAkj), b_kj.to(dt), input_precision=PREC)
        b_dkc *= exp_ftz(b_r[None, :] - b_G)
    b_x = (tl.dot(tl.trans(b_dAq), (b_q * b_P).to(dt), input_precision=PREC)
           + tl.dot(tl.trans(b_dAk * b_b[:, None]), (b_k * b_P).to(dt), input_precision=PREC))
    b_dkc += b_x * b_Q

    # Totals with the state/WY path (gradients of scale * q / |q|, k / |k| and G), written back in place.
    add_rows(dqs, b_dq + b_dAqd[:, None] * b_k, t0, n_t, o_i, s_K, i_hv * K, o_k, K)
    add_rows(dkn, b_dk + b_dkc + b_dAqd[:, None] * b_q, t0, n_t, o_i, s_K, i_hv * K, o_k, K)
    add_rows(dG, b_dGr - b_k * b_dkc, t0, n_t, o_i, s_K, i_hv * K, o_k, K)
    tl.store(dbeta_part + (i_k * T_total + t0 + o_i).to(tl.int64) * HV + i_hv, b_db, mask=o_i < n_t)


@triton.jit
def kda_gate_bwd_kernel(
    z, A_log, dt_bias, dG, dgx,  # z [T, HV, K]; dG, dgx fp32 [T, HV, K] (dG's total, after the intra backward)
    dz, dA_part, dbias_part,  # dz [T, HV, K]; dA_part fp32 [NKT, NT, HV]; dbias_part fp32 [NT, HV, K]
    cu_seqlens, chunk_indices, lower_bound,
    HV: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr, BKT: tl.constexpr,
):
    """Per K tile, chunk and value head: G = cumsum(g) in the chunk gives dg = reverse cumsum of dG (+ dgx,
    the terms sent straight to dg); then g = lb * sigmoid(a (z + bias)) gives dz and this chunk's sums
    for dA_log (one per K tile) and ddt_bias."""
    i_k, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, n_t = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BKT + tl.arange(0, BKT)
    m = (o_t < n_t)[:, None] & (o_k < K)[None, :]
    s_K = HV * K
    b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_dg = tl.cumsum(load_rows(dG, t0, n_t, o_t, s_K, i_hv * K, o_k, K, False), axis=0, reverse=True)
    b_dg += load_rows(dgx, t0, n_t, o_t, s_K, i_hv * K, o_k, K, False)
    b_z = load_rows(z, t0, n_t, o_t, s_K, i_hv * K, o_k, K, False)
    if HAS_BIAS:
        b_z += tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)[None, :]
    b_ds = tl.where(m, b_dg * lower_bound * sigmoid_grad(b_a * b_z), 0.0)
    store_rows(dz, b_ds * b_a, t0, n_t, o_t, s_K, i_hv * K, o_k, K)
    tl.store(dbias_part + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, tl.sum(b_ds, 0) * b_a, mask=o_k < K)
    tl.store(dA_part + (i_k * tl.num_programs(1) + i_c).to(tl.int64) * HV + i_hv, tl.sum(tl.sum(b_ds * b_z, 0), 0) * b_a)


@triton.jit
def kda_qk_norm_bwd_kernel(
    q, k, beta, dqs, dkn, dbeta_part, db, dq, dk, dbeta,  # q, k, dq, dk [T, H, K]; dqs, dkn fp32 [T, HV, K];
                                                        # beta, db, dbeta [T, HV]; dbeta_part fp32 [NKT, T, HV]
    T_total, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, NKT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
):
    """Per block of BR tokens and q/k head: the gradients of q / |q| (times the scale) and k / |k| summed
    over the head's GVA group, then the L2-norm backward dx = (dy - y <dy, y>) / |x|; and
    dbeta = (sum of the K tiles' parts + the WY path's) * sigmoid'(beta)."""
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    GV: tl.constexpr = HV // H
    o_r = i_r * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m_r = o_r < T_total
    m = m_r[:, None] & (o_k < K)[None, :]
    o_r64 = o_r.to(tl.int64)
    b_dq = tl.zeros([BR, BK], tl.float32)
    b_dk = tl.zeros([BR, BK], tl.float32)
    for i_g in tl.static_range(GV):
        i_hv = i_h * GV + i_g
        p = (o_r64 * HV + i_hv)[:, None] * K + o_k[None, :]
        b_dq += tl.load(dqs + p, mask=m, other=0.0)
        b_dk += tl.load(dkn + p, mask=m, other=0.0)
        b_db = tl.load(db + o_r64 * HV + i_hv, mask=m_r, other=0.0)
        for i_k in tl.static_range(NKT):
            b_db += tl.load(dbeta_part + (i_k * T_total + o_r64) * HV + i_hv, mask=m_r, other=0.0)
        b_x = tl.load(beta + o_r64 * HV + i_hv, mask=m_r, other=0.0).to(tl.float32)
        tl.store(dbeta + o_r64 * HV + i_hv, (b_db * sigmoid_grad(b_x)).to(dbeta.dtype.element_ty), mask=m_r)
    p = (o_r64 * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + p, mask=m, other=0.0).to(tl.float32)
    tl.store(dq + p, l2norm_bwd(b_q, b_dq * scale).to(dq.dtype.element_ty), mask=m)
    b_k = tl.load(k + p, mask=m, other=0.0).to(tl.float32)
    tl.store(dk + p, l2norm_bwd(b_k, b_dk).to(dk.dtype.element_ty), mask=m)


def kda_state_bwd(QG, KG, W, G, Aqk, do, dht, need_dh0, cu_seqlens, chunk_offsets, NT, dh=None, dVn=None):
    """Launch ``kda_state_bwd_kernel``. Returns (dh [NT, HV, K, V], dVn [T, HV, V] in W's dtype (stored as the
    bf16 operands the next kernels use; measured on an H200 at B4 T8192 H16: backward 0.2 ms faster, peak
    memory 3012 -> 2628 MiB, the GPU check's errors unchanged), dh0 fp32 or None).

    As for ``kda_state_fwd``, ``cu_seqlens``/``chunk_offsets`` may be a slice of a layout's tables: only
    those sequences' parts of ``dh`` and ``dVn`` (pass the layout's buffers) are written.
    """
    T, HV, K = W.shape
    V = do.shape[-1]
    N = cu_seqlens.numel() - 1
    BV = state_tile(N, HV, V, W.device)
    dh = torch.empty(NT, HV, K, V, device=W.device, dtype=W.dtype) if dh is None else dh
    dVn = torch.empty(T, HV, V, device=W.device, dtype=W.dtype) if dVn is None else dVn
    dh0 = torch.empty(N, HV, K, V, device=W.device, dtype=torch.float32) if need_dh0 else None
    launch_fitting(
        kda_state_bwd_kernel, (triton.cdiv(V, BV), N * HV),
        QG, KG, W, G, Aqk, do, dh, dVn, dht, dh0, cu_seqlens, chunk_offsets, HV=HV, K=K, V=V, BT=BT,
        BKH=state_half(K), BV=BV, USE_DHT=dht is not None, STORE_DH0=need_dh0, PREFETCH=state_prefetch(BV, stores=True),
        PREC=dot_precision(W.dtype, W.device),
        num_warps=4, num_stages=3 if W.element_size() == 2 else 2,
    )
    return dh, dVn, dh0


def _dqkw_tiles(K: int, V: int, cuda: bool) -> tuple[int, int, int]:
    """(BKK, BK, BV): K whole (BKK) or in tiles of 64, and the dW/dv kernel's V tile, 32 on the GPU (dq/dk
    uses ``block_sizes``' 64). Measured on an H200 at B4 T8192 H16, bf16 (tile and warp sweeps): dq/dk
    V tile 64 -> 1.14 ms, 32 -> 1.24; dW/dv 32 is the fastest of 16, 32 and 64."""
    BKK, BV = block_sizes(K, V)
    return BKK, min(BKK, 64), min(BV, 32) if cuda else BV


def kda_dqk_bwd(q, k, G, h, dh, Vn, dVn, do, scale, cu_seqlens, chunk_indices):
    """Launch ``kda_dqk_bwd_kernel``. Returns [T, HV, K] (dqs, dkn, dG, dW, dgx), all float32 but dW, which
    is in h's dtype (the intermediates'), and the rows' inverse norms rn float32 [2, T, HV] (q's, k's).

    dW, and the dW/dv kernel's dAqk and dAkk, are stored in the intermediates' dtype: their readers use
    them as 16-bit or tf32 operands, which round them anyway. Measured on an H200 (bf16; fwd+bwd ms, float32
    dW -> bf16 dW -> also bf16 dAqk, dAkk): B1 T32768 H32 13.788 -> 13.485 -> 13.314, B4 T8192 H16 6.598 ->
    6.456 -> 6.372; the GPU check's largest gradient error 3.66e-3 -> 3.65e-3 -> 3.71e-3 (dq), bound 1e-2."""
    T, H, K = k.shape
    HV, V = Vn.shape[1:]
    BKK, BK, _ = _dqkw_tiles(K, V, k.is_cuda)
    BV = block_sizes(K, V)[1]
    dqs, dkn, dG, dgx = (torch.empty(T, HV, K, device=k.device, dtype=torch.float32) for _ in range(4))
    dW = torch.empty(T, HV, K, device=k.device, dtype=h.dtype)
    rn = torch.empty(2, T, HV, device=k.device, dtype=torch.float32)
    grid = (triton.cdiv(K, BK), chunk_indices.shape[0], HV)
    kda_dqk_bwd_kernel[grid](
        q, k, G, h, dh, Vn, dVn, do, dqs, dkn, dG, dW, dgx, rn[0], rn[1], cu_seqlens, chunk_indices, scale,
        grid_log2(math.prod(grid)), H=H, HV=HV, K=K, V=V, BT=BT, BKK=BKK, BK=BK, BV=BV,
        PREC=dot_precision(h.dtype, k.device),
    )
    return dqs, dkn, dG, dW, dgx, rn


def kda_dwv_bwd(k, v, beta, G, Tinv, dW, dVn, do, Vn, dkn, dG, rn, cu_seqlens, chunk_indices):
    """Launch ``kda_dwv_bwd_kernel``; adds its terms into ``dkn`` and ``dG`` in place. Returns (db float32
    [T, HV], dv in v's dtype, dAqk and dAkk [T, HV, BT] in Vn's dtype, see ``kda_dqk_bwd``). Call it after
    dropping the chunk states and their gradients (not read here): that is what keeps the backward's peak
    memory down."""
    T, H, K = k.shape
    HV, V = v.shape[1:]
    _, BK, BV = _dqkw_tiles(K, V, k.is_cuda)
    db = torch.empty(T, HV, device=k.device, dtype=torch.float32)
    dv = torch.empty_like(v)
    dAqk, dAkk = (torch.empty(T, HV, BT, device=k.device, dtype=Vn.dtype) for _ in range(2))
    # Triton 3.6 on an H200: with float32 intermediates (bf16x3 products) this kernel read shared memory
    # out of bounds at 4 and 8 warps at small K and V tiles (compute-sanitizer memcheck at K = V = 16,
    # and still at V tiles of 32: gradients NaN or ~1e36, or an illegal-address crash); at 2 warps it
    # is clean, so float32 intermediates (float32 and float16 inputs) launch it there, untuned.
    fp32 = k.is_cuda and Vn.dtype == torch.float32
    kernel, launch = (kda_dwv_bwd_kernel.fn, dict(num_warps=2)) if fp32 else (kda_dwv_bwd_kernel, {})
    kernel[(chunk_indices.shape[0], HV)](
        k, v, beta, G, Tinv, dW, dVn, do, Vn, rn[1], dkn, dG, db, dv, dAqk, dAkk, cu_seqlens, chunk_indices,
        grid_log2(chunk_indices.shape[0] * HV), H=H, HV=HV, K=K, V=V, BT=BT, BK=min(BK, 32), BV=BV,
        PREC=dot_precision(Vn.dtype, k.device), **launch,
    )
    return db, dv, dAqk, dAkk


def kda_intra_bwd(q, k, z, beta, A_log, dt_bias, G, rn, dAqk, dAkk, dqs, dkn, dG, dgx, db, scale, lower_bound,
                  cu_seqlens, chunk_indices):
    """Launch ``kda_intra_bwd_kernel``, ``kda_gate_bwd_kernel`` and ``kda_qk_norm_bwd_kernel`` (``dqs``,
    ``dkn``, ``dG`` are overwritten with their totals). Returns (dq, dk [T, H, K] in q's dtype, dz [T, HV, K],
    dbeta [T, HV], dA_part fp32 [parts, HV], dbias_part fp32 [NT, HV, K]); the parts sum to dA_log and dt_bias's gradient."""
    T, H, K = k.shape
    HV = z.shape[1]
    NT = chunk_indices.shape[0]
    BK, _ = block_sizes(K, K)
    # K tiles of 64 for the score gradients (measured on an H200 at B4 T8192 H16, bf16: 2.54 ms at 2 warps
    # vs 2.89 with tiles of 32 at their best 4 warps and 2.58 with K whole), 32 for the gate backward.
    BKT, BKG = min(BK, 64), min(BK, 32)
    NKT, NKG = triton.cdiv(K, BKT), triton.cdiv(K, BKG)
    dev = k.device
    dbeta_part = torch.empty(NKT, T, HV, device=dev, dtype=torch.float32)
    grid = (NKT * (BT // BC), NT, HV)
    kda_intra_bwd_kernel[grid](
        q, k, beta, G, rn[0], rn[1], dAqk, dAkk, dqs, dkn, dG, dbeta_part, cu_seqlens, chunk_indices, scale, T,
        grid_log2(math.prod(grid)), H=H, HV=HV, K=K, BT=BT, BC=BC, BKT=BKT, PREC=intra_bwd_precision(q.dtype, dev),
    )
    dz = torch.empty_like(z)
    dA_part = torch.empty(NKG, NT, HV, device=dev, dtype=torch.float32)
    dbias_part = torch.empty(NT, HV, K, device=dev, dtype=torch.float32)
    kda_gate_bwd_kernel[(NKG, NT, HV)](
        z, A_log, dt_bias, dG, dgx, dz, dA_part, dbias_part, cu_seqlens, chunk_indices, lower_bound,
        HV=HV, K=K, HAS_BIAS=dt_bias is not None, BT=BT, BKT=BKG, num_warps=4,
    )
    dq, dk, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(beta)
    BR = 16 if dev.type != "cuda" else 32
    kda_qk_norm_bwd_kernel[(triton.cdiv(T, BR), H)](
        q, k, beta, dqs, dkn, dbeta_part, db, dq, dk, dbeta, T, scale, H=H, HV=HV, K=K, NKT=NKT, BR=BR, BK=BK,
        num_warps=8,
    )
    return dq, dk, dz, dbeta, dA_part.view(NKG * NT, HV), dbias_part


def intra_bwd_precision(dtype: torch.dtype, device: torch.device) -> str:
    """The intra backward's float32 products: tf32 when the inputs are 16-bit (measured on an H200 at
    B1 T8192 H16: 1.49 ms vs 1.76 ms with bf16x3; bf16 vs float64 gradients stay <= 3.7e-3, while bf16
    operands gave ddt_bias 1.96e-2), the float32 emulation for float32 inputs."""
    return dot_precision(torch.float32, device) if dtype == torch.float32 else "tf32"
