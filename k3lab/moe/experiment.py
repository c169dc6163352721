"""Chapter 05's experiments on the real corpus: balancing methods and LatentMoE vs full width.

``train_moe_lm`` trains ``k3lab.lm.LM`` with every FFN an ``MoE`` layer and records, per step and
per MoE layer, the load of each expert (from the bias of the previous step: the load the step
really ran with) and its maxvio; ``balance_floor`` measures how balanced any bias fitted on one
batch can be on the next one, the floor that batch-to-batch variation of the routed tokens sets.
"""
from __future__ import annotations

from dataclasses import replace

import torch

import k3lab.data as kdata
import k3lab.lm as lm
from k3lab.moe.balance import maxvio, quantile_bias
from k3lab.moe.experts import group_by_expert
from k3lab.moe.layer import MoE, MoEConfig, balance_loss, moe_layers, update_biases
from k3lab.moe.router import route


def build_moe_lm(lm_config: lm.LMConfig, moe_config: MoEConfig, seed: int = 0) -> lm.LM:
    """An ``LM`` whose every FFN is ``MoE(moe_config)`` (d and depth taken from ``lm_config``)."""
    c = replace(moe_config, d_model=lm_config.d_model, n_layers=lm_config.n_layers)
    torch.manual_seed(seed)
    return lm.LM(lm_config, ffn=lambda i: MoE(c))


def train_moe_lm(model: lm.LM, steps: int, batch_size: int, seq_len: int, lr: float, device, seed: int = 0,
                 log_every: int = 10, progress: bool = True, microbatches: int = 1) -> dict:
    """Train with ``k3lab.lm.train`` plus the MoE hooks: the aux loss (for ``balance="aux"`` layers) and
    the bias update after every optimizer step. With ``microbatches`` M, a step of ``batch_size`` sequences
    runs as M passes of batch_size / M (``lm.train``), and the bias update reads the counts of all M.

    Returns:
        ``lm.train``'s history plus ``loads`` [steps, layers, E] int64 and ``maxvio`` [steps, layers].
    """
    loads = []

    def after(step, m):
        loads.append(torch.stack(update_biases(m)).cpu())

    history = lm.train(model, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, device=device,
                       seed=seed, log_every=log_every, extra_loss=balance_loss, after_step=after, progress=progress,
                       microbatches=microbatches)
    history["loads"] = torch.stack(loads)
    history["maxvio"] = torch.tensor([[maxvio(l) for l in step] for step in history["loads"]])
    return history


@torch.no_grad()
def balance_floor(model: lm.LM, batches: int, batch_size: int, seq_len: int, device, seed: int = 1,
                  split: str = "val") -> dict:
    """How balanced a bias can be on a batch it was not fitted to.

    For each MoE layer and consecutive batches t, t+1 of ``split`` (random windows): the bias is fitted to
    batch t by Quantile Balancing run to convergence on it (30 exact updates), then applied to batch t (the
    in-sample maxvio, about 0) and to batch t+1 (the floor: no bias computed from past tokens can beat
    it on average). Also the model's own current bias on batch t+1 (what training sees).

    Args:
        split (str): "val" (held out, ~80K tokens: small batches) or "train" (~2M tokens: batches large
            enough that "val"'s windows would overlap).

    Returns:
        dict of [layers] float tensors: ``same_batch``, ``next_batch``, ``current_bias``.

    Raises:
        ValueError: ``split`` is not "train" or "val", or ``batches`` is not an int >= 2 (one pair of
            consecutive batches at least); checked before the model is touched.
    """
    if split not in kdata.SPLITS:
        raise ValueError(f"split must be one of {kdata.SPLITS}, got {split!r}")
    if not (isinstance(batches, int) and not isinstance(batches, bool) and batches >= 2):
        raise ValueError(f"batches must be an int >= 2 (consecutive pairs t, t+1), got {batches!r}")
    was = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    tokens = kdata.load_split(split)
    layers = moe_layers(model)
    routings = []
    for _ in range(batches):
        x, _ = kdata.get_batch(tokens, batch_size, seq_len, gen, device)
        model(x)
        routings.append([(m.last_routing.scores.clamp(1e-7, 1 - 1e-7).logit(), m.router.bias.clone()) for m in layers])
    out = {k: torch.zeros(len(layers)) for k in ("same_batch", "next_batch", "current_bias")}
    for i, m in enumerate(layers):
        K, E = m.config.top_k, m.config.n_experts
        for t in range(batches - 1):
            logits, bias_now = routings[t][i]
            b = torch.zeros(E, device=logits.device)
            for _ in range(30):
                r = route(logits, b, K)
                b = quantile_bias(r.scores, r.cutoff, K)
            nxt = routings[t + 1][i][0]
            for key, lg, bias in (("same_batch", logits, b), ("next_batch", nxt, b), ("current_bias", nxt, bias_now)):
                load = group_by_expert(route(lg, bias, K).topk_idx, E)[2]
                out[key][i] += maxvio(load) / (batches - 1)
    model.train(was)
    return out
