"""Attention Residuals by the formula: the reference every other path is tested against.

AttnRes paper (Kimi Team, arXiv 2603.15031), Sec. 3; K3 report, Sec. 2 (Block AttnRes in K3).

Full AttnRes. Sources are the embedding v_0 = h0 and the outputs v_1..v_l of the sublayers before
sublayer l (0-based l = 0..L-1). Sublayer l has a pseudo-query w_l in R^d and reads

    alpha_{l,i} = softmax_i( w_l^T RMSNorm(v_i) )        (float32, over depth i = 0..l)
    h_l         = sum_i alpha_{l,i} v_i                  (values are not normalised)
    v_{l+1}     = f_l(h_l)

and a final query w_L aggregates all L+1 sources into the output that goes to the final norm/head.

Block AttnRes. The L sublayers are cut into N consecutive blocks (``block_sizes``). A block's
representation b_n is the sum of its sublayers' outputs; b_0 = h0. Sublayer l in block n reads the
completed blocks b_0..b_{n-1} plus the running partial sum of block n (absent for the block's first
sublayer); the final query reads b_0..b_N. With N = L every block is one sublayer and Block AttnRes
is full AttnRes.

The RMSNorm on keys has no gain: a gain g would only rescale the query (w^T (g * k) = (w * g)^T k).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def block_sizes(n_sublayers: int, n_blocks) -> list[int]:
    """Sizes of N consecutive blocks covering L sublayers: as even as possible for a count N (the
    first L mod N blocks get one more), or exactly the sizes given.

    Args:
        n_sublayers (int): L >= 1.
        n_blocks (int | Sequence[int]): N, 1 <= N <= L; or the N block sizes themselves, positive ints
            summing to L (K3: blocks of 12 layers, the last partial).

    Returns:
        list[int]: N sizes summing to L, e.g. ``block_sizes(10, 4) == [3, 3, 2, 2]``,
        ``block_sizes(10, [4, 4, 2]) == [4, 4, 2]``.

    Raises:
        ValueError: L < 1; a count N < 1 or N > L (a block cannot be empty); sizes that are not
            positive ints or do not sum to L.
    """
    # bool is an int to isinstance: True would be one block.
    if not (isinstance(n_sublayers, int) and not isinstance(n_sublayers, bool) and n_sublayers >= 1):
        raise ValueError(f"n_sublayers must be an int >= 1, got {n_sublayers!r}")
    if isinstance(n_blocks, (list, tuple)):
        sizes = list(n_blocks)
        if not (sizes and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)
                and sum(sizes) == n_sublayers):
            raise ValueError(f"n_blocks as block sizes must be positive ints summing to n_sublayers={n_sublayers}, "
                             f"got {n_blocks!r}")
        return sizes
    if not (isinstance(n_blocks, int) and not isinstance(n_blocks, bool) and 1 <= n_blocks <= n_sublayers):
        raise ValueError(
            f"n_blocks must be an int in [1, n_sublayers={n_sublayers}] (a block holds at least one "
            f"sublayer) or a list of block sizes, got {n_blocks!r}"
        )
    q, r = divmod(n_sublayers, n_blocks)
    return [q + 1 if i < r else q for i in range(n_blocks)]


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps), no gain; in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _check_read(sources, w) -> None:
    """``depth_attention``'s argument checks (ValueError naming sources or w)."""
    if not (isinstance(sources, (list, tuple)) and sources and all(
            isinstance(v, torch.Tensor) and v.is_floating_point() and v.ndim >= 1 for v in sources)):
        raise ValueError("sources must be a non-empty list of floating-point tensors [..., d], got "
                         f"{type(sources).__name__} of {len(sources) if isinstance(sources, (list, tuple)) else '?'}")
    if len({v.shape for v in sources}) > 1:
        raise ValueError(f"sources must share one shape, got {sorted({tuple(v.shape) for v in sources})}")
    d = sources[0].shape[-1]
    if not (isinstance(w, torch.Tensor) and w.is_floating_point() and tuple(w.shape) == (d,)):
        raise ValueError(f"w must be a floating-point [d={d}] tensor, got "
                         f"{list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}"
                         f"{'' if not isinstance(w, torch.Tensor) else ' ' + str(w.dtype)}")


def depth_attention(sources: list[torch.Tensor], w: torch.Tensor, eps: float = 1e-6):
    """One AttnRes read: softmax over depth of w^T RMSNorm(v_i), weighted sum of the raw v_i.

    Args:
        sources (list[Tensor]): S >= 1 tensors [..., d] of one shape (any float dtypes).
        w (Tensor): [d] pseudo-query.
        eps (float): RMSNorm eps.

    Returns:
        (h, alpha): h [..., d] in ``sources[0]``'s dtype (computed in float32, float64 stays float64);
        alpha [S, ...] the depth weights in the compute dtype.

    Raises:
        ValueError: sources not a non-empty list of floating-point tensors of one shape [..., d]; w not a
            floating-point [d] tensor.
    """
    _check_read(sources, w)
    dt = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
    # float32 even under autocast (which would run the logits' matmul in bf16).
    with torch.autocast(sources[0].device.type, enabled=False):
        V = torch.stack([v.to(dt) for v in sources])
        alpha = (rms_norm(V, eps) @ w.to(dt)).softmax(0)
        return (alpha[..., None] * V).sum(0).to(sources[0].dtype), alpha


def naive_block_attnres(
    h0: torch.Tensor,
    sublayers: nn.ModuleList | list,
    queries: torch.Tensor,
    n_blocks: int,
    eps: float = 1e-6,
    return_weights: bool = False,
    *,
    check_values: bool = True,
):
    """Block AttnRes around ``sublayers`` by the formula, differentiable by autograd.

    Args:
        h0 (Tensor): [B, T, d] embedding output (source b_0).
        sublayers (ModuleList | list): L callables [B, T, d] -> [B, T, d], each applying its own
            pre-norm and returning its output (not added).
        queries (Tensor): [L + 1, d] pseudo-queries; row L is the final aggregation's.
        n_blocks (int | list[int]): N in [1, L] (N = L is full AttnRes), or the block sizes
            (``block_sizes``).
        eps (float): RMSNorm eps of the keys.
        return_weights (bool): also return the depth weights.
        check_values (bool): reject NaN/inf in h0 or queries and an h0 beyond RMSNorm's range (one host
            sync; ``check_input_values``).

    Returns:
        Tensor [B, T, d] (h0's dtype), the input of the final norm; with ``return_weights``, also a
        list of L + 1 tensors [S_l] float32: each read's weights averaged over tokens, in source
        order (b_0, ..., completed blocks, partial sum).

    Raises:
        ValueError: N < 1 or N > L or bad block sizes, h0 or queries not a floating-point tensor, queries not [L + 1, d],
            h0 not [B, T, d], eps not a finite number > 0, a sublayer returning
            anything but a tensor of h0's shape.
    """
    L = len(sublayers)
    sizes = block_sizes(L, n_blocks)
    sublayers = _check_inputs(h0, sublayers, queries, eps, check_values)
    blocks, weights, layer = [h0], [], 0
    for size in sizes:
        partial = None
        for _ in range(size):
            sources = blocks if partial is None else blocks + [partial]
            h, alpha = depth_attention(sources, queries[layer], eps)
            weights.append(alpha.detach().float().flatten(1).mean(1))
            v = sublayers[layer](h)
            partial = v if partial is None else partial + v
            layer += 1
        blocks.append(partial)
    out, alpha = depth_attention(blocks, queries[L], eps)
    weights.append(alpha.detach().float().flatten(1).mean(1))
    return (out, weights) if return_weights else out


def naive_attnres(h0: torch.Tensor, sublayers, queries: torch.Tensor, eps: float = 1e-6, *,
                  check_values: bool = True) -> torch.Tensor:
    """Full AttnRes by the formula: sublayer l reads [h0, v_1, ..., v_l] (see the module docstring).

    Written as its own loop (not via ``naive_block_attnres``) so that the N = L equivalence is a test.

    Args:
        h0 (Tensor): [B, T, d]; sublayers: L callables; queries (Tensor): [L + 1, d]; eps (float);
        check_values (bool): as in ``naive_block_attnres``.

    Returns:
        Tensor: [B, T, d] in h0's dtype.

    Raises:
        ValueError: h0 or queries not a floating-point tensor, queries not [L + 1, d], h0 not [B, T, d],
            eps not a finite number > 0, a sublayer returning
            anything but a tensor of h0's shape; with ``check_values``, NaN/inf in h0 or queries or an h0
            beyond RMSNorm's range.
    """
    L = len(sublayers)
    sublayers = _check_inputs(h0, sublayers, queries, eps, check_values)
    sources = [h0]
    for layer in range(L):
        h, _ = depth_attention(sources, queries[layer], eps)
        sources.append(sublayers[layer](h))
    return depth_attention(sources, queries[L], eps)[0]


def check_eps(eps: float) -> None:
    """ValueError unless eps is a finite number > 0 (a negative one makes RMSNorm's mean square + eps
    negative, and 0 makes a zero source 0/0: NaN outputs)."""
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < float("inf")):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")


def check_input_values(h0: torch.Tensor, queries: torch.Tensor, name: str = "h0") -> None:
    """ValueError naming h0 or queries when it holds a NaN or inf, when h0 is so large that RMSNorm's
    mean square overflows the compute dtype (max |h0| > sqrt(finfo.max / d), ~3.3e18 in float32 at
    d = 32: the key would come out 0 and the depth softmax uniform, silently), or when the queries are so
    large that a logit w^T RMSNorm(v) can overflow (max |w| > finfo.max / d, since |RMSNorm(v)|_1 <= d:
    an inf logit made the softmax, and every output, NaN). One host sync."""
    dt = torch.float64 if h0.dtype == torch.float64 else torch.float32
    d = h0.shape[-1]
    limit = (torch.finfo(dt).max / d) ** 0.5
    q_limit = torch.finfo(dt).max / d
    # An empty batch (B or T = 0) has nothing to check; the inf-norm of an empty tensor raises.
    maxima = torch.stack([torch.linalg.vector_norm(x, float("inf")).double() if x.numel() else
                          x.new_zeros((), dtype=torch.float64) for x in (h0, queries)]).tolist()
    for what, m in zip((name, "queries"), maxima):
        if m != m or m == float("inf"):
            raise ValueError(f"{what} contains NaN or inf")
    if maxima[0] > limit:
        raise ValueError(f"{name} is too large: max |{name}| = {maxima[0]:.3g}, but RMSNorm's mean square overflows "
                         f"{str(dt)[6:]} beyond sqrt(finfo.max / d) = {limit:.3g} (d={d}); scale it down")
    if maxima[1] > q_limit:
        raise ValueError(f"queries are too large: max |queries| = {maxima[1]:.3g}, but a depth logit overflows "
                         f"{str(dt)[6:]} beyond finfo.max / d = {q_limit:.3g} (d={d}); scale them down")


def _check_inputs(h0: torch.Tensor, sublayers, queries: torch.Tensor, eps: float, values: bool = True) -> list:
    """The checks every path runs; returns the sublayers, each wrapped to raise ValueError unless it
    returns a tensor of h0's shape (the paths would otherwise broadcast a [B, 1, d] output, or, in the
    memory path's block buffer, resize a slot and read rows never written). With ``values``, also
    ``check_input_values`` (a NaN in h0 would otherwise come out of every path as a NaN output)."""
    check_eps(eps)
    L = len(sublayers)
    for name, x in dict(h0=h0, queries=queries).items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if h0.ndim != 3:
        raise ValueError(f"h0 must be [B, T, d], got shape {list(h0.shape)}")
    if tuple(queries.shape) != (L + 1, h0.shape[-1]):
        raise ValueError(f"queries must be [L + 1, d] = [{L + 1}, {h0.shape[-1]}], got {list(queries.shape)}")
    if values:
        check_input_values(h0, queries)
    return [_shape_checked(f, layer, h0.shape) for layer, f in enumerate(sublayers)]


def _shape_checked(sublayer, layer: int, shape: torch.Size):
    def run(h: torch.Tensor) -> torch.Tensor:
        v = sublayer(h)
        if not isinstance(v, torch.Tensor) or v.shape != shape:
            got = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"sublayer {layer} must return a tensor of its input's shape {list(shape)}, got {got}")
        return v

    return run
