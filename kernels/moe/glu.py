"""SiTU-GLU (and SwiGLU) fused: one kernel forward, one backward that recomputes from (a, u).

``fused_glu_packed`` takes a and u side by side in one [rows, 2h] tensor, the output of one grouped GEMM
against the experts' [W_gate | W_up], and returns their gradient packed the same way.

Unfused, autograd runs the activation as about eight elementwise kernels forward and fifteen backward,
each a full pass over the [rows, h] activations, and keeps their intermediates alive; at K3's expert
shapes that is a fifth of the expert block's time. Fused, the forward reads a and u and writes out;
the backward reads a, u and d_out and writes da and du: the fewest passes the math allows.

    g(a) = b1 tanh(a / b1) sigmoid(a)      g'(a) = (1 - tanh^2(a / b1)) sigmoid(a) + g(a) (1 - sigmoid(a))
    v(u) = b2 tanh(u / b2)                 v'(u) = 1 - tanh^2(u / b2)
    SwiGLU: g(a) = a sigmoid(a), v(u) = u  (g'(a) = sigmoid(a) + g(a) (1 - sigmoid(a)), v' = 1)

All arithmetic in float32, whatever the storage dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1: saturates cleanly to +-1 in float32 (exp overflows to inf, 1/inf = 0).
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _rows(o_, h, stride):
    # Element o_ of a contiguous [rows, h] output sits at row o_ // h of inputs whose rows are ``stride`` apart.
    row = o_ // h
    return row * stride + (o_ - row * h)


@triton.jit
def glu_fwd_kernel(a_ptr, u_ptr, o_ptr, n, h, stride, beta1, beta2, SITU: tl.constexpr, BLOCK: tl.constexpr):
    # o [n / h, h] contiguous; a and u rows of h, ``stride`` elements apart (h, or 2h for a packed [rows, 2h]).
    i_b = tl.program_id(0)
    o_ = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_ = o_ < n
    o_in = _rows(o_, h, stride)
    b_a = tl.load(a_ptr + o_in, mask=m_, other=0.0).to(tl.float32)
    b_u = tl.load(u_ptr + o_in, mask=m_, other=0.0).to(tl.float32)
    if SITU:
        b_o = beta1 * _tanh(b_a / beta1) * _sigmoid(b_a) * (beta2 * _tanh(b_u / beta2))
    else:
        b_o = b_a * _sigmoid(b_a) * b_u
    tl.store(o_ptr + o_, b_o.to(o_ptr.dtype.element_ty), mask=m_)


@triton.jit
def glu_bwd_kernel(a_ptr, u_ptr, do_ptr, da_ptr, du_ptr, n, h, stride, beta1, beta2, SITU: tl.constexpr,
                   BLOCK: tl.constexpr):
    # do contiguous like o; da and du laid out like a and u.
    i_b = tl.program_id(0)
    o_ = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_ = o_ < n
    o_in = _rows(o_, h, stride)
    b_a = tl.load(a_ptr + o_in, mask=m_, other=0.0).to(tl.float32)
    b_u = tl.load(u_ptr + o_in, mask=m_, other=0.0).to(tl.float32)
    b_do = tl.load(do_ptr + o_, mask=m_, other=0.0).to(tl.float32)
    b_s = _sigmoid(b_a)
    if SITU:
        b_ta = _tanh(b_a / beta1)
        b_g = beta1 * b_ta * b_s
        b_dg = (1.0 - b_ta * b_ta) * b_s + b_g * (1.0 - b_s)
        b_tu = _tanh(b_u / beta2)
        b_v = beta2 * b_tu
        b_dv = 1.0 - b_tu * b_tu
    else:
        b_g = b_a * b_s
        b_dg = b_s + b_g * (1.0 - b_s)
        b_v = b_u
        b_dv = 1.0
    tl.store(da_ptr + o_in, (b_do * b_v * b_dg).to(da_ptr.dtype.element_ty), mask=m_)
    tl.store(du_ptr + o_in, (b_do * b_g * b_dv).to(du_ptr.dtype.element_ty), mask=m_)


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


class FusedGLU(torch.autograd.Function):
    """forward: one kernel, out = g(a) v(u); backward: one kernel, (da, du) from (a, u, d_out).
    No collectives. Saves a and u (the GEMM outputs, alive anyway), nothing else."""

    @staticmethod
    def forward(ctx, a, u, situ: bool, beta1: float, beta2: float):
        a, u = a.contiguous(), u.contiguous()
        out = torch.empty_like(a)
        n = a.numel()
        glu_fwd_kernel[_grid(n)](a, u, out, n, max(n, 1), max(n, 1), beta1, beta2, SITU=situ, BLOCK=BLOCK)
        ctx.save_for_backward(a, u)
        ctx.cfg = (situ, beta1, beta2)
        return out

    @staticmethod
    def backward(ctx, d_out):
        a, u = ctx.saved_tensors
        situ, beta1, beta2 = ctx.cfg
        d_out = d_out.contiguous()
        da, du = torch.empty_like(a), torch.empty_like(u)
        n = a.numel()
        glu_bwd_kernel[_grid(n)](a, u, d_out, da, du, n, max(n, 1), max(n, 1), beta1, beta2, SITU=situ,
                                 BLOCK=BLOCK)
        return da, du, None, None, None


class FusedPackedGLU(torch.autograd.Function):
    """``FusedGLU`` on a and u packed side by side, au = [a | u] [rows, 2h] (one grouped GEMM's output against
    [W_gate | W_up]); backward writes d_au in the same packing, the input of one GEMM back."""

    @staticmethod
    def forward(ctx, au, situ: bool, beta1: float, beta2: float):
        au = au.contiguous()
        h = au.shape[-1] // 2
        out = au.new_empty(*au.shape[:-1], h)
        n = out.numel()
        glu_fwd_kernel[_grid(n)](au, au[..., h:], out, n, h, 2 * h, beta1, beta2, SITU=situ, BLOCK=BLOCK)
        ctx.save_for_backward(au)
        ctx.cfg = (situ, beta1, beta2)
        return out

    @staticmethod
    def backward(ctx, d_out):
        au, = ctx.saved_tensors
        situ, beta1, beta2 = ctx.cfg
        d_out = d_out.contiguous()
        h = au.shape[-1] // 2
        d_au = torch.empty_like(au)
        n = d_out.numel()
        glu_bwd_kernel[_grid(n)](au, au[..., h:], d_out, d_au, d_au[..., h:], n, h, 2 * h, beta1, beta2,
                                 SITU=situ, BLOCK=BLOCK)
        return d_au, None, None, None


def fused_glu(a: torch.Tensor, u: torch.Tensor, activation: str = "situ", beta1: float = 4.0,
              beta2: float = 25.0) -> torch.Tensor:
    """``k3lab.moe.activation.glu`` in one Triton kernel each way.

    Args:
        a, u (Tensor): [..., h] gate and up pre-activations, same shape, float32/bfloat16/float16, on the
            GPU (or on the CPU under TRITON_INTERPRET=1).
        activation (str): ``"situ"`` (K3 Eq. 12, bounds ``beta1``, ``beta2``) or ``"swiglu"``.

    Returns:
        Tensor [..., h], ``a``'s dtype.

    Raises:
        ValueError: shapes or dtypes differ, or an unknown activation.
    """
    if a.shape != u.shape or a.dtype != u.dtype:
        raise ValueError(f"fused_glu: a and u must share shape and dtype, got {list(a.shape)} {a.dtype} and "
                         f"{list(u.shape)} {u.dtype}")
    if activation not in ("situ", "swiglu"):
        raise ValueError(f"fused_glu: activation must be 'situ' or 'swiglu', got {activation!r}")
    return FusedGLU.apply(a, u, activation == "situ", float(beta1), float(beta2))


def fused_glu_packed(au: torch.Tensor, activation: str = "situ", beta1: float = 4.0,
                     beta2: float = 25.0) -> torch.Tensor:
    """``fused_glu(a, u)`` for au = [a | u] packed along the last dim, without splitting it.

    Args:
        au (Tensor): [..., 2h] float32/bfloat16/float16, a in the first h columns and u in the last h.
        activation (str), beta1, beta2: as in ``fused_glu``.

    Returns:
        Tensor [..., h], ``au``'s dtype; the gradient of au comes back packed the same way.

    Raises:
        ValueError: au has no last dim or an odd one, or an unknown activation.
    """
    if au.ndim == 0 or au.shape[-1] % 2:
        raise ValueError(f"fused_glu_packed: au must be [..., 2h] (a and u side by side), got {list(au.shape)}")
    if activation not in ("situ", "swiglu"):
        raise ValueError(f"fused_glu_packed: activation must be 'situ' or 'swiglu', got {activation!r}")
    return FusedPackedGLU.apply(au, activation == "situ", float(beta1), float(beta2))
