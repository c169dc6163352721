"""LatentMoE against a full-width MoE with the same routed expert compute: validation loss on the corpus.

    python -m k3lab.bench.moe_quality                    # CPU defaults -> data/results/moe_quality_cpu.json
    python -m k3lab.bench.moe_quality --device cuda --d-model 256 --n-layers 4 --batch-size 64 --seq-len 512
    python -m k3lab.bench.moe_quality --small            # a few steps, for checking the script

K3's argument for latent experts (LatentMoE, arXiv 2601.18089): at half the width an expert costs half, so a layer
can route each token to twice as many of twice as many experts for the same expert FLOPs and parameters.
The pair trained here is chapter 05's: the full-width MoE routes top-k/2 of E/2 experts at width d, the
LatentMoE top-k of E at width d/2 (plus its down and up projections); both balanced by Quantile Balancing,
every other weight, the data order and the steps the same. Each pair runs on several seeds (model
initialisation and batch order), since at small scale one seed's difference is mostly noise.

Correctness first: the two configurations' routed expert FLOPs per token and routed expert parameters per
token are checked equal before any training. JSON: run info, the configurations and their forward FLOPs
per token, per run the validation-loss curve, and per model the final validation loss over seeds.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace


import k3lab.lm as lm
from k3lab.bench import check_out, nonnegative_int, parse_device, positive_float, positive_int, run_info, write_result
from k3lab.data import vocab_size
from k3lab.moe import MoEConfig
from k3lab.moe.experiment import build_moe_lm, train_moe_lm


def pair(d_model: int, n_layers: int, n_experts: int, top_k: int, expert_hidden: int) -> dict[str, MoEConfig]:
    """The full-width and latent configurations of chapter 05, Section 7 (QB-balanced, one shared expert).

    Raises:
        ValueError: top_k or n_experts odd (the full-width model uses half of each); d_model not a multiple of
            16 or expert_hidden not of 8 (the grouped expert matmul needs 16-byte rows in bfloat16 at both
            widths, d_model and d_model/2).
    """
    for name, v in (("top_k", top_k), ("n_experts", n_experts)):
        if v % 2:
            raise ValueError(f"{name} must be even (the full-width model uses half of it), got {v}")
    if d_model % 16 or expert_hidden % 8:
        raise ValueError(f"d_model must be a multiple of 16 and expert_hidden of 8 (16-byte rows of the grouped "
                         f"expert matmul in bfloat16, at widths d_model and d_model/2), got {d_model}, {expert_hidden}")
    base = MoEConfig(d_model=d_model, n_layers=n_layers, n_experts=n_experts, top_k=top_k,
                     expert_hidden=expert_hidden, n_shared=1, balance="qb")
    return {"full width": replace(base, n_experts=n_experts // 2, top_k=top_k // 2, latent_dim=None),
            "latent": replace(base, latent_dim=d_model // 2)}


def routed_cost(c: MoEConfig) -> tuple[int, int]:
    """(routed expert FLOPs per token, routed expert parameters per token): K experts of 3 matrices
    [width, h], 2 FLOPs per multiply-add."""
    per_expert = 3 * c.routed_dim * c.expert_hidden
    return 2 * c.top_k * per_expert, c.top_k * per_expert


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.moe_quality", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--d-model", type=positive_int, default=128)
    p.add_argument("--n-layers", type=positive_int, default=2)
    p.add_argument("--n-experts", type=positive_int, default=64)
    p.add_argument("--top-k", type=positive_int, default=4)
    p.add_argument("--expert-hidden", type=positive_int, default=64)
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--seeds", type=nonnegative_int, nargs="+", default=[0, 1, 2])
    p.add_argument("--log-every", type=positive_int, default=25)
    p.add_argument("--small", action="store_true",
                   help="a few steps at tiny sizes (flags given explicitly still apply); writes nothing by default")
    p.add_argument("--out", default=None, help="JSON path ('' writes nothing; default data/results/moe_quality_<card>.json)")
    args = p.parse_args(argv)
    if args.small:
        # The tiny sizes are defaults, so --small --seeds 3 4 runs seeds 3 and 4.
        p.set_defaults(steps=4, seeds=[0], log_every=2, batch_size=2, seq_len=32, d_model=32, n_experts=8,
                       expert_hidden=16)
        args = p.parse_args(argv)
    check_out(args.out)
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"argument --seeds: each seed once (the summary pairs runs by seed), got {args.seeds}")
    device = parse_device(p, args.device)
    try:
        configs = pair(args.d_model, args.n_layers, args.n_experts, args.top_k, args.expert_hidden)
    except ValueError as e:
        p.error(str(e))
    costs = {name: routed_cost(c) for name, c in configs.items()}
    if len(set(costs.values())) != 1:
        raise AssertionError(f"the pair's routed expert FLOPs and parameters per token differ: {costs}")
    lm_cfg = lm.LMConfig.tiny(vocab_size=vocab_size(), mixer="attention", d_model=args.d_model, n_layers=args.n_layers,
                              max_seq_len=args.seq_len)
    result = run_info(device) | {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "device")},
        "configs": {name: {"n_experts": c.n_experts, "top_k": c.top_k, "width": c.routed_dim,
                           "routed_flops_per_token": costs[name][0],
                           "forward_flops_per_token": c.flops_per_token()} for name, c in configs.items()},
        "runs": []}
    print(f"routed expert FLOPs per token, both: {costs['latent'][0]:,}; forward FLOPs per MoE layer and token: "
          + ", ".join(f"{n} {c.flops_per_token():,}" for n, c in configs.items()), flush=True)
    for seed in args.seeds:
        for name, c in configs.items():
            t0 = time.perf_counter()
            model = build_moe_lm(lm_cfg, c, seed=seed).to(device)
            h = train_moe_lm(model, args.steps, args.batch_size, args.seq_len, args.lr, device, seed=seed,
                             log_every=args.log_every, progress=not args.small)
            result["runs"].append({"name": name, "seed": seed, "step": h["step"], "val_loss": h["val_loss"],
                                   "final_maxvio": [float(v) for v in h["maxvio"][-1]],
                                   "seconds": round(time.perf_counter() - t0, 1)})
    finals = {name: [r["val_loss"][-1] for r in result["runs"] if r["name"] == name] for name in configs}
    result["summary"] = {name: {"mean": statistics.fmean(v), "min": min(v), "max": max(v)} for name, v in finals.items()}
    diffs = [a - b for a, b in zip(finals["latent"], finals["full width"])]
    result["summary"]["latent_minus_full"] = {"mean": statistics.fmean(diffs), "min": min(diffs), "max": max(diffs)}
    write_result("moe_quality", result, args.out, small=args.small)
    print(f"\n{'model':<12}{'E':>5}{'top-k':>7}{'width':>7}   final val loss over seeds {args.seeds} "
          f"after {args.steps} steps ({result['device']})")
    for name, c in configs.items():
        s = result["summary"][name]
        print(f"{name:<12}{c.n_experts:>5}{c.top_k:>7}{c.routed_dim:>7}   mean {s['mean']:.4f}  "
              f"[{s['min']:.4f}, {s['max']:.4f}]")
    d = result["summary"]["latent_minus_full"]
    print(f"latent - full width, same seed: mean {d['mean']:+.4f}  [{d['min']:+.4f}, {d['max']:+.4f}]")
    return result


if __name__ == "__main__":
    main()
