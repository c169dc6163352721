"""Benchmark FlashKDA (``k3lab.kernels.kda.flash_kda``) against fla-core's ``chunk_kda`` on one GPU.

    python -m k3lab.bench.flash_kda                        # check, ceilings, the issue's 4 baseline cases
    python -m k3lab.bench.flash_kda --cases 1x8192x16 4x8192x16 --out data/results/flash_kda_h200.json
    python -m k3lab.bench.flash_kda --cases 1x4096x16      # one shape, table only (no JSON without --out)
    python -m k3lab.bench.flash_kda --check-only           # correctness only (bf16 vs float64 naive)

Order: (1) correctness first, bf16 on the GPU against the float64 naive recurrence (outputs and final
state <= 5e-3, every gradient <= 1e-2 RMS relative; it stops on failure); (2) ceilings: bf16 matmul
TFLOP/s and device-to-device copy GB/s; (3) per case, ours and fla forward and forward+backward times
(``triton.testing.do_bench``, median ms) and peak memory of one forward+backward
(``torch.cuda.max_memory_allocated`` above the inputs). Both run the same settings: bf16, K = V = 128,
K3's lower-bounded gate (lower_bound -5), q/k L2 norm, beta sigmoid and gate activation in-kernel,
no initial or final state. Writes ``data/results/flash_kda_<card>.json`` (``k3lab.bench.result_path``:
device, commit, date, versions, ceilings, and per case ``fla_same_run``: whether fla was timed in this run
or its times came from ``--fla-from``) and prints the table last.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from k3lab.bench import positive_int, result_path, run_info, shape_bth
from k3lab.files import write_json
from k3lab.testing import rel_rms_error

LOWER_BOUND = -5.0
BASELINE_CASES = ["1x8192x16", "4x8192x16", "1x32768x32", "8x4096x32"]
OUT_TOL, GRAD_TOL = 5e-3, 1e-2
# flash_kda's MAX_K, here so that parsing the command line loads no kernels (tests/test_bench_cli.py
# checks that the two agree).
MAX_K = 256


def head_dim(text: str) -> int:
    """argparse type: a head dim in [1, MAX_K]."""
    K = positive_int(text)
    if K > MAX_K:
        raise argparse.ArgumentTypeError(f"flash_kda supports K <= {MAX_K}, got {K}")
    return K


def reference(q, k, v, z, beta, A_log, dt_bias, initial_state=None, cu_seqlens=None, lower_bound=LOWER_BOUND):
    """The ground truth: ``k3lab.kda.naive_fused_kda`` (run it on float64 inputs), final state returned."""
    from k3lab.kda import naive_fused_kda

    return naive_fused_kda(q, k, v, z, beta, A_log, dt_bias, initial_state=initial_state, cu_seqlens=cu_seqlens,
                           lower_bound=lower_bound)


def make_inputs(B, T, H, HV, K, V, device, dtype=torch.bfloat16, seed=0, N=None):
    """Random KDA inputs: q, k, v, z [B, T, *, *] in dtype; beta logits; A_log, dt_bias float32; h0 [N, HV, K, V]."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v, z, beta = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), r(B, T, HV, K), r(B, T, HV)
    A_log, dt_bias = 0.5 * r(HV), 0.5 * r(HV * K)
    h0 = r(N or B, HV, K, V)
    return ([x.to(device, dtype) for x in (q, k, v, z, beta)]
            + [A_log.to(device), dt_bias.to(device), h0.to(device)])


def check_correctness(device, B=2, T=600, H=2, HV=4, K=128, V=128, cu=(0, 100, 700)) -> dict:
    """bf16 flash_kda vs the float64 naive reference: outputs, final state, all 8 gradients; fixed-length
    (T not a multiple of 64, GVA, initial state) and varlen. Raises AssertionError over the tolerances."""
    from k3lab.kernels.kda import flash_kda

    errors = {}
    for name, cu_seqlens in (("fixed", None), ("varlen", torch.tensor(cu, device=device))):
        b, t = (B, T) if cu_seqlens is None else (1, cu[-1])
        N = b if cu_seqlens is None else len(cu) - 1
        ins = make_inputs(b, t, H, HV, K, V, device, N=N, seed=1)
        ours = [x.detach().clone().requires_grad_() for x in ins]
        ref = [x.detach().double().requires_grad_() for x in ins]
        with torch.no_grad():
            # Inference path: bf16 intermediates (no backward follows).
            o_inf, s_inf = flash_kda(*ins[:7], initial_state=ins[7], output_final_state=True,
                                     cu_seqlens=cu_seqlens)
        o, s = flash_kda(*ours[:7], initial_state=ours[7], output_final_state=True, cu_seqlens=cu_seqlens)
        o_ref, s_ref = reference(*ref[:7], initial_state=ref[7], cu_seqlens=cu_seqlens)
        gen = torch.Generator(device="cpu").manual_seed(2)
        do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64).to(device)
        ds = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64).to(device)
        ((o.double() * do).sum() + (s.double() * ds).sum()).backward()
        ((o_ref * do).sum() + (s_ref * ds).sum()).backward()
        errs = {"o": rel_rms_error(o_ref, o), "final_state": rel_rms_error(s_ref, s),
                "o_inference": rel_rms_error(o_ref, o_inf), "final_state_inference": rel_rms_error(s_ref, s_inf)}
        for n, a, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"), ref, ours):
            errs[n] = rel_rms_error(a.grad, x.grad)
        errors[name] = errs
        print(f"correctness {name} (B={b}, T={t}, H={H}, HV={HV}, K={K}, V={V}, bf16 vs float64 naive): "
              + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()), flush=True)
        bad = {n: e for n, e in errs.items() if not e <= (GRAD_TOL if n.startswith("d") else OUT_TOL)}
        if bad:
            raise AssertionError(f"flash_kda {name}: errors over tolerance {bad}")
    return errors


def ceilings(device) -> dict:
    """Measured bf16 matmul TFLOP/s (8192^3) and device-to-device copy GB/s (bytes read + written)."""
    from triton.testing import do_bench

    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = do_bench(lambda: a @ b, warmup=50, rep=300)
    x = torch.empty(2**30, device=device, dtype=torch.uint8)
    y = torch.empty_like(x)
    ms_copy = do_bench(lambda: y.copy_(x), warmup=50, rep=300)
    del a, b, x, y
    return {"bf16_matmul_tflops": 2 * n**3 / ms / 1e9, "copy_gbps": 2 * 2**30 / ms_copy / 1e6}


def fwd_flops(B, T, H, K, V, C=64) -> float:
    """Useful FLOPs of the chunkwise forward (lower-triangular products counted at half):
    per chunk and head: Akk, Aqk C^2 K each; the UT inverse C^3 / 3; W, U 2 C^2 K, 2 C^2 V;
    W S, K^T V~, Q S 2 C K V each; Aqk V~ C^2 V."""
    per_chunk = 2 * C * C * K + C**3 / 3 + 2 * C * C * K + 2 * C * C * V + 6 * C * K * V + C * C * V
    return B * H * (T / C) * per_chunk


def fwd_bytes(B, T, H, K, V, itemsize=2) -> float:
    """Compulsory forward traffic: read q, k, v, z, beta; write o (the floor any implementation pays)."""
    return B * T * H * (3 * K + V + 1 + V) * itemsize


def time_case(B, T, H, K, V, device, run_fla=True, warmup=25, rep=100) -> dict:
    """Time ours and fla at one shape (HV = H); returns the issue's per-case record."""
    from triton.testing import do_bench

    from k3lab.kernels.kda import flash_kda

    q, k, v, z, beta, A_log, dt_bias, _ = make_inputs(B, T, H, H, K, V, device)
    scale = K**-0.5

    def ours(grad):
        return flash_kda(q, k, v, z, beta, A_log, dt_bias, scale=scale, lower_bound=LOWER_BOUND,
                         check_values=False)[0]

    def fla(grad):
        from fla.ops.kda import chunk_kda

        return chunk_kda(q, k, v, z, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND)[0]

    leaves = (q, k, v, z, beta, A_log, dt_bias)
    do = torch.randn(B, T, H, V, device=device, dtype=torch.bfloat16)

    def measure(fn):
        for x in leaves:
            x.requires_grad_(False)
        with torch.no_grad():
            fwd = do_bench(lambda: fn(False), warmup=warmup, rep=rep)
        for x in leaves:
            x.requires_grad_(True)

        def step():
            o = fn(True)
            torch.autograd.backward(o, do, inputs=list(leaves))

        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        fb = do_bench(step, warmup=warmup, rep=rep, grad_to_none=list(leaves))
        return fwd, fb, peak

    t = time.time()
    ours_fwd, ours_fb, ours_peak = measure(ours)
    print(f"  ours {B}x{T}x{H}: fwd {ours_fwd:.3f} ms, fwd+bwd {ours_fb:.3f} ms ({time.time() - t:.0f} s)", flush=True)
    fla_fwd = fla_fb = fla_peak = float("nan")
    if run_fla:
        t = time.time()
        fla_fwd, fla_fb, fla_peak = measure(fla)
        print(f"  fla  {B}x{T}x{H}: fwd {fla_fwd:.3f} ms, fwd+bwd {fla_fb:.3f} ms ({time.time() - t:.0f} s)", flush=True)
    return {
        "B": B, "T": T, "H": H, "K": K,
        "ours_fwd_ms": ours_fwd, "fla_fwd_ms": fla_fwd,
        "ours_fwd_bwd_ms": ours_fb, "fla_fwd_bwd_ms": fla_fb,
        "speedup_fwd": fla_fwd / ours_fwd, "speedup_fwd_bwd": fla_fb / ours_fb,
        "tflops_fwd": fwd_flops(B, T, H, K, V) / ours_fwd / 1e9,
        "ours_peak_mib": ours_peak, "fla_peak_mib": fla_peak,
    }


def kernel_resources() -> list[dict]:
    """Registers and spills of every compiled FlashKDA kernel (from Triton's per-device caches), and for
    the autotuned ones the num_warps that Triton's timing chose per key."""
    import triton

    from k3lab.kernels.kda import chunk_bwd, chunk_fwd

    rows = []
    for mod in (chunk_fwd, chunk_bwd):
        for name, fn in vars(mod).items():
            tuner = fn if isinstance(fn, triton.runtime.Autotuner) else None
            chosen = sorted({c.num_warps for c in tuner.cache.values()}) if tuner else None
            for entry in getattr(tuner.fn if tuner else fn, "device_caches", {}).values():
                for kern in entry[0].values():
                    rows.append({"kernel": name, "n_regs": getattr(kern, "n_regs", None),
                                 "n_spills": getattr(kern, "n_spills", None),
                                 "num_warps": kern.metadata.num_warps, "shared": kern.metadata.shared,
                                 "autotune_chose": chosen})
    return rows


def stage_times(B, T, H, K, V, device, rep=100) -> dict:
    """Median ms of each FlashKDA stage at one shape, forward and backward, with bf16 intermediates (what
    bf16 inputs use) and float32 ones (float32 inputs), to show where the time goes."""
    from triton.testing import do_bench

    from k3lab.kernels.kda import chunk_bwd as cb
    from k3lab.kernels.kda import chunk_fwd as cf
    from k3lab.kernels.kda.utils import chunk_index

    q, k, v, z, beta, A_log, dt_bias, _ = make_inputs(B, T, H, H, K, V, device)
    flat = [x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, z, beta)]
    cu, chunk_indices, chunk_offsets = chunk_index([T] * B, device)
    NT, scale = chunk_indices.shape[0], K**-0.5
    do = torch.randn(B * T, H, V, device=device, dtype=torch.bfloat16)
    times = {}

    def bench(name, fn):
        times[name] = do_bench(fn, warmup=10, rep=rep)
        return fn()

    for dt in (torch.bfloat16, torch.float32):
        tag = "bf16" if dt == torch.bfloat16 else "fp32"
        G, Tinv, Aqk, W, U, KG, QG = bench(f"fwd intra ({tag})", lambda: cf.kda_intra_fwd(
            *flat, A_log, dt_bias, scale, LOWER_BOUND, cu, chunk_indices, dt))
        if dt == torch.bfloat16:
            bench("fwd intra, no backward: inverse and W/U fused (bf16)", lambda: cf.kda_intra_fwd(
                *flat, A_log, dt_bias, scale, LOWER_BOUND, cu, chunk_indices, dt, keep_t=False))
        o = torch.empty_like(U)
        bench(f"fwd state + output ({tag})", lambda: cf.kda_state_fwd(
            W, U, KG, G, None, False, cu, chunk_offsets, NT, store_states=False, output=(QG, Aqk, o)))
        h, Vn, _ = bench(f"fwd state + output, h and V~ stored ({tag})", lambda: cf.kda_state_fwd(
            W, U, KG, G, None, False, cu, chunk_offsets, NT, output=(QG, Aqk, o)))
        dh, dVn, _ = bench(f"bwd state ({tag})", lambda: cb.kda_state_bwd(QG, KG, W, G, Aqk, do, None, False, cu,
                                                                          chunk_offsets, NT))
        dqs, dkn, dG, dW, dgx, rn = bench(f"bwd dq/dk ({tag})", lambda: cb.kda_dqk_bwd(
            flat[0], flat[1], G, h, dh, Vn, dVn, do, scale, cu, chunk_indices))
        db, dv, dAqk, dAkk = bench(f"bwd dW/dv ({tag})", lambda: cb.kda_dwv_bwd(
            flat[1], flat[2], flat[4], G, Tinv, dW, dVn, do, Vn, dkn, dG, rn, cu, chunk_indices))
        bench(f"bwd intra ({tag})", lambda: cb.kda_intra_bwd(
            flat[0], flat[1], flat[3], flat[4], A_log, dt_bias, G, rn, dAqk, dAkk, dqs, dkn, dG, dgx, db, scale,
            LOWER_BOUND, cu, chunk_indices))
    return times


def fla_times(paths) -> dict:
    """fla's times per shape from earlier result JSONs of this benchmark: {(B, T, H, K): {"fla_fwd_ms",
    "fla_fwd_bwd_ms", "fla_peak_mib", "fla_times_from"}}, the first file with a (non-null) time for a
    shape winning. "fla_times_from" is the date of the run that timed fla: the case's own field, else
    the file's ``versions.fla_times_from`` (a file that took fla's times from an earlier one), else the
    file's date (fla timed live).

    Raises:
        FileNotFoundError: a path that does not exist. ValueError: a file that is not such a JSON.
    """
    found = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            default = data["versions"].get("fla_times_from") or data["date"]
            cases = data["cases"]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"--fla-from {path}: not a result JSON of this benchmark ({e!r})") from None
        for c in cases:
            key = (c["B"], c["T"], c["H"], c["K"])
            if c.get("fla_fwd_ms") is not None and key not in found:
                found[key] = {k: c[k] for k in ("fla_fwd_ms", "fla_fwd_bwd_ms", "fla_peak_mib")}
                found[key]["fla_times_from"] = c.get("fla_times_from") or default
    return found


def table(result: dict) -> str:
    """The speed table as text (GB/s = compulsory forward bytes / our forward time)."""
    ceil = result["hardware"]
    head = (f"{'B':>2} {'T':>6} {'H':>3} | {'ours fwd':>9} {'fla fwd':>8} {'x':>5} | {'ours f+b':>9} "
            f"{'fla f+b':>8} {'x':>5} | {'TFLOP/s':>7} {'GB/s':>6} | {'ours MiB':>8} {'fla MiB':>8}")
    lines = [f"ceilings: bf16 matmul {ceil.get('bf16_matmul_tflops', float('nan')):.0f} TFLOP/s, "
             f"copy {ceil.get('copy_gbps', float('nan')):.0f} GB/s", head, "-" * len(head)]
    for c in result["cases"]:
        gbps = fwd_bytes(c["B"], c["T"], c["H"], c["K"], c["K"]) / c["ours_fwd_ms"] / 1e6
        lines.append(
            f"{c['B']:>2} {c['T']:>6} {c['H']:>3} | {c['ours_fwd_ms']:>9.3f} {c['fla_fwd_ms']:>8.3f} "
            f"{c['speedup_fwd']:>5.2f} | {c['ours_fwd_bwd_ms']:>9.3f} {c['fla_fwd_bwd_ms']:>8.3f} "
            f"{c['speedup_fwd_bwd']:>5.2f} | {c['tflops_fwd']:>7.1f} {gbps:>6.0f} | "
            f"{c['ours_peak_mib']:>8.0f} {c['fla_peak_mib']:>8.0f}")
    return "\n".join(lines)


def versions() -> dict:
    import triton

    out = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda}
    try:
        from importlib.metadata import version

        out["fla-core"] = version("fla-core")
    except Exception:  # fla not installed: the JSON says so
        out["fla-core"] = None
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.flash_kda", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", type=shape_bth, default=None,
                   help=f"shapes BxTxH (K = V = --K, HV = H); default {' '.join(BASELINE_CASES)}")
    p.add_argument("--K", type=head_dim, default=128, help="key and value head dim of the timed cases, <= 256 "
                   "(the correctness check runs at K = V = 128)")
    p.add_argument("--out", default=None, help="where the JSON goes ('' = nowhere); default "
                   "data/results/flash_kda_<card>.json for the default cases, nowhere with --cases (a one-shape "
                   "try must not replace the committed sweep)")
    check = p.add_mutually_exclusive_group()
    check.add_argument("--check-only", action="store_true", help="run the correctness check and stop")
    check.add_argument("--skip-check", action="store_true", help="skip the correctness check")
    p.add_argument("--no-fla", action="store_true", help="time ours only")
    p.add_argument("--rep", type=positive_int, default=100, help="do_bench rep (ms of timed runs)")
    p.add_argument("--stages", action="store_true", help="print each kernel's time, registers and spills "
                   "per case and stop")
    p.add_argument("--fla-from", nargs="*", default=[], help="with --no-fla: take fla's times for matching shapes "
                   "from earlier result JSONs of this benchmark, the first file that has a shape winning (fla "
                   "autotunes for minutes per shape)")
    args = p.parse_args(argv)
    if args.fla_from and not args.no_fla:
        p.error("--fla-from needs --no-fla (without it fla is timed live)")
    if not torch.cuda.is_available():
        raise SystemExit("python -m k3lab.bench.flash_kda needs a CUDA GPU")
    if args.out is None:
        args.out = result_path("flash_kda", torch.cuda.get_device_name()) if args.cases is None else ""
    args.cases = args.cases if args.cases is not None else [shape_bth(c) for c in BASELINE_CASES]
    device = torch.device("cuda")
    info = run_info(device)
    result = {"hardware": {"name": info.pop("device")}, **info, "versions": versions(), "cases": []}
    if not args.skip_check:
        t = time.time()
        result["hardware"]["correctness"] = check_correctness(device)
        print(f"correctness passed ({time.time() - t:.0f} s incl. compile)", flush=True)
        if args.check_only:
            return result
    if args.stages:
        for B, T, H in args.cases:
            case = f"{B}x{T}x{H}"
            times = stage_times(B, T, H, args.K, args.K, device, rep=args.rep)
            print(f"stages {case}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in times.items()), flush=True)
            result.setdefault("stages", {})[case] = times
        result["kernels"] = kernel_resources()
        for r in result["kernels"]:
            print(r)
        return result
    earlier = fla_times(args.fla_from) if args.no_fla else {}
    result["hardware"].update(ceilings(device))
    for B, T, H in args.cases:
        case_result = time_case(B, T, H, args.K, args.K, device, run_fla=not args.no_fla, rep=args.rep)
        case_result["fla_same_run"] = not args.no_fla
        if (B, T, H, args.K) in earlier:
            case_result.update(earlier[B, T, H, args.K])
            case_result["speedup_fwd"] = case_result["fla_fwd_ms"] / case_result["ours_fwd_ms"]
            case_result["speedup_fwd_bwd"] = case_result["fla_fwd_bwd_ms"] / case_result["ours_fwd_bwd_ms"]
            # The runs that timed fla, over all cases so far.
            result["versions"]["fla_times_from"] = ", ".join(sorted(
                {c["fla_times_from"] for c in result["cases"] + [case_result] if "fla_times_from" in c}))
        result["cases"].append(case_result)
        torch.cuda.empty_cache()
        if args.out:
            clean = json.loads(json.dumps(result), parse_constant=lambda c: None)
            write_json(args.out, clean, indent=1)
    print(table(result))
    if not args.out:
        print("(no JSON written: pass --out PATH to keep this run)")
    return result


if __name__ == "__main__":
    main()
