"""Balance at a large step: the four balancing rules of chapter 05 trained at hundreds of thousands of tokens a step.

    python -m k3lab.bench.moe_balance --device cuda       # 1024 x 512 tokens a step (16 micro-batches of 64)
    python -m k3lab.bench.moe_balance --small             # a few tiny steps, for checking the script

Chapter 05 measures the floor any bias computed from past steps meets on real text: the routing of
consecutive batches differs by the batch's sampling noise, which falls about as the square root of the
step's tokens; the chapter's fit, extrapolated from far smaller steps, puts maxvio 0.05 near half a million
tokens a step at E = 64, top-4. This benchmark trains the chapter's MoE language model at such a step,
accumulated over micro-batches (the bias update reads every micro-batch's counts), with no balancing, the
auxiliary loss, the sign update and Quantile Balancing (with the histogram estimator, and with the exact
quantile as its reference), the same model initialisation and batches for each; maxvio is measured on each
step's own tokens with the bias the step ran with (the load it really had), every MoE layer. QB is then
trained again at lower learning rates (``--qb-lrs``): its bias is fitted to one step and used at the next, so
what the router moves in between, which the learning rate scales, adds to the sampling floor.

Correctness first: before any training, the per-step expert loads of one micro-batched step are checked to
sum to B T K in every layer. The verdict (K3's claim for QB): the worst layer's maxvio is at most 0.05 from
some step within the first 20 onwards, to the last step (``verdict``: none for a run of 20 steps or fewer,
which cannot show "and after"). JSON: run info, settings, per method the maxvio of every step and layer, the
validation loss curve, the verdict (``met``), the QB runs at other learning rates (``qb_lr_sweep``, each
with its verdict), and the sampling floor at this step size on QB's trained model
(``sampling_floor``, from ``balance_floor``: what is left when the router does not move); the table is printed
last. The JSON is written after every run, ``complete`` false (and ``met`` None) until the last one is done, so a
job cut off at its time limit keeps the runs it finished.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import k3lab.lm as lm
from k3lab.bench import check_out, nonnegative_int, parse_device, positive_float, positive_int, run_info, write_result
from k3lab.data import vocab_size
from k3lab.moe import MoEConfig
from k3lab.moe.experiment import balance_floor, build_moe_lm, train_moe_lm

# "qb" is Quantile Balancing with the histogram estimator (the one that runs distributed); "qb-exact" the exact
# quantile of every margin, the reference that isolates the histogram's resolution.
METHODS = ("none", "aux", "sign", "qb", "qb-exact")
TARGET = 0.05
WITHIN = 20


def settled_at(worst: list[float], target: float = TARGET) -> int | None:
    """The first step (0-based) from which every step's ``worst`` maxvio is <= ``target``, or None when the
    last step is above it (a NaN counts as above)."""
    at = None
    for i, v in enumerate(worst):
        if not v <= target:
            at = None
        elif at is None:
            at = i
    return at


def verdict(qb_settled_at: int | None, steps: int) -> bool | None:
    """K3's claim for QB on one run: maxvio <= TARGET from a step below WITHIN to the last step. None when the
    run has WITHIN steps or fewer (a run must go past step WITHIN to show the "and after")."""
    if steps <= WITHIN:
        return None
    return qb_settled_at is not None and qb_settled_at < WITHIN


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.moe_balance", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--d-model", type=positive_int, default=256, help="model width d, a multiple of 16 (default 256)")
    p.add_argument("--n-layers", type=positive_int, default=4, help="MoE layers (default 4)")
    p.add_argument("--n-experts", type=positive_int, default=64, help="routed experts E (default 64)")
    p.add_argument("--top-k", type=positive_int, default=4, help="experts a token K, below E (default 4)")
    p.add_argument("--expert-hidden", type=positive_int, default=128,
                   help="each expert's hidden width, a multiple of 8 (default 128)")
    p.add_argument("--steps", type=positive_int, default=120, help="optimizer steps per method (default 120)")
    p.add_argument("--batch-size", type=positive_int, default=1024, help="sequences a step (B)")
    p.add_argument("--microbatches", type=positive_int, default=16, help="passes a step (M, a divisor of B)")
    p.add_argument("--seq-len", type=positive_int, default=512, help="tokens a sequence (T, default 512)")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--qb-lrs", type=positive_float, nargs="*", default=[3e-4, 1e-4],
                   help="QB (histogram) trained again at each of these learning rates, to show how far the router's "
                        "motion between steps sets its maxvio (default 3e-4 1e-4; none: no sweep)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="model initialisation and batches (default 0)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="balancing rules to train, each once (default all)")
    p.add_argument("--small", action="store_true", help="tiny sizes and a few steps (checks the script)")
    p.add_argument("--out", default=None, help="JSON path ('' writes nothing; default data/results/moe_balance_<card>.json)")
    args = p.parse_args(argv)
    if args.small:
        p.set_defaults(d_model=32, n_layers=2, n_experts=8, expert_hidden=16, steps=3, batch_size=8, microbatches=2,
                       seq_len=32)
        args = p.parse_args(argv)
    check_out(args.out)
    if args.batch_size % args.microbatches:
        p.error(f"argument --microbatches: must divide --batch-size {args.batch_size}, got {args.microbatches}")
    if args.d_model % 16 or args.expert_hidden % 8:
        p.error(f"argument --d-model: a multiple of 16 and --expert-hidden of 8 (16-byte rows of the grouped expert "
                f"matmul in bfloat16 at the latent width d/2), got {args.d_model}, {args.expert_hidden}")
    # Below E: the correctness check and the sampling floor run Quantile Balancing, which reads each
    # token's (K+1)-th score; at K = E every expert gets every token and there is nothing to balance.
    if args.top_k >= args.n_experts:
        p.error(f"argument --top-k: below --n-experts {args.n_experts}, got {args.top_k}")
    if len(set(args.methods)) != len(args.methods):
        p.error(f"argument --methods: each method once (the JSON keeps one run per method), got {args.methods}")
    device = parse_device(p, args.device)
    lm_cfg = lm.LMConfig.tiny(vocab_size=vocab_size(), mixer="attention", d_model=args.d_model,
                              n_layers=args.n_layers, max_seq_len=args.seq_len)
    moe_cfg = MoEConfig(n_experts=args.n_experts, top_k=args.top_k, expert_hidden=args.expert_hidden,
                        latent_dim=args.d_model // 2, n_shared=1, aux_coef=1e-2, sign_lr=1e-3)
    tokens = args.batch_size * args.seq_len
    q = tokens * args.top_k // args.n_experts
    print(f"{args.n_layers} MoE layers: {args.n_experts} experts, top-{args.top_k}; {args.batch_size} x {args.seq_len} "
          f"= {tokens:,} tokens a step in {args.microbatches} micro-batches, q = {q:,} pairs per expert", flush=True)

    # Correctness first: one micro-batched step's counts cover every token of the step exactly K times.
    check = train_moe_lm(build_moe_lm(lm_cfg, replace(moe_cfg, balance="qb"), seed=args.seed), 1, args.batch_size,
                         args.seq_len, args.lr, device, seed=args.seed, log_every=1, progress=False,
                         microbatches=args.microbatches)
    sums = check["loads"][0].sum(-1)
    if not bool((sums == tokens * args.top_k).all()):
        raise AssertionError(f"a step's expert loads per layer should sum to B T K = {tokens * args.top_k}, got {sums.tolist()}")

    result = run_info(device) | {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "device", "small")},
                                 "tokens_per_step": tokens, "pairs_per_expert": q, "target": TARGET, "runs": {}}

    def run(rule: MoEConfig, lr: float) -> tuple:
        """(trained model, its record) of one rule at ``lr``, from the same initialisation and batches."""
        t0 = time.perf_counter()
        model = build_moe_lm(lm_cfg, rule, seed=args.seed)
        h = train_moe_lm(model, args.steps, args.batch_size, args.seq_len, lr, device, seed=args.seed,
                         log_every=max(1, args.steps // 4), progress=not args.small, microbatches=args.microbatches)
        worst = h["maxvio"].max(1).values.tolist()
        return model, {"maxvio": h["maxvio"].tolist(), "worst_maxvio": worst, "settled_at": settled_at(worst),
                       "val_step": h["step"], "val_loss": h["val_loss"], "seconds": round(time.perf_counter() - t0, 1)}

    def save(complete: bool) -> None:
        # After every run, so a job cut off at its time limit keeps the runs it finished ("complete": false).
        result["complete"] = complete
        qb = result["runs"].get("qb")
        result["met"] = None if not complete or qb is None or args.small else verdict(qb["settled_at"], args.steps)
        write_result("moe_balance", result, args.out, small=args.small)

    result["qb_lr_sweep"] = {}
    for method in args.methods:
        rule = replace(moe_cfg, balance="qb", estimator="exact") if method == "qb-exact" else replace(moe_cfg, balance=method)
        model, result["runs"][method] = run(rule, args.lr)
        if method == "qb":
            # The sampling floor at this step size, on the trained model: a bias fitted to one step's batch,
            # applied to the next batch through the same router (chapter 05, Section 6). What QB's training
            # curve shows above it comes from the router moving between steps.
            floor = balance_floor(model, batches=3, batch_size=args.batch_size, seq_len=args.seq_len, device=device,
                                  split="train")
            result["sampling_floor"] = {k: v.tolist() for k, v in floor.items()}
        save(complete=False)
    # The same QB run at lower learning rates: QB's bias is fitted to one step and used at the next, so the
    # router's motion in between (which the learning rate scales) adds to the sampling floor.
    for lr in dict.fromkeys(x for x in args.qb_lrs if x != args.lr):
        _, r = run(replace(moe_cfg, balance="qb"), lr)
        result["qb_lr_sweep"][str(lr)] = {"lr": lr, **r,
                                          "met": None if args.small else verdict(r["settled_at"], args.steps)}
        save(complete=False)
    save(complete=True)

    tail = max(1, args.steps // 4)
    rows = [(f"{m} (lr {args.lr:g})" if result["qb_lr_sweep"] else m, r) for m, r in result["runs"].items()]
    rows += [(f"qb (lr {r['lr']:g})", r) for r in result["qb_lr_sweep"].values()]
    width = max(9, *(len(name) + 1 for name, _ in rows))
    print(f"\n{tokens:,} tokens a step, {args.steps} steps ({result['device']}); maxvio of the worst layer")
    print(f"{'method':<{width}}{'step 0':>8}{'step 10':>9}{'step 20':>9}{'last ' + str(tail) + ', mean':>14}"
          f"{'<= 0.05 from step':>19}{'val loss':>10}{'seconds':>9}")
    for method, r in rows:
        w = r["worst_maxvio"]
        at = lambda i: f"{w[i]:.3f}" if i < len(w) else "-"  # noqa: E731
        settled = "never" if r["settled_at"] is None else str(r["settled_at"])
        print(f"{method:<{width}}{at(0):>8}{at(10):>9}{at(20):>9}{sum(w[-tail:]) / tail:>14.3f}{settled:>19}"
              f"{r['val_loss'][-1]:>10.3f}{r['seconds']:>9.1f}")
    if "sampling_floor" in result:
        f = result["sampling_floor"]
        print(f"sampling floor at this step size (bias fitted to one batch, on the next; worst layer): "
              f"{max(f['next_batch']):.3f}; in-sample {max(f['same_batch']):.3f}")
    if result["met"] is not None:
        print(f"QB at maxvio <= {TARGET} within {WITHIN} steps and after: {'met' if result['met'] else 'NOT met'}"
              + "".join(f"; at lr {r['lr']:g} {'met' if r['met'] else 'NOT met'}" for r in result["qb_lr_sweep"].values()))
    return result


if __name__ == "__main__":
    main()
