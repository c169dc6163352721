"""``short_conv_silu``: a KDA layer's depthwise causal short convolution and its SiLU as one Triton kernel
forward and one backward (K3 report, Sec. 2.1: q, k, v = SiLU(ShortConv(W x))).

In PyTorch (``k3lab.kda.layer.causal_short_conv`` then ``F.silu``) the convolution is a concatenation with
the zero state, W shifted multiply-adds and the activation: about nine elementwise kernels forward and
twice that backward, each a full pass over a [B, T, C] tensor. Here the forward reads x once and writes y;
the backward is two passes: the first reads x and dy and writes dpre (float32) and per-tile sums of
dweight, recomputing the pre-activation from x rather than saving it; the second runs the convolution
backwards in time over dpre into dx. (One backward kernel that recomputed dpre at each of the W shifted
rows it needs did W times the work and measured 1.5 ms a call on an H100 at [16, 2048, 1024] bf16.)

    pre[b, t, c] = sum_{j<W} weight[c, j] * x[b, t - (W-1) + j, c]     (x before t = 0 is 0)
    y = silu(pre) = pre * sigmoid(pre)
    dpre = dy * silu'(pre),  silu'(p) = s (1 + p (1 - s)),  s = sigmoid(p)
    dx[t] = sum_j weight[c, j] * dpre[t + (W-1) - j]                      (dpre beyond T is 0)
    dweight[c, j] = sum_{b, t} dpre[b, t, c] * x[b, t - (W-1) + j, c]

Every row b is its own sequence starting from zeros (no state, no packed sequences: the layer keeps the
PyTorch path for those). Arithmetic is float32 whatever the storage dtype; the dweight partial sums of
each [BT, BC] tile go to a [tiles, C, W] float32 buffer summed in torch (deterministic, no atomics).
On a CPU-only machine call ``k3lab.setup()`` before importing this module (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.autograd import differentiable_once
from k3lab.kda.checks import _shape
from k3lab.kernels import interpreting

MIN_W, MAX_W = 2, 8
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Tiles (tokens x channels) and warps. Forward and dx: 16 values of a tile per thread. The backward's first
# pass: BS = 8 tokens a step over BT = 64 (one [C, W] dweight partial per 64 tokens).
FWD = dict(BT=16, BC=128, num_warps=4)
BWD = dict(BT=64, BS=8, BC=128, num_warps=4)
DX = FWD


@triton.jit
def _tap(weight, o_c, m_c, W: tl.constexpr, j: tl.constexpr):
    # Tap j of channels o_c as a [BC] float32 vector (weight: [C, W], any float dtype).
    return tl.load(weight + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)


@triton.jit
def _program(T, BT: tl.constexpr):
    # (token tile, channel tile, sequence) of this program: grid axis 0 runs over sequences x token tiles (its
    # limit is 2^31 - 1; axis 2's, 65535, would cap B), axis 1 over channel tiles.
    NT = tl.cdiv(T, BT)
    i_bt = tl.program_id(0)
    return i_bt % NT, tl.program_id(1), i_bt // NT


@triton.jit
def _tile(T, C, BT: tl.constexpr, BC: tl.constexpr):
    # Program (i_t, i_c, i_b)'s tile: rows [i_t BT, i_t BT + BT) and channels [i_c BC, i_c BC + BC) of sequence
    # i_b, as (row ids, channel ids, channel mask, the tile's first element, [BT, BC] offsets within the tile).
    # The first element in int64 (B T C may pass 2^31), offsets within the tile in int32.
    i_t, i_c, i_b = _program(T, BT)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    base = (i_b.to(tl.int64) * T + i_t * BT) * C
    return o_t, o_c, o_c < C, base, tl.arange(0, BT)[:, None] * C + o_c[None, :]


@triton.jit
def _shifted(x, base, o_bt, o_t, m_c, T, C, W: tl.constexpr, j: tl.constexpr):
    # Rows o_t - (W-1) + j of the tile (tap j's inputs), float32, zero before t = 0 and from T on.
    o_s = o_t + (j - (W - 1))
    m_s = ((o_s >= 0) & (o_s < T))[:, None] & m_c[None, :]
    return tl.load(x + base + o_bt + (j - (W - 1)) * C, mask=m_s, other=0.0).to(tl.float32)


@triton.jit
def short_conv_silu_fwd_kernel(x, weight, y, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    # x, y: [B, T, C] contiguous (y in x's dtype); weight: [C, W] contiguous, any float dtype. Tiles: ``_tile``.
    o_t, o_c, m_c, base, o_bt = _tile(T, C, BT, BC)
    b_p = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        b_p += _tap(weight, o_c, m_c, W, j)[None, :] * _shifted(x, base, o_bt, o_t, m_c, T, C, W, j)
    b_y = b_p * tl.sigmoid(b_p)
    m_tc = (o_t < T)[:, None] & m_c[None, :]
    tl.store(y + base + o_bt, b_y.to(y.dtype.element_ty), mask=m_tc)


@triton.jit
def short_conv_silu_dpre_kernel(x, weight, dy, dpre, dw_part, T, C, W: tl.constexpr, BT: tl.constexpr,
                                BS: tl.constexpr, BC: tl.constexpr):
    # Backward, first pass. x, dy: [B, T, C] contiguous; dpre: [B, T, C] float32; weight: [C, W];
    # dw_part: [B * cdiv(T, BT), C, W] float32, this program's sums of dpre * x per tap.
    # Program (i_t, i_c, i_b): rows [i_t BT, i_t BT + BT) of sequence i_b, BS rows at a time, channels
    # [i_c BC, i_c BC + BC). The taps and the W shifted x rows are tuples of tiles: each tap's dpre * x
    # accumulates elementwise in its own [BS, BC] tile and is summed over rows once, after the loop. (Summing
    # at every step crosses warps W times a step and made this pass 9x slower than its bytes.)
    i_t, i_c, i_b = _program(T, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_bt = tl.arange(0, BS)[:, None] * C + o_c[None, :]
    taps = ()
    acc = ()
    for j in tl.static_range(W):
        taps = taps + (_tap(weight, o_c, m_c, W, j)[None, :],)
        acc = acc + (tl.zeros([BS, BC], dtype=tl.float32),)
    for t0 in range(i_t * BT, tl.minimum(i_t * BT + BT, T), BS):
        o_t = t0 + tl.arange(0, BS)
        base = (i_b.to(tl.int64) * T + t0) * C
        m_tc = (o_t < T)[:, None] & m_c[None, :]
        xs = ()
        b_p = tl.zeros([BS, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            xs = xs + (_shifted(x, base, o_bt, o_t, m_c, T, C, W, j),)
            b_p += taps[j] * xs[j]
        b_s = tl.sigmoid(b_p)
        b_dy = tl.load(dy + base + o_bt, mask=m_tc, other=0.0).to(tl.float32)
        b_dp = b_dy * b_s * (1.0 + b_p * (1.0 - b_s))
        tl.store(dpre + base + o_bt, b_dp, mask=m_tc)
        summed = ()
        for j in tl.static_range(W):
            summed = summed + (acc[j] + b_dp * xs[j],)
        acc = summed
    o_dw = ((i_b * tl.cdiv(T, BT) + i_t).to(tl.int64) * C + o_c) * W
    for j in tl.static_range(W):
        tl.store(dw_part + o_dw + j, tl.sum(acc[j], axis=0), mask=m_c)


@triton.jit
def short_conv_silu_dx_kernel(dpre, weight, dx, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    # Backward, second pass: dx[t] = sum_{i<W} weight[c, W-1-i] * dpre[t + i] (dpre beyond T is 0), the
    # forward's convolution run backwards in time over the float32 dpre. Tiles as the forward's.
    o_t, o_c, m_c, base, o_bt = _tile(T, C, BT, BC)
    b_dx = tl.zeros([BT, BC], dtype=tl.float32)
    for i in tl.static_range(W):
        m_i = ((o_t + i) < T)[:, None] & m_c[None, :]
        b_dp = tl.load(dpre + base + o_bt + i * C, mask=m_i, other=0.0)
        b_dx += _tap(weight, o_c, m_c, W, W - 1 - i)[None, :] * b_dp
    m_tc = (o_t < T)[:, None] & m_c[None, :]
    tl.store(dx + base + o_bt, b_dx.to(dx.dtype.element_ty), mask=m_tc)


def _grid(B: int, T: int, C: int, cfg: dict) -> tuple[int, int]:
    return B * triton.cdiv(T, cfg["BT"]), triton.cdiv(C, cfg["BC"])


def _check(x, weight, dy=None, contiguous: bool = False) -> None:
    """The arguments' checks (``short_conv_silu``'s Raises); ``contiguous``: also their layout (the ops read raw
    pointers); dy as x."""
    if not isinstance(x, torch.Tensor) or x.ndim != 3:
        raise ValueError(f"x must be a [B, T, C] tensor, got {_shape(x)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    C = x.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [C, W] with C = x.shape[-1] = {C}, got {_shape(weight)}")
    if not MIN_W <= weight.shape[1] <= MAX_W:
        raise ValueError(f"weight's width W must be in [{MIN_W}, {MAX_W}], got weight {list(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point tensor, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    if dy is not None and (not isinstance(dy, torch.Tensor) or dy.shape != x.shape or dy.device != x.device):
        raise ValueError(f"dy must be a tensor of x's shape {list(x.shape)} on {x.device}, got {_shape(dy)}")
    if contiguous and not all(t.is_contiguous() for t in (x, weight, *([] if dy is None else [dy]))):
        raise ValueError("x, weight (and dy) must be contiguous: the kernels read them as dense row-major tensors")
    if x.device.type == "cpu" and not torch.compiler.is_compiling() and not interpreting():
        raise RuntimeError("short_conv_silu on CPU needs TRITON_INTERPRET=1 set before kernels are imported: "
                           "call k3lab.setup() first")


@torch.library.custom_op("k3lab::short_conv_silu_fwd", mutates_args=())
def short_conv_silu_fwd(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = silu(conv(x, weight)): x [B, T, C] contiguous, weight [C, W] contiguous -> y [B, T, C] in x's dtype.
    Not differentiable by itself: ``short_conv_silu`` gives it its backward."""
    _check(x, weight, contiguous=True)
    B, T, C = x.shape
    y = torch.empty_like(x)
    if y.numel():
        short_conv_silu_fwd_kernel[_grid(B, T, C, FWD)](x, weight, y, T, C, W=weight.shape[1], **FWD)
    return y


@short_conv_silu_fwd.register_fake
def _(x, weight):
    return torch.empty_like(x)


@torch.library.custom_op("k3lab::short_conv_silu_bwd", mutates_args=())
def short_conv_silu_bwd(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [B, T, C] in x's dtype, dweight [C, W] float32) from x, weight and dy [B, T, C], all contiguous."""
    _check(x, weight, dy, contiguous=True)
    B, T, C = x.shape
    W = weight.shape[1]
    dx = torch.empty_like(x)
    if not dx.numel():
        return dx, torch.zeros(C, W, dtype=torch.float32, device=x.device)
    dpre = torch.empty(B, T, C, dtype=torch.float32, device=x.device)
    dw_part = torch.empty(B * triton.cdiv(T, BWD["BT"]), C, W, dtype=torch.float32, device=x.device)
    short_conv_silu_dpre_kernel[_grid(B, T, C, BWD)](x, weight, dy, dpre, dw_part, T, C, W=W, **BWD)
    short_conv_silu_dx_kernel[_grid(B, T, C, DX)](dpre, weight, dx, T, C, W=W, **DX)
    return dx, dw_part.sum(0)


@short_conv_silu_bwd.register_fake
def _(x, weight, dy):
    return torch.empty_like(x), x.new_empty(weight.shape, dtype=torch.float32)


class ShortConvSiLUFunction(torch.autograd.Function):
    """Forward: one kernel, y = silu(conv(x)), saving only x and weight. Backward: a kernel recomputing the
    pre-activation, writing dpre and per-tile dweight sums (summed here), then a kernel from dpre to dx. Both
    are custom ops (``k3lab::short_conv_silu_fwd`` / ``_bwd``), so a compiled region calls the kernels
    without a graph break."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return short_conv_silu_fwd(x, weight)

    @staticmethod
    @differentiable_once
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = short_conv_silu_bwd(x, weight, dy.contiguous())
        return dx, dw.to(weight.dtype)


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of each row of x, fused (no state: x before t = 0 is 0).

    ``y[b, t, c] = silu(sum_{j<W} weight[c, j] * x[b, t-(W-1)+j, c])``, computed in float32; equal to
    ``F.silu(causal_short_conv(x, weight)[0])`` (``k3lab.kda.layer``) up to rounding.

    Args:
        x (Tensor): [B, T, C] float16, bfloat16 or float32, on the GPU (or the CPU under TRITON_INTERPRET=1).
        weight (Tensor): [C, W] any floating dtype, 2 <= W <= 8, on x's device; the last tap multiplies the
            current token.

    Returns:
        y (Tensor): [B, T, C] in x's dtype; differentiable once in x and weight (dweight in weight's dtype).

    Raises:
        ValueError: x not 3-D or not float16/bfloat16/float32; weight not a floating-point [C, W] with
            C = x.shape[-1] and W in [2, 8]; weight on another device than x. Inside ``torch.compile`` with
            ``fullgraph=True`` it reaches the caller as dynamo's error, with this message.
        RuntimeError: CPU tensors without TRITON_INTERPRET=1 (call ``k3lab.setup()`` first); compiled, when the
            graph runs.

    The kernels are the custom ops ``torch.ops.k3lab.short_conv_silu_fwd`` / ``_bwd`` (contiguous arguments,
    checked as here; not differentiable by themselves), which compiled graphs call as they are.

    Example:
        >>> y = short_conv_silu(torch.randn(2, 100, 256, device="cuda"), torch.randn(256, 4, device="cuda"))
    """
    _check(x, weight)
    return ShortConvSiLUFunction.apply(x.contiguous(), weight.contiguous())
