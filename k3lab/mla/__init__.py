"""Gated multi-head latent attention (K3 report, Eq. 7): the NoPE layer with a sigmoid output gate,
its latent cache and absorbed decoding form, and the float64 reference.

    layer.py   GatedMLA, MLACache, absorbed_attention, attention_mask, context_mask (context parallel)
    naive.py   naive_gated_mla (loops over documents, heads and positions)
"""
from k3lab.mla.layer import GatedMLA, MLACache, absorbed_attention, attention_mask, context_mask
from k3lab.mla.naive import naive_gated_mla

__all__ = ["GatedMLA", "MLACache", "absorbed_attention", "attention_mask", "context_mask", "naive_gated_mla"]
