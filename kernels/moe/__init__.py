"""Triton kernels for the MoE layer: the fused gated activation between the expert GEMMs, and the gather-and-sum
of the combine (and of the dispatch's backward)."""
from k3lab.kernels.moe.gather import gather_sum
from k3lab.kernels.moe.glu import fused_glu, fused_glu_packed

__all__ = ["fused_glu", "fused_glu_packed", "gather_sum"]
