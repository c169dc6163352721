"""The depth-softmax mixing as a memory-efficient autograd function (AttnRes paper, Sec. 3-4).

One AttnRes read over S = n + 1 sources (n stored block representations plus an optional
running partial sum), per token (x = one row of d values):

    r_i = (mean(v_i^2) + eps)^-1/2,   s_i = r_i w^T v_i,   alpha = softmax(s),   h = sum_i alpha_i v_i

Backward, with g = dL/dh (derived in book/04_attnres):

    a_i  = g^T v_i,        ds_i = alpha_i (a_i - sum_j alpha_j a_j)
    dv_i = alpha_i g + r_i ds_i (w - (s_i r_i / d) v_i),        dw = sum_tokens sum_i ds_i r_i v_i

``depth_mix`` saves only w, the partial sum and the per-token log-sum-exp (4 bytes per token);
the block representations are read from one shared buffer that is written once per block, and the
keys, logits and weights are recomputed in backward. Two backends compute the same thing:
"torch" (below) and "triton" (``k3lab.kernels.attnres``).
"""
from __future__ import annotations

import functools

import torch

BACKENDS = ("torch", "triton")


def _no_autocast(fn):
    """Run ``fn`` with autocast off (the mixing is float32 by definition), on buf's device type."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        buf = args[1] if fn.__name__.startswith("mix_bwd") else args[0]
        with torch.autocast(buf.device.type, enabled=False):
            return fn(*args, **kwargs)

    return wrapped


@_no_autocast
def mix_fwd_torch(buf: torch.Tensor, n: int, partial: torch.Tensor | None, w: torch.Tensor, eps: float):
    """Forward of the mixing in PyTorch.

    Args:
        buf (Tensor): [S_max, ..., d]; slots 0..n-1 are the stored sources.
        n (int): number of stored sources read, 1 <= n <= S_max.
        partial (Tensor | None): [..., d] the running partial sum (one more source), or None.
        w (Tensor): [d] pseudo-query.
        eps (float): RMSNorm eps.

    Returns:
        (h, lse): h [..., d] in buf's dtype; lse [...] float32 (float64 for float64 inputs), the
        log-sum-exp of the logits.
    """
    dt = torch.float64 if buf.dtype == torch.float64 else torch.float32
    V = buf[:n].to(dt)
    wd = w.to(dt)
    s = (V @ wd) * torch.rsqrt(V.pow(2).mean(-1) + eps)
    if partial is not None:
        P = partial.to(dt)
        sp = (P @ wd) * torch.rsqrt(P.pow(2).mean(-1) + eps)
        s = torch.cat([s, sp[None]])
    lse = torch.logsumexp(s, 0)
    alpha = torch.exp(s - lse)
    h = torch.einsum("n...,n...d->...d", alpha[:n], V)
    if partial is not None:
        h = h + alpha[n, ..., None] * P
    return h.to(buf.dtype), lse


@_no_autocast
def mix_bwd_torch(dh: torch.Tensor, buf: torch.Tensor, n: int, partial: torch.Tensor | None, w: torch.Tensor,
                  lse: torch.Tensor, eps: float):
    """Backward of the mixing in PyTorch, by the closed form in the module docstring.

    Args:
        dh (Tensor): [..., d] gradient of h; the others as in ``mix_fwd_torch`` (lse from it).

    Returns:
        (dbuf, dpartial, dw): dbuf [n, ..., d] in buf's dtype, dpartial [..., d] or None, dw [d] in
        w's dtype.
    """
    dt = lse.dtype
    src = [buf[:n].to(dt)] + ([partial.to(dt)[None]] if partial is not None else [])
    V = torch.cat(src) if len(src) > 1 else src[0]
    g, wd, d = dh.to(dt), w.to(dt), V.shape[-1]
    r = torch.rsqrt(V.pow(2).mean(-1) + eps)
    s = (V @ wd) * r
    alpha = torch.exp(s - lse)
    a = (V * g).sum(-1)
    ds = alpha * (a - (alpha * a).sum(0))
    dV = alpha[..., None] * g + (r * ds)[..., None] * (wd - (s * r / d)[..., None] * V)
    dw = torch.einsum("s...,s...d->d", ds * r, V)
    dpartial = dV[n].to(partial.dtype) if partial is not None else None
    return dV[:n].to(buf.dtype), dpartial, dw.to(w.dtype)


def _kernels(backend: str):
    if backend == "torch":
        return mix_fwd_torch, mix_bwd_torch
    from k3lab.kernels.attnres import mix_bwd, mix_fwd

    return mix_fwd, mix_bwd


class _DepthMix(torch.autograd.Function):
    """Forward: the mixing; saves w, partial, lse and a reference to the shared buffer.
    Backward: recomputes keys/logits/weights from the buffer and returns gradients for w, the
    partial sum and each block tensor (the buffer only holds their values)."""

    @staticmethod
    def forward(ctx, w, partial, buf, n, eps, backend, *blocks):
        fwd, _ = _kernels(backend)
        h, lse = fwd(buf, n, partial, w, eps)
        ctx.save_for_backward(w, partial, lse)
        # The buffer is written in place once per block, after this read, in slots >= n only, so
        # it is kept as an attribute: save_for_backward's version check would reject it.
        ctx.buf, ctx.n, ctx.eps, ctx.backend = buf, n, eps, backend
        return h

    @staticmethod
    def backward(ctx, dh):
        w, partial, lse = ctx.saved_tensors
        _, bwd = _kernels(ctx.backend)
        dbuf, dpartial, dw = bwd(dh.contiguous(), ctx.buf, ctx.n, partial, w, lse, ctx.eps)
        return (dw, dpartial, None, None, None, None, *dbuf.unbind(0))


def depth_mix(w: torch.Tensor, partial: torch.Tensor | None, buf: torch.Tensor, n: int,
              blocks: list[torch.Tensor], eps: float = 1e-6, backend: str = "torch") -> torch.Tensor:
    """One AttnRes read with recompute-in-backward (the memory-efficient training path).

    Args:
        w (Tensor): [d] pseudo-query (requires grad in training).
        partial (Tensor | None): [..., d] running partial sum of the current block, or None.
        buf (Tensor): [S_max, ..., d] contiguous, no grad; ``buf[i]`` holds the value of ``blocks[i]``.
        n (int): number of stored sources read (``len(blocks)``).
        blocks (list[Tensor]): the n block tensors [..., d] whose values ``buf[:n]`` holds; only used
            to route gradients back to them.
        eps (float): RMSNorm eps.
        backend (str): "torch" or "triton" (CUDA, or CPU under TRITON_INTERPRET=1).

    Returns:
        Tensor: h [..., d] in buf's dtype.

    Raises:
        ValueError: unknown backend, n != len(blocks), n out of range, shape mismatch, buf not contiguous.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not (1 <= n <= buf.shape[0]) or len(blocks) != n:
        raise ValueError(f"need 1 <= n <= buf.shape[0]={buf.shape[0]} and len(blocks) == n, got n={n}, "
                         f"len(blocks)={len(blocks)}")
    if not buf.is_contiguous():
        raise ValueError("buf must be contiguous")
    shape = tuple(buf.shape[1:])
    if partial is not None and tuple(partial.shape) != shape:
        raise ValueError(f"partial must be {list(shape)}, got {list(partial.shape)}")
    if tuple(w.shape) != shape[-1:]:
        raise ValueError(f"w must be [d] = [{shape[-1]}], got {list(w.shape)}")
    if partial is not None:
        partial = partial.contiguous()
    return _DepthMix.apply(w, partial, buf, n, eps, backend, *blocks)
