"""Where one training step of ``k3lab.train``'s model goes on the GPU: device time per phase, per kernel
category and per kernel, under ``torch.profiler``.

    python -m k3lab.bench.step_profile                        # k3-1b, 8 x 2048 -> data/results/step_profile_<card>.json
    python -m k3lab.bench.step_profile --batch-size 4 --microbatches 2
    python -m k3lab.bench.step_profile --compile              # each sublayer compiled -> step_profile_compile_<card>.json
    python -m k3lab.bench.step_profile --small --device cpu   # k3-tiny, CPU self time per op: checks the script

The step is the trainer's, built by its own functions (``k3lab.train.loop``: ``build_run``, ``build_optimizers``,
``forward_backward``, ``optimizer_step``; Quantile Balancing's ``update_biases``; value checks off) on the
loader's first batch of the corpus. Correctness first: before each profiled step, an eager float32 forward of the
same weights on the same batch (eval mode, no autograd, compiled code forced eager) gives the loss the step must
reproduce within ``BF16_LOSS_BOUND`` (bf16 autocast and near-tied routers apart), and the step must change the
weights. Phases are ``torch.profiler.record_function`` ranges opened here around the trainer's calls (the forward
by hooks on the model; backward is the rest of ``forward_backward``; optimizer = gradient norm, clipping, Per-Head
Muon with its AdamW groups); a kernel belongs to the phase in which the host op that launched it started (the
backward's ops run on the autograd thread). ``CATEGORIES`` sorts kernel names (on a CPU, aten op names with their
self time) into kinds. Device time is the sum of kernel, memcpy and memset durations; wall time is measured under
the profiler, the unprofiled step time on the last warm-up step. A table is printed last.
"""
from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from k3lab.bench import add_attnres_flags, check_out, gpu_device, positive_int, run_info, write_result
from k3lab.bench.train import BF16_LOSS_BOUND
from k3lab.model import flops_per_token, mfu
from k3lab.moe import update_biases
from k3lab.train import TrainConfig
from k3lab.train.config import ConfigError
from k3lab.train.loop import (build_optimizers, build_run, counted_once, forward_backward, optimizer_step,
                              process_group)
from k3lab.train.metrics import FLOPS_CONVENTION, peak_key

# Kernel (or aten op) name -> category: the first regex that matches (case-insensitive search) wins; "other"
# takes the rest. Triton kernels keep their function names (kernels/kda: kda_*, short_conv_silu_*;
# kernels/attnres: attnres_*); inductor's are triton_poi_* (pointwise), triton_red_* / triton_per_*
# (reductions), triton_tem_* (matmul templates). On a CPU, AttnRes's autograd.Functions count as attnres.
CATEGORIES = (
    ("nccl", r"nccl"),
    ("grouped_gemm", r"grouped|groupproblemshape"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|cublas|xmma|splitkreduce|triton_tem_"
             r"|^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|einsum|dot|mv)$"),
    ("flash_kda", r"^kda_|short_conv_silu|flashkda"),
    ("attnres", r"^attnres_|^_(storefirst|storesum|phase1|addmerge)"),
    ("attention", r"flash|fmha|sdpa|scaled_dot_product|attention|flex"),
    ("norm", r"rms_?norm|layer_?norm|group_?norm|batch_?norm|rowwisemoments"),
    ("reduction", r"triton_(red|per)_|reduce|softmax|nll_loss|cross_entropy|logsumexp|cumsum|scan|sort|topk|"
                  r"histc|bincount|histogram|^aten::(sum|mean|amax|amin|max|min|argmax|argmin|prod|all|any|std|var|"
                  r"norm|linalg_vector_norm)$"),
    ("copy_cast", r"copy|memcpy|memset|cast|convert|gather|scatter|index|catarray|fill|embedding"
                  r"|^aten::(to|cat|stack|clone|contiguous|zero_|zeros|ones|full)$"),
    ("elementwise", r"triton_poi_|elementwise|vectorized|unrolled|foreach|multi_tensor|pointwise|glu_(fwd|bwd)"
                    r"|^aten::(add|sub|rsub|mul|div|neg|exp|log|log1p|expm1|sigmoid|silu|gelu|relu|tanh|pow|sqrt|"
                    r"rsqrt|square|abs|sign|clamp|clamp_min|clamp_max|maximum|minimum|where|masked_fill|lerp|"
                    r"addcmul|addcdiv|reciprocal|softplus|sin|cos|erf|eq|ne|lt|le|gt|ge|\w+_backward)_?$"),
)
CATEGORY_NAMES = tuple(c for c, _ in CATEGORIES) + ("other",)
_COMPILED = tuple((c, re.compile(r, re.IGNORECASE)) for c, r in CATEGORIES)
# The benchmark's record_function ranges -> phase ("forward_backward" minus "forward" is the backward).
RANGES = {"forward": "forward", "forward_backward": "backward", "optimizer": "optimizer", "bias_update": "bias_update"}
PHASES = ("forward", "backward", "optimizer", "bias_update", "other")
DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")


TOP_KERNELS = 40  # kernels listed, each with its three largest callers


def category(name: str) -> str:
    """The ``CATEGORIES`` entry of a kernel or aten op name ("other" when none matches)."""
    return next((c for c, r in _COMPILED if r.search(name)), "other")


_BACKWARD_NODE = "autograd::engine::evaluate_function: "


def caller(event) -> str:
    """Who launched a kernel: the launching host op's name, after the autograd node it runs under in backward
    ("MulBackward0 > aten::mul"), so that a kernel name shared by many ops can be traced to one. A launch that
    waited for the device's queue is recorded under a "Command Buffer Full" event: its op is that event's parent."""
    if event.name == "Command Buffer Full" and getattr(event, "cpu_parent", None) is not None:
        event = event.cpu_parent
    parent = getattr(event, "cpu_parent", None)
    while parent is not None and not parent.name.startswith(_BACKWARD_NODE):
        parent = parent.cpu_parent
    return event.name if parent is None else f"{parent.name.removeprefix(_BACKWARD_NODE)} > {event.name}"


def records(prof, device: torch.device) -> tuple[list, list]:
    """(records, intervals) of a finished profile: records (name, microseconds, host start, caller) per kernel,
    memcpy and memset on CUDA (host start: the launching op's), per aten op's self time on a CPU; intervals
    (phase, start, end) of the benchmark's ranges on the host.

    On CUDA the device work is read from each host op's ``kernels`` (the device events torch links to the op
    that launched them, the list its own ``device_time_total`` sums), which every torch here has; the device
    events' own ``linked_correlation_id`` is missing from ``FunctionEvent`` in torch 2.11. The ranges' device
    copies (``gpu_user_annotation``) hang under the annotation events and are skipped with them."""
    events = prof.events()
    intervals = [(RANGES[e.name], e.time_range.start, e.time_range.end) for e in events
                 if e.is_user_annotation and e.device_type == DeviceType.CPU and e.name in RANGES]
    if device.type == "cpu":
        # torch 2.11's FunctionEvent has no activity_type; there every non-annotation CPU event is an op.
        return [(e.name, e.self_cpu_time_total, e.time_range.start, caller(e)) for e in events
                if e.device_type == DeviceType.CPU and not e.is_user_annotation
                and getattr(e, "activity_type", "cpu_op") == "cpu_op"], intervals
    return [(k.name, k.duration, e.time_range.start, caller(e)) for e in events
            if e.device_type == DeviceType.CPU and not e.is_user_annotation for k in e.kernels], intervals


def summarise(recs: list, intervals: list) -> dict:
    """One step's {"device_ms", "phases_ms", "categories_ms", "kernels" {name: [ms, count, {caller: ms}]}}: each
    record in the shortest interval holding its host start ("other" outside all), and in its ``category``."""
    phases, cats, kernels = dict.fromkeys(PHASES, 0.0), dict.fromkeys(CATEGORY_NAMES, 0.0), {}
    for name, us, t, who in recs:
        inside = [(end - start, phase) for phase, start, end in intervals if start <= t <= end]
        phases[min(inside)[1] if inside else "other"] += us / 1e3
        cats[category(name)] += us / 1e3
        k = kernels.setdefault(name, [0.0, 0, defaultdict(float)])
        k[0] += us / 1e3
        k[1] += 1
        k[2][who] += us / 1e3
    return dict(device_ms=sum(r[1] for r in recs) / 1e3, phases_ms=phases, categories_ms=cats, kernels=kernels)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mark_forward(model: torch.nn.Module) -> None:
    """Open a "forward" range for every call of ``model`` (hooks: the trainer's code stays as it is)."""
    open_ = []

    def enter(module, args):
        open_.append(record_function("forward"))
        open_[-1].__enter__()

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(lambda module, args, out: open_.pop().__exit__(None, None, None))


def profile_steps(config: TrainConfig, device: torch.device, warmup: int, steps: int) -> dict:
    """``warmup`` then ``steps`` profiled trainer steps of ``config`` on ``device`` (one rank).

    Returns:
        {"check", "steps" (per step: wall_ms, loss, device_ms, phases_ms, categories_ms), "kernels"
        {name: [ms, count]} summed over the profiled steps, "unprofiled_step_ms", "flops_per_token"}.

    Raises:
        AssertionError: a step's loss off the eager float32 loss past ``BF16_LOSS_BOUND`` (or not finite), or
            the step leaves the weights unchanged.
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with process_group(device):
        par, loader, parts, pipe = build_run(config, device)
        x, y = loader.next_batch(device)
        opts = build_optimizers(parts, config)
        for part in parts:
            part.value_checks(False)
            part.train()
        _mark_forward(parts[0])
        params, counted = [p for part in parts for p in part.parameters()], counted_once(parts)
        # A Muon matrix (a Q/K/V projection): every step moves it.
        probe = next(g["params"][0] for g in opts[0].param_groups if g["algorithm"] == "muon")

        def step(i):
            with record_function("forward_backward"):
                loss = forward_backward(parts, pipe, x, y, config, par)
            with record_function("optimizer"):
                optimizer_step(opts, params, counted, config, i, par.pp_group)
            with record_function("bias_update"):
                for part in parts:
                    update_biases(part, par.batch_group)
            return loss

        for i in range(1, warmup + 1):
            _sync(device)
            t = time.perf_counter()
            step(i)
            _sync(device)
            unprofiled = time.perf_counter() - t
        out, total, errs = [], defaultdict(lambda: [0.0, 0, defaultdict(float)]), []
        for i in range(warmup + 1, warmup + steps + 1):
            # The reference: eager float32, eval mode (no balance counts recorded), no autograd.
            parts[0].eval()
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                ref = float(parts[0](x, y)[1])
            parts[0].train()
            before = probe.detach().clone()
            _sync(device)
            with profile(activities=activities) as prof:
                t = time.perf_counter()
                loss = float(step(i))
                _sync(device)
                wall = time.perf_counter() - t
            err = abs(loss - ref) / abs(ref)
            errs.append(err)
            if not err <= BF16_LOSS_BOUND or torch.equal(before, probe.detach()):
                raise AssertionError(f"step {i}: loss {loss} vs eager float32 {ref} (rel err {err:.2e}, bound "
                                     f"{BF16_LOSS_BOUND:.0e}); weights changed: {not torch.equal(before, probe)}")
            s = summarise(*records(prof, device))
            for name, (ms, n, callers) in s.pop("kernels").items():
                total[name][0] += ms
                total[name][1] += n
                for who, t in callers.items():
                    total[name][2][who] += t
            out.append(dict(step=i, wall_ms=1e3 * wall, loss=loss, loss_eager_fp32=ref, **s))
            print(f"step {i}: wall {1e3 * wall:.1f} ms, device {s['device_ms']:.1f} ms, loss {loss:.5f} vs eager "
                  f"float32 {ref:.5f} (rel err {err:.1e})", flush=True)
        fpt = flops_per_token(parts[0].config, config.seq_len)
    check = dict(loss_max_rel_err=max(errs), loss_bound=BF16_LOSS_BOUND, weights_changed=True, ok=True)
    return dict(check=check, steps=out, kernels=dict(total), unprofiled_step_ms=1e3 * unprofiled, flops_per_token=fpt)


def table(r: dict) -> str:
    """The result as text: per-step wall and device time, phases, categories, FLOPs, top kernels."""
    steps, n = r["steps"], len(r["steps"])

    def row(label, values, share=None):
        cells = "".join(f"{v:>10.2f}" for v in values) + f"{sum(values) / n:>10.2f}"
        return f"{label:<26}{cells}" + (f"{100 * share:>8.1f}%" if share is not None else "")

    dev = r["mean"]["device_ms"]
    attnres = "".join([f", AttnRes buffer {r['attnres_buffer']}" if r.get("attnres_buffer", "float32") != "float32"
                       else "", ", AttnRes inputs kept" if r.get("attnres_keep_inputs") else ""])
    lines = [f"Step profile, {r['preset']}, B x T = {r['batch_size']} x {r['seq_len']}, {r['microbatches']} "
             f"micro-batch(es){', compiled' if r['compile'] else ''}{attnres}, on {r['device']} ({r['date']}): {n} profiled "
             f"steps after {r['warmup']} warm-up; time: {r['time_kind']}",
             f"check: loss vs eager float32 forward, max rel err {r['check']['loss_max_rel_err']:.1e} (bound "
             f"{r['check']['loss_bound']:.0e}); weights changed by every step",
             f"{'ms':<26}" + "".join(f"{'step ' + str(s['step']):>10}" for s in steps) + f"{'mean':>10}{'share':>9}",
             row("wall (profiled)", [s["wall_ms"] for s in steps]), row("device", [s["device_ms"] for s in steps])]
    lines += [row(f"  phase {p}", [s["phases_ms"][p] for s in steps], r["mean"]["phases_ms"][p] / dev) for p in PHASES]
    lines += [row(f"  {c}", [s["categories_ms"][c] for s in steps], r["mean"]["categories_ms"][c] / dev)
              for c in CATEGORY_NAMES]
    lines += [f"model FLOPs per step {r['flops_per_step']:.3e} (k3lab.model.flops_per_token x tokens): "
              f"{r['tflops_per_s']:.3g} TFLOP/s over the unprofiled step ({r['unprofiled_step_ms']:.1f} ms)"
              + (f", MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""),
              f"gemm + grouped_gemm: {100 * r['gemm_share']:.1f}% of device time (the rest is memory-bound work "
              f"and overhead); device busy {100 * dev / r['mean']['wall_ms']:.0f}% of the profiled wall time",
              f"top {len(r['top_kernels'])} by device time (per step):",
              f"{'ms':>10}{'count':>8}  {'category':<13}name"]
    for k in r["top_kernels"]:
        lines.append(f"{k['ms']:>10.2f}{k['count']:>8.0f}  {k['category']:<13}{k['name'][:110]}")
        lines += [f"{'':>20}{t:>8.2f} ms from {who[:100]}" for who, t in k.get("callers", {}).items()]
    return "\n".join(lines)


def main(argv=None) -> dict:
    """``python -m k3lab.bench.step_profile [flags]``: profile, write the JSON, print the table; returns the result.

    Raises:
        SystemExit: 2 on a bad flag; no CUDA device for ``--device cuda``; ``--device cpu`` without ``--small``;
            no token shards or a batch the model cannot run.
        AssertionError: the correctness check failed.
    """
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.step_profile", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark), cuda:N, or cpu (only with --small)")
    p.add_argument("--small", action="store_true", help="k3-tiny, 2 x 32 tokens, 1 warm-up and 2 profiled steps")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences per micro-batch (default 8; --small 2)")
    p.add_argument("--microbatches", type=positive_int, default=1, help="micro-batches per step (default 1)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default 2048; --small 32)")
    p.add_argument("--steps", type=positive_int, default=None, help="profiled steps (default 3; --small 2)")
    p.add_argument("--compile", action="store_true", help="torch.compile each sublayer (k3lab.train.compile_blocks)")
    add_attnres_flags(p)
    p.add_argument("--out", default=None, help="JSON path ('' = write nothing); default "
                   "data/results/step_profile[_compile]_<card>.json after the device (with --small: nothing)")
    args = p.parse_args(argv)
    check_out(args.out)
    device = gpu_device(p, args, "k3-1b is GPU work")
    small, M = args.small, args.microbatches
    warmup, steps = (1, args.steps or 2) if small else (2, args.steps or 3)
    B = args.batch_size or (2 if small else 8)
    try:
        config = TrainConfig(preset="k3-tiny" if small else "k3-1b", batch_size=M * B, microbatches=M,
                             seq_len=args.seq_len or (32 if small else 2048), progress=False, compile=args.compile,
                             steps=warmup + steps, attnres_buffer=args.attnres_buffer,
                             attnres_keep_inputs=args.attnres_keep_inputs)
    except ValueError as e:
        p.error(str(e))
    try:
        r = profile_steps(config, device, warmup, steps)
    except (ConfigError, FileNotFoundError) as e:
        p.error(str(e))
    result = run_info(device)
    result.update(preset=config.preset, batch_size=B, microbatches=M, seq_len=config.seq_len, compile=config.compile,
                  attnres_buffer=config.attnres_buffer, attnres_keep_inputs=config.attnres_keep_inputs, warmup=warmup, tokens_per_step=config.batch_size * config.seq_len, flops_convention=FLOPS_CONVENTION,
                  time_kind="CUDA kernel + memcpy + memset time" if device.type == "cuda" else "CPU self time per op",
                  categories=[list(c) for c in CATEGORIES], **r)
    mean = lambda key: {k: sum(s[key][k] for s in r["steps"]) / steps for k in r["steps"][0][key]}  # noqa: E731
    result["mean"] = dict(wall_ms=sum(s["wall_ms"] for s in r["steps"]) / steps,
                          device_ms=sum(s["device_ms"] for s in r["steps"]) / steps,
                          phases_ms=mean("phases_ms"), categories_ms=mean("categories_ms"))
    cats = result["mean"]["categories_ms"]
    result["gemm_share"] = (cats["gemm"] + cats["grouped_gemm"]) / max(result["mean"]["device_ms"], 1e-9)
    result["flops_per_step"] = r["flops_per_token"] * result["tokens_per_step"]
    result["tflops_per_s"] = result["flops_per_step"] / r["unprofiled_step_ms"] / 1e9
    peak = peak_key(device)
    tok_s = result["tokens_per_step"] / r["unprofiled_step_ms"] * 1e3
    result["mfu"] = mfu(tok_s, r["flops_per_token"], peak) if peak else None
    top = sorted(result.pop("kernels").items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    result["top_kernels"] = [dict(name=name[:300], category=category(name), ms=ms / steps, count=n / steps,
                                  callers={who[:200]: t / steps for who, t in sorted(callers.items(), key=lambda c: -c[1])[:3]})
                             for name, (ms, n, callers) in top]
    write_result("step_profile_compile" if config.compile else "step_profile", result, args.out, small)
    print("\n" + table(result))
    return result


if __name__ == "__main__":
    main()
