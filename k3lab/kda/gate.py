"""KDA's channel-wise forget gates, in log space (g = log alpha <= 0)."""
from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from k3lab.kda.checks import _shape
from k3lab.precision import widen


def check_gate_params(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> None:
    """ValueError unless z is a floating-point [B, T, HV, K] tensor (an integer one would give a truncated
    integer gate) and ``check_gate_shapes`` passes for its HV and K."""
    if not isinstance(z, torch.Tensor) or z.dim() != 4:
        raise ValueError(f"z must be a [B, T, HV, K] tensor, got {_shape(z)}")
    if not z.is_floating_point():
        raise ValueError(f"z must be a floating-point tensor, got dtype {z.dtype}")
    check_gate_shapes(z.shape[2], z.shape[3], A_log, dt_bias)


def check_gate_shapes(HV: int, K: int, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> None:
    """ValueError unless A_log is a floating-point [HV] tensor and dt_bias None or a floating-point
    [HV * K] or [HV, K] one (no broadcasting: a wrong-sized A_log would otherwise broadcast over the K
    axis; an integer one has no gradient)."""
    if not isinstance(A_log, torch.Tensor) or A_log.shape != (HV,):
        raise ValueError(f"A_log must be a [HV] = [{HV}] tensor, got {_shape(A_log)}")
    if dt_bias is not None and (not isinstance(dt_bias, torch.Tensor) or dt_bias.shape not in ((HV * K,), (HV, K))):
        raise ValueError(f"dt_bias must be [HV * K] = [{HV * K}] or [HV, K] = [{HV}, {K}], got {_shape(dt_bias)}")
    for name, x in dict(A_log=A_log, dt_bias=dt_bias).items():
        if x is not None and not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_lower_bound(lower_bound) -> None:
    """ValueError unless ``lower_bound`` is a finite negative number (a bool is refused)."""
    if (not isinstance(lower_bound, numbers.Real) or isinstance(lower_bound, bool)
            or not math.isfinite(lower_bound) or not lower_bound < 0):
        raise ValueError(f"lower_bound must be a finite negative number, got {lower_bound!r}")


def kimi_linear_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Kimi Linear's gate g = -exp(A_log) * softplus(z + dt_bias) (Kimi Linear report, KDA gate).

    Args:
        z (Tensor): [B, T, HV, K] pre-activation from the decay projection.
        A_log (Tensor): [HV] per-head log decay rate.
        dt_bias (Tensor | None): [HV * K] or [HV, K] bias.

    Returns:
        Tensor: [B, T, HV, K] log-decay in (-inf, 0], in z's dtype (computed in float32 or wider), while
        exp(A_log) is finite in that dtype: beyond (A_log >= 89 in float32) the product overflows to -inf, or
        to NaN where softplus underflows to 0. Not checked here (a read back per call); ``KDALayer`` names
        such an A_log.

    Raises:
        ValueError: z not a floating-point [B, T, HV, K] tensor, A_log not [HV], dt_bias not [HV * K] or
            [HV, K].
    """
    check_gate_params(z, A_log, dt_bias)
    x = widen(z)
    if dt_bias is not None:
        x = x + dt_bias.reshape(z.shape[-2:])
    return (-A_log.to(x.dtype).exp()[:, None] * F.softplus(x)).to(z.dtype)


def lower_bounded_gate(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None, lower_bound: float = -5.0
) -> torch.Tensor:
    """K3's lower-bounded gate g = lower_bound * sigmoid(exp(A_log) * (z + dt_bias)) (K3 report, Eq. 5).

    Every per-token decay alpha = exp(g) lies in (exp(lower_bound), 1), so 16 tokens of decay stay
    above exp(16 * lower_bound) = e^-80 and 1/Gamma fits bf16's range. K3 initialises A_log = 0.

    Args:
        z (Tensor): [B, T, HV, K] pre-activation.
        A_log (Tensor): [HV] per-head log scale.
        dt_bias (Tensor | None): [HV * K] or [HV, K] bias.
        lower_bound (float): g_min < 0 (K3: -5).

    Returns:
        Tensor: [B, T, HV, K] log-decay in (lower_bound, 0), in z's dtype, while exp(A_log) is finite (beyond
        it, a z + dt_bias of exactly 0 gives NaN; ``KDALayer`` names such an A_log).

    Raises:
        ValueError: ``lower_bound`` not a finite negative number; z not a floating-point [B, T, HV, K]
            tensor, A_log not [HV], dt_bias not [HV * K] or [HV, K].
    """
    check_lower_bound(lower_bound)
    check_gate_params(z, A_log, dt_bias)
    x = widen(z)
    if dt_bias is not None:
        x = x + dt_bias.reshape(z.shape[-2:])
    return (lower_bound * torch.sigmoid(A_log.to(x.dtype).exp()[:, None] * x)).to(z.dtype)
