"""The depth-softmax mixing of Block AttnRes training, two-phase (AttnRes paper, Sec. 3-4), in PyTorch.

Inside block n, sublayer k (k = 0..S-1) reads the completed blocks b_0..b_{n-1} (n of them) and,
for k > 0, the partial sum p_k of its own block, with its pseudo-query w_k. Per token (rows of d):

    r_i = (mean(b_i^2) + eps)^-1/2,   s_{k,i} = r_i w_k^T b_i

The logits s_{l,i} of every query l against block i, and r_i, are formed once, when block i is
stored (``store_block``: b_i, its logits and r_i in one pass), and kept in tables [L + 1, N + 1, ...]
and [N + 1, ...].

Phase 1 (once per block, all S queries, one pass over the blocks, logits from the table): the
inter-block part

    lse_k = logsumexp_i s_{k,i},   a_{k,i} = exp(s_{k,i} - lse_k),   o_k = sum_i a_{k,i} b_i

Phase 2 (per sublayer k > 0): merge with the partial sum's logit s = r_p w_k^T p (online softmax):

    beta = sigmoid(s - lse_k),   h_k = (1 - beta) o_k + beta p          (k = 0: h_0 = o_0)

which is softmax over [b_0..b_{n-1}, p] exactly. Backward, with g = dL/dh_k (derived in book/04); the
merge has o_k and dO_k at hand, so it leaves phase 1 the per-token offset delta_k (FlashAttention's
D = rowsum(dO * O), with the lse gradient folded in) and phase 1's backward reads the blocks once:

    merge:   dO_k = (1 - beta) g,   ds = beta (1 - beta) g^T (p - o_k),   dlse_k = -ds,
             dp = beta g + r_p ds (w_k - (s r_p / d) p),   dw_k += sum_tokens ds r_p p,
             delta_k = dO_k^T o_k - dlse_k            (delta_0 = dh_0^T h_0: phase 1 forms it)
    phase 1: ds_{k,i} = a_{k,i} (dO_k^T b_i - delta_k)
             db_i = sum_k [a_{k,i} dO_k + r_i ds_{k,i} (w_k - (s_{k,i} r_i / d) b_i)],
             dw_k += sum_tokens sum_i ds_{k,i} r_i b_i

Two backends compute these five functions with the same arguments: "torch" (below; any float dtype,
float64 for tests) and "triton" (``k3lab.kernels.attnres``). ``k3lab.attnres.train`` builds the
training path from them.
"""
from __future__ import annotations

import functools

import torch

BACKENDS = ("torch", "triton")
TABLE_DTYPES = (torch.float32, torch.float64)  # of the logits and r tables (the Triton kernels: float32)


def _no_autocast(fn):
    """Run ``fn`` with autocast off on its first tensor argument's device (the mixing is float32)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        t = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        with torch.autocast(t.device.type, enabled=False):
            return fn(*args, **kwargs)

    return wrapped


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_phase1(buf: torch.Tensor, n: int, W: torch.Tensor, scores: torch.Tensor | None = None) -> None:
    """Phase 1's inputs (both backends).

    Raises:
        ValueError: n not an int in [1, buf.shape[0]]; W not [S >= 1, d]; scores (when given) not
            [S, n, ...] like a block's rows.
    """
    if not (isinstance(n, int) and 1 <= n <= buf.shape[0]):
        raise ValueError(f"n must be an int in [1, buf.shape[0]={buf.shape[0]}], got {n!r}")
    if W.ndim != 2 or W.shape[1] != buf.shape[-1] or W.shape[0] < 1:
        raise ValueError(f"W must be [S >= 1, d={buf.shape[-1]}], got {list(W.shape)}")
    if scores is not None and scores.shape != (W.shape[0], n, *buf.shape[1:-1]):
        raise ValueError(f"scores must be {[W.shape[0], n, *buf.shape[1:-1]]}, got {list(scores.shape)}")


def check_store(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, W: torch.Tensor,
                scores: torch.Tensor, rstd: torch.Tensor | None = None) -> None:
    """``store_block``'s inputs (both backends).

    Raises:
        ValueError: a, b, dst not of one shape [..., d]; b given with dst = a (nothing would be added);
            W not [Q >= 1, d]; scores not [Q, ...] float32 or float64 (the Triton store takes float32
            only); rstd (when given) not [...] in scores' dtype; scores or rstd overlapping each other
            or dst, a, b or W in memory, or dst overlapping a or b (other than as the same view).
    """
    if any(t is not None and t.shape != a.shape for t in (b, dst)):
        raise ValueError(f"a, b and dst must have one shape [..., d], got "
                         f"{[list(t.shape) for t in (a, b, dst) if t is not None]}")
    if dst is a and b is not None:
        raise ValueError("b must be None when dst is a (the logits of a stored block only)")
    if W.ndim != 2 or W.shape[1] != a.shape[-1] or W.shape[0] < 1:
        raise ValueError(f"W must be [Q >= 1, d={a.shape[-1]}], got {list(W.shape)}")
    if scores.shape != (W.shape[0], *a.shape[:-1]) or scores.dtype not in TABLE_DTYPES:
        raise ValueError(f"scores must be float32 (or float64) {[W.shape[0], *a.shape[:-1]]}, got {scores.dtype} "
                         f"{list(scores.shape)}")
    if rstd is not None and (rstd.shape != a.shape[:-1] or rstd.dtype != scores.dtype):
        raise ValueError(f"rstd must be {list(a.shape[:-1])} in scores' dtype {scores.dtype}, got {rstd.dtype} "
                         f"{list(rstd.shape)}")
    # Outputs are written while the inputs are read: r written into the logits, logits into W or a block,
    # or a block into a shifted view of its summands gave garbage on the Triton store. dst may be a (or b)
    # itself: each element is then read and written by the same program.
    outs, ins = (("scores", scores), ("rstd", rstd)), (("dst", dst), ("a", a), ("b", b), ("W", W))
    pairs = [("rstd", rstd, "scores", scores)] + [(n, out, m, t) for n, out in outs for m, t in ins]
    pairs += [("dst", dst, m, t) for m, t in (("a", a), ("b", b)) if t is not None and not _same_view(dst, t)]
    for name, out, other, t in pairs:
        if out is not None and t is not None and _overlap(out, t):
            raise ValueError(f"{name} must not overlap {other} in memory (their byte ranges intersect)")


def _same_view(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (x.device, x.data_ptr(), x.shape, x.stride(), x.dtype) == (y.device, y.data_ptr(), y.shape, y.stride(),
                                                                       y.dtype)


def _overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the byte ranges that x and y span in memory intersect (conservative for interleaved views)."""
    if x.device != y.device or 0 in (x.numel(), y.numel()):
        return False

    def span(t):
        start = t.data_ptr()
        return start, start + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()

    (x0, x1), (y0, y1) = span(x), span(y)
    return x0 < y1 and y0 < x1


def check_merge(o: torch.Tensor, lse: torch.Tensor, w: torch.Tensor, **rows) -> None:
    """A merge's inputs (both backends): lse [...] and w [d] for o [..., d]; each of ``rows`` (name ->
    tensor or None) shaped like o.

    Raises:
        ValueError: naming the first argument of another shape.
    """
    # The kernels index lse by token and w by channel: smaller ones were read past their ends.
    if lse.shape != o.shape[:-1] or w.shape != o.shape[-1:]:
        raise ValueError(f"lse must be {list(o.shape[:-1])} and w {list(o.shape[-1:])} for o of shape "
                         f"{list(o.shape)}, got {list(lse.shape)} and {list(w.shape)}")
    for name, t in rows.items():
        if t is not None and t.shape != o.shape:
            raise ValueError(f"{name} must be {list(o.shape)} like o, got {list(t.shape)}")


def _scores(V: torch.Tensor, W: torch.Tensor, eps: float):
    """V [n, ..., d], W [S, d] (compute dtype) -> r [n, ...], s [S, n, ...]."""
    r = torch.rsqrt(V.pow(2).mean(-1) + eps)
    return r, torch.einsum("n...d,sd->sn...", V, W) * r


@_no_autocast
def store_block_torch(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, W: torch.Tensor, eps: float,
                      scores: torch.Tensor, rstd: torch.Tensor | None = None) -> None:
    """Store a block representation and form its logits for every query that will read it.

    Args:
        dst (Tensor): [..., d] the buffer slot, written with a + b (or a) rounded to its dtype; may be
            ``a`` itself (then only the logits are formed).
        a (Tensor): [..., d]; b (Tensor | None): [..., d] added to a (in float32, or float64).
        W (Tensor): [Q, d] the queries.
        eps (float): RMSNorm eps.
        scores (Tensor): [Q, ...] float32 (float64 for a float64 slot) output: s_q = r w_q^T dst with
            r = (mean(dst^2) + eps)^-1/2, formed from the stored (rounded) values.
        rstd (Tensor | None): [...] output in scores' dtype: r (phase 1's backward reads it).

    Raises:
        ValueError: as ``check_store``.
    """
    check_store(dst, a, b, W, scores, rstd)
    if dst is not a:
        dt = _compute_dtype(dst)
        dst.copy_(a.to(dt) if b is None else a.to(dt) + b.to(dt))
    r, s = _scores(dst[None].to(scores.dtype), W.to(scores.dtype), eps)
    scores.copy_(s[:, 0])
    if rstd is not None:
        rstd.copy_(r[0])


def block_scores(buf: torch.Tensor, n: int, W: torch.Tensor, eps: float) -> torch.Tensor:
    """Logits s [S, n, ...] of queries W [S, d] against blocks ``buf[:n]`` (what ``store_block_torch``
    forms when each block is stored), float32 (float64 for a float64 buffer)."""
    with torch.autocast(buf.device.type, enabled=False):
        return _scores(buf[:n].to(_compute_dtype(buf)), W.to(_compute_dtype(buf)), eps)[1]


@_no_autocast
def phase1_fwd_torch(buf: torch.Tensor, n: int, W: torch.Tensor, eps: float, h_dtype: torch.dtype | None = None,
                     o_dtype: torch.dtype | None = None, scores: torch.Tensor | None = None):
    """Phase 1 forward: the inter-block reads of a block's S sublayers.

    Args:
        buf (Tensor): [S_max, ..., d]; slots 0..n-1 are the blocks read.
        n (int): number of blocks read, 1 <= n <= S_max.
        W (Tensor): [S, d] the block's pseudo-queries.
        eps (float): RMSNorm eps.
        h_dtype (torch.dtype | None): dtype of h (query 0's read), default buf's.
        o_dtype (torch.dtype | None): dtype of o (queries 1..S-1), default h_dtype.
        scores (Tensor | None): [S, n, ...] the logits as ``store_block_torch`` formed them (any
            strides); None forms them here (``block_scores``).

    Returns:
        (h, o, lse): h [..., d] = o_0; o [S - 1, ..., d] or None (S = 1); lse [S, ...] float32
        (float64 for float64 inputs).
    """
    check_phase1(buf, n, W, scores)
    dt = _compute_dtype(buf)
    V = buf[:n].to(dt)
    s = block_scores(buf, n, W, eps) if scores is None else scores.to(dt)
    lse = torch.logsumexp(s, 1)
    # The weights normalised by their own sum, as the Triton kernel's online softmax, not exp(s - lse),
    # whose sum is 1 only up to lse's rounding (|lse| eps, growing with the logits).
    out = torch.einsum("sn...,n...d->s...d", torch.softmax(s, 1), V)
    h_dtype = h_dtype or buf.dtype
    o = out[1:].to(o_dtype or h_dtype) if W.shape[0] > 1 else None
    # h a tensor of its own, as the Triton kernel's: a view of out, returned by the training path's
    # autograd Function, could not be modified in place by the caller or by a sublayer.
    return out[0].to(h_dtype, copy=True), o, lse


def check_phase1_grads(buf: torch.Tensor, W: torch.Tensor, lse: torch.Tensor, h: torch.Tensor, dh: torch.Tensor,
                       dO: torch.Tensor | None, delta: torch.Tensor | None) -> None:
    """The phase-1 backward's inputs beside the forward's (both backends).

    Raises:
        ValueError: lse not [S, ...] (the Triton kernel read past a smaller one); h or dh not [..., d]
            like a block of ``buf``; dO ([S - 1, ..., d]) and delta ([S, ...]) not given exactly when
            S > 1, or of other shapes.
    """
    S, row = W.shape[0], buf.shape[1:]
    if lse.shape != (S, *row[:-1]):
        raise ValueError(f"lse must be {[S, *row[:-1]]}, got {list(lse.shape)}")
    if h.shape != row or dh.shape != row:
        raise ValueError(f"h and dh must be {list(row)}, got {list(h.shape)} and {list(dh.shape)}")
    if (dO is None) != (S == 1) or (delta is None) != (S == 1):
        raise ValueError(f"dO and delta are needed exactly when S > 1 (S = {S})")
    if dO is not None and (dO.shape != (S - 1, *row) or delta.shape != (S, *row[:-1])):
        raise ValueError(f"dO must be {[S - 1, *row]} and delta {[S, *row[:-1]]}, got {list(dO.shape)} and "
                         f"{list(delta.shape)}")


def check_phase1_tables(buf: torch.Tensor, n: int, scores: torch.Tensor | None, rstd: torch.Tensor | None) -> None:
    """The phase-1 backward's logits and r (both backends; ``check_phase1`` checks the scores' shape):
    both or neither, rstd [n, ...] like the scores' rows, one dtype, float32 or float64.

    Raises:
        ValueError: one of the two given without the other, rstd of another shape, the two in different
            dtypes or in neither float32 nor float64.
    """
    if (scores is None) != (rstd is None):
        raise ValueError("scores and rstd must be given together (or neither: both are formed from the blocks)")
    if rstd is None:
        return
    if rstd.shape != (n, *buf.shape[1:-1]):
        raise ValueError(f"rstd must be {[n, *buf.shape[1:-1]]}, got {list(rstd.shape)}")
    if scores.dtype != rstd.dtype or scores.dtype not in TABLE_DTYPES:
        raise ValueError(f"scores and rstd must have one dtype, float32 or float64, got {scores.dtype} and "
                         f"{rstd.dtype}")


@_no_autocast
def phase1_bwd_torch(buf: torch.Tensor, n: int, W: torch.Tensor, lse: torch.Tensor, h: torch.Tensor,
                     dh: torch.Tensor, dO: torch.Tensor | None, delta: torch.Tensor | None, eps: float,
                     dacc: torch.Tensor, accumulate: bool = True, scores: torch.Tensor | None = None,
                     rstd: torch.Tensor | None = None) -> torch.Tensor:
    """Phase 1 backward (closed form in the module docstring).

    Args:
        buf, n, W, eps: as in ``phase1_fwd_torch``; lse (Tensor): [S, ...] and h (Tensor): [..., d] from it.
        dh (Tensor): [..., d] gradient of h (query 0).
        dO (Tensor | None): [S - 1, ..., d] gradients of o (None when S = 1).
        delta (Tensor | None): [S, ...] dO_k^T o_k - dlse_k as ``merge_bwd_torch`` leaves it; row 0 is
            ignored (dh^T h is formed here, as sum_i a_{0,i} dh^T b_i; None when S = 1). ``h`` is only
            checked here (the Triton kernel reads it).
        dacc (Tensor): [>= n, ..., d] the blocks' gradients: ``dacc[:n]`` is written, or added to
            when ``accumulate``.
        scores (Tensor | None), rstd (Tensor | None): [S, n, ...] and [n, ...], the logits and the
            blocks' r as ``store_block_torch`` formed them, given together; formed here when None.

    Returns:
        Tensor: dW [S, d] in W's dtype.

    Raises:
        ValueError: as ``check_phase1_grads`` and ``check_phase1_tables``.
    """
    check_phase1(buf, n, W, scores)
    check_phase1_grads(buf, W, lse, h, dh, dO, delta)
    check_phase1_tables(buf, n, scores, rstd)
    dt = lse.dtype
    V, Wd = buf[:n].to(dt), W.to(dt)
    r, s = _scores(V, Wd, eps) if scores is None else (rstd.to(dt), scores.to(dt))
    a = torch.softmax(s, 1)  # as in the forward
    G = dh.to(dt)[None] if dO is None else torch.cat([dh.to(dt)[None], dO.to(dt)])
    P = torch.einsum("s...d,n...d->sn...", G, V)
    # delta_0 = dh . h_0 = sum_i a_{0,i} dh . b_i, formed from the same products as ds so that they
    # cancel exactly where they should (a read of one source has ds = 0, and dw_0 = 0).
    offset = (a[:1] * P[:1]).sum(1)
    if delta is not None:
        offset = torch.cat([offset, delta[1:].to(dt)])
    ds = a * (P - offset[:, None])
    dV = (torch.einsum("sn...,s...d->n...d", a, G) + r[..., None] * torch.einsum("sn...,sd->n...d", ds, Wd)
          - (r.pow(2) / V.shape[-1] * (ds * s).sum(0))[..., None] * V)
    if accumulate:
        dacc[:n] += dV
    else:
        dacc[:n] = dV
    return torch.einsum("sn...,n...d->sd", ds * r, V).to(W.dtype)


@_no_autocast
def merge_fwd_torch(p: torch.Tensor | None, o: torch.Tensor, lse: torch.Tensor, w: torch.Tensor, eps: float,
                    prev: torch.Tensor | None = None, v: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """Phase 2 forward: merge the inter-block part o with the partial sum p.

    Args:
        p (Tensor | None): [..., d] the partial sum (read), or None when ``v`` is given.
        o (Tensor): [..., d]; lse (Tensor): [...] (from phase 1); w (Tensor): [d]; eps (float).
        prev (Tensor | None), v (Tensor | None): with ``v``, p = prev + v (or v.to(dtype) when
            prev is None) is formed first.
        dtype (torch.dtype | None): dtype of p formed from v, default prev's (or v's).

    Returns:
        (p, h): p [..., d] (the given or formed partial sum) and h [..., d] in p's dtype.
    """
    if (p is None) == (v is None):
        raise ValueError("give exactly one of p (read) and v (p = prev + v formed here)")
    check_merge(o, lse, w, p=p, prev=prev, v=v)
    if v is not None:
        p = (v if prev is None else prev + v).to(dtype or (v if prev is None else prev).dtype)
    dt = lse.dtype
    P = p.to(dt)
    s = (P @ w.to(dt)) * torch.rsqrt(P.pow(2).mean(-1) + eps)
    beta = torch.sigmoid(s - lse)[..., None]
    return p, ((1 - beta) * o.to(dt) + beta * P).to(p.dtype)


@_no_autocast
def merge_bwd_torch(dh: torch.Tensor, dp_in: torch.Tensor | None, p: torch.Tensor, o: torch.Tensor,
                    lse: torch.Tensor, w: torch.Tensor, eps: float, dO: torch.Tensor, delta: torch.Tensor,
                    v_dtype: torch.dtype | None = None, need_dp: bool = True):
    """Phase 2 backward (closed form in the module docstring).

    Args:
        dh (Tensor): [..., d] gradient of h.
        dp_in (Tensor | None): [..., d] gradient of p from its other uses (added).
        p, o, lse, w, eps: as in ``merge_fwd_torch``.
        dO (Tensor): [..., d] output slot, written with the gradient of o.
        delta (Tensor): [...] output slot, written with dO^T o - dlse (phase 1's backward offset).
        v_dtype (torch.dtype | None): dtype of the gradient of v (p = prev + v).
        need_dp (bool): False when p had no prev (p = v): dp is then only returned as dv.

    Returns:
        (dp, dv, dw): dp [..., d] in p's dtype (the total gradient of p, which is also prev's; None
        when not ``need_dp`` and ``v_dtype`` differs from p's); dv the same in ``v_dtype``; dw [d] in
        w's dtype.
    """
    check_merge(o, lse, w, p=p, dh=dh, dp_in=dp_in, dO=dO)
    if delta.shape != p.shape[:-1]:
        raise ValueError(f"delta must be {list(p.shape[:-1])}, got {list(delta.shape)}")
    dt = lse.dtype
    P, g, wd = p.to(dt), dh.to(dt), w.to(dt)
    r = torch.rsqrt(P.pow(2).mean(-1) + eps)
    s = (P @ wd) * r
    beta = torch.sigmoid(s - lse)
    ds = beta * (1 - beta) * (g * (P - o.to(dt))).sum(-1)
    dO.copy_((1 - beta)[..., None] * g)
    # delta from dO as stored (rounded to its dtype), as phase 1's backward reads it.
    delta.copy_((dO.to(dt) * o.to(dt)).sum(-1) + ds)
    dp = beta[..., None] * g + (r * ds)[..., None] * (wd - (s * r / P.shape[-1])[..., None] * P)
    if dp_in is not None:
        dp = dp + dp_in.to(dt)
    dv = dp.to(v_dtype or p.dtype)
    dp = dp.to(p.dtype) if need_dp or dv.dtype == p.dtype else None
    return dp, dv, torch.einsum("...,...d->d", ds * r, P).to(w.dtype)


def kernels(backend: str):
    """(store_block, phase1_fwd, phase1_bwd, merge_fwd, merge_bwd) of ``backend`` ("torch" or "triton")."""
    if backend == "torch":
        return store_block_torch, phase1_fwd_torch, phase1_bwd_torch, merge_fwd_torch, merge_bwd_torch
    if backend == "triton":
        from k3lab.kernels.attnres import merge_bwd, merge_fwd, phase1_bwd, phase1_fwd, store_block

        return store_block, phase1_fwd, phase1_bwd, merge_fwd, merge_bwd
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
