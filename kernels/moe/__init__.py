"""Triton kernels for the MoE layer: the fused gated activation between the expert GEMMs."""
from k3lab.kernels.moe.glu import fused_glu, fused_glu_packed

__all__ = ["fused_glu", "fused_glu_packed"]
