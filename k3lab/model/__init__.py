"""The K3 model (K3 report, Sec. 2, Table 1): config with the released field names and presets, the
hybrid KDA / Gated MLA model with Stable LatentMoE and Block AttnRes, and its accounting.

    config.py      K3Config, its presets ("k3-full", "k3-1b", "k3-tiny")
    model.py       K3Model (forward, packed documents, caches, generate), MTPModule (multi-token prediction)
    accounting.py  param_table / count_params (total and activated by component), flops_per_token, mfu
    pipeline.py    split_model: K3Stage pipeline stages at sublayer cuts (balanced_cuts), sum_queries_grad
"""
from k3lab.model.accounting import COMPONENTS, PEAK_FLOPS, count_params, flops_per_token, format_table, mfu, param_table
from k3lab.model.config import PRESETS, K3Config, k3_full_attn_layers
from k3lab.model.model import K3Model, MTPModule, build_mixer, moe_config
from k3lab.model.pipeline import K3Stage, balanced_cuts, split_model, sublayer_costs, sum_queries_grad

__all__ = ["COMPONENTS", "PEAK_FLOPS", "PRESETS", "K3Config", "K3Model", "K3Stage", "MTPModule", "balanced_cuts",
           "build_mixer", "count_params", "flops_per_token", "format_table", "k3_full_attn_layers", "mfu",
           "moe_config", "param_table", "split_model", "sublayer_costs", "sum_queries_grad"]
