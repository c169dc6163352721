"""Block AttnRes training path: two-phase reads, recompute in backward (AttnRes paper, Sec. 4).

Per block n (S sublayers, completed blocks b_0..b_{n-1} in one buffer [N + 1, B, T, d]; each block's
logits for all L + 1 queries and its r formed when it was stored, in tables [L + 1, N + 1, B, T] and
[N + 1, B, T]):

1. ``_Phase1``, once at the block's start: one pass over the n blocks computes every sublayer's
   inter-block part o_k and its log-sum-exp (``k3lab.attnres.mix``) from the table's logits; o_0 is
   the first sublayer's input h_0. In backward, one batched pass adds all S reads' gradients into the
   blocks' gradient accumulator and gives the S queries' gradients, with the logits and r from the
   tables.
2. ``_AddMerge``, per later sublayer k: p_k = p_{k-1} + v_{k-1} (the partial sum) and
   h_k = merge(o_k, lse_k, p_k) in one pass; it saves p_k only (where the standard residual keeps
   its stream h_k). Its backward adds the merge's gradient to p_k's incoming one and leaves
   dO_k = dL/do_k in the block's slot for phase 1's backward.
3. ``_StoreSum``: the block's last sum p + v goes straight into its buffer slot, and its logits into
   the tables, in one pass.

Nothing [B, T, d]-sized per sublayer is kept beyond p_k: the o_k are dropped at the block's end and
recomputed by one phase-1 pass when backward reaches the block, and the sublayers' saved inputs h_k
are swapped by saved-tensor hooks for recipes that rebuild them from o_k, lse_k and p_k. Saved
activations are thus the standard residual's plus the buffer (N + 1 vectors per token) and the
lse (4 bytes per token per sublayer) and the tables (4 (L + 2)(N + 1) bytes per token).

The blocks' gradients never pass through autograd per read: phase 1's backward adds them into one
accumulator (``DepthBuffer``), the final aggregation (the first read that backward meets) writing
it, the others adding; a stored block's node (whose backward autograd runs after all its reads')
hands its slot on. The nodes' contexts reference the buffer and the blocks, never the graph's
tensors: a reference cycle through autograd's C++ graph could not be collected.

The path is differentiable once: its backwards write into shared buffers in place and keep no tensors
that a second derivative could be traced through, so a backward with ``create_graph=True`` raises
RuntimeError (``differentiable_once(create_graph=False)``) rather than return gradients whose
second-order terms would be silently missing. Gradient penalties and other second-order uses need the
naive path.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from k3lab.attnres.mix import BACKENDS, kernels
from k3lab.attnres.naive import _check_inputs, block_sizes
from k3lab.autograd import differentiable_once


def check_buffer_dtype(buffer_dtype) -> None:
    """Raises ValueError unless ``buffer_dtype`` is a floating-point torch.dtype or None."""
    if buffer_dtype is not None and not (isinstance(buffer_dtype, torch.dtype) and buffer_dtype.is_floating_point):
        raise ValueError(f"buffer_dtype must be a floating-point dtype or None, got {buffer_dtype}")


class DepthBuffer:
    """The block representations of one forward pass [N + 1, B, T, d], their logits for every query
    [L + 1, N + 1, B, T], their r = (mean(b^2) + eps)^-1/2 [N + 1, B, T] and their gradient sum.

    Args:
        like (Tensor): [B, T, d] (shape, device, gradient dtype).
        slots (int): N + 1.
        queries (Tensor): [L + 1, d] all pseudo-queries (detached).
        eps (float): RMSNorm eps of the keys.
        backend (str): "torch" or "triton" (its ``store_block`` fills the tables; float64 ones for a
            float64 buffer on "torch", float32 otherwise).
        dtype (torch.dtype | None): storage dtype of the buffer, default ``like``'s.
    """

    def __init__(self, like: torch.Tensor, slots: int, queries: torch.Tensor, eps: float, backend: str,
                 dtype: torch.dtype | None = None):
        self.buf = torch.empty((slots, *like.shape), dtype=dtype or like.dtype, device=like.device)
        score_dtype = torch.float64 if self.buf.dtype == torch.float64 and backend == "torch" else torch.float32
        self.scores = torch.empty((queries.shape[0], slots, *like.shape[:-1]), dtype=score_dtype, device=like.device)
        self.rstd = torch.empty((slots, *like.shape[:-1]), dtype=score_dtype, device=like.device)
        self.queries, self.eps, self.store_block = queries, eps, kernels(backend)[0]
        self.grad_dtype, self.n, self.acc = like.dtype, 0, None

    def put(self, a: torch.Tensor, b: torch.Tensor | None = None) -> None:
        """The next slot = a + b (or a), its logits for every query and its r."""
        self.store_block(self.buf[self.n], a, b, self.queries, self.eps, self.scores[:, self.n], self.rstd[self.n])
        self.n += 1

    def accumulator(self, overwrite: bool) -> torch.Tensor:
        """[N + 1, B, T, d] in the gradient dtype; zeros when first made by a read that adds."""
        if self.acc is None:
            self.acc = (torch.empty if overwrite else torch.zeros)(
                self.buf.shape, dtype=self.grad_dtype, device=self.buf.device)
        return self.acc


class _StoreFirst(torch.autograd.Function):
    """Forward: h0 into slot 0; returns an empty tap. Backward: slot 0's gradient sum."""

    @staticmethod
    def forward(ctx, h0, store):
        store.put(h0.detach())
        ctx.store = store
        return h0.new_empty(0)

    @staticmethod
    @differentiable_once(create_graph=False)
    def backward(ctx, _):
        # A copy: h0 may be a leaf whose .grad would otherwise keep the whole accumulator alive.
        acc = ctx.store.acc
        return (None if acc is None else acc[0].clone()), None


class _StoreSum(torch.autograd.Function):
    """Forward: the block's representation prev + v (or v) into the next slot; returns an empty tap.
    Backward: the slot's gradient sum, for prev and v."""

    @staticmethod
    def forward(ctx, prev, v, store):
        ctx.store, ctx.i, ctx.has_prev, ctx.v_dtype = store, store.n, prev is not None, v.dtype
        if prev is None:
            store.put(v.detach())
        else:
            store.put(prev.detach(), v.detach())
        return v.new_empty(0)

    @staticmethod
    @differentiable_once(create_graph=False)
    def backward(ctx, _):
        # No later backward writes this slot: its view is handed on without a copy.
        g = ctx.store.acc[ctx.i]
        return (g if ctx.has_prev else None), g.to(ctx.v_dtype), None


class _Block:
    """One block's reads: phase 1 over ``store.buf[:n]`` for queries ``store.queries[first:first + S]``,
    the merges' inputs, and the slots where the merges' backward leaves dO_k and delta_k for phase 1's
    backward."""

    def __init__(self, store: DepthBuffer, n: int, first: int, S: int, backend: str, o_dtype: torch.dtype,
                 last: bool):
        self.store, self.n, self.o_dtype, self.last = store, n, o_dtype, last
        self.W, self.scores, self.eps = store.queries[first:first + S], store.scores[first:first + S, :n], store.eps
        self.rstd = store.rstd[:n]
        _, self.phase1_fwd, self.phase1_bwd, self.merge_fwd, self.merge_bwd = kernels(backend)
        self.S = S
        self.h = self.o = self.lse = self.dO = self.delta = None

    def inter(self):
        """(h_0, o [S - 1, ...]): kept during the block's forward, recomputed once in backward."""
        if self.h is None:
            with torch.no_grad():
                self.h, self.o, lse = self.phase1_fwd(self.store.buf, self.n, self.W, self.eps,
                                                     self.store.grad_dtype, self.o_dtype, scores=self.scores)
            if self.lse is None:
                self.lse = lse
        return self.h, self.o

    def end_forward(self) -> None:
        self.h = self.o = None

    def merge(self, k: int, w: torch.Tensor, p=None, prev=None, v=None):
        return self.merge_fwd(p, self.inter()[1][k - 1], self.lse[k], w, self.eps, prev=prev, v=v,
                              dtype=self.store.grad_dtype)

    def rebuild(self, k: int, p: torch.Tensor | None = None, w: torch.Tensor | None = None) -> torch.Tensor:
        """Sublayer k's input h_k, recomputed (for the saved-tensor hooks)."""
        with torch.no_grad():
            return self.inter()[0] if k == 0 else self.merge(k, w, p=p)[1]

    def merge_backward(self, k, dh, dp_in, p, w, v_dtype):
        if self.dO is None:
            # The gradients of the o_k in the o_k's own dtype (bf16 under autocast): phase 1's backward
            # reads them once, in float32 arithmetic.
            self.dO = torch.empty((self.S - 1, *p.shape), dtype=self.o_dtype, device=p.device)
            self.delta = torch.empty_like(self.lse)
        return self.merge_bwd(dh, dp_in, p, self.inter()[1][k - 1], self.lse[k], w, self.eps, self.dO[k - 1],
                              self.delta[k], v_dtype, need_dp=k > 1)

    def backward(self, dh: torch.Tensor) -> torch.Tensor:
        """Phase 1's backward, with h_0 as recomputed (never the forward's output, which the caller may
        have changed in place)."""
        acc = self.store.accumulator(overwrite=self.last)
        dW = self.phase1_bwd(self.store.buf, self.n, self.W, self.lse, self.inter()[0], dh, self.dO, self.delta,
                             self.eps, acc, accumulate=not self.last, scores=self.scores, rstd=self.rstd)
        self.h = self.o = self.dO = self.delta = None
        return dW


class _Phase1(torch.autograd.Function):
    """Forward: phase 1 of ``blk``; returns h_0 and S - 1 empty taps (one per merge), the o_k
    staying in ``blk``. Backward: phase 1's backward (blocks' gradients into the accumulator; dW)."""

    @staticmethod
    def forward(ctx, W, blk, *taps):
        h, _ = blk.inter()
        ctx.blk, ctx.taps = blk, [(t.dtype, t.device) for t in taps]
        return (h, *(h.new_empty(0) for _ in range(blk.S - 1)))

    @staticmethod
    @differentiable_once(create_graph=False)
    def backward(ctx, dh, *_):
        dW = ctx.blk.backward(dh)
        return (dW, None, *(torch.empty(0, dtype=dt, device=dev) for dt, dev in ctx.taps))


class _AddMerge(torch.autograd.Function):
    """Forward: p = prev + v (or v) and h = merge(o_k, lse_k, p) in one pass; saves p.
    Backward: the total gradient of p (for prev and v) and of w; dO_k, delta_k into ``blk``'s slots."""

    @staticmethod
    def forward(ctx, prev, v, w, blk, k, tap):
        p, h = blk.merge(k, w, prev=prev, v=v)
        ctx.save_for_backward(p, w)
        ctx.blk, ctx.k, ctx.has_prev, ctx.v_dtype, ctx.tap = blk, k, prev is not None, v.dtype, (tap.dtype, tap.device)
        return p, h

    @staticmethod
    @differentiable_once(create_graph=False)
    def backward(ctx, dp_in, dh):
        p, w = ctx.saved_tensors
        dp, dv, dw = ctx.blk.merge_backward(ctx.k, dh, dp_in, p, w, ctx.v_dtype)
        return (dp if ctx.has_prev else None), dv, dw, None, None, torch.empty(0, dtype=ctx.tap[0], device=ctx.tap[1])


class _RecomputeInput:
    """Saved-tensor hooks that replace a sublayer's saved copy of its input h (or a view of it) by a
    recipe, and rebuild it in backward. One rebuilt h is cached at a time: backward visits one
    sublayer's nodes together.

    Under saved-tensor hooks autograd no longer checks that a saved tensor was left unchanged; the hooks
    do it as autograd would (same error) for every tensor they keep. An h saved as a recipe is exempt:
    changed in place after the save it raises nothing (autograd without the hooks would), and backward
    uses the h as it was saved, so the gradients stay right. An h that its sublayer changed in place
    before a save is saved as it is then, not rebuilt (the recipe gives the h the sublayer received)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.h, self.recipe, self.key, self.version = None, None, None, None
        self.cache_key, self.cache = None, None

    def watch(self, h: torch.Tensor, recipe, key: int) -> None:
        # Disabled, nothing is saved (and an inference-mode h has no version counter to read).
        if self.enabled:
            self.h, self.recipe, self.key, self.version = h, recipe, key, h._version

    def unwatch(self) -> None:
        self.h, self.recipe, self.key, self.version = None, None, None, None

    def pack(self, t: torch.Tensor):
        h = self.h
        if (h is not None and t.dtype == h.dtype and t.device == h.device and t._version == self.version
                and t.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()):
            return (self.key, self.recipe, t.shape, t.stride(), t.storage_offset())
        # Detached (same storage and version counter): a saved output returned as itself would reference its
        # own node through its grad_fn, a cycle that keeps a graph never run backward (and its buffer) alive.
        return t.detach(), t._version

    def unpack(self, packed):
        if isinstance(packed[0], torch.Tensor):  # (tensor, version), else a recipe
            t, version = packed
            if t._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: a saved tensor of shape {list(t.shape)} is at version {t._version}; expected "
                    f"version {version} instead (Block AttnRes memory path)")
            return t
        key, recipe, shape, stride, offset = packed
        if self.cache_key != key:
            self.cache_key, self.cache = key, recipe()
        return self.cache.as_strided(shape, stride, offset)


def block_attnres_train(h0: torch.Tensor, sublayers, queries: torch.Tensor, n_blocks: int, eps: float = 1e-6,
                        backend: str = "torch", recompute_input: bool = True,
                        buffer_dtype: torch.dtype | None = None, *, check_values: bool = True) -> torch.Tensor:
    """Block AttnRes forward for training, two-phase with recompute in backward (module docstring).

    Args:
        h0 (Tensor): [B, T, d] embedding output; sublayers: L callables [B, T, d] -> [B, T, d];
            queries (Tensor): [L + 1, d]; n_blocks (int | list[int]): N in [1, L] or the block
            sizes (``block_sizes``); eps (float): RMSNorm eps.
        backend (str): "torch" or "triton" (``k3lab.kernels.attnres``; on CPU under TRITON_INTERPRET=1).
        recompute_input (bool): rebuild each sublayer's saved input in backward (default) instead of
            keeping it (one more d-vector per token per sublayer). Ignored under ``torch.compile``,
            which does not carry the saved-tensor hooks that do it: compiled, the inputs are kept.
        buffer_dtype (torch.dtype | None): storage dtype of the block buffer, default h0's.
        check_values (bool): reject NaN/inf in h0 or queries and an h0 beyond RMSNorm's range (one host
            sync per forward; benchmarks may pass False).

    Returns:
        Tensor: [B, T, d] in h0's dtype; equal to ``naive_block_attnres`` in value and gradients
        (up to float rounding; under autocast the o_k and their gradients are stored in the autocast
        dtype, and phase 1's backward takes its offsets delta_k from the o_k and h_0 as stored, so with
        bf16 o_k or a bf16 h0 the gradients carry that rounding).
        Differentiable once: a backward with ``create_graph=True`` raises RuntimeError (use the naive path).

    Raises:
        ValueError: N < 1 or N > L or bad block sizes, h0 or queries not a floating-point tensor, queries not [L + 1, d],
            h0 not [B, T, d], eps not a finite number > 0, unknown backend, buffer_dtype not a
            floating-point dtype or None, a sublayer returning anything but a tensor of h0's shape; with
            ``check_values``, NaN/inf in h0 or queries or an h0 beyond RMSNorm's range.
        RuntimeError: in backward, under ``create_graph=True``.
    """
    L = len(sublayers)
    sizes = block_sizes(L, n_blocks)
    sublayers = _check_inputs(h0, sublayers, queries, eps, check_values)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    dev = h0.device.type
    o_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h0.dtype
    check_buffer_dtype(buffer_dtype)
    store = DepthBuffer(h0, len(sizes) + 1, queries.detach(), eps, backend, buffer_dtype)
    taps = [_StoreFirst.apply(h0, store)]
    Q, layer = queries, 0
    # torch.compile does not carry saved-tensor hooks through: h0's gradient came back None. Compiled,
    # the inputs are kept (recompute_input=False), which gives the eager gradients. Without autograd
    # nothing is saved.
    recompute_input = recompute_input and torch.is_grad_enabled() and not torch.compiler.is_compiling()
    hooks = _RecomputeInput(recompute_input)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack) if recompute_input \
            else contextlib.nullcontext():
        for size in sizes:
            blk = _Block(store, len(taps), layer, size, backend, o_dtype, last=False)
            h, *merge_taps = _Phase1.apply(Q[layer: layer + size], blk, *taps)
            hooks.watch(h, functools.partial(blk.rebuild, 0), layer)
            v, p = sublayers[layer](h), None
            hooks.unwatch()
            for k in range(1, size):
                p, h = _AddMerge.apply(p, v, Q[layer + k], blk, k, merge_taps[k - 1])
                hooks.watch(h, functools.partial(blk.rebuild, k, p.detach(), Q[layer + k].detach()), layer + k)
                v = sublayers[layer + k](h)
                hooks.unwatch()
            blk.end_forward()
            taps.append(_StoreSum.apply(p, v, store))
            layer += size
        final = _Block(store, len(taps), L, 1, backend, o_dtype, last=True)
        out = _Phase1.apply(Q[L:], final, *taps)[0]
        final.end_forward()
    return out
