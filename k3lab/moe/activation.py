"""SiTU-GLU, K3's bounded gated activation (K3 report, Eq. 12).

    gate = b1 * tanh(a / b1) * sigmoid(a)        a = W_gate x
    up   = b2 * tanh(u / b2)                     u = W_up x
    out  = gate * up                             |gate| < b1, |up| < b2, so |out| < b1 * b2

K3 uses b1 = 4, b2 = 25: every activation stays below 100 in magnitude whatever the weights do,
which is what keeps bf16 expert outputs (and their gradients) from blowing up late in training.
As b1, b2 -> infinity, b1 tanh(a / b1) -> a and b2 tanh(u / b2) -> u: SiTU-GLU tends to SwiGLU,
SiLU(a) * u. Near zero the two agree to second order, so a small-input test cannot tell them
apart; one with |a| > b1 or |u| > b2 does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BETA1 = 4.0
BETA2 = 25.0
ACTIVATIONS = ("situ", "swiglu")


def situ_glu(a: torch.Tensor, u: torch.Tensor, beta1: float = BETA1, beta2: float = BETA2) -> torch.Tensor:
    """SiTU-GLU: ``[b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(u/b2)]``, elementwise.

    Args:
        a (Tensor): [..., h] gate pre-activations, any float dtype.
        u (Tensor): [..., h] up pre-activations, same shape and dtype as ``a``.
        beta1 (float): b1 > 0, the gate's bound (K3: 4).
        beta2 (float): b2 > 0, the up branch's bound (K3: 25).

    Returns:
        Tensor [..., h], ``a``'s dtype; every entry is at most ``beta1 * beta2`` in magnitude (below it in exact arithmetic; the
        saturated tanh and sigmoid round to 1, so the bound itself is reached).

    Raises:
        TypeError: ``a`` or ``u`` is not a floating-point tensor.
        ValueError: ``a`` and ``u`` differ in shape or dtype, or a beta is not a positive finite number
            (a bool is not one).
    """
    for name, t in (("a", a), ("u", u)):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"situ_glu: {name} must be a floating-point tensor, got {got}")
    if a.shape != u.shape or a.dtype != u.dtype:
        raise ValueError(f"situ_glu: a and u must have the same shape and dtype, got {list(a.shape)} {a.dtype} "
                         f"and {list(u.shape)} {u.dtype}")
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not (isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < float("inf")):
            raise ValueError(f"situ_glu: {name} must be a positive finite number, got {b!r}")
    return (beta1 * torch.tanh(a / beta1) * torch.sigmoid(a)) * (beta2 * torch.tanh(u / beta2))


FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def glu(a: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated unit by name: ``"situ"`` (K3, ``situ_glu`` with b1 = 4, b2 = 25) or ``"swiglu"``
    (``SiLU(a) * u``, the baseline). Raises ValueError for any other name.

    On a GPU (float32/bf16/fp16) it runs as one fused Triton kernel each way
    (``k3lab.kernels.moe.fused_glu``, the same function checked against this one); elsewhere as the
    PyTorch expression below. Under ``torch.compile`` the expression too: inductor fuses it (forward and
    backward) with the ops around it, where the kernel's autograd.Function would end the graph.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if (a.is_cuda and a.dtype in FUSED_DTYPES and a.shape == u.shape and a.dtype == u.dtype
            and not torch.compiler.is_compiling()):
        from k3lab.kernels.moe import fused_glu

        return fused_glu(a, u, activation, BETA1, BETA2)
    if activation == "situ":
        return situ_glu(a, u)
    return F.silu(a) * u



def glu_packed(au: torch.Tensor, activation: str) -> torch.Tensor:
    """``glu(a, u, activation)`` for au = [a | u] [..., 2h], packed along the last dim (one GEMM against
    [W_gate | W_up]); the gradient of au comes back packed. On a GPU one fused kernel each way
    (``k3lab.kernels.moe.fused_glu_packed``); elsewhere, and under ``torch.compile``, ``glu`` on the two halves.

    Raises:
        ValueError: an unknown activation; au with no last dim or an odd one.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if au.ndim == 0 or au.shape[-1] % 2:
        raise ValueError(f"au must be [..., 2h] (a and u side by side), got {list(au.shape)}")
    if au.is_cuda and au.dtype in FUSED_DTYPES and not torch.compiler.is_compiling():
        from k3lab.kernels.moe import fused_glu_packed

        return fused_glu_packed(au, activation, BETA1, BETA2)
    a, u = au.chunk(2, dim=-1)
    return glu(a, u, activation)