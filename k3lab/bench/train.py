"""End-to-end training on one GPU: k3lab's trainer on the real corpus, the Block AttnRes step overhead, and
torchtitan's DeepSeek-V3 model as the peer, all in one run.

    python -m k3lab.bench.train                                # k3-1b, 4 minutes -> data/results/train_<card>.json
    python -m k3lab.bench.train --minutes 10 --batch-size 8    # a longer run at a smaller batch
    python -m k3lab.bench.train --microbatches 4               # 4 micro-batches a step, the peer too
    python -m k3lab.bench.train --compile                      # each sublayer under torch.compile, the peer's blocks too
                                                               #   -> data/results/train_compile_<card>.json
    python -m k3lab.bench.train --minutes 10 --run-dir build/bench_train --stop-after-minutes 6
                                                               # a 10-minute run in parts: repeat until it writes the JSON
    python -m k3lab.bench.train --small --device cpu --out ''  # k3-tiny, a few steps: checks the script

Needs the token shards (``python -m k3lab.data build``) and, for the peer, torchtitan 0.3.0 (its wheel and
tyro's are carried to GPU nodes without internet; ``--no-torchtitan`` skips it).

Order: (1) correctness first: the model's loss under bf16 autocast against float32 on one real batch
(relative error printed and bounded, the benchmark stops past the bound; the logits' error recorded); a
warm-up run of the trainer (it finds a batch that fits, halving on CUDA out-of-memory, and times a step);
a short run with the trainer's value checks off under ``torch.cuda.set_sync_debug_mode("error")``
(``TrainConfig(sync_debug=True)``), pass or fail recorded with the error, the benchmark going on without
it; with ``--compile``, the compiled model's loss and gradients against the eager model's on one real batch
(``check_compile``). (2) ``k3lab.train.train`` on the corpus for ``--minutes`` (steps estimated from the warm-up): tokens/s
as the median of the ``--log-every`` windows after the first, MFU on ``k3lab.model.flops_per_token``'s
convention, peak memory, the loss curve. (3) The same step (bf16 autocast, Per-Head Muon, Quantile
Balancing) with Block AttnRes and with the standard residual h = h + f(h) (``k3lab.lm.PreNormResidual``)
swapped into one model between steps, so both time the same weights, optimizer and batch: the AttnRes
overhead is the ratio of the median step times minus one. (4) torchtitan's ``DeepSeekV3Model`` (MLA + MoE)
at k3lab's width, depth, heads, MLA ranks, experts and top-k, its expert width chosen so its activated
parameters match the preset's; forward + backward + AdamW under bf16 autocast on random tokens at the same
batch and length (on a CPU only its config and counts: FlexAttention has no CPU backward). ``--compile``
compiles k3lab's sublayers (``k3lab.train.compile_blocks``) in every run above and the peer's transformer blocks
as torchtitan's ``apply_compile`` does (fullgraph, scalar outputs captured). A table is printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from k3lab.bench import RoutingReplay, add_attnres_flags, check_out, positive_float, positive_int, run_info, write_result
from k3lab.data import load_split, resolve_data_dir
from k3lab.files import write_json
from k3lab.lm import PreNormResidual
from k3lab.model import K3Config, count_params, flops_per_token, mfu
from k3lab.moe import update_biases
from k3lab.optim import per_head_muon
from k3lab.testing import rel_rms_error
from k3lab.train import TokenLoader, TrainConfig, compile_blocks, train
from k3lab.train.config import ConfigError
from k3lab.train.loop import build_model, train_autocast
from k3lab.train.metrics import FLOPS_CONVENTION, after_first_window, peak_key, run_parts

# bf16 autocast against float32, same weights and batch: bound on the loss's relative error. The logits'
# error is recorded, not bounded: at initialisation the router's scores nearly tie, bf16 rounding sends some
# tokens to other experts (k3lab.bench.moe compares only tokens routed alike), and attention spreads those
# changes to every token (k3-1b on a CPU: logits off by ~100% RMS, the loss by 0.5%; with every expert
# selected, 8% and 0.01%).
BF16_LOSS_BOUND = 2e-2
# With the float32 run's experts replayed, the logits differ by bf16 arithmetic alone; a broken bf16 path
# (a wrong cast, a kernel on the wrong inputs) moves them by ~100% RMS.
BF16_LOGITS_BOUND = 0.25
PEER = "torchtitan 0.3.0 deepseek_v3 DeepSeekV3Model (MLA + MoE), built from its model class"
# In --run-dir: the first part's checks, batch and step count (so later parts repeat neither the checks nor
# the warm-up and keep the learning-rate schedule's length), and the trainer's log.
PLAN, LOG = "bench_plan.json", "metrics.jsonl"
# --stop-after-minutes already spent by the checks: the trainer then stops at its first --log-every step.
MIN_BUDGET_MINUTES = 1e-6


def read_plan(run_dir: str, settings: dict) -> dict | None:
    """The plan a first part wrote in ``run_dir`` (None: no run there yet).

    Raises:
        SystemExit: the run there was started with other flags (``settings``: preset, batch, micro-batches,
            length, log interval, compile, minutes or steps), or its plan file is unreadable.
    """
    path = Path(run_dir) / PLAN
    if not path.exists():
        return None
    try:
        plan = json.loads(path.read_text())
        saved = plan["settings"]
        # The later parts take the batch, step count and checks from here: a hand-edited value stops here.
        for key, ok in (("batch_size", _is_count), ("steps", _is_count), ("too_big", lambda v: isinstance(v, list)),
                        ("checks", lambda v: isinstance(v, dict)),
                        ("step_s", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0)):
            if not ok(plan[key]):
                raise ValueError(f"{key} {plan[key]!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--run-dir {run_dir}: {PLAN} is unreadable ({type(e).__name__}: {e}); start in another "
                         f"--run-dir") from None
    diff = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
    if diff:
        def say(v):
            return "default" if v is None else v
        told = ", ".join(f"{k} {say(a)} there, {say(b)} now" for k, (a, b) in diff.items())
        raise SystemExit(f"--run-dir {run_dir} holds a run started with other flags ({told}): repeat its command or "
                         f"use another --run-dir")
    return plan


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def real_batch(config: TrainConfig, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first batch of ``config``'s loader order: (x, y) int64 [batch_size, seq_len] on ``device``.

    Raises:
        FileNotFoundError: no token shards (``python -m k3lab.data build``).
    """
    tokens = load_split("train", resolve_data_dir(config.data_dir) / "shards")
    return TokenLoader(tokens, batch_size, config.seq_len, 0, 1, config.seed).next_batch(device)


def check_bf16(config: TrainConfig, device: torch.device, batch_size: int = 2) -> dict:
    """The run's model (``build_model``, float32 weights, training path) on one real batch of ``batch_size``
    x ``config.seq_len`` tokens, without autocast and under bf16 autocast (CPU autocast on a CPU).

    Returns:
        {"loss_fp32", "loss_bf16", "loss_rel_err" (|l16 - l32| / l32), "loss_bound", "logits_rel_rms_err"
        (routed freely: recorded, see ``BF16_LOSS_BOUND``), "logits_rel_rms_err_same_routing" (the float32
        run's experts replayed), "logits_bound_same_routing", "ok"}.

    Raises:
        AssertionError: the loss's relative error above ``BF16_LOSS_BOUND``, the same-routing logits' above
            ``BF16_LOGITS_BOUND``, or either not finite.
    """
    x, y = real_batch(config, batch_size, device)
    model = build_model(config, device)
    model.train()
    # The float32 run with routing recorded, then bf16 replaying its experts: only the arithmetic differs.
    replay = RoutingReplay(model)
    out = {}
    for name, autocast, pinned in (("fp32", False, False), ("bf16", True, False), ("fp32_rec", False, True),
                                   ("bf16_same_routing", True, True)):
        with replay if pinned else contextlib.nullcontext(), \
                torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits, loss = model(x, y)
        out[name] = (logits.detach().float(), float(loss.detach()))
        del logits, loss
    (logits32, loss32), (logits16, loss16) = out["fp32"], out["bf16"]
    err = abs(loss16 - loss32) / abs(loss32)
    same = rel_rms_error(out["fp32_rec"][0], out["bf16_same_routing"][0])
    result = dict(loss_fp32=loss32, loss_bf16=loss16, loss_rel_err=err, loss_bound=BF16_LOSS_BOUND,
                  logits_rel_rms_err=rel_rms_error(logits32, logits16), logits_rel_rms_err_same_routing=same,
                  logits_bound_same_routing=BF16_LOGITS_BOUND,
                  ok=err <= BF16_LOSS_BOUND and same <= BF16_LOGITS_BOUND)
    print(f"check bf16 vs float32: loss {loss16:.5f} vs {loss32:.5f}, rel err {err:.2e} (bound {BF16_LOSS_BOUND:.0e}); "
          f"logits rel RMS err {same:.2e} with the float32 routing (bound {BF16_LOGITS_BOUND:.2g}), "
          f"{result['logits_rel_rms_err']:.2e} routed freely (near ties, not bounded)", flush=True)
    del model, out, logits32, logits16
    _free(device)
    if not result["ok"]:
        raise AssertionError(f"bf16 autocast disagrees with float32 past its bounds: {result}")
    return result


def check_compile(config: TrainConfig, device: torch.device, batch_size: int = 2) -> dict:
    """The run's model (``build_model``, value checks off, training mode) and a copy of it under
    ``compile_blocks``: forward and backward on one real batch of ``batch_size`` x ``config.seq_len`` tokens in the
    trainer's precision (bf16 autocast on CUDA). Inductor keeps float32 between the ops it fuses, so the two differ
    by bf16 rounding, and near-tied routers may send a few tokens elsewhere (``BF16_LOSS_BOUND``): the loss is
    bounded, the gradients recorded.

    Returns:
        {"loss_eager", "loss_compiled", "loss_rel_err", "loss_bound", "grads_max_rel_rms_err", "grads_worst"
        (that parameter's name), "ok"}.

    Raises:
        AssertionError: the loss's relative error above ``BF16_LOSS_BOUND`` or not finite.
    """
    x, y = real_batch(config, batch_size, device)
    eager = build_model(config, device)
    compiled = compile_blocks(copy.deepcopy(eager))
    out = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        model.value_checks(False)
        model.train()
        with train_autocast(device):
            _, loss = model(x, y, return_logits=False)
        loss.backward()
        out[name] = (float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (l_e, g_e), (l_c, g_c) = out["eager"], out["compiled"]
    err = abs(l_c - l_e) / abs(l_e)
    grads = {n: rel_rms_error(g_e[n], g_c[n]) for n in g_e if n in g_c}
    worst = max(grads, key=grads.get)
    result = dict(loss_eager=l_e, loss_compiled=l_c, loss_rel_err=err, loss_bound=BF16_LOSS_BOUND,
                  grads_max_rel_rms_err=grads[worst], grads_worst=worst, ok=err <= BF16_LOSS_BOUND)
    print(f"check compile vs eager: loss {l_c:.5f} vs {l_e:.5f}, rel err {err:.2e} (bound {BF16_LOSS_BOUND:.0e}); "
          f"gradients' max rel RMS err {grads[worst]:.2e} ({worst}; not bounded)", flush=True)
    del eager, compiled, out, g_e, g_c
    _free(device)
    if not result["ok"]:
        raise AssertionError(f"the compiled model disagrees with the eager one past the loss bound: {result}")
    return result


def check_sync(config: TrainConfig, device: torch.device) -> dict:
    """Two trainer steps with ``sync_debug=True`` (value checks off, every step body under
    ``torch.cuda.set_sync_debug_mode("error")``; enforced on CUDA only). A failure is recorded, not raised.

    Returns:
        {"ok", "enforced" (bool: a CUDA device), "steps", "error" (first line, or None), "where" (the
        innermost k3lab frames of the failure)}.
    """
    out = dict(ok=True, enforced=device.type == "cuda", steps=2, error=None, where=[])
    try:
        train(replace(config, steps=2, log_every=2, sync_debug=True, progress=False))
    except RuntimeError as e:
        frames = [f"{f.filename.split('k3lab/', 1)[-1]}:{f.lineno} {f.name}"
                  for f in traceback.extract_tb(e.__traceback__) if "k3lab" in f.filename]
        out.update(ok=False, error=(str(e).strip().splitlines() or [type(e).__name__])[0][:500], where=frames[-4:])
    _free(device)
    verdict = ("skipped (enforced on CUDA only; the steps ran)" if not out["enforced"] else
               "pass" if out["ok"] else "FAIL: " + out["error"] + " at " + " <- ".join(reversed(out["where"])))
    print(f"check sync debug: {verdict}", flush=True)
    return out


def warm_up(config: TrainConfig, device: torch.device) -> tuple[TrainConfig, float, list[int]]:
    """Four trainer steps (two windows of two) at ``config.batch_size``, the micro-batch (``batch_size /
    microbatches`` sequences) halved after each CUDA out-of-memory error: compiles and autotunes the kernels
    for the run's shapes and times a step.

    Returns:
        (config with the batch that fit, seconds per step of the second window, the micro-batches that did
        not fit).

    Raises:
        torch.cuda.OutOfMemoryError: not even one sequence fits.
    """
    M = config.microbatches
    batch, too_big = config.batch_size // M, []
    while True:
        records = None
        try:
            records = train(replace(config, batch_size=batch * M, steps=4, log_every=2, progress=False))
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
        if records is not None:
            return replace(config, batch_size=batch * M), records[-1]["step_s"], too_big
        too_big.append(batch)
        print(f"batch {batch} x {config.seq_len} does not fit; trying {batch // 2}", flush=True)
        batch //= 2
        _free(device)


def summarise(records: list[dict], config: TrainConfig, device: torch.device,
              parts: list[list[dict]] | None = None) -> dict:
    """Throughput, MFU, memory and the loss curve of a ``train`` run's step records.

    tokens/s is the median over the ``log_every`` windows after each invocation's first (``parts``, the step
    records of each; None: one, ``records``), which compiles and warms up; with no other window, over all
    (``steady`` False).
    """
    def ends(rs):
        return [r for r in rs if r["step"] % config.log_every == 0 or r["step"] == config.steps]

    rates = [r["tokens_per_s"] for r in ends(records)]
    timed = [r["tokens_per_s"] for part in (parts or [records]) for r in ends(after_first_window(part, config.log_every))]
    tok_s = statistics.median(timed or rates)
    fpt = flops_per_token(K3Config.preset(config.preset, vocab_size=_vocab(config)), config.seq_len)
    peak = peak_key(device)
    return dict(tokens_per_s=tok_s, tokens_per_s_windows=rates, steady=bool(timed), flops_per_token=fpt,
                peak_flops_key=peak, mfu=mfu(tok_s, fpt, peak) if peak else None,
                peak_GiB=max(r["peak_mem_GiB"] for r in records), peak_mem_kind=records[-1]["peak_mem_kind"],
                loss_curve=[[r["step"], r["loss"]] for r in records], final_loss=records[-1]["loss"])


def _vocab(config: TrainConfig) -> int:
    from k3lab.data import vocab_size

    return vocab_size(resolve_data_dir(config.data_dir))


def _timed(fn, device: torch.device) -> tuple[float, object]:
    """(seconds, result) of ``fn()``, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t, out


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def attnres_overhead(config: TrainConfig, device: torch.device, steps: int, warmup: int = 3) -> dict:
    """The trainer's step (bf16 autocast on CUDA, Per-Head Muon, Quantile Balancing, value checks off) on one
    real batch, with the model's Block AttnRes and with the standard residual swapped in, alternating
    step by step (``warmup`` untimed steps of each first). With ``config.compile`` a third step alternates
    with them: the same compiled model with Block AttnRes run eagerly (``torch.compiler.set_stance
    ("force_eager")``), so the compile's speedup is measured on one model, batch and run.

    Returns:
        {"attnres_ms", "standard_ms" (medians), "overhead" (their ratio - 1), "overhead_min" (of the
        minima), "attnres_peak_GiB", "standard_peak_GiB" (CUDA), "steps", "tokens"}; with ``config.compile``
        also "eager_ms" (median) and "compile_speedup" (eager_ms / attnres_ms).
    """
    x, y = real_batch(config, config.batch_size, device)
    model = build_model(config, device)
    if config.compile:
        # The sublayers are shared by both residuals: one compiled set serves both.
        compile_blocks(model)
    model.value_checks(False)
    model.train()
    opt = per_head_muon(model, lr=config.lr, weight_decay=config.weight_decay)
    residuals = {"attnres": model.residual, "standard": PreNormResidual()}
    if config.compile:
        residuals["eager"] = model.residual

    def step(name):
        # The residual is the only difference: K3Model combines its sublayers with whatever module
        # ``residual`` holds (forward(h0, sublayers)). Block AttnRes' queries get no gradient from the
        # standard steps, and the optimizer skips parameters without one.
        model.residual = residuals[name]
        stance = torch.compiler.set_stance("force_eager") if name == "eager" else contextlib.nullcontext()
        with stance, train_autocast(device):
            _, loss = model(x, y, return_logits=False)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_biases(model)
        return loss.detach()

    times, peaks = {k: [] for k in residuals}, {}
    for i in range(warmup + steps):
        for name in residuals:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t, _ = _timed(lambda: step(name), device)
            peaks[name] = _peak_gib(device)
            if i >= warmup:
                times[name].append(t)
    model.residual = residuals["attnres"]
    med = {k: statistics.median(v) for k, v in times.items()}
    out = dict(attnres_ms=1e3 * med["attnres"], standard_ms=1e3 * med["standard"],
               overhead=med["attnres"] / med["standard"] - 1,
               overhead_min=min(times["attnres"]) / min(times["standard"]) - 1,
               attnres_peak_GiB=peaks["attnres"], standard_peak_GiB=peaks["standard"], steps=steps,
               tokens=config.batch_size * config.seq_len)
    out["step_tokens_per_s"] = out["tokens"] / med["attnres"]
    print(f"AttnRes step {out['attnres_ms']:.1f} ms vs standard residual {out['standard_ms']:.1f} ms: "
          f"overhead {100 * out['overhead']:+.2f}% (of the minima {100 * out['overhead_min']:+.2f}%)", flush=True)
    if "eager" in med:
        out.update(eager_ms=1e3 * med["eager"], compile_speedup=med["eager"] / med["attnres"])
        print(f"compiled step {out['attnres_ms']:.1f} ms vs the same model eager {out['eager_ms']:.1f} ms: "
              f"{out['compile_speedup']:.2f}x", flush=True)
    del model, opt, residuals, x, y
    _free(device)
    return out


def peer_model_config(cfg: K3Config, seq_len: int, moe_hidden: int):
    """torchtitan's ``DeepSeekV3Model.Config`` at ``cfg``'s shape: its width, depth, heads, MLA ranks and
    head widths, first dense layers and dense width, experts, top-k and shared experts, vocabulary; every
    layer MLA (DeepSeek-V3 has no linear attention), SwiGLU experts at full width and ``moe_hidden`` wide
    (shared experts ``moe_hidden`` x their count), sigmoid router, renormalised as ``cfg``, RoPE over the
    ``qk_rope_head_dim`` channels, flex attention (torchtitan's default), DeepSeek-V3's initialisation.

    Raises:
        ValueError: ``cfg`` has no shared experts (torchtitan sizes them from ``moe_hidden``).
        ImportError: torchtitan is not installed.
    """
    _torch_compat()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    # DeepSeek-V3's own initialisers, as its preset configs pass them.
    from torchtitan.models.deepseek_v3 import (_EMBEDDING_INIT, _LINEAR_INIT, _NORM_INIT, DeepSeekV3Model,
                                               _depth_experts_init, _depth_init, _output_linear_init,
                                               build_mla_moe_layers)

    if cfg.n_shared_experts < 1:
        raise ValueError("peer_model_config: torchtitan's shared experts are moe_hidden x count wide; "
                         f"the config has n_shared_experts={cfg.n_shared_experts}")
    d, V = cfg.hidden_size, cfg.vocab_size
    layers = build_mla_moe_layers(
        n_layers=cfg.num_hidden_layers, n_dense_layers=cfg.first_k_dense_replace, dim=d,
        n_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank or 0, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        mscale=1.0, dense_hidden_dim=cfg.intermediate_size, moe_hidden_dim=moe_hidden,
        num_experts=cfg.n_routed_experts, num_shared_experts=cfg.n_shared_experts,
        router_top_k=cfg.num_experts_per_tok, router_score_func="sigmoid", router_route_norm=cfg.moe_renormalize,
        router_route_scale=cfg.routed_scaling_factor, attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, linear_init=_LINEAR_INIT, norm_init=_NORM_INIT, depth_init=_depth_init,
        depth_experts_init=_depth_experts_init,
        rope=ComplexRoPE.Config(dim=cfg.qk_rope_head_dim, max_seq_len=seq_len, theta=10000.0))
    return DeepSeekV3Model.Config(
        vocab_size=V, dim=d, layers=layers, mtp_layers=[],
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=d, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=V, param_init=_output_linear_init(d)))


def peer_params(model: torch.nn.Module, cfg: K3Config) -> dict:
    """{"total", "active"} parameters of a torchtitan model on ``k3lab.model``'s convention: the input
    embedding not active, routed experts K of E, everything else (router, shared experts, head) in full."""
    share = cfg.num_experts_per_tok / cfg.n_routed_experts
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if "tok_embeddings" in name:
            continue
        active += p.numel() * (share if "moe.routed_experts" in name else 1.0)
    return dict(total=total, active=round(active))


def match_peer(cfg: K3Config, seq_len: int, multiple: int = 16) -> tuple[object, int, dict]:
    """The peer's config whose activated parameters come nearest ``cfg``'s (``count_params``) with the expert
    width a multiple of ``multiple`` (grouped GEMMs want 16-byte rows); counted on the meta device.

    Activated parameters are linear in the expert width h: a(h) = a(h1) + (h - h1) * slope.

    Returns:
        (DeepSeekV3Model.Config, h, {"total", "active", "target_active", "flops_per_token"}); flops per token
        by torchtitan's ``get_nparams_and_flops``, the same convention as ``k3lab.model.flops_per_token``.
    """
    target = count_params(cfg)["total"][1]

    def counts(h):
        pcfg = peer_model_config(cfg, seq_len, h)
        with torch.device("meta"):
            model = pcfg.build()
        return pcfg, model, peer_params(model, cfg)

    h1, h2 = multiple, 2 * multiple
    a1, a2 = counts(h1)[2]["active"], counts(h2)[2]["active"]
    slope = (a2 - a1) / (h2 - h1)
    h = max(multiple, multiple * round((h1 + (target - a1) / slope) / multiple))
    pcfg, model, n = counts(h)
    n["target_active"] = target
    n["flops_per_token"] = pcfg.get_nparams_and_flops(model, seq_len)[1]
    return pcfg, h, n


def describe_peer(pcfg, cfg: K3Config, hidden: int, batch: int, T: int, device: torch.device,
                  compile_: bool = False) -> dict:
    """The peer's settings for the JSON (``peer_config``)."""
    attn = pcfg.layers[0].attention
    return dict(model="DeepSeekV3Model", dim=pcfg.dim, n_layers=len(pcfg.layers),
                n_dense_layers=cfg.first_k_dense_replace,
                n_heads=attn.n_heads, q_lora_rank=attn.q_lora_rank, kv_lora_rank=attn.kv_lora_rank,
                qk_nope_head_dim=attn.qk_nope_head_dim, qk_rope_head_dim=attn.qk_rope_head_dim,
                v_head_dim=attn.v_head_dim, dense_hidden_dim=cfg.intermediate_size, moe_hidden_dim=hidden,
                num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                num_shared_experts=cfg.n_shared_experts,
                router="sigmoid scores, top-k renormalised" if cfg.moe_renormalize else "sigmoid scores, top-k",
                experts="SwiGLU at full width", vocab_size=pcfg.vocab_size, seq_len=T, batch_size=batch,
                attention="MLA in every layer, flex attention (causal block mask built once by torch's create_block_mask)",
                rope=f"ComplexRoPE over the {attn.qk_rope_head_dim} rope channels, theta 1e4",
                precision="float32 parameters, bf16 autocast" if device.type == "cuda" else "float32",
                optimizer="torch.optim.AdamW (fused on CUDA), lr 3e-4, weight decay 0.1",
                expert_bias_update="not run (torchtitan applies it in an optimizer pre-hook)", data="random tokens",
                compile=("each transformer block under torch.compile(fullgraph=True), scalar outputs captured "
                         "(torchtitan's apply_compile)") if compile_ else None)


def time_peer(cfg: K3Config, config: TrainConfig, device: torch.device, steps: int, warmup: int = 3) -> dict:
    """torchtitan's DeepSeek-V3 model matched to ``cfg`` (``match_peer``): forward (bf16 autocast on CUDA,
    float32 parameters, as k3lab's trainer), cross-entropy on float32 logits, backward, fused AdamW, on random
    tokens [B, T] of ``config``'s micro-batch (``batch_size / microbatches`` sequences), ``microbatches`` of
    them accumulated per optimizer step as k3lab's trainer does; the causal block mask built once. Halves the
    micro-batch on CUDA out-of-memory.
    On a CPU only the config and its counts (FlexAttention has no CPU backward): the timing fields are None.

    Returns:
        {"peer_tokens_per_s", "peer_step_ms" (median of ``steps`` after ``warmup``), "peer_mfu", "peer_config",
        "peer_params", "peer_flops_per_token", "peer_peak_GiB", "peer_batch_size", "peer_loss"}.
    """
    pcfg, hidden, n = match_peer(cfg, config.seq_len)
    M = config.microbatches
    batch, T = config.batch_size // M, config.seq_len
    out = dict(peer_tokens_per_s=None, peer_step_ms=None, peer_mfu=None, peer_peak_GiB=None, peer_loss=None,
               peer_flops_per_token=n["flops_per_token"], peer_batch_size=batch,
               peer_params=dict(total=n["total"], active=n["active"], target_active=n["target_active"]))
    print(f"peer: expert width {hidden}, active {n['active'] / 1e6:.2f}M vs k3lab's {n['target_active'] / 1e6:.2f}M, "
          f"total {n['total'] / 1e6:.1f}M", flush=True)
    if device.type != "cuda":
        out["peer_config"] = describe_peer(pcfg, cfg, hidden, batch, T, device, config.compile)
        return out
    while True:
        try:
            ms, loss, peak_gib = _time_peer_step(pcfg, cfg.vocab_size, batch, T, device, steps, warmup, M,
                                                 config.compile)
            break
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
        print(f"peer: batch {batch} x {T} does not fit; trying {batch // 2}", flush=True)
        batch //= 2
        _free(device)
    tok_s = M * batch * T / ms * 1e3
    peak = peak_key(device)
    out.update(peer_tokens_per_s=tok_s, peer_step_ms=ms,
               peer_mfu=mfu(tok_s, n["flops_per_token"], peak) if peak else None, peer_peak_GiB=peak_gib,
               peer_loss=loss, peer_batch_size=batch,
               peer_config=describe_peer(pcfg, cfg, hidden, batch, T, device, config.compile))
    print(f"peer: {ms:.1f} ms/step, {tok_s:.0f} tokens/s", flush=True)
    return out


def _causal_block_mask(T: int, device: torch.device):
    """The causal ``BlockMask`` [T, T] for flex attention, built by torch directly. With positions 0..T-1 in every
    row it is the document mask torchtitan builds (``get_attention_masks``), whose builder passes an argument
    (``separate_full_blocks``) that torch before 2.12 lacks."""
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415

    return create_block_mask(lambda b, h, q, kv: kv <= q, None, None, T, T, device=device)


def _time_peer_step(pcfg, vocab: int, batch: int, T: int, device: torch.device, steps: int,
                    warmup: int, microbatches: int = 1, compile_: bool = False) -> tuple[float, float, float | None]:
    """(median step ms, last loss, peak GiB) of the peer's training step: ``microbatches`` forward + backward
    passes at [batch, T] (each loss / microbatches), then one AdamW step; with ``compile_`` each transformer
    block compiled as torchtitan's ``apply_compile`` does (fullgraph, data-dependent MoE shapes captured)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = pcfg.build()
        model.init_states()
    model.train()
    if compile_:
        for block in model.layers.values():
            block.compile(fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    x, y = (torch.randint(0, vocab, (batch, T), generator=g).to(device) for _ in range(2))
    positions = torch.arange(T, device=device).expand(batch, T)
    masks = _causal_block_mask(T, device)

    def step():
        for _ in range(microbatches):
            with train_autocast(device):
                logits = model(x, positions, masks)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            (loss / microbatches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    times = []
    torch.cuda.reset_peak_memory_stats(device)
    # torchtitan's apply_compile sets this globally; here only for the peer's calls (its token-choice dispatch).
    with torch._dynamo.config.patch(capture_scalar_outputs=compile_):
        for i in range(warmup + steps):
            t, loss = _timed(step, device)
            if i >= warmup:
                times.append(t)
    result = 1e3 * statistics.median(times), float(loss), _peak_gib(device)
    del model, opt, x, y, masks, loss
    _free(device)
    return result


def _millions(n: dict) -> str:
    return f"{n['total'] / 1e6:.0f} / {n['active'] / 1e6:.0f}"


def table(r: dict) -> str:
    """The result as text: k3lab beside the peer, the checks, and the floors and goals of the run."""
    def num(v, fmt, scale=1.0):
        return "n/a" if v is None else format(v * scale, fmt)

    peer = r.get("peer_params")
    # The peer's step stands beside the step of the same batch: the bare step (one micro-batch) or, with
    # micro-batches, the trainer's.
    accumulating = r.get("microbatches", 1) > 1
    rows = [("tokens/s, trainer", r["tokens_per_s"], r["peer_tokens_per_s"] if accumulating else None, ".0f", 1.0),
            ("tokens/s, bare step", r["attnres"]["step_tokens_per_s"], None if accumulating
             else r["peer_tokens_per_s"], ".0f", 1.0),
            ("MFU %", r["mfu"], r.get("peer_mfu"), ".1f", 100.0),
            ("FLOPs / token (G)", r["flops_per_token"], r.get("peer_flops_per_token"), ".3f", 1e-9),
            ("peak GiB", r["peak_GiB"], r.get("peer_peak_GiB"), ".1f", 1.0)]
    accumulate = f", {r['microbatches']} micro-batches a step" if accumulating else ""
    compiled = ", sublayers compiled (--compile)" if r.get("compile") else ""
    compiled += f", AttnRes buffer {r['attnres_buffer']}" if r.get("attnres_buffer", "float32") != "float32" else ""
    compiled += ", AttnRes inputs kept" if r.get("attnres_keep_inputs") else ""
    lines = [f"End-to-end training, {r['preset']}, B x T = {r['batch_size']} x {r['seq_len']}{accumulate}{compiled}, on {r['device']} "
             f"({r['date']}): {r['steps']} steps, {r['minutes']:.1f} min on the corpus ({r['epochs']:.1f} epochs)"
             + (f" in {r['parts']} parts" if r.get("parts", 1) > 1 else ""),
             f"FLOPs convention (both models): {r['flops_convention']}",
             f"{'':<28}{'k3lab':>14}{'torchtitan dsv3':>18}"]
    lines += [f"{name:<28}{num(a, fmt, k):>14}{num(b, fmt, k):>18}" for name, a, b, fmt, k in rows]
    peer_n = _millions(peer) if peer else "n/a"
    lines.append(f"{'params total / active (M)':<28}{_millions(r['params']):>14}{peer_n:>18}")
    if r.get("vs_peer") is not None:
        lines.append(f"k3lab / peer tokens/s: trainer {r['vs_peer']:.2f}x, bare step {num(r['vs_peer_bare_step'], '.2f')}x "
                     f"(floor 1.0x, goal 1.3x)")
    if r.get("peer_error"):
        lines.append(f"peer failed: {r['peer_error']}")
    bf16, sync = r["checks"]["bf16"], r["checks"]["sync_debug"]
    lines += [f"MFU {num(r['mfu'], '.1f', 100.0)} % (floor 25 %, goal 45 %); AttnRes step overhead "
              f"{100 * r['attnres_overhead']:+.2f}% (goal <= 4%)"
              + (f"; compiled step {r['attnres']['compile_speedup']:.2f}x the same model's eager step"
                 if "compile_speedup" in r["attnres"] else ""),
              f"loss {r['loss_curve'][0][1]:.3f} -> {r['final_loss']:.3f}",
              f"checks: bf16 vs float32 loss rel err {bf16['loss_rel_err']:.1e} (logits with the same routing "
              f"{bf16.get('logits_rel_rms_err_same_routing', float('nan')):.1e}, routed freely "
              f"{bf16['logits_rel_rms_err']:.1e}); sync debug "
              + ("skipped (CPU)" if not sync["enforced"] else "pass" if sync["ok"] else f"FAIL ({sync['error']})")
              + (f"; compiled vs eager loss rel err {r['checks']['compile']['loss_rel_err']:.1e}"
                 if "compile" in r["checks"] else "")]
    return "\n".join(lines)


def _torch_compat() -> None:
    """torchtitan 0.3.0's deepseek_v3 imports ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12) only
    to annotate its parallelize helpers, which the peer never calls; on an older torch a placeholder class lets
    the model classes import."""
    import torch.distributed.fsdp as fsdp  # noqa: PLC0415

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})


def _peer_importable(required: bool) -> bool:
    """Whether torchtitan's deepseek_v3 imports (tried before any work, so a GPU run fails in seconds).

    Raises:
        SystemExit: it does not import and ``required``.
    """
    _torch_compat()
    try:
        import torchtitan.models.deepseek_v3  # noqa: F401
    except Exception as e:  # noqa: BLE001  (torchtitan pulls in much of torch: any failure means no peer)
        if required:
            raise SystemExit(f"torchtitan's deepseek_v3 does not import ({type(e).__name__}: {e}): install "
                             f"torchtitan 0.3.0 or pass --no-torchtitan") from e
        return False
    return True


def main(argv=None) -> dict:
    """``python -m k3lab.bench.train [flags]``: run the benchmark, write its JSON, print the table; returns
    the result dict.

    Raises:
        SystemExit: 2 on a bad flag; no CUDA device for ``--device cuda``; ``--device cpu`` without
            ``--small`` or on a machine whose trainer would use its GPU; torchtitan missing without
            ``--no-torchtitan`` (outside ``--small``); a ``--run-dir`` that cannot be made or written, whose plan
            is unreadable or edited, or whose checkpoint another run saved.
        AssertionError: the bf16 check failed.
    """
    started = time.monotonic()
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.train", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (the benchmark) or cpu (only with --small)")
    p.add_argument("--small", action="store_true",
                   help="k3-tiny, batch 4 x 32, 6 steps; torchtitan only when installed (checks the script)")
    p.add_argument("--minutes", type=positive_float, default=4.0,
                   help="length of the timed trainer run in minutes, its steps estimated from the warm-up (default "
                        "4: with the checks and the peer the command takes about 8)")
    p.add_argument("--steps", type=positive_int, default=None, help="trainer steps instead of --minutes")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences per step, halved while CUDA runs out of memory (default 16; --small 4)")
    p.add_argument("--microbatches", type=positive_int, default=1,
                   help="micro-batches of --batch-size sequences per optimizer step, k3lab's and the peer's alike "
                        "(default 1): a larger global batch amortises the optimizer, as pretraining batches do")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sequence T (default 2048; --small 32)")
    p.add_argument("--log-every", type=positive_int, default=None,
                   help="the trainer reads its metrics back every N steps, tokens/s per window of N (default 10; "
                        "--small 2)")
    p.add_argument("--overhead-steps", type=positive_int, default=None,
                   help="timed steps of each residual for the AttnRes overhead (default 20; --small 2)")
    p.add_argument("--peer-steps", type=positive_int, default=None, help="timed peer steps (default 10; --small 2)")
    p.add_argument("--no-torchtitan", action="store_true", help="skip the peer")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each k3lab sublayer (k3lab.train.compile_blocks) and each of the peer's "
                        "transformer blocks; the warm-up steps then include the compilation")
    p.add_argument("--run-dir", default=None,
                   help="checkpoint the timed trainer run in this folder (its log: metrics.jsonl there), so that "
                        "with --stop-after-minutes it spans several invocations of the same command")
    p.add_argument("--stop-after-minutes", type=positive_float, default=None,
                   help="a job's time limit: stop the timed run at its first --log-every step M minutes after "
                        "this command started (checks and warm-up count), checkpointed in --run-dir, and exit; the "
                        "same command continues it, and the invocation that finishes it measures the rest (the "
                        "AttnRes overhead and the peer: leave them a few minutes) and writes the JSON (a run longer "
                        "than one job's time limit)")
    add_attnres_flags(p)
    p.add_argument("--out", default=None, help="JSON path ('' = write nothing); default data/results/train_<card>.json "
                   "after the device, train_compile_<card>.json with --compile (with --small: nothing)")
    args = p.parse_args(argv)
    if args.run_dir is not None and not args.run_dir.strip():
        p.error("--run-dir must name a folder, got ''")
    if args.stop_after_minutes is not None and not args.run_dir:
        p.error("--stop-after-minutes needs --run-dir (where the stopped run is checkpointed)")
    check_out(args.out)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --small to check the script")
    if device.type == "cpu" and not args.small:
        raise SystemExit("--device cpu needs --small (k3-1b is GPU work)")
    if device.type == "cpu" and torch.cuda.is_available():
        raise SystemExit("--device cpu on a machine with CUDA: k3lab.train runs on the GPU; hide it "
                         "(CUDA_VISIBLE_DEVICES=) or use --device cuda")
    with_peer = not args.no_torchtitan and _peer_importable(required=not args.small)
    small = args.small
    M = args.microbatches
    try:
        config = TrainConfig(preset="k3-tiny" if small else "k3-1b",
                             batch_size=M * (args.batch_size or (4 if small else 16)), microbatches=M,
                             seq_len=args.seq_len or (32 if small else 2048), progress=False,
                             log_every=args.log_every or (2 if small else 10), compile=args.compile,
                             attnres_buffer=args.attnres_buffer, attnres_keep_inputs=args.attnres_keep_inputs)
    except ValueError as e:
        p.error(str(e))
    if args.run_dir:
        # The checks and the warm-up run before the first checkpoint: a folder that cannot hold it stops here.
        try:
            replace(config, ckpt_dir=args.run_dir, log_jsonl=str(Path(args.run_dir) / LOG))
            Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        except (ValueError, OSError) as e:
            # The trainer's own message names its flag, --ckpt-dir: this command's is --run-dir.
            p.error(f"--run-dir {args.run_dir} cannot hold the run ({str(e).replace('--ckpt-dir', '--run-dir')})")
    cfg = K3Config.preset(config.preset, vocab_size=_vocab(config))

    result = run_info(device)
    result.update(preset=config.preset, flops_convention=FLOPS_CONVENTION, peer=PEER if with_peer else None,
                  compile=config.compile, attnres_buffer=config.attnres_buffer,
                  attnres_keep_inputs=config.attnres_keep_inputs)
    settings = dict(preset=config.preset, batch_size=args.batch_size, microbatches=M, seq_len=config.seq_len,
                    log_every=config.log_every, compile=config.compile, minutes=args.minutes, steps=args.steps,
                    attnres_buffer=config.attnres_buffer, attnres_keep_inputs=config.attnres_keep_inputs)
    plan = read_plan(args.run_dir, settings) if args.run_dir else None
    if plan is None:
        print(f"== correctness: {config.preset} bf16 autocast vs float32", flush=True)
        checks = {"bf16": check_bf16(config, device)}
        if config.compile:
            print("== correctness: compiled sublayers vs eager", flush=True)
            checks["compile"] = check_compile(config, device)
        print(f"== warm-up: {config.batch_size} x {config.seq_len}", flush=True)
        config, step_s, too_big = warm_up(config, device)
        checks["sync_debug"] = check_sync(config, device)
        windows = math.ceil(args.minutes * 60 / step_s / config.log_every)
        steps = args.steps or (6 if small else max(2, windows) * config.log_every)
        plan = dict(settings=settings, batch_size=config.batch_size, too_big=too_big, step_s=step_s, steps=steps,
                    checks=checks)
        if args.run_dir:
            write_json(Path(args.run_dir) / PLAN, plan, indent=1)
    else:
        print(f"== continuing the run in {args.run_dir} (its checks and warm-up ran in its first part)", flush=True)
    checks, steps, too_big = plan["checks"], plan["steps"], plan["too_big"]
    config = replace(config, batch_size=plan["batch_size"], steps=steps, progress=sys.stderr.isatty())
    if args.run_dir:
        # The trainer counts its budget from its own start: pass what is left of this command's.
        left = None if args.stop_after_minutes is None else max(
            args.stop_after_minutes - (time.monotonic() - started) / 60, MIN_BUDGET_MINUTES)
        config = replace(config, ckpt_dir=args.run_dir, resume=True, log_jsonl=str(Path(args.run_dir) / LOG),
                         stop_after_minutes=left)
    print(f"== k3lab.train: {steps} steps (warm-up step {plan['step_s']:.3f} s)", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        records = train(config)
    except ConfigError as e:
        if not args.run_dir:
            raise
        # The checkpoint in --run-dir was saved by another run (its plan deleted or edited).
        raise SystemExit(f"--run-dir {args.run_dir}: {e}") from None
    minutes = (time.perf_counter() - t0) / 60
    _free(device)
    if records.stopped_at is not None:
        print(f"== stopped at step {records.stopped_at} of {steps} (--stop-after-minutes {args.stop_after_minutes}, "
              f"counted from this command's start): "
              f"run the same command again to continue; the invocation that finishes the run writes the JSON",
              flush=True)
        return dict(stopped_at=records.stopped_at, steps=steps, run_dir=args.run_dir)
    if args.run_dir and not len(records):
        print(f"== the run in {args.run_dir} had already reached step {steps}: measuring the AttnRes overhead and "
              f"the peer again and writing the JSON of the whole run", flush=True)
    parts, step_parts = 1, None
    if args.run_dir:
        # The run's records over all its parts (a step replayed after a kill counted once, from its last
        # part); its minutes are those steps' stepping time, without the parts' start-ups and checkpoint saves.
        step_parts, _, _ = run_parts(Path(args.run_dir) / LOG)
        records = sorted({r["step"]: r for part in step_parts for r in part}.values(), key=lambda r: r["step"])
        parts = sum(1 for part in step_parts if part)
        minutes = sum(r["step_s"] for r in records) / 60
    n = count_params(cfg)["total"]
    split = len(load_split("train", resolve_data_dir(config.data_dir) / "shards"))
    result.update(batch_size=config.batch_size // M, microbatches=M, seq_len=config.seq_len,
                  tokens_per_step=config.batch_size * config.seq_len, batch_sizes_that_did_not_fit=too_big,
                  steps=steps, log_every=config.log_every, lr=config.lr,
                  minutes=minutes, parts=parts, minutes_requested=None if args.steps or small else args.minutes,
                  epochs=steps * config.batch_size * config.seq_len / split, params=dict(total=n[0], active=n[1]),
                  **summarise(records, config, device, step_parts))
    print("== AttnRes overhead", flush=True)
    # One micro-batch a step: the overhead is a ratio of step times, which accumulation does not change.
    micro = replace(config, batch_size=config.batch_size // M, microbatches=1)
    result["attnres"] = attnres_overhead(micro, device, args.overhead_steps or (2 if small else 20),
                                         warmup=1 if small else 3)
    result["attnres_overhead"] = result["attnres"]["overhead"]
    result["checks"] = checks
    result.update(peer_tokens_per_s=None, peer_config=None, vs_peer=None, vs_peer_bare_step=None)
    if with_peer:
        print("== peer: torchtitan deepseek_v3", flush=True)
        try:
            result.update(time_peer(cfg, config, device, args.peer_steps or (2 if small else 10),
                                    warmup=1 if small else 3))
        except Exception as e:  # noqa: BLE001  (the peer's failure is recorded; k3lab's numbers are kept)
            traceback.print_exc()
            result["peer_error"] = f"{type(e).__name__}: {e}"[:1000]
            _free(device)
        if result["peer_tokens_per_s"]:
            result["vs_peer"] = result["tokens_per_s"] / result["peer_tokens_per_s"]
            if M == 1:  # the bare step runs one micro-batch: comparable only to a peer step of one
                result["vs_peer_bare_step"] = result["attnres"]["step_tokens_per_s"] / result["peer_tokens_per_s"]
    write_result("train_compile" if config.compile else "train", result, args.out, small)
    print("\n" + table(result))
    return result


if __name__ == "__main__":
    main()
