"""Stable LatentMoE, SiTU-GLU, the sigmoid router and Quantile Balancing (chapter 05).

    activation.py  situ_glu (K3 Eq. 12) and the SwiGLU baseline
    router.py      route / Router: top-k on s + b, weights from s (Eq. 13)
    experts.py     stacked experts run by grouped GEMMs, and the loop reference
    balance.py     Quantile Balancing (exact and histogram), aux loss, sign update
    layer.py       MoE (latent or full width), MoEConfig, update_biases, balance_loss
"""
from k3lab.moe.activation import situ_glu
from k3lab.moe.balance import Balancing, histogram_bias, maxvio, quantile_bias
from k3lab.moe.experts import GatedFFN, GroupedExperts, expert_ffn, group_by_expert, naive_expert_ffn
from k3lab.moe.layer import MoE, MoEConfig, balance_loss, moe_layers, update_biases
from k3lab.moe.router import Router, Routing, route

__all__ = ["situ_glu", "Balancing", "histogram_bias", "maxvio", "quantile_bias", "GatedFFN", "GroupedExperts",
           "expert_ffn", "group_by_expert", "naive_expert_ffn", "MoE", "MoEConfig", "balance_loss", "moe_layers",
           "update_biases", "Router", "Routing", "route"]
