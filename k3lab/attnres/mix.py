"""The depth-softmax mixing as a memory-efficient autograd function (AttnRes paper, Sec. 3-4).

One AttnRes read over S = n + 1 sources (n stored block representations plus an optional
running partial sum), per token (x = one row of d values):

    r_i = (mean(v_i^2) + eps)^-1/2,   s_i = r_i w^T v_i,   alpha = softmax(s),   h = sum_i alpha_i v_i

Backward, with g = dL/dh (derived in book/04_attnres):

    a_i  = g^T v_i,        ds_i = alpha_i (a_i - sum_j alpha_j a_j)
    dv_i = alpha_i g + r_i ds_i (w - (s_i r_i / d) v_i),        dw = sum_tokens sum_i ds_i r_i v_i

``read`` saves only w, the partial sum and the per-token log-sum-exp (4 bytes per token); the
block representations are read from one shared ``DepthBuffer`` written once per block, the keys,
logits and weights are recomputed in backward, and the blocks' gradients are summed in one
accumulator by the backward kernel. Two backends compute the same thing:
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
def mix_fwd_torch(buf: torch.Tensor, n: int, partial: torch.Tensor | None, w: torch.Tensor, eps: float,
                  out_dtype: torch.dtype | None = None):
    """Forward of the mixing in PyTorch.

    Args:
        buf (Tensor): [S_max, ..., d]; slots 0..n-1 are the stored sources.
        n (int): number of stored sources read, 1 <= n <= S_max.
        partial (Tensor | None): [..., d] the running partial sum (one more source), or None.
        w (Tensor): [d] pseudo-query.
        eps (float): RMSNorm eps.
        out_dtype (torch.dtype | None): dtype of h, default buf's.

    Returns:
        (h, lse): h [..., d] in ``out_dtype``; lse [...] float32 (float64 for float64 inputs), the
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
    return h.to(out_dtype or buf.dtype), lse


@_no_autocast
def mix_bwd_torch(dh: torch.Tensor, buf: torch.Tensor, n: int, partial: torch.Tensor | None, w: torch.Tensor,
                  lse: torch.Tensor, eps: float, dacc: torch.Tensor | None = None):
    """Backward of the mixing in PyTorch, by the closed form in the module docstring.

    Args:
        dh (Tensor): [..., d] gradient of h; the others as in ``mix_fwd_torch`` (lse from it).
        dacc (Tensor | None): [>= n, ..., d] accumulator: when given, the stored sources' gradients
            are added into ``dacc[:n]`` in place and returned as ``dacc[:n]``.

    Returns:
        (dbuf, dpartial, dw): dbuf [n, ..., d] in buf's dtype (or ``dacc[:n]``), dpartial [..., d]
        in partial's dtype or None, dw [d] in w's dtype.
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
    if dacc is not None:
        dacc[:n] += dV[:n]
        return dacc[:n], dpartial, dw.to(w.dtype)
    return dV[:n].to(buf.dtype), dpartial, dw.to(w.dtype)


def _kernels(backend: str):
    if backend == "torch":
        return mix_fwd_torch, mix_bwd_torch
    from k3lab.kernels.attnres import mix_bwd, mix_fwd

    return mix_fwd, mix_bwd


class DepthBuffer:
    """The block representations of one forward pass, stored once and read by every later sublayer.

    ``store(block)`` copies a block's value into the next slot of one buffer [S_max, ..., d] and
    returns its *tap*, an empty tensor that reads take as input instead of the block. Reads never
    hand gradients to autograd per block: the backward kernel adds each read's source gradients
    straight into one accumulator [S_max, ..., d] (in the blocks' dtype), and a tap's backward,
    which autograd runs after every read of that block has run its backward, hands the slot's sum to
    the block. This saves writing one gradient tensor per read and source, and autograd's re-reads
    to sum them.

    Args:
        like (Tensor): [..., d] a block (gives shape, device, and the gradient dtype).
        slots (int): S_max, the number of blocks that will be stored.
        dtype (torch.dtype | None): storage dtype of the buffer, default ``like``'s (bf16 halves the
            traffic of every read; the mixing still computes in float32).
    """

    def __init__(self, like: torch.Tensor, slots: int, dtype: torch.dtype | None = None):
        self.buf = torch.empty((slots, *like.shape), dtype=dtype or like.dtype, device=like.device)
        self.grad = _Accumulator(self.buf.shape, like.dtype, like.device)
        self.grad_dtype, self.n, self.taps = like.dtype, 0, []

    def store(self, block: torch.Tensor) -> torch.Tensor:
        if self.n == self.buf.shape[0]:
            raise ValueError(f"DepthBuffer is full ({self.n} slots)")
        self.buf[self.n].copy_(block.detach())
        # The tap's node must not reference this object (it holds the taps): that would be a
        # reference cycle through autograd's C++ graph, which Python's GC cannot collect.
        self.taps.append(_Tap.apply(block, self.grad, self.n))
        self.n += 1
        return self.taps[-1]


class _Accumulator:
    """The blocks' gradient sum [S_max, ..., d], allocated (zeros) by the first backward read."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device, self.acc = shape, dtype, device, None

    def get(self) -> torch.Tensor:
        if self.acc is None:
            self.acc = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self.acc


class _Tap(torch.autograd.Function):
    """Forward: an empty tensor standing for block ``i``. Backward (after all its reads): the
    block's gradient, the accumulator's slot ``i``."""

    @staticmethod
    def forward(ctx, block, grad, i):
        ctx.grad, ctx.i = grad, i
        return block.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        acc = ctx.grad.acc
        return (None if acc is None else acc[ctx.i].clone()), None, None


class _DepthMix(torch.autograd.Function):
    """Forward: the mixing over the buffer's first n slots and the partial sum; saves w, partial, lse.
    Backward: recomputes keys/logits/weights from the buffer, adds the slots' gradients into the
    accumulator, returns the gradients of w and the partial sum."""

    @staticmethod
    def forward(ctx, w, partial, buf, grad, n, eps, backend, out_dtype, *taps):
        fwd, _ = _kernels(backend)
        h, lse = fwd(buf, n, partial, w, eps, out_dtype)
        ctx.save_for_backward(w, partial, lse)
        # The buffer is written in place once per block, after this read, in slots >= n only, so
        # it is kept as an attribute: save_for_backward's version check would reject it.
        ctx.buf, ctx.grad, ctx.n, ctx.eps, ctx.backend = buf, grad, n, eps, backend
        return h

    @staticmethod
    def backward(ctx, dh):
        w, partial, lse = ctx.saved_tensors
        _, bwd = _kernels(ctx.backend)
        _, dpartial, dw = bwd(dh.contiguous(), ctx.buf, ctx.n, partial, w, lse, ctx.eps, dacc=ctx.grad.get())
        return (dw, dpartial, None, None, None, None, None, None, *(dh.new_empty(0) for _ in range(ctx.n)))


def read(store: DepthBuffer, w: torch.Tensor, partial: torch.Tensor | None, eps: float = 1e-6,
         backend: str = "torch") -> torch.Tensor:
    """One AttnRes read of every block stored so far (plus ``partial``), recompute-in-backward.

    Args:
        store (DepthBuffer): holds the n >= 1 blocks read.
        w (Tensor): [d] pseudo-query.
        partial (Tensor | None): [..., d] running partial sum of the current block, or None.
        eps (float): RMSNorm eps.
        backend (str): "torch" or "triton".

    Returns:
        Tensor: h [..., d] in the blocks' dtype (``DepthBuffer.grad_dtype``).

    Raises:
        ValueError: unknown backend, empty store, shape mismatch.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if store.n < 1:
        raise ValueError("the DepthBuffer holds no block yet")
    shape = tuple(store.buf.shape[1:])
    if partial is not None and tuple(partial.shape) != shape:
        raise ValueError(f"partial must be {list(shape)}, got {list(partial.shape)}")
    if tuple(w.shape) != shape[-1:]:
        raise ValueError(f"w must be [d] = [{shape[-1]}], got {list(w.shape)}")
    if partial is not None:
        partial = partial.contiguous()
    return _DepthMix.apply(w, partial, store.buf, store.grad, store.n, eps, backend, store.grad_dtype, *store.taps)


def depth_mix(w: torch.Tensor, partial: torch.Tensor | None, blocks: list[torch.Tensor], eps: float = 1e-6,
              backend: str = "torch") -> torch.Tensor:
    """One stand-alone AttnRes read of ``blocks + [partial]`` through the recompute-in-backward
    path (``DepthBuffer`` + ``read``), differentiable with respect to all inputs.

    Args:
        w (Tensor): [d]; partial (Tensor | None): [..., d]; blocks (list[Tensor]): n >= 1 tensors
        [..., d]; eps (float); backend (str): "torch" or "triton".

    Returns:
        Tensor: h [..., d] in ``blocks[0]``'s dtype.

    Raises:
        ValueError: no blocks, unknown backend, shape mismatch.
    """
    if not blocks:
        raise ValueError("blocks must hold at least one tensor")
    store = DepthBuffer(blocks[0], len(blocks))
    for b in blocks:
        if b.shape != blocks[0].shape:
            raise ValueError(f"blocks must share one shape, got {list(b.shape)} and {list(blocks[0].shape)}")
        store.store(b)
    return read(store, w, partial, eps, backend)
