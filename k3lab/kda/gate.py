"""KDA's channel-wise forget gates, in log space (g = log alpha <= 0)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kimi_linear_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Kimi Linear's gate g = -exp(A_log) * softplus(z + dt_bias) (Kimi Linear report, KDA gate).

    Args:
        z (Tensor): [B, T, HV, K] pre-activation from the decay projection.
        A_log (Tensor): [HV] per-head log decay rate.
        dt_bias (Tensor | None): [HV * K] or [HV, K] bias.

    Returns:
        Tensor: [B, T, HV, K] log-decay in (-inf, 0], in z's dtype (computed in float32 or wider).
    """
    x = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
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
        Tensor: [B, T, HV, K] log-decay in (lower_bound, 0), in z's dtype.

    Raises:
        ValueError: ``lower_bound`` is not negative.
    """
    if not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    x = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
    if dt_bias is not None:
        x = x + dt_bias.reshape(z.shape[-2:])
    return (lower_bound * torch.sigmoid(A_log.to(x.dtype).exp()[:, None] * x)).to(z.dtype)
