"""Activation memory per storage policy (``k3lab.memory``) on K3Model: what each policy set holds for
backward, the peak memory of a training step, and what the step costs in time.

    python -m k3lab.bench.memory                                # k3-1b, 8 x 2048 -> data/results/memory_<card>.json
    python -m k3lab.bench.memory --batch-size 4 --seq-len 4096  # another shape
    python -m k3lab.bench.memory --device cpu --out ''          # k3-tiny, 2 x 64: checks the script in seconds

Policy sets (``policy_sets``; rules on ``K3Model`` module names, every sublayer named so that every saved
tensor is counted): no policies (plain autograd, the baseline of time and peak); keep everything; recompute
every sublayer; recompute the MoE FFN sublayers only; offload every sublayer to host memory; fp8 on the FFN
sublayers (dense and MoE); a K3-like mix (MoE FFNs recomputed, as K3 keeps only the dispatch input; the
dense FFN in fp8; the token mixers kept).

Order: (1) correctness first, in float32 on ``min(B, 2) x min(T, 1024)`` random tokens: every set's loss and
every gradient against "keep" on the same weights and tokens, every run routed to the keep run's experts
(``k3lab.bench.RoutingReplay``: CUDA's forward is not bitwise repeatable and near ties in the routers would
send some tokens elsewhere); relative RMS error per tensor, printed with its bound: ``EXACT_BOUND`` for
recompute and offload (float32 round-off of reordered sums), ``FP8_BOUND`` for sets with fp8; "keep" is also
run twice to show the floor. A set past its bound stops the benchmark. (2) Per set,
at the benchmark's shape (bf16 autocast on CUDA, float32 on a CPU): ``--steps`` forward + backward steps after
warm-up; the median step time (synchronised wall clock); the peak memory of a step (CUDA:
``torch.cuda.max_memory_allocated`` after a reset, weights and gradients included; CPU: the sum over policies
of the manager's peak live bytes of saved activations, which does not see what a recompute region
rematerialises in backward); and at the end of forward the manager's counters (bytes held for backward per
policy on the device, bytes copied to host) and, on CUDA, the device memory held since the step began. Block
AttnRes keeps its depth buffer outside autograd's saved tensors: the counters do not see it, CUDA's peak does.
A table is printed last.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from torch.utils.checkpoint import CheckpointError

from k3lab.bench import RoutingReplay, _int_at_least, check_out, positive_int, run_info, write_result
from k3lab.memory import ActivationManager, apply_policies
from k3lab.model import K3Config, K3Model
from k3lab.model.accounting import param_table
from k3lab.testing import rel_rms_error

# Recompute and offload store the same values (offload copies them, recompute replays the same kernels on the
# same inputs), so only the order of float32 sums may differ: bitwise equal on a CPU; on CUDA, keep run twice
# differs by up to ~1e-4 on the KDA decay's A_log (a sum over tokens with heavy cancellation). An activation
# 0.1% off (a stale or mis-scaled copy) moves that gradient by ~2e-2.
EXACT_BOUND = 1e-3
# fp8 (e4m3, one scale per 128 values) stores activations with ~2^-4 relative error each; on a gradient, a sum
# over many tokens, the errors average out (k3-tiny: a few 1e-3 to 1e-2 per tensor).
FP8_BOUND = 0.1
# The correctness check runs on at most this many sequences of at most this length (float32 needs twice
# bf16's memory, and the reference gradients are held beside the set's).
CHECK_BATCH, CHECK_SEQ_LEN = 2, 1024
SET_DOCS = {
    "plain": "no policies: plain autograd, Block AttnRes rebuilding each sublayer's input in backward",
    "keep": "every saved tensor kept (every sublayer's input too)",
    "recompute": "every sublayer recomputed in backward (its input kept)",
    "recompute_moe": "the MoE FFN sublayers recomputed (their input kept), the rest kept",
    "offload": "every sublayer's saved tensors copied to host memory",
    "fp8_ffn": "the FFN sublayers (dense and MoE) stored in block-wise fp8, the mixers kept",
    "k3_mix": "MoE FFNs recomputed, the dense FFN in fp8, the mixers kept",
}
SETS = tuple(SET_DOCS)


def policy_sets(model: K3Model) -> dict[str, dict[str, str]]:
    """The benchmark's policy sets as ``k3lab.memory.apply_policies`` rules on ``model``'s module names.

    Sublayers are named exactly ("sublayers.3"): ``fnmatch`` has no "digits only" pattern, and "sublayers.*"
    would also match every module inside them. Every set but "plain" names the root "" and every sublayer
    (those without another policy as "keep"): Block AttnRes runs the sublayers under saved-tensor hooks of
    its own (they rebuild each sublayer's input in backward), and the innermost hooks win, so a root policy
    alone would not see what the sublayers save. A sublayer under the manager keeps its input (one [B, T, d]
    tensor) instead of AttnRes rebuilding it: "plain" (no policies) measures the model as trained without
    ``--activations``.

    Args:
        model (K3Model): any preset; its sublayers alternate mixer, FFN, mixer, ... (the first FFN dense).

    Returns:
        {set name (``SETS``): {module name: policy}} ("plain": {}), for ``apply_policies(..., default=None)``.
    """
    from k3lab.moe import MoE  # noqa: PLC0415

    n = len(model.sublayers)
    mixers = [f"sublayers.{i}" for i in range(0, n, 2)]
    moe = [f"sublayers.{i}" for i in range(1, n, 2) if isinstance(model.sublayers[i].fn, MoE)]
    dense = [f"sublayers.{i}" for i in range(1, n, 2) if not isinstance(model.sublayers[i].fn, MoE)]

    def rules(**groups):
        out = {"": "keep", **dict.fromkeys(mixers + moe + dense, "keep")}
        for policy, names in groups.items():
            out.update(dict.fromkeys(names, policy))
        return out

    every = mixers + moe + dense
    return {"plain": {}, "keep": rules(), "recompute": rules(recompute=every), "recompute_moe": rules(recompute=moe),
            "offload": rules(offload=every), "fp8_ffn": rules(fp8=moe + dense),
            "k3_mix": rules(recompute=moe, fp8=dense)}


def _grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _step(model: K3Model, idx: torch.Tensor, autocast: bool, manager: ActivationManager | None = None):
    """One forward + backward on ``idx`` (targets = idx); returns (loss float, manager stats at the end of
    forward or None, device bytes held at the end of forward beyond those at the start: CUDA only)."""
    dev = idx.device
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
        _, loss = model(idx, targets=idx)
    stats = manager.stats() if manager is not None else None
    held = torch.cuda.memory_allocated(dev) - before if dev.type == "cuda" else None
    loss.backward()
    # Read back after backward: a read between forward and backward would stall the GPU inside the step.
    return float(loss.detach()), stats, held


def check_policies(model: K3Model, idx: torch.Tensor, sets: dict[str, dict[str, str]]) -> dict:
    """Loss and gradients of ``model`` on ``idx`` in float32 under every policy set, against "keep", every run
    routed to the keep run's experts (``RoutingReplay``).

    Args:
        model (K3Model): float32 weights, any device; its policies must be unset (they are applied and
            removed here); its gradients are overwritten.
        idx (Tensor): [B, T] int64 token ids in [0, vocab), the targets too.
        sets (dict): {name: rules} (``policy_sets``), "keep" among them.

    Returns:
        {"shape": [B, T], "exact_bound", "fp8_bound", "keep_repeat": the floor (keep run twice),
        "sets": {name: {"loss", "loss_rel_err", "grad_rel_err" (worst tensor), "worst" (its parameter name),
        "bound", "ok"}}}.

    Raises:
        AssertionError: a set's loss or a gradient past its bound (NaN fails), naming the set and the
            parameter; or the manager still holding saved tensors after backward.
    """
    names = [n for n, _ in model.named_parameters()]

    def run(rules):
        model.zero_grad(set_to_none=True)
        mgr = ActivationManager()
        handle = apply_policies(model, rules, manager=mgr, default=None)
        try:
            loss, _, _ = _step(model, idx, autocast=False)
        finally:
            handle.remove()
        if mgr.live_tensors():
            raise AssertionError(f"{mgr.live_tensors()} saved tensors still held after backward: {mgr.stats()}")
        return loss, _grads(model)

    out = dict(shape=list(idx.shape), exact_bound=EXACT_BOUND, fp8_bound=FP8_BOUND, sets={})
    # CUDA's forward is not bitwise repeatable, and near ties in the routers' scores turn its last-bit
    # differences into other experts for some tokens: every run routes to the keep run's experts.
    replay = RoutingReplay(model)
    for name, rules in [("keep", sets["keep"]), ("keep_repeat", sets["keep"])] + \
            [(n, r) for n, r in sets.items() if n != "keep"]:
        with replay:
            loss, grads = run(rules)
        if name == "keep":
            ref_loss, ref = loss, grads
            continue
        # fp8 changes what backward reads, never the forward: the loss is held to the exact bound in every set.
        bound = FP8_BOUND if "fp8" in rules.values() else EXACT_BOUND
        errs = {n: (float("inf") if (r is None) != (g is None) else 0.0 if r is None else rel_rms_error(r, g))
                for n, r, g in zip(names, ref, grads)}
        worst = max(errs, key=errs.get)
        loss_err = abs(loss - ref_loss) / abs(ref_loss)
        ok = loss_err <= EXACT_BOUND and errs[worst] <= bound
        out["sets"][name] = dict(loss=loss, loss_rel_err=loss_err, grad_rel_err=errs[worst], worst=worst,
                                 bound=bound, ok=ok)
        print(f"check {name:<14} loss rel err {loss_err:.1e} (bound {EXACT_BOUND:.0e}); worst gradient "
              f"{worst}: rel RMS err {errs[worst]:.1e} (bound {bound:.0e}) {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            raise AssertionError(f"policy set {name!r} disagrees with keep: loss rel err {loss_err:.2e} (bound "
                                 f"{EXACT_BOUND:.0e}), gradient of {worst} rel RMS err {errs[worst]:.2e} (bound "
                                 f"{bound:.0e})")
        del grads
    out["keep_repeat"] = out["sets"].pop("keep_repeat")
    model.zero_grad(set_to_none=True)
    return out


def _free(device: torch.device) -> None:
    # On CUDA the next set's peak must not include this one's cached blocks; a CPU run has no peak to protect.
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def measure(model: K3Model, idx: torch.Tensor, rules: dict[str, str], steps: int, warmup: int) -> dict:
    """Time and memory of ``warmup + steps`` forward + backward steps on ``idx`` under ``rules``.

    bf16 autocast on CUDA (float32 weights, as ``k3lab.train``), float32 on a CPU; gradients dropped before
    each step, so a step's peak holds one set of them.

    Returns:
        {"rules", "step_ms" (median of the timed steps), "step_ms_min", "step_ms_all", "loss" (last step), "peak_bytes"
        (CUDA: max_memory_allocated of the timed steps; CPU: the manager's summed per-policy peaks),
        "base_bytes" (CUDA: allocated when the step begins: weights), "held_bytes" (CUDA: device bytes held
        at the end of forward, beyond base), "saved_bytes" {policy: bytes on the device at the end of
        forward}, "saved_total_bytes", "host_bytes", "saved_tensors"; or {"rules", "oom": message} when a
        CUDA step ran out of memory, {"rules", "error": message} when a recompute replay did not match its
        forward (``CheckpointError``).
    """
    dev = idx.device
    cuda = dev.type == "cuda"
    mgr = ActivationManager()
    handle = apply_policies(model, rules, manager=mgr, default=None)
    times, peak, loss, stats, held, base = [], 0, None, None, None, None
    try:
        for i in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            mgr.reset_peaks()
            t = time.perf_counter()
            loss, stats, held = _step(model, idx, autocast=cuda, manager=mgr)
            if cuda:
                torch.cuda.synchronize(dev)
            dt = time.perf_counter() - t
            if i >= warmup:
                times.append(dt)
                peak = max(peak, torch.cuda.max_memory_allocated(dev) if cuda else
                           sum(c["peak_bytes"] for c in mgr.stats().values()))
    except torch.cuda.OutOfMemoryError as e:
        return dict(rules=rules, oom=str(e).splitlines()[0][:300])
    except CheckpointError as e:
        # A recompute replay that saved other shapes than its forward: on CUDA a router near a tie can pick
        # other experts the second time (the check pins routing; the timed steps run as training would).
        return dict(rules=rules, error=f"CheckpointError: {str(e).strip().splitlines()[0][:300]}")
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
        _free(dev)
    return dict(rules=rules, step_ms=1e3 * statistics.median(times), step_ms_min=1e3 * min(times),
                step_ms_all=[1e3 * t for t in times],
                loss=loss, peak_bytes=peak, base_bytes=base, held_bytes=held,
                saved_bytes={p: c["live_bytes"] for p, c in stats.items() if c["live_tensors"]},
                saved_total_bytes=sum(c["live_bytes"] for c in stats.values()),
                host_bytes=sum(c["host_bytes"] for c in stats.values()),
                saved_tensors=sum(c["live_tensors"] for c in stats.values()))


def table(r: dict) -> str:
    """The result as text: one row per policy set, the check's errors beside the costs."""
    cuda = r["peak_kind"] == "cuda_max_memory_allocated"
    peak_head = "peak GiB" if cuda else "peak saved MiB"
    lines = [f"Activation memory per policy set, {r['preset']}, B x T = {r['batch_size']} x {r['seq_len']}, "
             f"{r['dtype']}, on {r['device']} ({r['date']}); median of {r['steps']} steps",
             f"peak: {r['peak_kind']}; saved: the manager's bytes held for backward at the end of forward "
             f"(host: offloaded copies); check: float32 {r['check']['shape'][0]} x {r['check']['shape'][1]}, "
             f"worst gradient's rel RMS error against keep (keep run twice: "
             f"{r['check']['keep_repeat']['grad_rel_err']:.1e})"
             + ("; start: allocated when a step begins (weights, and what the last step left)" if cuda else ""),
             f"{'set':<15}{'saved MiB':>11}{'host MiB':>10}{peak_head:>16}" + (f"{'start GiB':>11}" if cuda else "")
             + f"{'step ms':>10}{'vs keep':>9}{'grad err':>10}{'bound':>8}"]
    keep = r["sets"].get("keep", {}).get("step_ms")
    for name, s in r["sets"].items():
        chk = r["check"]["sets"].get(name, {"grad_rel_err": 0.0, "bound": 0.0})
        if "oom" in s or "error" in s:
            what = "out of memory" if "oom" in s else s["error"][:60]
            lines.append(f"{name:<15}{what:>{66 if cuda else 55}}")
            continue
        peak = s["peak_bytes"] / 2**30 if cuda else s["peak_bytes"] / 2**20
        rel = f"{s['step_ms'] / keep:.2f}x" if keep else "n/a"
        # Without policies the manager sees nothing: "plain" has no counters.
        saved, host = ((f"{s['saved_total_bytes'] / 2**20:.1f}", f"{s['host_bytes'] / 2**20:.1f}") if s["rules"]
                       else ("n/a", "n/a"))
        start = f"{s['base_bytes'] / 2**30:>11.2f}" if cuda else ""
        lines.append(f"{name:<15}{saved:>11}{host:>10}{peak:>16.2f}{start}{s['step_ms']:>10.1f}{rel:>9}"
                     f"{chk['grad_rel_err']:>10.1e}{chk['bound'] if name != 'keep' else 0:>8.0e}")
    return "\n".join(lines)


def _sets_arg(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SETS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected set names from {list(SETS)} separated by commas, got {text!r}")
    return [s for s in SETS if s in names or s == "keep"]


def main(argv=None) -> dict:
    """``python -m k3lab.bench.memory [flags]``: check, measure, write the JSON, print the table; returns the
    result dict.

    Raises:
        SystemExit: 2 on a bad flag; no CUDA device for ``--device cuda``.
        AssertionError: a policy set failed its correctness check (nothing is written).
    """
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.memory", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where to run (default: cuda when present)")
    p.add_argument("--preset", choices=("k3-tiny", "k3-1b"), default=None,
                   help="model size (default: k3-1b on cuda, k3-tiny on cpu)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step B (default 8; cpu 2)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence T (default 2048; cpu 64)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="timed steps per set, after warm-up (default 5; cpu 2)")
    p.add_argument("--vocab-size", type=lambda t: _int_at_least(t, 2, "an int >= 2 (a one-token vocabulary has "
                                                                   "zero loss)"), default=None,
                   help="vocabulary (default: the corpus tokenizer's, the model k3lab.train trains)")
    p.add_argument("--sets", type=_sets_arg, default=list(SETS),
                   help=f"policy sets to run, comma-separated, keep always included (default: all of {','.join(SETS)})")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens")
    p.add_argument("--out", default=None, help="JSON path ('' = write nothing); default "
                   "data/results/memory_<card>.json after the device (a k3-tiny run writes nothing by default)")
    args = p.parse_args(argv)
    check_out(args.out)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu to check the script")
    cpu = device.type == "cpu"
    preset = args.preset or ("k3-tiny" if cpu else "k3-1b")
    B, T = args.batch_size or (2 if cpu else 8), args.seq_len or (64 if cpu else 2048)
    steps = args.steps or (2 if cpu else 5)
    if args.vocab_size is None:
        from k3lab.data import vocab_size  # noqa: PLC0415

        args.vocab_size = vocab_size()
    cfg = K3Config.preset(preset, vocab_size=args.vocab_size)
    torch.manual_seed(args.seed)
    model = K3Model(cfg).to(device)
    model.train()
    sets = {n: r for n, r in policy_sets(model).items() if n in args.sets}
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=gen).to(device)

    result = run_info(device)
    total, active = param_table(model)["total"]
    result.update(preset=preset, batch_size=B, seq_len=T, tokens=B * T, steps=steps, vocab_size=cfg.vocab_size,
                  dtype="float32" if cpu else "bf16 autocast, float32 weights", params=dict(total=total, active=active),
                  peak_kind="manager_saved_peak" if cpu else "cuda_max_memory_allocated", set_docs=SET_DOCS)
    print(f"== correctness: every policy set against keep, float32, {min(B, CHECK_BATCH)} x {min(T, CHECK_SEQ_LEN)}",
          flush=True)
    result["check"] = check_policies(model, idx[:CHECK_BATCH, :CHECK_SEQ_LEN], sets)
    _free(device)
    if not cpu:
        # The timed steps never wait on the host for the value checks (as k3lab.train runs).
        model.value_checks(False)
    print(f"== {preset}, {B} x {T}, {result['dtype']}: {steps} timed steps per set", flush=True)
    result["sets"] = {}
    for i, (name, rules) in enumerate(sets.items()):
        # The first set also pays for compiling and autotuning the kernels at this shape.
        s = result["sets"][name] = measure(model, idx, rules, steps, warmup=(3 if i == 0 else 1) if not cpu else 1)
        print(f"{name}: " + (f"out of memory ({s['oom']})" if "oom" in s else s["error"] if "error" in s else
                             f"{s['step_ms']:.1f} ms, peak {s['peak_bytes'] / 2**20:.1f} MiB, saved "
                             f"{s['saved_total_bytes'] / 2**20:.1f} MiB, host {s['host_bytes'] / 2**20:.1f} MiB"),
              flush=True)
    write_result("memory", result, args.out, small=preset == "k3-tiny")
    print("\n" + table(result))
    return result


if __name__ == "__main__":
    main()
