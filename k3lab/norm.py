"""RMSNorm for mixed precision: the weight follows the input's dtype.

Under bf16 autocast a norm meets a bf16 input (a projection's output) and its float32 weight; torch's
``rms_norm`` then leaves its fused kernel for a composite of elementwise kernels (forward and backward) and
warns once per call site. Casting the weight (d values) to the input's dtype keeps the fused path; the
statistics are still accumulated in float32 inside the kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    """``y = x / sqrt(mean(x^2, last dims) + eps) * w``, as ``torch.nn.RMSNorm`` (same parameter, same
    state dict), with ``w`` cast to ``x``'s dtype when they differ; the weight's gradient reaches the float32
    parameter through the cast.

    Shapes: x [..., *normalized_shape] (any float dtype) -> y, same shape and dtype as x.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w is not None and w.dtype != x.dtype:
            w = w.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, w, self.eps)
