"""Parameter counts by component (total and activated) and FLOPs per token / MFU for ``K3Model``.

Conventions (stated once, used by both):

- Activated parameters are those a token's forward multiplies by: every parameter except the
  routed experts it does not visit (K of E per MoE layer, counted at the latent width they run at)
  and the input embedding (a table lookup; the LM head, a real [d, vocab] matmul, counts). The
  router counts in full (all E scores are computed).
- KDA's output gate is low rank (rank 128, Kimi Linear's W_g2 W_g1 + bias); its decay projection is
  full rank (K3 report). With these, the meta build of ``k3-full`` counts 2.7795T total and 104.19B
  activated against K3's 2.78T / 104.2B. A full-rank KDA output gate would give 2.785T / 110.1B, and
  counting the input embedding too adds 1.17B. The released config has no MTP layer; with
  ``num_nextn_predict_layers`` > 0 the MTP modules are counted under "mtp" (their routed experts K of E),
  and their Gated MLA layers join the attention term of ``flops_per_token``.
"""
from __future__ import annotations

import numbers
from collections import OrderedDict

import torch

from k3lab.model.config import K3Config

COMPONENTS = ("embedding", "head", "kda", "mla", "dense ffn", "moe routed experts", "moe shared experts",
              "moe latent projections", "moe router", "norms", "attnres queries", "mtp")

# Dense bf16 tensor-core peak (FLOP/s, no sparsity) of the GPUs the book runs on.
PEAK_FLOPS = {"h100": 989.4e12, "h200": 989.4e12}


def param_table(model: torch.nn.Module) -> "OrderedDict[str, tuple[int, int]]":
    """Total and activated parameters of a ``K3Model`` by component (see the module docstring).

    Args:
        model (K3Model): on any device (the meta device counts without allocating).

    Returns:
        OrderedDict component -> (total, activated), in ``COMPONENTS`` order plus "total"; tied weights
        counted once.

    Raises:
        ValueError: ``model`` is not a K3Model.
    """
    from k3lab.model.model import K3Model  # a cycle at import time otherwise

    if not isinstance(model, K3Model):
        raise ValueError(f"model must be a K3Model, got {type(model).__name__}")
    from k3lab.moe import MoE

    c = model.config
    routed_share = c.num_experts_per_tok / c.n_routed_experts
    # id(parameter) -> (component, fraction a token activates), from the module structure.
    where = {id(model.embed.weight): ("embedding", 0.0), id(model.head.weight): ("head", 1.0),
             id(model.residual.queries): ("attnres queries", 1.0)}
    for p in model.norm.parameters():
        where[id(p)] = ("norms", 1.0)
    kinds = c.layer_types()
    for i, sub in enumerate(model.sublayers):
        for p in sub.norm.parameters():
            where[id(p)] = ("norms", 1.0)
        f = sub.fn
        if i % 2 == 0:
            parts = [(f, kinds[i // 2], 1.0)]
        elif isinstance(f, MoE):
            parts = [(f.experts, "moe routed experts", routed_share), (f.router, "moe router", 1.0)]
            parts += [(m, "moe shared experts", 1.0) for m in (f.shared,) if m is not None]
            parts += [(m, "moe latent projections", 1.0) for m in (f.down, f.latent_norm, f.up) if m is not None]
        else:
            parts = [(f, "dense ffn", 1.0)]
        for module, comp, share in parts:
            for p in module.parameters():
                where.setdefault(id(p), (comp, share))
    for m in model.mtp:
        for p in m.ffn.fn.experts.parameters():
            where.setdefault(id(p), ("mtp", routed_share))
        for p in m.parameters():
            where.setdefault(id(p), ("mtp", 1.0))
    table = OrderedDict((k, [0, 0.0]) for k in COMPONENTS)
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) not in where:
            raise ValueError(f"param_table: parameter {name} belongs to no known component")
        comp, share = where[id(p)]
        table[comp][0] += p.numel()
        table[comp][1] += p.numel() * share
    out = OrderedDict((k, (v[0], int(round(v[1])))) for k, v in table.items())
    out["total"] = (sum(v[0] for v in out.values()), sum(v[1] for v in out.values()))
    return out


def count_params(config: K3Config | str = "k3-full", verbose: bool = False) -> "OrderedDict[str, tuple[int, int]]":
    """Build ``config`` (a K3Config or a preset name) on the meta device and count its parameters by
    component; K3 (``"k3-full"``) gives ~2.78T total and ~104.2B activated (K3 report, Table 1).

    Args:
        config (K3Config | str): the model; nothing is allocated.
        verbose (bool): print the table (``format_table``).

    Returns:
        ``param_table``'s OrderedDict component -> (total, activated).

    Raises:
        ValueError: an unknown preset name, or what ``K3Config`` raises.
    """
    from k3lab.model.model import K3Model

    if isinstance(config, str):
        config = K3Config.preset(config)
    with torch.device("meta"):
        model = K3Model(config)
    table = param_table(model)
    if verbose:
        print(format_table(table))
    return table


def format_table(table) -> str:
    """A fixed-width text table of ``param_table``'s output, in billions (B) of parameters."""
    lines = [f"{'component':<24}{'total (B)':>14}{'activated (B)':>16}"]
    for k, (tot, act) in table.items():
        lines.append(f"{k:<24}{tot / 1e9:>14.4f}{act / 1e9:>16.4f}")
    return "\n".join(lines)


def flops_per_token(config: K3Config | str, seq_len: int, causal: bool = False) -> float:
    """Training FLOPs per token of ``config`` at sequence length ``seq_len`` (forward + backward).

    Convention: 6 x activated parameters (``count_params``'s: the input embedding excluded, routed
    experts K of E at their real latent width, the LM head included) plus the shared head's matmul once
    more per MTP depth (6 * d * vocab each: every depth predicts through the one head) plus, for the Gated
    MLA layers (and the MTP modules' MLA) only, the attention scores and weighted sum: 6 * H * (Dn + Dr + Dv) * seq_len per MLA layer
    (forward 2 * H * (Dqk + Dv) * seq_len, backward twice that; the PaLM/torchtitan convention, which
    does not halve for the causal mask unless ``causal=True``). KDA's chunkwise state work is linear in
    T and not counted (its projections are in the 6N term), nor are the element-wise ops, norms and the
    AttnRes mixing.

    Args:
        config (K3Config | str): the model or a preset name.
        seq_len (int): T >= 1, the training sequence (document) length.
        causal (bool): halve the attention term (only the causal half is computed by a masked kernel).

    Returns:
        float FLOPs per token.

    Raises:
        ValueError: seq_len not a positive int (numpy's ints count); causal not a bool; an unknown preset.
    """
    if not (isinstance(seq_len, numbers.Integral) and not isinstance(seq_len, bool) and seq_len >= 1):
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    seq_len = int(seq_len)
    if isinstance(config, str):
        config = K3Config.preset(config)
    active = count_params(config)["total"][1]
    c = config
    attn = 6 * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * seq_len
    head = 6 * c.hidden_size * c.vocab_size * c.num_nextn_predict_layers
    return 6 * active + head + (c.num_mla_layers + c.num_nextn_predict_layers) * attn * (0.5 if causal else 1.0)


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float | str = "h100", n_gpus: int = 1) -> float:
    """Model FLOPs utilisation: tokens_per_s * flops_per_tok / (n_gpus * peak).

    Args:
        tokens_per_s (float): training throughput over all GPUs.
        flops_per_tok (float): from ``flops_per_token``.
        peak_flops (float | str): peak FLOP/s of one GPU, or a key of ``PEAK_FLOPS`` (dense bf16).
        n_gpus (int): GPUs the throughput is over.

    Returns:
        float in [0, 1] for a sound count (above 1 means the FLOPs are over-counted).

    Raises:
        ValueError: non-positive or non-finite inputs (numbers: Python's or numpy's), an unknown GPU name.
    """
    if isinstance(peak_flops, str):
        if peak_flops not in PEAK_FLOPS:
            raise ValueError(f"peak_flops must be a number or one of {sorted(PEAK_FLOPS)}, got {peak_flops!r}")
        peak_flops = PEAK_FLOPS[peak_flops]
    for name, v in (("tokens_per_s", tokens_per_s), ("flops_per_tok", flops_per_tok), ("peak_flops", peak_flops)):
        if not (isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < v < float("inf")):
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    if not (isinstance(n_gpus, numbers.Integral) and not isinstance(n_gpus, bool) and n_gpus >= 1):
        raise ValueError(f"n_gpus must be a positive int, got {n_gpus!r}")
    return float(tokens_per_s) * float(flops_per_tok) / (int(n_gpus) * float(peak_flops))
