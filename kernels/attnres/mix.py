"""Triton kernels for the AttnRes depth-softmax mixing (forward and backward).

The math is in ``k3lab.attnres.mix`` (same arguments as ``mix_fwd_torch`` / ``mix_bwd_torch``).
Both kernels are memory-bound: forward reads each source row once (an online softmax over depth
keeps one [BLOCK_M, d] accumulator), backward reads each source row twice (pass 1 for
sum_j alpha_j g^T v_j, pass 2 for the gradients) and writes each source's gradient once.

On a CPU-only machine ``k3lab.setup()`` must run before this module is imported (TRITON_INTERPRET=1);
the interpreter cannot do bf16 arithmetic, so every block is upcast to float32 right after its load.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _score(b_v, b_w, D, eps):
    # r = rsqrt(mean(v^2) + eps), s = r * w^T v, for each row of b_v [BLOCK_M, BLOCK_D].
    b_r = 1.0 / tl.sqrt(tl.sum(b_v * b_v, axis=1) / D + eps)
    return b_r, tl.sum(b_v * b_w[None, :], axis=1) * b_r


@triton.jit
def _online_softmax_step(b_v, b_w, b_max, b_sum, b_acc, D, eps):
    """Fold one source [BLOCK_M, BLOCK_D] into the running (max, sum, weighted sum) of the depth softmax."""
    b_r, b_s = _score(b_v, b_w, D, eps)
    b_new = tl.maximum(b_max, b_s)
    b_scale, b_p = tl.exp(b_max - b_new), tl.exp(b_s - b_new)
    return b_new, b_sum * b_scale + b_p, b_acc * b_scale[:, None] + b_p[:, None] * b_v


@triton.jit
def attnres_mix_fwd_kernel(
    buf,  # [S_max, M, D] stored sources; slots 0..n_src-1 are read
    partial,  # [M, D] running partial sum (read when HAS_PARTIAL)
    w,  # [D] pseudo-query
    h,  # [M, D] output, buf's dtype
    lse,  # [M] float32 output: log-sum-exp of the logits
    M, D, n_src, stride_s,  # tokens, width, stored sources read, elements between slots
    eps,
    HAS_PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m, m_d = o_m < M, o_d < D
    m_md = m_m[:, None] & m_d[None, :]
    o_md = o_m[:, None].to(tl.int64) * D + o_d[None, :]
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)

    b_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_sum = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    p_src = buf
    for _ in range(0, n_src):
        b_v = tl.load(p_src + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_max, b_sum, b_acc = _online_softmax_step(b_v, b_w, b_max, b_sum, b_acc, D, eps)
        p_src += stride_s
    if HAS_PARTIAL:
        b_v = tl.load(partial + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_max, b_sum, b_acc = _online_softmax_step(b_v, b_w, b_max, b_sum, b_acc, D, eps)
    tl.store(h + o_md, (b_acc / b_sum[:, None]).to(h.dtype.element_ty), mask=m_md)
    tl.store(lse + o_m, b_max + tl.log(b_sum), mask=m_m)


@triton.jit
def _source_grad(b_v, b_g, b_w, b_lse, b_dd, D, eps):
    # alpha, ds and dv of one source (see k3lab.attnres.mix), and its contribution ds*r*v to dw.
    b_r, b_s = _score(b_v, b_w, D, eps)
    b_alpha = tl.exp(b_s - b_lse)
    b_ds = b_alpha * (tl.sum(b_g * b_v, axis=1) - b_dd)
    b_dv = b_alpha[:, None] * b_g + (b_r * b_ds)[:, None] * (b_w[None, :] - (b_s * b_r / D)[:, None] * b_v)
    return b_dv, tl.sum((b_ds * b_r)[:, None] * b_v, axis=0)


@triton.jit
def attnres_mix_bwd_kernel(
    buf,  # [S_max, M, D] stored sources
    partial,  # [M, D] partial sum (read when HAS_PARTIAL)
    w,  # [D]
    lse,  # [M] float32 from the forward
    dh,  # [M, D] gradient of the output
    dbuf,  # [n_src, M, D] output: gradients of the stored sources (ACCUMULATE: added in place)
    dpartial,  # [M, D] output: gradient of the partial sum (when HAS_PARTIAL)
    dw,  # [n_programs, D] float32 output: per-program partial sums of dw
    M, D, n_src, stride_s,
    eps,
    HAS_PARTIAL: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Persistent: program i_p handles token tiles i_p, i_p + n_p, ... and keeps its dw in registers.
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BLOCK_D], tl.float32)
    for i_t in range(i_p, tl.cdiv(M, BLOCK_M), n_p):
        o_m = i_t * BLOCK_M + tl.arange(0, BLOCK_M)
        m_m = o_m < M
        m_md = m_m[:, None] & m_d[None, :]
        o_md = o_m[:, None].to(tl.int64) * D + o_d[None, :]
        b_g = tl.load(dh + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_lse = tl.load(lse + o_m, mask=m_m, other=0.0)
        # Pass 1: dd = sum_j alpha_j g^T v_j = g^T h.
        b_dd = tl.zeros([BLOCK_M], tl.float32)
        p_src = buf
        for _ in range(0, n_src):
            b_v = tl.load(p_src + o_md, mask=m_md, other=0.0).to(tl.float32)
            b_r, b_s = _score(b_v, b_w, D, eps)
            b_dd += tl.exp(b_s - b_lse) * tl.sum(b_g * b_v, axis=1)
            p_src += stride_s
        if HAS_PARTIAL:
            b_v = tl.load(partial + o_md, mask=m_md, other=0.0).to(tl.float32)
            b_r, b_s = _score(b_v, b_w, D, eps)
            b_dd += tl.exp(b_s - b_lse) * tl.sum(b_g * b_v, axis=1)
        # Pass 2: the gradients.
        p_src, p_dsrc = buf, dbuf
        for _ in range(0, n_src):
            b_v = tl.load(p_src + o_md, mask=m_md, other=0.0).to(tl.float32)
            b_dv, b_dw_i = _source_grad(b_v, b_g, b_w, b_lse, b_dd, D, eps)
            if ACCUMULATE:
                b_dv += tl.load(p_dsrc + o_md, mask=m_md, other=0.0).to(tl.float32)
            tl.store(p_dsrc + o_md, b_dv.to(dbuf.dtype.element_ty), mask=m_md)
            b_dw += b_dw_i
            p_src += stride_s
            p_dsrc += M * D
        if HAS_PARTIAL:
            b_v = tl.load(partial + o_md, mask=m_md, other=0.0).to(tl.float32)
            b_dv, b_dw_i = _source_grad(b_v, b_g, b_w, b_lse, b_dd, D, eps)
            tl.store(dpartial + o_md, b_dv.to(dpartial.dtype.element_ty), mask=m_md)
            b_dw += b_dw_i
    tl.store(dw + i_p * D + o_d, b_dw, mask=m_d)


def _blocks(D: int, elems: int) -> tuple[int, int, int]:
    block_d = triton.next_power_of_2(D)
    block_m = max(1, min(16, elems // block_d))
    num_warps = 4 if block_m * block_d <= 4096 else 8
    return block_m, block_d, num_warps


def _check(buf: torch.Tensor, n: int, partial: torch.Tensor | None, w: torch.Tensor) -> None:
    if not buf.is_contiguous() or (partial is not None and not partial.is_contiguous()):
        raise ValueError("buf and partial must be contiguous")
    if not 1 <= n <= buf.shape[0]:
        raise ValueError(f"n must be in [1, buf.shape[0]={buf.shape[0]}], got {n}")
    if w.shape != buf.shape[-1:] or (partial is not None and partial.shape != buf.shape[1:]):
        raise ValueError(f"w must be [d] and partial {list(buf.shape[1:])} for buf {list(buf.shape)}, got "
                         f"w {list(w.shape)}, partial {None if partial is None else list(partial.shape)}")


def mix_fwd(buf: torch.Tensor, n: int, partial: torch.Tensor | None, w: torch.Tensor, eps: float,
            out_dtype: torch.dtype | None = None):
    """Triton forward of the depth mixing; arguments and returns as ``k3lab.attnres.mix.mix_fwd_torch``
    (buf [S_max, ..., d] contiguous; returns h [..., d] in ``out_dtype``, default buf's, and lse
    [...] float32).

    Raises:
        ValueError: non-contiguous inputs, n out of range, shape mismatch.
    """
    _check(buf, n, partial, w)
    D = buf.shape[-1]
    M = buf[0].numel() // D
    h = torch.empty(buf.shape[1:], dtype=out_dtype or buf.dtype, device=buf.device)
    lse = torch.empty(buf.shape[1:-1], dtype=torch.float32, device=buf.device)
    block_m, block_d, num_warps = _blocks(D, 4096)
    grid = (triton.cdiv(M, block_m),)
    attnres_mix_fwd_kernel[grid](
        buf, partial if partial is not None else buf, w.contiguous(), h, lse, M, D, n, M * D, eps,
        HAS_PARTIAL=partial is not None, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
    )
    return h, lse


def mix_bwd(dh: torch.Tensor, buf: torch.Tensor, n: int, partial: torch.Tensor | None, w: torch.Tensor,
            lse: torch.Tensor, eps: float, dacc: torch.Tensor | None = None):
    """Triton backward of the depth mixing; as ``k3lab.attnres.mix.mix_bwd_torch``: returns
    (dbuf [n, ..., d] in buf's dtype, dpartial [..., d] or None, dw [d] in w's dtype); with ``dacc``
    ([>= n, ..., d] contiguous) the stored sources' gradients are added into ``dacc[:n]`` in place
    and ``dacc[:n]`` is returned as dbuf.

    Raises:
        ValueError: non-contiguous inputs, n out of range, shape mismatch.
    """
    _check(buf, n, partial, w)
    D = buf.shape[-1]
    M = buf[0].numel() // D
    if dacc is not None:
        if not dacc.is_contiguous() or dacc.shape[1:] != buf.shape[1:] or dacc.shape[0] < n:
            raise ValueError(f"dacc must be contiguous [>= {n}, {list(buf.shape[1:])}], got {list(dacc.shape)}")
        dbuf = dacc
    else:
        dbuf = torch.empty((n, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
    dpartial = torch.empty_like(partial) if partial is not None else None
    block_m, block_d, num_warps = _blocks(D, 2048)
    n_tiles = triton.cdiv(M, block_m)
    n_prog = min(n_tiles, 4 if INTERPRET else 4 * torch.cuda.get_device_properties(buf.device).multi_processor_count)
    dw = torch.empty((n_prog, D), dtype=torch.float32, device=buf.device)
    attnres_mix_bwd_kernel[(n_prog,)](
        buf, partial if partial is not None else buf, w.contiguous(), lse.contiguous(), dh.contiguous(),
        dbuf, dpartial if dpartial is not None else dbuf, dw, M, D, n, M * D, eps,
        HAS_PARTIAL=partial is not None, ACCUMULATE=dacc is not None, BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return dbuf[:n], dpartial, dw.sum(0).to(w.dtype)
