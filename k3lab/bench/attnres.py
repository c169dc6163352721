"""Benchmark Attention Residuals on one GPU: the Triton depth-mixing kernels against PyTorch and
torch.compile, and the training-step overhead of Block AttnRes over the standard residual.

    python -m k3lab.bench.attnres                              # everything -> data/results/attnres_h200.json
    python -m k3lab.bench.attnres --skip-step                  # kernels only
    python -m k3lab.bench.attnres --smoke                      # tiny sizes, CPU (interpreter) allowed

Order: (1) correctness first (it stops on failure): the kernels against the PyTorch closed form
(float32 and bf16 storage), and a BlockAttnRes stack on the Triton backend against autograd through
the formula; (2) per kernel case, forward and backward median times (``triton.testing.do_bench``)
of ours, the PyTorch closed form (eager) and the same function under ``torch.compile``, with the
bandwidth ours reaches (bytes it must move / time); (3) training steps (forward, backward, AdamW)
of ``k3lab.lm.LM`` with softmax-attention mixers, 24 layers, d = 2048 (48 sublayers), bf16 autocast,
with the standard residual, Block AttnRes (N = 4, 8) and full AttnRes: median step time and peak
memory. Writes the JSON and prints the table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import k3lab

KERNEL_CASES = [  # (tokens M, width d, stored sources n, with partial)
    (8192, 2048, 4, True),
    (8192, 2048, 8, True),
    (8192, 7168, 9, False),  # K3's width: the final aggregation over 9 sources
]
BF16_CASE = (8192, 2048, 8, True)  # the same read with a bf16 block buffer


def check_correctness(device, M=1000, d_check=320, T=300) -> dict:
    """Kernels vs the PyTorch closed form; module (Triton backend) vs autograd through the formula.
    Raises AssertionError over tolerance."""
    import torch.nn as nn

    from k3lab.attnres import BlockAttnRes
    from k3lab.attnres.mix import mix_bwd_torch, mix_fwd_torch
    from k3lab.kernels.attnres import mix_bwd, mix_fwd
    from k3lab.testing import assert_close

    errors = {}
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        buf = (torch.randn(6, M, d_check, generator=g) * 3).to(device, dtype)
        partial = torch.randn(M, d_check, generator=g).to(device, dtype)
        w = torch.randn(d_check, generator=g).to(device)
        dh = torch.randn(M, d_check, generator=g).to(device, dtype)
        h, lse = mix_fwd(buf, 5, partial, w, 1e-6)
        h_ref, lse_ref = mix_fwd_torch(buf, 5, partial, w, 1e-6)
        name = str(dtype).split(".")[-1]
        errors[f"h_{name}"] = assert_close("h", h_ref.float(), h.float(), tol)
        errors[f"lse_{name}"] = assert_close("lse", lse_ref, lse, 1e-5)
        ours = mix_bwd(dh, buf, 5, partial, w, lse_ref, 1e-6)
        ref = mix_bwd_torch(dh, buf, 5, partial, w, lse_ref, 1e-6)
        for k, a, b in zip(("dbuf", "dpartial", "dw"), ref, ours):
            errors[f"{k}_{name}"] = assert_close(k, a.float(), b.float(), tol)
    d, L, N = d_check, 6, 3
    torch.manual_seed(0)
    subs = nn.ModuleList([nn.Sequential(nn.RMSNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                          for _ in range(L)]).to(device)
    x0, q = torch.randn(2, T, d, device=device), torch.randn(L + 1, d, device=device)
    grads = {}
    for path, backend in (("naive", None), ("memory", "triton")):
        res = BlockAttnRes(d, L, N, path=path, backend=backend).to(device)
        with torch.no_grad():
            res.queries.copy_(q)
        x = x0.clone().requires_grad_()
        subs.zero_grad()
        y = res(x, subs)
        y.square().mean().backward()
        grads[path] = [y.detach(), x.grad, res.queries.grad, subs[0][1].weight.grad.clone()]
    for k, a, b in zip(("out", "dh0", "dqueries", "dW0"), grads["naive"], grads["memory"]):
        # tf32 may be used by the reference's matmuls on GPU: a looser bound than the kernel check.
        errors[f"module_{k}"] = assert_close(f"module {k}", a, b, 1e-4)
    return errors


def bench_kernels(device, cases, compile_: bool) -> list[dict]:
    from triton.testing import do_bench

    from k3lab.attnres.mix import mix_bwd_torch, mix_fwd_torch
    from k3lab.kernels.attnres import mix_bwd, mix_fwd

    fwd_c = torch.compile(mix_fwd_torch, dynamic=False) if compile_ else None
    bwd_c = torch.compile(mix_bwd_torch, dynamic=False) if compile_ else None
    rows = []
    for M, d, n, with_partial, dtype in cases:
        g = torch.Generator(device=device).manual_seed(M + d + n)
        buf = torch.randn(n, M, d, device=device, generator=g).to(dtype)
        partial = torch.randn(M, d, device=device, generator=g) if with_partial else None
        w = torch.randn(d, device=device, generator=g) * 0.1
        dh = torch.randn(M, d, device=device, generator=g)
        _, lse = mix_fwd(buf, n, partial, w, 1e-6)
        S = n + with_partial
        eb, ep, row = buf.element_size(), 4 * with_partial, M * d
        bytes_fwd = row * (n * eb + ep + eb)  # read every source once, write h
        bytes_bwd = row * (3 * n * eb + 3 * ep + 4)  # two reads of each source and dh; write each gradient
        shape = f"M{M}_d{d}_S{S}" + ("_bf16" if dtype == torch.bfloat16 else "")
        for name, ours, torch_fn, comp, nbytes in (
            ("fwd", lambda: mix_fwd(buf, n, partial, w, 1e-6), lambda: mix_fwd_torch(buf, n, partial, w, 1e-6),
             (lambda: fwd_c(buf, n, partial, w, 1e-6)) if compile_ else None, bytes_fwd),
            ("bwd", lambda: mix_bwd(dh, buf, n, partial, w, lse, 1e-6),
             lambda: mix_bwd_torch(dh, buf, n, partial, w, lse, 1e-6),
             (lambda: bwd_c(dh, buf, n, partial, w, lse, 1e-6)) if compile_ else None, bytes_bwd),
        ):
            t_ours = do_bench(ours, warmup=25, rep=100, return_mode="median")
            t_torch = do_bench(torch_fn, warmup=25, rep=100, return_mode="median")
            t_comp = do_bench(comp, warmup=25, rep=100, return_mode="median") if comp else None
            rows.append(dict(shape=shape, pass_=name, ours_ms=t_ours, torch_ms=t_torch, compile_ms=t_comp,
                             ours_GBps=nbytes / t_ours / 1e6, bytes=nbytes))
            print(f"  {shape} {name}: ours {t_ours:.3f} ms ({nbytes / t_ours / 1e6:.0f} GB/s), torch {t_torch:.3f} ms"
                  + (f", compile {t_comp:.3f} ms" if t_comp else ""), flush=True)
    for r in rows:
        r["pass"] = r.pop("pass_")
    return rows


def bench_step(device, d, n_layers, batch, seq, variants, steps: int) -> list[dict]:
    """Median training-step time and peak memory of LM(attention mixers) per residual variant."""
    import k3lab.lm as lm
    from k3lab.attnres import BlockAttnRes

    cfg = lm.LMConfig(vocab_size=32000, d_model=d, n_layers=n_layers, n_heads=max(1, d // 128),
                      head_dim=min(128, d), mixer="attention", max_seq_len=seq)
    L = 2 * n_layers
    rows = []
    for name, n_blocks, kwargs in variants:
        torch.manual_seed(0)
        with torch.device(device):
            residual = None if n_blocks is None else BlockAttnRes(d, L, min(n_blocks, L), **kwargs)
            model = lm.LM(cfg, residual=residual)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=g)
        y = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=g)

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = model(x, y)[1]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss

        times, peak, act = [], None, None
        for i in range(steps + 3):
            if device.type == "cuda":
                torch.cuda.synchronize()
                if i == 2:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            loss = step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
            if i == 2 and device.type == "cuda":
                peak = torch.cuda.max_memory_allocated()
                act = peak - base
        row = dict(variant=name, n_blocks=n_blocks, step_ms=1e3 * statistics.median(times),
                   step_ms_min=1e3 * min(times), loss=loss.item(), peak_GiB=peak / 2**30 if peak else None,
                   step_extra_GiB=act / 2**30 if act else None, tokens=batch * seq)
        rows.append(row)
        print(f"  {name}: {row['step_ms']:.1f} ms/step, peak {row['peak_GiB']} GiB", flush=True)
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def lm_experiment(device, d, n_layers, batch, seq, steps, block_counts, lr=3e-3) -> dict:
    """Chapter 04's experiment at GPU size: the same LM on the real corpus with the standard residual,
    Block AttnRes (each N in block_counts) and full AttnRes; histories and learned depth weights."""
    import k3lab.data as kdata
    import k3lab.lm as lm
    from k3lab.attnres import BlockAttnRes

    cfg = lm.LMConfig(vocab_size=kdata.vocab_size(), d_model=d, n_layers=n_layers, n_heads=d // 64, head_dim=64,
                      mixer="attention", max_seq_len=seq)
    L = 2 * n_layers
    runs, weights = {}, {}
    val_x, _ = kdata.get_batch(kdata.load_split("val"), 8, seq, torch.Generator().manual_seed(7), device)
    for name, N in [("standard", None)] + [(f"block N={N}", N) for N in block_counts] + [("full AttnRes", L)]:
        torch.manual_seed(0)
        model = lm.LM(cfg, residual=None if N is None else BlockAttnRes(d, L, N))
        runs[name] = lm.train(model, steps=steps, batch_size=batch, seq_len=seq, lr=lr, device=device, seed=0,
                              log_every=max(1, steps // 20), progress=False)
        print(f"  {name}: final val loss {runs[name]['val_loss'][-1]:.4f}", flush=True)
        if N is not None:
            with torch.no_grad():
                weights[name] = model.residual.depth_weights(model.embed(val_x), model.sublayers).tolist()
        del model
    return dict(config=dict(d_model=d, n_layers=n_layers, sublayers=L, batch=batch, seq=seq, steps=steps, lr=lr,
                            mixer="attention"), runs=runs, depth_weights=weights)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.attnres", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data/results/attnres_h200.json", help="JSON output path")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU allowed); for checking the script")
    p.add_argument("--skip-step", action="store_true", help="skip the training-step benchmark")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile timings")
    p.add_argument("--kernels-from", default=None,
                   help="reuse kernel_cases from this earlier JSON instead of timing the kernels again")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per variant")
    p.add_argument("--batch", type=int, default=4, help="training-step batch size")
    p.add_argument("--seq", type=int, default=2048, help="training-step sequence length")
    p.add_argument("--lm-steps", type=int, default=0,
                   help="also run chapter 04's LM experiment (d=512, 8 layers, real corpus) for this many steps")
    args = p.parse_args(argv)

    device = k3lab.setup(verbose=True)
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke for a CPU check of the script")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    result = dict(hardware=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  torch=torch.__version__)
    print("1. correctness", flush=True)
    result["correctness"] = check_correctness(device, *((40, 24, 8) if args.smoke else ()))
    print("   ok:", {k: f"{v:.1e}" for k, v in result["correctness"].items()}, flush=True)

    print("2. kernels", flush=True)
    if args.kernels_from:
        earlier = json.loads(Path(args.kernels_from).read_text())
        result["kernel_cases"] = earlier["kernel_cases"]
        result["kernel_cases_from"] = dict(path=args.kernels_from, date=earlier["date"])
        print(f"   reused from {args.kernels_from} ({earlier['date']})")
    cases = [(64, 48, 3, True), (40, 32, 2, False)] if args.smoke else KERNEL_CASES
    cases = [(*c, torch.float32) for c in cases] + ([] if args.smoke else [(*BF16_CASE, torch.bfloat16)])
    if not args.kernels_from:
        result["kernel_cases"] = ([] if device.type != "cuda" else
                                  bench_kernels(device, cases, compile_=not args.no_compile))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    if not args.skip_step:
        print("3. training step", flush=True)
        d, n_layers, batch, seq = (64, 3, 2, 32) if args.smoke else (2048, 24, args.batch, args.seq)
        variants = [("standard", None, {}), ("block_N8", 8, {}), ("N8_bf16buf", 8, dict(buffer_dtype=torch.bfloat16)),
                    ("block_N4", 4, {}), ("full", 2 * n_layers, {}), ("N8_keep_h", 8, dict(recompute_input=False))]
        rows = bench_step(device, d, n_layers, batch, seq, variants, 2 if args.smoke else args.steps)
        std = rows[0]["step_ms"]
        for r in rows:
            r["overhead"] = r["step_ms"] / std - 1
        result["step"] = dict(model=f"k3lab.lm.LM attention mixers, {n_layers} layers ({2 * n_layers} sublayers), "
                                    f"d={d}, B={batch}, T={seq}, bf16 autocast, AdamW", rows=rows)
        result["step_overhead_block"] = next(r["overhead"] for r in rows if r["variant"] == "block_N8")

    if args.lm_steps:
        print("4. LM experiment (real corpus)", flush=True)
        result["lm_experiment"] = (lm_experiment(device, 64, 2, 4, 32, args.lm_steps, [2]) if args.smoke else
                                   lm_experiment(device, 512, 8, 32, 512, args.lm_steps, [2, 4, 8]))

    if not args.smoke:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    print("\n" + table(result))
    return result


def table(result: dict) -> str:
    lines = [f"AttnRes on {result['hardware']} ({result['date']})"]
    if result.get("kernel_cases"):
        lines.append(f"{'kernel case':<22}{'pass':<6}{'ours ms':>9}{'torch ms':>10}{'compile ms':>12}{'ours GB/s':>11}")
        for r in result["kernel_cases"]:
            comp = f"{r['compile_ms']:.3f}" if r["compile_ms"] else "-"
            lines.append(f"{r['shape']:<22}{r['pass']:<6}{r['ours_ms']:>9.3f}{r['torch_ms']:>10.3f}{comp:>12}"
                         f"{r['ours_GBps']:>11.0f}")
    if "step" in result:
        lines.append(result["step"]["model"])
        lines.append(f"{'residual':<12}{'step ms':>9}{'overhead':>10}{'peak GiB':>10}")
        for r in result["step"]["rows"]:
            peak = f"{r['peak_GiB']:.2f}" if r["peak_GiB"] else "-"
            lines.append(f"{r['variant']:<12}{r['step_ms']:>9.1f}{100 * r['overhead']:>9.1f}%{peak:>10}")
    if "lm_experiment" in result:
        c = result["lm_experiment"]["config"]
        lines.append(f"LM experiment: d={c['d_model']}, {c['sublayers']} sublayers, {c['steps']} steps x "
                     f"{c['batch']}x{c['seq']} tokens")
        for name, hist in result["lm_experiment"]["runs"].items():
            lines.append(f"  {name:<14} final train {hist['loss'][-1]:.4f}  val {hist['val_loss'][-1]:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
