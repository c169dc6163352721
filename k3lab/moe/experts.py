"""Experts as stacked weights, run with one grouped GEMM per projection.

E experts, each a gated FFN of width d -> h -> d, are stored as three stacked tensors
``w_gate``, ``w_up`` [E, d, h] and ``w_down`` [E, h, d]. The token-expert pairs of a batch are
sorted by expert so that expert e's rows are contiguous, ``x[offsets[e-1]:offsets[e]]``, and the
projections are ``torch.nn.functional.grouped_mm`` calls over all experts, gate and up as one against
[W_gate | W_up]: no Python loop over experts, no host synchronisation (the offsets stay on the device), two
GEMM kernels forward on the GPU.

    y[rows of e] = (glu(x W_gate[e], x W_up[e])) W_down[e]

``naive_expert_ffn`` is the same computation as a loop over experts, in any dtype (float64 for
the reference: ``grouped_mm`` takes float32, bfloat16 and float16 only).
"""
from __future__ import annotations

import math

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3lab.dist import local_shard
from k3lab.moe.activation import ACTIVATIONS, glu, glu_packed
from k3lab.precision import AUTOCAST_DTYPES, autocast_dtype, shape_of as _shape, widen

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def row_alignment(dtype: torch.dtype) -> int:
    """Elements per 16 bytes in ``dtype``: grouped_mm needs every row stride a multiple of it (4 in float32,
    8 in bf16/fp16), so the experts' widths d and h must be too."""
    return 16 // dtype.itemsize
# The public name arrived after torch 2.11; the private op it wraps is in every supported version.
grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def _typed(t) -> str:
    """A tensor's shape and dtype for error messages ("[3, 2] torch.int32"); the type name of anything else."""
    return f"{_shape(t)} {t.dtype}" if isinstance(t, torch.Tensor) else _shape(t)


def group_by_expert(topk_idx: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the token-expert pairs of ``topk_idx`` by expert (stable, so token order is kept inside an expert).

    Args:
        topk_idx (Tensor): [N, K] int64 expert ids in [0, E).
        E (int): number of experts.

    Returns:
        order (Tensor): [N*K] int64, pair ``order[r]`` (a flat index into ``topk_idx``) goes to row r;
            its token is ``order[r] // K``.
        offsets (Tensor): [E] int32 cumulative ends of each expert's rows (``grouped_mm``'s ``offs``).
        counts (Tensor): [E] int64 pairs per expert.

    Raises:
        ValueError: topk_idx not int64 [N, K]; E not a positive int. The ids' values are not checked (a host sync).
    """
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.ndim != 2 or topk_idx.dtype != torch.int64:
        raise ValueError(f"group_by_expert: topk_idx must be int64 [N, K], got {_typed(topk_idx)}")
    if not isinstance(E, int) or isinstance(E, bool) or E < 1:
        raise ValueError(f"group_by_expert: E must be a positive int, got {E!r}")
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add_ instead of bincount: bincount reads the max back to the host on CUDA.
    counts = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts.cumsum(0).to(torch.int32), counts


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inv [P] int64 with ``inv[order[r]] = r``: the row a pair was sorted to (``order`` from ``group_by_expert``).
    ValueError when order is not int64 [P] (its values, a permutation of 0..P-1, are not checked)."""
    if not isinstance(order, torch.Tensor) or order.ndim != 1 or order.dtype != torch.int64:
        raise ValueError(f"inverse_permutation: order must be int64 [P], got {_typed(order)}")
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def _check_permutation(where: str, order, inv, P: int) -> None:
    for name, t in (("order", order), ("inv", inv)):
        if not isinstance(t, torch.Tensor) or t.shape != (P,) or t.dtype != torch.int64:
            raise ValueError(f"{where}: {name} must be int64 [N*K={P}], got {_typed(t)}")


def _gather_sum(y: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    # The kernel on a GPU only (as the fused GLU): on a CPU, Triton's interpreter would run it element by element.
    # Imported on first use: the kernel module imports triton, which on a CPU must come after k3lab.setup().
    from k3lab.kernels.moe.gather import gather_sum, gather_sum_torch  # noqa: PLC0415

    return gather_sum(y, idx, weight) if y.is_cuda else gather_sum_torch(y, idx, weight)


class _Permute(torch.autograd.Function):
    """``y[idx]`` for a permutation ``idx`` whose inverse is ``inv``; backward gathers by ``inv``. Both ways
    are gathers: autograd's backward of ``y[idx]`` is an accumulating scatter, atomic adds on a GPU."""

    @staticmethod
    def forward(ctx, y, idx, inv):
        ctx.save_for_backward(idx, inv)
        return y.index_select(0, idx)

    @staticmethod
    def backward(ctx, grad):
        idx, inv = ctx.saved_tensors
        return _Permute.apply(grad, inv, idx), None, None


class _Dispatch(torch.autograd.Function):
    """``x[order // K]``: each token's row copied to its K pairs' rows. Backward sums each token's K rows,
    gathered by ``inv`` and reduced over K, instead of an accumulating scatter into [N, d]."""

    @staticmethod
    def forward(ctx, x, order, inv, K):
        ctx.save_for_backward(order, inv)
        ctx.N, ctx.K = x.shape[0], K
        return x.index_select(0, order.div(K, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        order, inv = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the differentiable form
            pairs = _Permute.apply(grad, inv, order)
            return pairs.view(ctx.N, ctx.K, grad.shape[-1]).sum(1), None, None, None
        return _gather_sum(grad, inv.view(ctx.N, ctx.K)), None, None, None


class _Combine(torch.autograd.Function):
    """out[n] = sum_k weight[n, k] y[inv[n*K + k]] by one gather-and-sum kernel (``gather_sum``). Backward:
    dy[r] = weight at pair order[r] times dout of its token (a gather), dweight[n, k] = <dout[n], y[inv[n*K+k]]>,
    both in PyTorch (differentiable again)."""

    @staticmethod
    def forward(ctx, y, order, inv, weight):
        ctx.save_for_backward(y, order, inv, weight)
        return _gather_sum(y, inv.view(weight.shape), weight)

    @staticmethod
    def backward(ctx, dout):
        y, order, inv, weight = ctx.saved_tensors
        N, K = weight.shape
        dy = dweight = None
        if ctx.needs_input_grad[0]:
            token = order.div(K, rounding_mode="floor")
            dy = dout.index_select(0, token) * weight.reshape(-1).index_select(0, order).to(dout.dtype)[:, None]
        if ctx.needs_input_grad[3]:
            pairs = _Permute.apply(y, inv, order).view(N, K, y.shape[-1])
            dweight = (widen(pairs) * widen(dout)[:, None, :]).sum(-1).to(weight.dtype)
        return dy, None, None, dweight


def dispatch_rows(x: torch.Tensor, order: torch.Tensor, inv: torch.Tensor, K: int) -> torch.Tensor:
    """The expert-sorted input rows: ``x[order // K]``, differentiable, without an accumulating scatter.

    Args:
        x (Tensor): [N, d] tokens, any float dtype.
        order (Tensor): [N*K] int64 from ``group_by_expert``. inv (Tensor): [N*K] ``inverse_permutation(order)``.
        K (int): top-k.

    Returns:
        Tensor [N*K, d]: row r is token ``order[r] // K``. The gradient of x is
        ``dx[n] = sum_k dY[inv[n*K + k]]`` (gathers and a sum over K: deterministic, no atomics).

    Raises:
        ValueError: x not [N, d]; K not a positive int; order or inv not int64 [N*K]. Their values are not
        checked (a host sync): ``group_by_expert`` and ``inverse_permutation`` make valid ones.
    """
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError(f"dispatch_rows: x must be [N, d], got {_shape(x)}")
    if not isinstance(K, int) or isinstance(K, bool) or K < 1:
        raise ValueError(f"dispatch_rows: K must be a positive int, got {K!r}")
    _check_permutation("dispatch_rows", order, inv, x.shape[0] * K)
    return _Dispatch.apply(x, order, inv, K)


def combine_rows(y: torch.Tensor, order: torch.Tensor, inv: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The routed sum out[n] = sum_k weight[n, k] y[inv[n*K + k]] of the expert-sorted outputs.

    Args:
        y (Tensor): [N*K, d] expert outputs in ``group_by_expert``'s row order.
        order, inv (Tensor): [N*K] int64 as in ``dispatch_rows``.
        weight (Tensor): [N, K] floating routing weights.

    Returns:
        Tensor [N, d] in y's dtype; products and sum in float32 (one kernel on a GPU, ``gather_sum``).
        Backward: dy gathered by ``order``, dweight = <dout[n], y[inv[n*K + k]]>; no atomics.

    Raises:
        ValueError: weight not [N, K]; y not [N*K, d]; order or inv not int64 [N*K] (values unchecked, as in
        ``dispatch_rows``).
    """
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise ValueError(f"combine_rows: weight must be [N, K], got {_shape(weight)}")
    N, K = weight.shape
    if not isinstance(y, torch.Tensor) or y.ndim != 2 or y.shape[0] != N * K:
        raise ValueError(f"combine_rows: y must be [N*K={N * K}, d] for weight [N={N}, K={K}], got {_shape(y)}")
    _check_permutation("combine_rows", order, inv, N * K)
    return _Combine.apply(y, order, inv, weight)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, d] itself when its strides are (d, 1), else a row-major copy. grouped_mm needs row strides that
    are multiples of 16 bytes; a transposed, column-sliced or expanded tensor has others, and so may one of one
    row or none, for which ``is_contiguous`` is True whatever the strides."""
    return t if t.stride() == (t.shape[1], 1) else t.clone(memory_format=torch.contiguous_format)


class _RowMajorGrad(torch.autograd.Function):
    """Identity forward; backward passes on the gradient row-major (``_row_major``): grouped_mm's backward reads
    its output's gradient by the same stride rule, and ``y.sum()``'s is expanded (strides (0, 0))."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return _row_major(grad)


def _check_weights(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                   offsets: torch.Tensor) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be [N, d], got shape {list(x.shape)}")
    if w_gate.ndim != 3 or w_gate.shape != w_up.shape or w_gate.shape[1] != x.shape[1]:
        raise ValueError(f"w_gate and w_up must both be [E, d={x.shape[1]}, h], got {list(w_gate.shape)} "
                         f"and {list(w_up.shape)}")
    E, _, h = w_gate.shape
    if w_down.shape != (E, h, x.shape[1]):
        raise ValueError(f"w_down must be [E={E}, h={h}, d={x.shape[1]}], got {list(w_down.shape)}")
    if offsets.shape != (E,) or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be [E={E}] int32/int64 cumulative ends, got {list(offsets.shape)} "
                         f"{offsets.dtype}")


def split_groups(offsets: torch.Tensor, N: int, max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut every group longer than ``max_rows`` rows into pieces of at most ``max_rows``, on the device.

    A grouped GEMM's weight gradient is one [in, out] output per group, reduced over the group's rows: a
    group far longer than the others is a few long output tiles that run after the rest have finished. As
    pieces, its rows spread over more tiles; the pieces' gradients are summed per expert.

    Args:
        offsets (Tensor): [G] int cumulative ends of the groups of rows [0, N), non-decreasing.
        N (int): rows (``offsets[-1] <= N``).
        max_rows (int): the longest piece, >= 1.

    Returns:
        (ends [G + P] int64 cumulative ends of the pieces, non-decreasing, the last real end followed by
        empty or padding pieces ending at N; expert [G + P] int64 the group each piece belongs to, in
        [0, G)), P = N // max_rows: a static count (every group of n rows gives ceil(n / max_rows) - 1 <=
        n // max_rows cuts), so the shapes never depend on the values.

    Raises:
        ValueError: offsets not a 1-D integer tensor with at least one group, N or max_rows not ints >= 1.
    """
    if not (isinstance(offsets, torch.Tensor) and offsets.ndim == 1 and offsets.numel() >= 1
            and offsets.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"offsets must be [G >= 1] int32/int64 cumulative ends, got {_typed(offsets)}")
    for name, v in (("N", N), ("max_rows", max_rows)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    G, P = offsets.numel(), N // max_rows
    ends = offsets.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    cuts = starts[:, None] + max_rows * torch.arange(1, P + 1, device=ends.device)
    # Cuts past a group's end are parked at N: sorted, the at most P real ones come first.
    cuts = torch.where(cuts < ends[:, None], cuts, N).flatten().sort().values[:P]
    ends = torch.cat([ends, cuts]).sort().values
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    expert = torch.searchsorted(offsets.long(), starts, right=True).clamp_(max=G - 1)
    return ends, expert


# Eager under torch.compile: three grouped GEMMs (one kernel each) around the GLU, nothing for inductor to fuse,
# and grouped_mm's fake-tensor kernel accepts bf16 only, so float32 runs cannot be traced.
@torch.compiler.disable
def expert_ffn(x: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
               w_down: torch.Tensor, activation: str = "situ", *, padded: bool = True,
               max_group_rows: int | None = None) -> torch.Tensor:
    """Every expert's gated FFN on its rows of ``x``, by grouped GEMMs.

    Args:
        x (Tensor): [N, d] float32/bfloat16/float16, rows grouped by expert in expert order. Rows from
            ``offsets[-1]`` on are padding: they must be finite (any value); their outputs are 0 and
            they receive no gradient.
        offsets (Tensor): [E] int32 (or int64) cumulative ends, non-decreasing, ``offsets[-1] <= N``.
        w_gate, w_up (Tensor): [E, d, h], ``x``'s dtype.
        w_down (Tensor): [E, h, d], ``x``'s dtype.
        activation (str): ``"situ"`` (K3's SiTU-GLU) or ``"swiglu"``.
        padded (bool): False promises ``offsets[-1] == N`` (every row is some expert's, as in a one-process MoE
            layer) and skips zeroing the padding rows, a full pass over the output forward and backward.
        max_group_rows (int | None): run groups longer than this as pieces of at most this many rows
            (``split_groups``): the same result (the pieces' weight gradients summed per expert, in the
            weights' dtype), with a long group's weight gradient spread over more GEMM tiles. None: no cuts.

    Returns:
        Tensor [N, d]: row r of expert e is ``glu(x_r W_gate[e], x_r W_up[e]) W_down[e]``.

    Raises:
        ValueError: shapes or dtypes disagree, ``x``'s dtype is not one ``grouped_mm`` takes (use
            ``naive_expert_ffn`` for float64), or d or h is not a multiple of 16 bytes' worth of elements;
            ``max_group_rows`` not None or an int >= 1.

    The offsets' values are not checked (that would read them back to the host); ``group_by_expert``
    makes valid ones.
    """
    _check_weights(x, w_gate, w_up, w_down, offsets)
    if x.dtype not in GROUPED_DTYPES or not (x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype):
        raise ValueError(f"expert_ffn: x and the weights must share one dtype of {GROUPED_DTYPES}, got x "
                         f"{x.dtype}, weights {w_gate.dtype}/{w_up.dtype}/{w_down.dtype}")
    align = row_alignment(x.dtype)
    bad = [f"{n}={v}" for n, v in (("d", x.shape[1]), ("h", w_gate.shape[2])) if v % align]
    if bad:
        raise ValueError(f"expert_ffn: {' and '.join(bad)} must be a multiple of {align} for {x.dtype} (grouped_mm "
                         f"needs 16-byte row strides)")
    x = _row_major(x)
    N = x.shape[0]
    end = offsets[-1:].long()
    # grouped_mm leaves rows past the last offset uninitialised (and their gradients too): the last
    # expert's group is stretched over the padding and the padding rows are zeroed after the GEMMs.
    # Gate and up as one GEMM against [W_gate | W_up]: x is read once, and backward's dx is one GEMM rather
    # than two and a sum of their [N, d] outputs.
    w_gate_up = torch.cat([w_gate, w_up], dim=2)
    if max_group_rows is not None:
        offsets, expert = split_groups(offsets, N, max_group_rows)
        w_gate_up, w_down = w_gate_up[expert], w_down[expert]
    offs = torch.cat([offsets[:-1], offsets.new_full((1,), N)]).to(torch.int32)
    au = grouped_mm(x, w_gate_up, offs=offs)
    y = _RowMajorGrad.apply(grouped_mm(glu_packed(au, activation), w_down, offs=offs))
    if not padded:
        return y
    real = torch.arange(N, device=x.device) < end
    return torch.where(real[:, None], y, y.new_zeros(()))


def naive_expert_ffn(x: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                     w_down: torch.Tensor, activation: str = "situ") -> torch.Tensor:
    """``expert_ffn`` as a plain loop over experts with ``@``: the reference, in any float dtype."""
    _check_weights(x, w_gate, w_up, w_down, offsets)
    y = torch.zeros_like(x)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        rows = x[start:end]
        y[start:end] = glu(rows @ w_gate[e], rows @ w_up[e], activation) @ w_down[e]
        start = end
    return y


class GroupedExperts(nn.Module):
    """E gated FFN experts (d -> h -> d) as stacked weights.

    Args:
        E (int): number of experts.
        d (int): input and output width (K3's routed experts: the latent width, 3584).
        h (int): expert hidden width (K3: 3072).
        activation (str): ``"situ"`` or ``"swiglu"``.
        init_std (float): std of ``w_gate`` and ``w_up``; ``out_std`` that of ``w_down`` (default
            ``init_std``).

    Parameters: ``w_gate``, ``w_up`` [E, d, h]; ``w_down`` [E, h, d].
    ``forward(x [N, d], offsets [E] int32, padded=True) -> [N, d]`` is ``expert_ffn``; ``ep_forward`` runs the module as
    one expert-parallel rank's share of the experts (``k3lab.moonep``).
    """

    def __init__(self, E: int, d: int, h: int, activation: str = "situ", init_std: float = 0.02,
                 out_std: float | None = None):
        super().__init__()
        for name, n in (("E", E), ("d", d), ("h", h)):
            if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
                raise ValueError(f"GroupedExperts: {name} must be a positive int, got {n!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"GroupedExperts: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.E, self.d, self.h, self.activation = E, d, h, activation
        self.w_gate = nn.Parameter(torch.empty(E, d, h))
        self.w_up = nn.Parameter(torch.empty(E, d, h))
        self.w_down = nn.Parameter(torch.empty(E, h, d))
        self.reset_parameters(init_std, out_std)

    def reset_parameters(self, init_std: float = 0.02, out_std: float | None = None) -> None:
        nn.init.normal_(self.w_gate, std=init_std)
        nn.init.normal_(self.w_up, std=init_std)
        nn.init.normal_(self.w_down, std=init_std if out_std is None else out_std)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, *, padded: bool = True) -> torch.Tensor:
        if x.dtype == torch.float64:
            return naive_expert_ffn(x, offsets, self.w_gate, self.w_up, self.w_down, self.activation)
        return expert_ffn(*_autocast(x, offsets, self.w_gate, self.w_up, self.w_down), self.activation, padded=padded)

    def ep_forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, group,
                   mode: str = "moonep", pad_mask: torch.Tensor | None = None, grad_scale: float = 1.0) -> torch.Tensor:
        """The routed sum sum_k topk_weight[t, k] FFN_{topk_idx[t, k]}(x[t]) with this module holding one
        expert-parallel rank's experts (``k3lab.moonep.moonep_experts`` over ``group`` in ``mode``).

        Args:
            x (Tensor): [S, d] this rank's tokens. topk_idx (Tensor): [S, K] int64 global expert ids.
            topk_weight (Tensor): [S, K] float. pad_mask (Tensor | None): [S] bool, True for padding.
            grad_scale (float): factor on the expert weights' gradients, which ``moonep_experts`` sums over
                the ranks' losses (1 / R makes them the mean, as data parallelism averages).

        A method of the module (not a function reading its weights) so that a wrapper hooked on calls,
        FSDP2 through ``register_fsdp_forward_method(experts, "ep_forward")``, gathers the weights before
        it and reduces their gradients after. DTensor weights (sharded over the ep mesh axis) give
        their local shard, [E/R, d, h], with autograd kept.

        Returns:
            Tensor [S, d], x's dtype.

        Raises:
            ValueError: what ``moonep_experts`` raises (shapes, mode, E not R x local experts).
        """
        from k3lab.moonep import moonep_experts  # noqa: PLC0415  (k3lab.moonep imports k3lab.moe)

        def local(w):
            w = local_shard(w)
            return w if grad_scale == 1.0 else _ScaleGrad.apply(w, grad_scale)

        x, w_gate, w_up, w_down = _autocast(x, local(self.w_gate), local(self.w_up), local(self.w_down))
        weights = SimpleNamespace(w_gate=w_gate, w_up=w_up, w_down=w_down, activation=self.activation)
        # The ids come from a router (in [0, E) by construction): skip moonep's host-side check, a sync per layer.
        return moonep_experts(x, topk_idx, topk_weight, weights, group, mode=mode, pad_mask=pad_mask,
                              check_ids=False)

    def extra_repr(self) -> str:
        return f"E={self.E}, d={self.d}, h={self.h}, activation={self.activation}"


def _autocast(x: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(x, *tensors)`` with every float32/bfloat16/float16 one in autocast's dtype when autocast is on for
    x's device, as autocast casts an nn.Linear's input and weight (grouped_mm is not on its list); else
    unchanged. The tokens are cast too: a full-width MoE gets the float32 norm output, not a projection's
    bf16 one. Integer tensors (offsets) and float64 pass through, as under autocast."""
    dtype = autocast_dtype(x.device.type)
    if dtype is None:
        return (x, *tensors)
    return tuple(t.to(dtype) if t.dtype in AUTOCAST_DTYPES else t for t in (x, *tensors))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``. No collectives."""

    @staticmethod
    def forward(ctx, w, scale):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class GatedFFN(nn.Module):
    """A dense gated FFN, ``W_down glu(W_gate x, W_up x)``: [..., d] -> [..., d].

    K3's shared experts (2 of hidden 3072 each, run as one FFN of hidden 2 x 3072: summing two
    experts equals one FFN with their hidden units side by side) and its first, dense layer.

    Raises:
        ValueError: d or hidden not a positive int, an unknown activation.
    """

    def __init__(self, d: int, hidden: int, activation: str = "situ", init_std: float = 0.02,
                 out_std: float | None = None):
        super().__init__()
        for name, n in (("d", d), ("hidden", hidden)):
            if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
                raise ValueError(f"GatedFFN: {name} must be a positive int, got {n!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"GatedFFN: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        nn.init.normal_(self.gate_up.weight, std=init_std)
        nn.init.normal_(self.down.weight, std=init_std if out_std is None else out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(glu(a, u, self.activation))


def depth_scaled_std(init_std: float, n_layers: int) -> float:
    """``init_std / sqrt(2 n_layers)``: the std of a projection that writes into the residual stream
    (GPT-2's scaling, as ``k3lab.lm`` uses), so the stream's variance does not grow with depth."""
    return init_std / math.sqrt(2 * n_layers)
