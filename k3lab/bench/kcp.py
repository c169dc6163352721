"""Benchmark KCP on the FlashKDA kernels (``k3lab.kcp.kcp_flash_kda``) on 2 GPUs against ``flash_kda``
on 1 GPU.

    python -m k3lab.bench.kcp                                   # check, then T = 32K, 128K, 512K (H = 32)
    python -m k3lab.bench.kcp --T 32768 --reps 1 --out /tmp/kcp_smoke.json          # a short smoke run
    python -m k3lab.bench.kcp --device cpu --T 128 --H 1 --K 16 --reps 1 --out /tmp/kcp_cpu.json  # ~1 min

Starts one process per rank itself (torch.multiprocessing, NCCL on CUDA, gloo on CPU). On CPU the
kernels run in Triton's interpreter (TRITON_INTERPRET=1 is set for the ranks): float32 and tiny sizes
only, a smoke test of the script. Order: (1) correctness: float32 varlen with initial states, 2 ranks
against one-device ``flash_kda`` (outputs, final states and every gradient, each rank separately;
<= 1e-5 relative on CPU; on CUDA, where float32 dots run as 3 bf16 passes and the ranks' chunks
start at other tokens than one device's, the value is recorded and the run stops above 1e-3, as a
KCP bug gives >= 1e-2), then bf16 at the benchmark's head shape against the
1-GPU run (<= 2e-2); it stops on failure. (2) per T: forward and forward+backward (autograd on, the
training forward), 1 GPU (``flash_kda``, in slabs of ``--slab`` tokens chained through the state so
512K fits) vs 2 GPUs, wall-clock medians (the slower rank); one rank's T/2 tokens alone on one GPU
(perfect scaling's time); bytes communicated per layer counted from the collective buffers (the map
all-gather, the state-gradient all-gather and the three conv halos, forward + backward). (3) the
sequential fold against the log-depth scan for R = 2 ... 128 simulated ranks on one device. Writes the
JSON, prints the table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from k3lab.bench import check_out, positive_float, positive_int, run_info
from k3lab.dist import launch
from k3lab.files import write_json
from k3lab.kcp import kcp_short_conv, make_context
from k3lab.kcp.affine import fold_scan, fold_sequential
from k3lab.kcp.workers import (
    FLASH_LEAVES, FLASH_REPLICATED, FLASH_SHARDED, FlashCase, flash_rank_run, flash_reference,
)
from k3lab.testing import rel_rms_error

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LOWER_BOUND = -5.0
LOCAL_KDA = ("1 GPU: k3lab.kernels.kda.flash_kda (Triton); 2 GPUs: k3lab.kcp.kcp_flash_kda on the same "
             "kernel stages (k3lab.kernels.kda.chunk_fwd / chunk_bwd)")


def _inputs(T, H, K, V, device, dtype, seed) -> dict[str, torch.Tensor]:
    """Raw flash_kda inputs [1, T, ...] in ``dtype`` (A_log, dt_bias float32), all requiring grad. Gate
    -5 sigmoid(z - 2) (A_log = 0, K3's init; dt_bias = -2): K3's lower-bounded gate, log-decay in (-5, 0)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V), z=r(1, T, H, K), beta=r(1, T, H),
             A_log=torch.zeros(H, device=device), dt_bias=torch.full((H * K,), -2.0, device=device))
    return {n: t.requires_grad_() for n, t in x.items()}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, reps, device, group) -> float:
    """Median wall-clock ms of fn() over ``reps`` runs after one warm-up; the slowest rank's."""
    times = []
    for i in range(reps + 1):
        if group is not None:
            dist.barrier(group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([statistics.median(times)], device=device)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _worst(errs: dict, device, group) -> float:
    worst = torch.tensor([max(errs.values())], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return float(worst)


def one_gpu(x: dict, slab: int):
    """flash_kda over the whole sequence in slabs of ``slab`` tokens, each from the previous one's final
    state (what fits one GPU at 512K: flash_kda keeps every intermediate of a call)."""
    from k3lab.kernels.kda import flash_kda  # noqa: PLC0415

    T, outs, S = x["q"].shape[1], [], None
    for a in range(0, T, slab):
        o, S = flash_kda(*(x[n][:, a : a + slab] for n in ("q", "k", "v", "z", "beta")), x["A_log"], x["dt_bias"],
                         initial_state=S, output_final_state=True, lower_bound=LOWER_BOUND, check_values=False)
        outs.append(o)
    return torch.cat(outs, dim=1)


def _check(rank, R, group, device, cfg) -> dict:
    """float32 varlen with initial states vs one-device flash_kda; then the benchmark dtype at the
    benchmark's head shape, R ranks vs the 1-GPU run."""
    out = {}
    T = cfg.check_T
    cu = (0, T // 8, T // 2 + T // 40, T // 2 + T // 13, T)
    # GVA: 2 value heads per q/k head (fewer heads under the CPU interpreter).
    H, HV = (2, 4) if device.type == "cuda" else (1, 2)
    case = FlashCase(T=T, cu_seqlens=cu, H=H, HV=HV, K=cfg.K, V=cfg.K, seed=1)
    ref = flash_reference(case, device)
    res = flash_rank_run(rank, R, group, case, "sequential", device)
    sl = slice(res["start"], res["stop"])
    errs = {"o": rel_rms_error(ref["o"][:, sl], res["o"])}
    errs.update({f"grad_{n}": rel_rms_error(ref["grads"][n][:, sl], res["grads"][n]) for n in FLASH_SHARDED})
    sums = {"final": res["final"].clone(), **{n: res["grads"][n].clone() for n in FLASH_REPLICATED}}
    for t in sums.values():
        dist.all_reduce(t, group=group)
    errs["final"] = rel_rms_error(ref["final"], sums.pop("final"))
    errs.update({f"grad_{n}": rel_rms_error(ref["grads"][n], t) for n, t in sums.items()})
    tol = 1e-3 if device.type == "cuda" else 1e-5
    out["float32_varlen_max_rel_err"] = _worst(errs, device, group)
    out["float32_tol"] = tol
    out[f"float32_varlen_rank{rank}"] = errs
    if out["float32_varlen_max_rel_err"] > tol:
        raise AssertionError(f"KCP float32 check failed on some rank: rank {rank} errors {errs}")
    # The benchmark's dtype and head shape: R ranks vs the 1-GPU run, one document.
    T, H, K = cfg.bf16_check_T, cfg.H, cfg.K
    full = _inputs(T, H, K, K, device, cfg.dtype, seed=4)
    do = torch.randn(1, T, H, K, device=device, generator=torch.Generator(device).manual_seed(5)).to(cfg.dtype)
    o1 = one_gpu(full, cfg.slab)
    o1.backward(do)
    out.update(_kcp_vs_one(rank, R, group, device, cfg, full, o1.detach(), do))
    return out


def fused_args(x: dict) -> dict:
    """The workers' input names (``FLASH_SHARDED``, ``FLASH_REPLICATED``) as kcp_flash_kda's keyword arguments:
    the beta logits are its ``beta_logits``."""
    return {("beta_logits" if n == "beta" else n): t for n, t in x.items()}


def _kcp_vs_one(rank, R, group, device, cfg, full, o1, do) -> dict:
    from k3lab.kcp.flash import kcp_flash_kda  # noqa: PLC0415

    ctx = make_context(full["q"].shape[1], None, group)
    sl = slice(ctx.start, ctx.stop)
    loc = {n: (t[:, sl] if n in FLASH_SHARDED else t).detach().clone().requires_grad_() for n, t in full.items()}
    o2, _ = kcp_flash_kda(**fused_args(loc), ctx=ctx, lower_bound=LOWER_BOUND)
    o2.backward(do[:, sl])
    errs = {"o": rel_rms_error(o1[:, sl], o2)}
    errs.update({f"grad_{n}": rel_rms_error(full[n].grad[:, sl], loc[n].grad) for n in FLASH_SHARDED})
    for n in ("A_log", "dt_bias"):
        g = loc[n].grad.clone()
        dist.all_reduce(g, group=group)
        errs[f"grad_{n}"] = rel_rms_error(full[n].grad, g)
    name = f"{str(cfg.dtype).removeprefix('torch.')}_vs_1gpu"
    worst = _worst(errs, device, group)
    if worst > 2e-2:
        raise AssertionError(f"KCP {name} check failed (worst {worst:.3g}): rank {rank} errors {errs}")
    return {f"{name}_max_rel_err": worst, f"{name}_rank{rank}": errs}


def _case(rank, R, group, device, cfg, T) -> dict:
    from k3lab.kcp.flash import kcp_flash_kda  # noqa: PLC0415

    H, K = cfg.H, cfg.K
    res = {"T": T, "H": H}
    full = _inputs(T, H, K, K, device, cfg.dtype, seed=T)
    do = torch.randn(1, T, H, K, device=device, generator=torch.Generator(device).manual_seed(5)).to(cfg.dtype)

    def step(run, x, d, backward):
        for t in x.values():
            t.grad = None
        o = run(x)
        if backward:
            o.backward(d)

    def one(x):
        return one_gpu(x, cfg.slab)

    # Each GPU runs the 1-GPU baseline on its own copy at once (the slower one is reported).
    res["one_gpu_fwd_ms"] = _timed(lambda: step(one, full, do, False), cfg.reps, device, group)
    res["one_gpu_fwd_bwd_ms"] = _timed(lambda: step(one, full, do, True), cfg.reps, device, group)
    ctx = make_context(T, None, group)
    sl = slice(ctx.start, ctx.stop)
    loc = {n: (t[:, sl] if n in FLASH_SHARDED else t).detach().clone().requires_grad_() for n, t in full.items()}
    del full
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def kcp(x):
        return kcp_flash_kda(**fused_args(x), ctx=ctx, lower_bound=LOWER_BOUND, check_values=False)[0]

    res["two_gpu_fwd_ms"] = _timed(lambda: step(kcp, loc, do[:, sl], False), cfg.reps, device, group)
    ctx.comm.clear()
    res["two_gpu_fwd_bwd_ms"] = _timed(lambda: step(kcp, loc, do[:, sl], True), cfg.reps, device, group)
    kda_bytes = ctx.comm.total() // (cfg.reps + 1)
    res["speedup_fwd"] = res["one_gpu_fwd_ms"] / res["two_gpu_fwd_ms"]
    res["speedup_fwd_bwd"] = res["one_gpu_fwd_bwd_ms"] / res["two_gpu_fwd_bwd_ms"]
    # One rank's tokens alone on one GPU: what a perfect R-way split would take.
    res["local_alone_fwd_ms"] = _timed(lambda: step(one, loc, do[:, sl], False), cfg.reps, device, group)
    res["local_alone_fwd_bwd_ms"] = _timed(lambda: step(one, loc, do[:, sl], True), cfg.reps, device, group)
    # The three short-conv halos (q, k: H*K channels, v: H*V), forward + backward.
    ctx.comm.clear()
    xc = torch.randn(1, ctx.T_local, 3 * H * K, device=device, dtype=cfg.dtype, requires_grad=True)
    wc = torch.randn(3 * H * K, cfg.conv, device=device, dtype=cfg.dtype, requires_grad=True)
    for part in xc.split(H * K, dim=-1):
        kcp_short_conv(part, wc[: H * K], ctx).sum().backward()
    res["bytes_per_layer"] = kda_bytes + ctx.comm.total()
    res["bytes_per_layer_kda"] = kda_bytes
    # Ring attention would pass every rank's K and V blocks (bf16) around the ring: (R-1)/R * T tokens.
    res["ring_attention_kv_bytes_per_layer"] = (R - 1) * ctx.T_local * H * 2 * K * 2
    return res


def _fold_vs_scan(device, cfg) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    H, K = cfg.H, cfg.K
    for R in (2, 8, 32, 128):
        M = torch.eye(K, device=device) * 0.9 + 0.01 * torch.randn(R, H, K, K, generator=gen, device=device)
        maps = torch.cat([M, torch.randn(R, H, K, K, generator=gen, device=device)], -1)
        resets = torch.zeros(R, dtype=torch.bool, device=device)
        resets[0] = True
        seq = fold_sequential(maps, 0, R)
        err = rel_rms_error(seq, fold_scan(maps, resets, 0, R))
        rows.append({"R": R, "H": H, "sequential_ms": _timed(lambda: fold_sequential(maps, 0, R), cfg.reps, device, None),
                     "scan_ms": _timed(lambda: fold_scan(maps, resets, 0, R), cfg.reps, device, None),
                     "rel_err": err})
    return rows


def bench_worker(rank: int, R: int, group, cfg) -> dict:
    device = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t_start = time.perf_counter()
    out = {"check": _check(rank, R, group, device, cfg), "cases": []}
    for T in cfg.T:
        if time.perf_counter() - t_start > cfg.budget_s:
            out["cases"].append({"T": T, "H": cfg.H, "skipped": f"time budget of {cfg.budget_s} s spent"})
            continue
        try:
            out["cases"].append(_case(rank, R, group, device, cfg, T))
        except torch.OutOfMemoryError as e:
            out["cases"].append({"T": T, "H": cfg.H, "skipped": f"out of memory: {str(e)[:200]}"})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["fold_vs_scan"] = _fold_vs_scan(device, cfg) if rank == 0 else []
    return out


def _versions() -> dict:
    import numpy
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "numpy": numpy.__version__,
            "python": platform.python_version(), "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}


def _table(result) -> str:
    lines = [f"{'T':>8} {'H':>3} {'1gpu fwd':>9} {'2gpu fwd':>9} {'x':>5} {'1gpu f+b':>9} {'2gpu f+b':>9} {'x':>5} "
             f"{'ideal x':>7} {'bytes/layer':>12}"]
    for c in result["cases"]:
        if "skipped" in c:
            lines.append(f"{c['T']:>8} {c['H']:>3}  skipped: {c['skipped']}")
            continue
        lines.append(f"{c['T']:>8} {c['H']:>3} {c['one_gpu_fwd_ms']:>9.1f} {c['two_gpu_fwd_ms']:>9.1f} "
                     f"{c['speedup_fwd']:>5.2f} {c['one_gpu_fwd_bwd_ms']:>9.1f} {c['two_gpu_fwd_bwd_ms']:>9.1f} "
                     f"{c['speedup_fwd_bwd']:>5.2f} {c['one_gpu_fwd_bwd_ms'] / c['local_alone_fwd_bwd_ms']:>7.2f} "
                     f"{c['bytes_per_layer']:>12,}")
    return "\n".join(lines)


def notes(result: dict) -> str:
    """What the numbers say against the issue's target (speedup >= 1.8x at T >= 128K), from the cases."""
    done = [c for c in result["cases"] if "skipped" not in c]
    long = [c for c in done if c["T"] >= 131072]
    met = bool(long) and all(c["speedup_fwd_bwd"] >= 1.8 for c in long)
    parts = ", ".join(f"T={c['T']}: 2 GPUs {c['two_gpu_fwd_bwd_ms']:.0f} ms vs "
                      f"{c['local_alone_fwd_bwd_ms']:.0f} ms" for c in done)
    skipped = [f"T={c['T']} ({c['skipped']})" for c in result["cases"] if "skipped" in c]
    return (f"target speedup_fwd_bwd >= 1.8 at T >= 128K {'met' if met else 'NOT met'}: "
            + (", ".join(f"T={c['T']} {c['speedup_fwd_bwd']:.2f}x" for c in long) or "no case at T >= 128K")
            + f". Forward+backward against perfect scaling (one rank's tokens alone on one GPU): {parts}."
            + (f" Skipped: {', '.join(skipped)}." if skipped else ""))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.kcp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=positive_int, nargs="+", default=[32768, 131072, 524288], help="global sequence lengths")
    p.add_argument("--H", type=positive_int, default=32, help="heads (H = HV)")
    p.add_argument("--K", type=positive_int, default=128, help="key and value head dim")
    p.add_argument("--conv", type=positive_int, default=4, help="short-conv width W (halo W-1)")
    p.add_argument("--slab", type=positive_int, default=131072, help="tokens per flash_kda call of the 1-GPU baseline")
    p.add_argument("--reps", type=positive_int, default=3, help="timed repetitions after one warm-up")
    p.add_argument("--ranks", type=positive_int, default=2, help="processes (GPUs) to start")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="benchmark dtype (default bfloat16 on cuda, float32 on cpu: the interpreter has no bf16)")
    p.add_argument("--check-T", type=positive_int, default=None, dest="check_T",
                   help="float32 check length (default 4096 on cuda, 128 on cpu)")
    p.add_argument("--bf16-check-T", type=positive_int, default=None, dest="bf16_check_T",
                   help="length of the check in the benchmark dtype (default 32768 on cuda, 128 on cpu)")
    p.add_argument("--budget-s", type=positive_float, default=420.0, dest="budget_s",
                   help="skip (and record as skipped) cases that would start after this many seconds")
    p.add_argument("--out", default="data/results/kcp_h200x2.json", help="JSON output path ('' = write nothing)")
    cfg = p.parse_args(argv)
    check_out(cfg.out)
    cuda = cfg.device == "cuda"
    cfg.dtype = getattr(torch, cfg.dtype or ("bfloat16" if cuda else "float32"))
    cfg.check_T = cfg.check_T or (4096 if cuda else 128)
    cfg.bf16_check_T = cfg.bf16_check_T or (32768 if cuda else 128)
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    if not cuda:
        # The ranks define the kernels after they start: they inherit this.
        os.environ["TRITON_INTERPRET"] = "1"
    t0 = time.perf_counter()
    per_rank = launch(bench_worker, cfg.ranks, cfg, backend="nccl" if cuda else "gloo", timeout_s=570.0,
                      pg_timeout_s=600.0)
    r0 = per_rank[0]
    dev_name = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
    result = {
        "hardware": f"{cfg.ranks} x {dev_name}" + (" (NVLink)" if cuda else ""),
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cases": r0["cases"],
        "settings": {"dtype": str(cfg.dtype).removeprefix("torch."), "K": cfg.K, "V": cfg.K, "conv": cfg.conv,
                     "one_gpu_slab_tokens": cfg.slab, "chunk_size": 64, "local_kda": LOCAL_KDA,
                     "gate": f"lower_bound * sigmoid(exp(A_log) (z + dt_bias)), lower_bound {LOWER_BOUND}, "
                             "A_log 0, dt_bias -2 (K3's lower-bounded gate, in-kernel)",
                     "reps": cfg.reps, "fwd": "forward with autograd on, as in training (bf16 intermediates, float32 accumulators)",
                     "timing": "wall clock median after 1 warm-up, slower rank"},
        "check": r0["check"],
        "fold_vs_scan": r0["fold_vs_scan"],
        "wall_s": round(time.perf_counter() - t0, 1),
        "commit": run_info("cpu")["commit"],
        # The one-GPU baseline and each rank's local work alone are timed in this run, on these GPUs.
        "baselines_same_run": True,
    }
    result["notes"] = notes(result)
    if cfg.out:
        write_json(cfg.out, result, indent=2)
    print(json.dumps({k: v for k, v in result["check"].items() if k.endswith("max_rel_err")}, indent=1))
    print(json.dumps(result["fold_vs_scan"], indent=1))
    print(result["notes"])
    print(_table(result))
    return result


if __name__ == "__main__":
    main()
