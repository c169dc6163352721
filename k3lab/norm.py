"""RMSNorm for mixed precision: the weight follows the input's dtype, the output autocast's.

Under bf16 autocast a norm meets a bf16 input (a projection's output) and its float32 weight; torch's
``rms_norm`` then leaves its fused kernel for a composite of elementwise kernels (forward and backward) and
warns once per call site. Casting the weight (d values) to the input's dtype keeps the fused path; the
statistics are still accumulated in float32 inside the kernel.

A float32 input under autocast (the residual stream) is normalised in float32, and the output is cast to
autocast's dtype once, here. Every norm of the model feeds matmuls (a sublayer's projections, the router,
the head), and autocast casts a float32 input separately for each of them: a KDA layer's five
projections made five casts of the same [B, T, d] tensor forward and five casts of its gradients back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3lab.precision import autocast_dtype


class RMSNorm(nn.RMSNorm):
    """``y = x / sqrt(mean(x^2, last dims) + eps) * w``, as ``torch.nn.RMSNorm`` (same parameter, same
    state dict), with ``w`` cast to ``x``'s dtype when they differ; the weight's gradient reaches the float32
    parameter through the cast.

    Shapes: x [..., *normalized_shape] (any float dtype) -> y, same shape as x; y's dtype is x's, except
    under autocast on x's device, where a float32 x gives y in autocast's dtype (computed in float32, then
    cast once: what each matmul consuming y would cast it to).

    Raises:
        ValueError: in forward, x not a floating-point tensor (an integer x reached torch's
            NotImplementedError; casting the weight to it would truncate it).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
            raise ValueError(f"RMSNorm: x must be a floating-point tensor, got "
                             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        w = self.weight
        if w is not None and w.dtype != x.dtype:
            w = w.to(x.dtype)
        y = F.rms_norm(x, self.normalized_shape, w, self.eps)
        if x.dtype == torch.float32:
            dtype = autocast_dtype(x.device.type)
            if dtype is not None:
                y = y.to(dtype)
        return y
