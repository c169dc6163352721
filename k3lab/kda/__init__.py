"""Kimi Delta Attention: the reference recurrence, the chunkwise form, the gates and the layer."""
from k3lab.kda.chunk import chunk_kda
from k3lab.kda.gate import kimi_linear_gate, lower_bounded_gate
from k3lab.kda.layer import KDACache, KDALayer
from k3lab.kda.naive import naive_fused_kda, naive_recurrent_kda

__all__ = ["naive_recurrent_kda", "naive_fused_kda", "chunk_kda", "kimi_linear_gate", "lower_bounded_gate", "KDALayer", "KDACache"]
