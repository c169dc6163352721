"""Benchmark Attention Residuals on one GPU: the Triton two-phase kernels against PyTorch and
torch.compile, and the training-step overhead of Block AttnRes over the standard residual.

    python -m k3lab.bench.attnres                              # everything -> data/results/attnres_h200.json
    python -m k3lab.bench.attnres --skip-kernels               # correctness + training steps only
    python -m k3lab.bench.attnres --skip-step                  # kernels only
    python -m k3lab.bench.attnres --smoke                      # tiny sizes, CPU (interpreter) allowed
    python -m k3lab.bench.attnres --bytes-model                # print the bytes model and exit (no device)

Order: (1) correctness first (it stops on failure): the kernels against the PyTorch closed forms
(float32 and bf16 storage), and a BlockAttnRes stack on the Triton backend against autograd through
the formula; (2) per kernel case, forward and backward median times (``triton.testing.do_bench``)
of ours, the PyTorch closed form (eager) and the same function under ``torch.compile``, with the
bandwidth ours reaches (bytes it must move / time); (3) training steps (forward, backward, AdamW)
of ``k3lab.lm.LM`` with softmax-attention mixers, 24 layers, d = 2048 (48 sublayers), with the
standard residual and Block AttnRes's training path (two-phase; N = 4, 8, full AttnRes, a bf16 block
buffer, kept sublayer inputs), in each precision of ``PRECISIONS`` (bf16 autocast eager and with
compiled sublayers, FSDP2 bf16): median step time and peak memory, next to the bytes model
(``k3lab.attnres.traffic``: per-sublayer memory traffic of the two-phase path, the per-read path it
replaced, the standard residual, and the floor under any fused implementation) and the copy bandwidth
measured on the same GPU. Sections not run are kept from the JSON already at ``--out``. Writes the
JSON and prints the table last.
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
from k3lab.attnres.traffic import bytes_model, bytes_table, step_ms
from k3lab.bench import check_out, nonnegative_int, positive_int, run_info
from k3lab.files import write_json
from k3lab.norm import RMSNorm

PHASE1_CASES = [  # (tokens M, width d, blocks read n, queries S, buffer dtype)
    (8192, 2048, 8, 6, torch.float32),  # the last block of the 48-sublayer N = 8 model
    (8192, 2048, 8, 6, torch.bfloat16),  # the same with a bf16 block buffer
    (8192, 2048, 9, 1, torch.float32),  # the final aggregation
    (8192, 7168, 9, 1, torch.float32),  # K3's width, final aggregation over 9 sources
]
STORE_CASES = [(8192, 2048, 49)]  # (tokens, width, queries): a block of the 48-sublayer model and its logits
MERGE_CASES = [(8192, 2048)]


def check_correctness(device, M=1000, d_check=320, T=300) -> dict:
    """Kernels vs the PyTorch closed forms; module (Triton backend) vs autograd through the formula.
    Raises AssertionError over tolerance."""
    import torch.nn as nn

    from k3lab.attnres import BlockAttnRes
    from k3lab.attnres.mix import (merge_bwd_torch, merge_fwd_torch, phase1_bwd_torch, phase1_fwd_torch,
                                   store_block_torch)
    from k3lab.kernels.attnres import merge_bwd, merge_fwd, phase1_bwd, phase1_fwd, store_block
    from k3lab.testing import assert_close, rel_rms_error

    errors = {}
    g = torch.Generator().manual_seed(0)
    S, n = 5, 4
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        name = str(dtype).split(".")[-1]
        buf = (torch.randn(6, M, d_check, generator=g) * 3).to(device, dtype)
        W = torch.randn(S, d_check, generator=g).to(device)
        ours, ref = (f(buf, n, W, 1e-6, torch.float32, dtype) for f in (phase1_fwd, phase1_fwd_torch))
        for k, a, b in zip(("h", "o", "lse"), ref, ours):
            errors[f"phase1_{k}_{name}"] = assert_close(k, a.float(), b.float(), tol if k == "o" else 1e-4)
        lse = ours[2]
        dh, dO = torch.randn(M, d_check, generator=g).to(device), torch.randn(S - 1, M, d_check, generator=g).to(device)
        delta = torch.randn(S, M, generator=g).to(device)
        acc = [torch.randn(6, M, d_check, generator=torch.Generator().manual_seed(1)).to(device) for _ in range(2)]
        dW = [f(buf, n, W, lse, ours[0], dh, dO, delta, 1e-6, a) for f, a in zip((phase1_bwd, phase1_bwd_torch), acc)]
        errors[f"phase1_dblocks_{name}"] = assert_close("dblocks", acc[1][:n], acc[0][:n], 1e-4)
        errors[f"phase1_dW_{name}"] = assert_close("dW", dW[1], dW[0], 1e-4)
        prev = torch.randn(M, d_check, generator=g).to(device)
        o, v = (torch.randn(M, d_check, generator=g).to(device, dtype) for _ in range(2))
        slots = [torch.empty(M, d_check, device=device, dtype=dtype) for _ in range(2)]
        tables = [(torch.empty(S, M, device=device), torch.empty(M, device=device)) for _ in range(2)]
        for f, slot, (table, rstd) in zip((store_block, store_block_torch), slots, tables):
            f(slot, prev, v, W, 1e-6, table, rstd)
        errors[f"store_slot_{name}"] = assert_close("store slot", slots[1].float(), slots[0].float(), tol)
        errors[f"store_scores_{name}"] = assert_close("store scores", tables[1][0], tables[0][0], tol)
        errors[f"store_rstd_{name}"] = assert_close("store rstd", tables[1][1], tables[0][1], tol)
        w = W[1]
        (p, h), (p_r, h_r) = (f(None, o, lse[1], w, 1e-6, prev=prev, v=v) for f in (merge_fwd, merge_fwd_torch))
        errors[f"merge_h_{name}"] = assert_close("merge h", h_r, h, 1e-4)
        slots = [(torch.empty(M, d_check, device=device), torch.empty(M, device=device)) for _ in range(2)]
        out = [f(dh, prev, p_r, o, lse[1], w, 1e-6, *sl, v_dtype=dtype)
               for f, sl in zip((merge_bwd, merge_bwd_torch), slots)]
        for k, a, b in zip(("dp", "dv", "dw"), out[1], out[0]):
            errors[f"merge_{k}_{name}"] = assert_close(k, a.float(), b.float(), tol if k == "dv" else 1e-4)
        errors[f"merge_dO_{name}"] = assert_close("dO", slots[1][0], slots[0][0], 1e-4)
    # The module: float64 autograd through the formula is the ground truth; the float32 Triton path's
    # error must stay within 4x the float32 formula's own (gradients through a softmax over depth
    # cancel, so neither float32 path gets near 1e-6 of the truth; 1e-5 floor).
    d, L = d_check, 7
    torch.manual_seed(0)
    subs = nn.ModuleList([nn.Sequential(RMSNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                          for _ in range(L)]).to(device)
    x0, q = torch.randn(2, T, d, device=device), torch.randn(L + 1, d, device=device)
    for N in (3, L):
        grads = {}
        for path, backend, dt in (("naive", None, torch.float64), ("naive", None, torch.float32),
                                  ("memory", "triton", torch.float32)):
            res = BlockAttnRes(d, L, N, path=path, backend=backend).to(device, dt)
            subs.to(dt)
            with torch.no_grad():
                res.queries.copy_(q)
            x = x0.detach().to(dt, copy=True).requires_grad_()
            subs.zero_grad()
            y = res(x, subs)
            y.square().mean().backward()
            grads[(path, dt)] = [y.detach(), x.grad, res.queries.grad, subs[0][1].weight.grad.clone()]
        subs.float()
        truth, formula = grads[("naive", torch.float64)], grads[("naive", torch.float32)]
        ours = grads[("memory", torch.float32)]
        for k, t, a, b in zip(("out", "dh0", "dqueries", "dW0"), truth, formula, ours):
            bound = max(4 * rel_rms_error(t, a), 1e-5)
            errors[f"module_N{N}_{k}"] = assert_close(f"module N={N} {k} (vs float64)", t, b, bound)
            errors[f"module_N{N}_{k}_formula_fp32"] = rel_rms_error(t, a)
    return errors


def copy_bandwidth(device, M: int = 8192, d: int = 2048) -> dict:
    """What plain streaming reaches on this GPU, in TB/s (bytes read + written / median time): a copy
    and an add of [M, d] float32 tensors, the yardstick for the bytes model's milliseconds."""
    from triton.testing import do_bench

    a, b, c = (torch.randn(M, d, device=device) for _ in range(3))
    tbps = lambda ms, passes: passes * a.numel() * 4 / (ms * 1e-3) / 1e12  # noqa: E731
    return dict(shape=[M, d], copy_TBps=tbps(do_bench(lambda: c.copy_(a), return_mode="median"), 2),
                add_TBps=tbps(do_bench(lambda: torch.add(a, b, out=c), return_mode="median"), 3))


def bench_kernels(device, phase1_cases, store_cases, merge_cases, compile_: bool) -> list[dict]:
    from triton.testing import do_bench

    from k3lab.attnres.mix import (merge_bwd_torch, merge_fwd_torch, phase1_bwd_torch, phase1_fwd_torch,
                                   store_block_torch)
    from k3lab.kernels.attnres import merge_bwd, merge_fwd, phase1_bwd, phase1_fwd, store_block

    comp = {f.__name__: torch.compile(f, dynamic=False) if compile_ else None
            for f in (store_block_torch, phase1_fwd_torch, phase1_bwd_torch, merge_fwd_torch, merge_bwd_torch)}
    rows = []

    def time_case(shape, name, ours, torch_fn, comp_fn, nbytes):
        t_ours = do_bench(ours, warmup=25, rep=100, return_mode="median")
        t_torch = do_bench(torch_fn, warmup=25, rep=100, return_mode="median")
        t_comp = do_bench(comp_fn, warmup=25, rep=100, return_mode="median") if compile_ else None
        rows.append({"shape": shape, "pass": name, "ours_ms": t_ours, "torch_ms": t_torch, "compile_ms": t_comp,
                     "ours_GBps": nbytes / t_ours / 1e6, "bytes": nbytes})
        print(f"  {shape} {name}: ours {t_ours:.3f} ms ({nbytes / t_ours / 1e6:.0f} GB/s), torch {t_torch:.3f} ms"
              + (f", compile {t_comp:.3f} ms" if t_comp else ""), flush=True)

    for M, d, n, S, dtype in phase1_cases:
        g = torch.Generator(device=device).manual_seed(M + d + n)
        buf = torch.randn(n, M, d, device=device, generator=g).to(dtype)
        W = torch.randn(S, d, device=device, generator=g) * 0.1
        o_dt = torch.bfloat16
        # The tables as the blocks' stores left them.
        scores, rstd = torch.empty(S, n, M, device=device), torch.empty(n, M, device=device)
        for i in range(n):
            store_block(buf[i], buf[i], None, W, 1e-6, scores[:, i], rstd[i])
        h, _, lse = phase1_fwd(buf, n, W, 1e-6, torch.float32, o_dt, scores)
        dh = torch.randn(M, d, device=device, generator=g)
        dO = torch.randn(S - 1, M, d, device=device, generator=g).to(o_dt) if S > 1 else None
        delta = torch.randn(S, M, device=device, generator=g) if S > 1 else None
        acc = torch.zeros(n, M, d, device=device)
        eb, row = buf.element_size(), M * d
        bytes_fwd = row * (n * eb + 4 + 2 * (S - 1))  # read the blocks once; write h (fp32) and o_1.. (bf16)
        # At least: the blocks, dh and each dO (bf16, as the merges leave them) once, dacc read and written.
        bytes_bwd = row * (n * eb + 4 + 2 * (S - 1) + 8 * n)
        shape = f"phase1_M{M}_d{d}_n{n}_S{S}" + ("_bf16" if dtype == torch.bfloat16 else "")
        fwd_args = (buf, n, W, 1e-6, torch.float32, o_dt, scores)
        bwd_args = (buf, n, W, lse, h, dh, dO, delta, 1e-6, acc, True, scores, rstd)
        time_case(shape, "fwd", lambda: phase1_fwd(*fwd_args), lambda: phase1_fwd_torch(*fwd_args),
                  lambda: comp["phase1_fwd_torch"](*fwd_args), bytes_fwd)
        time_case(shape, "bwd", lambda: phase1_bwd(*bwd_args), lambda: phase1_bwd_torch(*bwd_args),
                  lambda: comp["phase1_bwd_torch"](*bwd_args), bytes_bwd)
    for M, d, Q in store_cases:
        g = torch.Generator(device=device).manual_seed(M + d + Q)
        prev, W = torch.randn(M, d, device=device, generator=g), torch.randn(Q, d, device=device, generator=g) * 0.1
        v, dst = torch.randn(M, d, device=device, generator=g).bfloat16(), torch.empty(M, d, device=device)
        table, rstd = torch.empty(Q, 9, M, device=device), torch.empty(9, M, device=device)
        args = (dst, prev, v, W, 1e-6, table[:, 1], rstd[1])
        time_case(f"store_M{M}_d{d}_Q{Q}", "fwd", lambda: store_block(*args), lambda: store_block_torch(*args),
                  lambda: comp["store_block_torch"](*args), M * d * (4 + 2 + 4))
    for M, d in merge_cases:
        g = torch.Generator(device=device).manual_seed(M + d)
        prev, dh, dp_in = (torch.randn(M, d, device=device, generator=g) for _ in range(3))
        o, v = (torch.randn(M, d, device=device, generator=g).bfloat16() for _ in range(2))
        lse, w = torch.randn(M, device=device, generator=g), torch.randn(d, device=device, generator=g) * 0.1
        p, _ = merge_fwd(None, o, lse, w, 1e-6, prev=prev, v=v)
        dO, delta = torch.empty(M, d, device=device), torch.empty(M, device=device)
        shape = f"merge_M{M}_d{d}"
        fwd_args, fwd_kw = (None, o, lse, w, 1e-6), dict(prev=prev, v=v)
        bwd_args = (dh, dp_in, p, o, lse, w, 1e-6, dO, delta, torch.bfloat16)
        time_case(shape, "fwd", lambda: merge_fwd(*fwd_args, **fwd_kw), lambda: merge_fwd_torch(*fwd_args, **fwd_kw),
                  lambda: comp["merge_fwd_torch"](*fwd_args, **fwd_kw), M * d * (4 + 2 + 2 + 8))
        time_case(shape, "bwd", lambda: merge_bwd(*bwd_args), lambda: merge_bwd_torch(*bwd_args),
                  lambda: comp["merge_bwd_torch"](*bwd_args), M * d * (12 + 2 + 8 + 2))
    return rows


PRECISIONS = {  # name -> how the training step runs (both residuals alike)
    "autocast": "float32 parameters under bf16 autocast: the residual stream, the partial sums and the block "
                "buffer stay float32",
    "fsdp_bf16": "FSDP2 fully_shard on one rank with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32) "
                 "(torchtitan's default): float32 master weights and AdamW, bf16 stream, partial sums and blocks",
    "autocast_compiled": "as autocast, each sublayer under torch.compile (the efficient baseline: the residual "
                         "machinery stays eager, the standard's adds and Block AttnRes's Triton kernels)",
}


def _prepare(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Apply ``precision`` (a PRECISIONS key) to a freshly built LM; needs a process group for FSDP2."""
    if precision == "fsdp_bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for sub in model.sublayers:
            fully_shard(sub, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    elif precision == "autocast_compiled":
        for i, sub in enumerate(model.sublayers):
            model.sublayers[i] = torch.compile(sub)
    return model


def bench_step(device, d, n_layers, batch, seq, variants, steps: int) -> list[dict]:
    """Training-step time and peak memory of LM(attention mixers) per residual variant.

    Each variant (name, N or None, BlockAttnRes kwargs, precision) is timed in alternation with a
    standard-residual model of the same precision, step by step, so that drift of the machine falls
    on both alike; ``overhead`` is the ratio of the two medians minus one."""
    import k3lab.lm as lm
    from k3lab.attnres import BlockAttnRes

    cfg = lm.LMConfig(vocab_size=32000, d_model=d, n_layers=n_layers, n_heads=max(1, d // 128),
                      head_dim=min(128, d), mixer="attention", max_seq_len=seq)
    L = 2 * n_layers
    cuda = device.type == "cuda"
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=g)

    def build(n_blocks, kwargs, precision):
        torch.manual_seed(0)
        with torch.device(device):
            residual = None if n_blocks is None else BlockAttnRes(d, L, min(n_blocks, L), **kwargs)
            model = _prepare(lm.LM(cfg, residual=residual), precision)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)

        def step():
            autocast = cuda and precision.startswith("autocast")
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, y)[1]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss

        return step

    def timed(step):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, loss

    def warm_and_measure(step):
        # Two warm-up steps (autotuning, allocator), then one step whose peak over the memory already
        # held (parameters, optimizer state, the other model) is the step's activation memory.
        for _ in range(2):
            timed(step)
        if not cuda:
            return None, None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        timed(step)
        peak = torch.cuda.max_memory_allocated()
        return peak / 2**30, (peak - base) / 2**30

    rows, standards = [], {}
    for name, n_blocks, kwargs, precision in variants:
        if n_blocks is None:
            standards[precision] = build(None, {}, precision)
            continue
        base_step = standards[precision]
        step = build(n_blocks, kwargs, precision)
        _, base_act = warm_and_measure(base_step)
        peak, act = warm_and_measure(step)
        t_base, t_var = [], []
        for _ in range(steps):
            t_base.append(timed(base_step)[0])
            t, loss = timed(step)
            t_var.append(t)
        row = dict(variant=name, precision=precision, n_blocks=n_blocks, step_ms=1e3 * statistics.median(t_var),
                   step_ms_min=1e3 * min(t_var), standard_ms=1e3 * statistics.median(t_base),
                   standard_ms_min=1e3 * min(t_base), loss=loss.item(), peak_GiB=peak, step_extra_GiB=act,
                   standard_step_extra_GiB=base_act, tokens=batch * seq)
        row["overhead"] = row["step_ms"] / row["standard_ms"] - 1
        rows.append(row)
        print(f"  {name} [{precision}]: {row['step_ms']:.1f} ms/step vs standard {row['standard_ms']:.1f} "
              f"({100 * row['overhead']:+.2f}%), peak {peak} GiB", flush=True)
        del step
        if cuda:
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


STEP_VARIANTS = [  # (name, N or None for the standard residual, BlockAttnRes kwargs, precision); every
    # Block AttnRes row runs the training path (two-phase, Triton) and is timed against the standard
    # residual of its precision, listed before it
    ("standard", None, {}, "autocast"),
    ("block_N8", 8, {}, "autocast"),
    ("standard", None, {}, "autocast_compiled"),
    ("block_N8", 8, {}, "autocast_compiled"),
    ("standard", None, {}, "fsdp_bf16"),
    ("block_N8", 8, {}, "fsdp_bf16"),
    ("block_N4", 4, {}, "fsdp_bf16"),
    ("block_N4", 4, {}, "autocast"),
    ("block_N8_bf16buf", 8, dict(buffer_dtype=torch.bfloat16), "autocast"),
    ("block_N8_keep_h", 8, dict(recompute_input=False), "autocast"),
    ("full", "L", {}, "autocast"),
]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.attnres", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data/results/attnres_h200.json",
                   help="JSON output path ('' = write nothing; --smoke writes nothing)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU allowed); for checking the script")
    p.add_argument("--bytes-model", action="store_true", help="print the bytes model and exit (no device needed)")
    p.add_argument("--skip-kernels", action="store_true", help="skip the kernel timings (kept from --out)")
    p.add_argument("--skip-step", action="store_true", help="skip the training-step benchmark (kept from --out)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile timings")
    p.add_argument("--steps", type=positive_int, default=10, help="timed training steps per variant")
    p.add_argument("--variants", nargs="+", choices=sorted({v[0] for v in STEP_VARIANTS if v[1] is not None}),
                   help="Block AttnRes step variants to time, in every precision that lists them (default: all)")
    p.add_argument("--batch", type=positive_int, default=4, help="training-step batch size")
    p.add_argument("--seq", type=positive_int, default=2048, help="training-step sequence length")
    p.add_argument("--lm-steps", type=nonnegative_int, default=0,
                   help="also run chapter 04's LM experiment (d=512, 8 layers, real corpus) for this many steps "
                   "(0: not run)")
    args = p.parse_args(argv)
    if args.bytes_model:
        for kw in (dict(), dict(buf=2), dict(N=4)):
            print((f"[{kw}] " if kw else "") + bytes_table(bytes_model(**kw)) + "\n")
        return {}

    check_out(args.out)
    out = Path(args.out) if args.out else None
    # The sections this run skips are kept from the file already there: read before the run, not after it.
    try:
        earlier = json.loads(out.read_text()) if out is not None and out.exists() else {}
    except (OSError, ValueError) as e:
        raise SystemExit(f"--out {out} holds no readable JSON to keep skipped sections from ({e})") from None
    device = k3lab.setup(verbose=True)
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke for a CPU check of the script")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    d, n_layers, batch, seq = (64, 3, 2, 32) if args.smoke else (2048, 24, args.batch, args.seq)
    result = dict(hardware=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  torch=torch.__version__, bytes_model=bytes_model(), bytes_priced_at=dict(tokens=batch * seq, d=d))
    info = run_info(device)
    # Every baseline (eager and compiled PyTorch, the standard-residual step) is timed in this run, beside ours.
    result.update(commit=info["commit"], versions=info["versions"], baselines_same_run=True)
    print(bytes_table(result["bytes_model"], **result["bytes_priced_at"]), flush=True)
    print("1. correctness", flush=True)
    result["correctness"] = check_correctness(device, *((40, 24, 8) if args.smoke else ()))
    print("   ok:", {k: f"{v:.1e}" for k, v in result["correctness"].items()}, flush=True)

    if not args.skip_kernels and device.type == "cuda":
        print("2. kernels", flush=True)
        cases = ([(64, 32, 3, 3, torch.float32)], [(64, 32, 5)], [(64, 32)]) if args.smoke else (
            PHASE1_CASES, STORE_CASES, MERGE_CASES)
        result["kernel_cases"] = bench_kernels(device, *cases, compile_=not args.no_compile)
        result["bandwidth"] = copy_bandwidth(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    if not args.skip_step:
        print("3. training step", flush=True)
        L = 2 * n_layers
        variants = [(name, L if N == "L" else N, kw, prec) for name, N, kw, prec in STEP_VARIANTS
                    if N is None or not args.variants or name in args.variants]
        # FSDP2 needs a process group, here of this one process (an in-memory store: no network).
        own_group = not torch.distributed.is_initialized()
        if own_group:
            torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                                 store=torch.distributed.HashStore(), rank=0, world_size=1)
        try:
            rows = bench_step(device, d, n_layers, batch, seq, variants, 2 if args.smoke else args.steps)
        finally:
            if own_group:
                torch.distributed.destroy_process_group()
        for r in rows:
            kw = next(kw for name, _, kw, prec in variants if (name, prec) == (r["variant"], r["precision"]))
            if "recompute_input" not in kw:
                stream = 4 if r["precision"].startswith("autocast") else 2
                buf = 2 if kw.get("buffer_dtype") == torch.bfloat16 else stream
                m = bytes_model(L, min(r["n_blocks"], L), buf=buf, h=stream)
                extra = sum(m["two_phase"].values()) - sum(m["standard"].values())
                r["model_extra_ms_at_4TBps"] = step_ms(extra, L, batch * seq, d)
        backend = "Triton" if device.type == "cuda" else "PyTorch"
        result["step"] = dict(model=f"k3lab.lm.LM attention mixers, {n_layers} layers ({L} sublayers), d={d}, "
                                    f"B={batch}, T={seq}, AdamW; Block AttnRes rows: two-phase training path "
                                    f"({backend} backend), each timed step by step in alternation with the "
                                    f"standard residual of its precision", precisions=PRECISIONS, rows=rows)
        overhead = {r["precision"]: r["overhead"] for r in rows if r["variant"] == "block_N8"}
        # The headline is over the tuned baseline (compiled sublayers) when it ran: the eager standard step
        # spends ~90 ms in elementwise work and copies, which dilutes the ratio.
        result["step_overhead_block_precision"] = "autocast_compiled" if "autocast_compiled" in overhead else "autocast"
        result["step_overhead_block"] = overhead[result["step_overhead_block_precision"]]
        result["step_overhead_block_by_precision"] = overhead

    if args.lm_steps:
        print("4. LM experiment (real corpus)", flush=True)
        result["lm_experiment"] = (lm_experiment(device, 64, 2, 4, 32, args.lm_steps, [2]) if args.smoke else
                                   lm_experiment(device, 512, 8, 32, 512, args.lm_steps, [2, 4, 8]))

    if not args.smoke and out is not None:
        # Sections this run skipped keep the values the file held, with the date they were measured.
        step_keys = ("step", "step_overhead_block", "step_overhead_block_precision", "step_overhead_block_by_precision")
        for keys in (("kernel_cases", "bandwidth"), step_keys, ("lm_experiment",)):
            if keys[0] not in result and keys[0] in earlier:
                result.update({k: earlier[k] for k in keys if k in earlier})
                result.setdefault("kept_from_earlier_run", {})[keys[0]] = earlier.get(
                    "kept_from_earlier_run", {}).get(keys[0], earlier["date"])
        write_json(out, result, indent=1)
        print(f"wrote {out}")
    print("\n" + table(result))
    return result


def table(result: dict) -> str:
    lines = [f"AttnRes on {result['hardware']} ({result['date']})"]
    kept = result.get("kept_from_earlier_run", {})
    if result.get("kernel_cases"):
        if "kernel_cases" in kept:
            lines.append(f"kernel cases from the run of {kept['kernel_cases']}")
        lines.append(f"{'kernel case':<30}{'pass':<6}{'ours ms':>9}{'torch ms':>10}{'compile ms':>12}{'ours GB/s':>11}")
        for r in result["kernel_cases"]:
            comp = f"{r['compile_ms']:.3f}" if r["compile_ms"] else "-"
            lines.append(f"{r['shape']:<30}{r['pass']:<6}{r['ours_ms']:>9.3f}{r['torch_ms']:>10.3f}{comp:>12}"
                         f"{r['ours_GBps']:>11.0f}")
    if "bandwidth" in result:
        bw = result["bandwidth"]
        lines.append(f"streaming {bw['shape'][0]} x {bw['shape'][1]} float32: copy {bw['copy_TBps']:.2f} TB/s, "
                     f"add {bw['add_TBps']:.2f} TB/s")
    if "bytes_model" in result:
        model = result["bytes_model"]
        shape = result.get("bytes_priced_at", {})  # runs before it existed priced the defaults
        lines.append(bytes_table(model, **shape))
        if "bandwidth" in result and "floor" in model:
            tbps = result["bandwidth"]["copy_TBps"]
            ms = step_ms(sum(model["floor"].values()), model["L"], tbps=tbps, **shape)
            lines.append(f"floor at the copy bandwidth ({tbps:.2f} TB/s): {ms:.2f} ms a step")
    if "step" in result:
        if "step" in kept:
            lines.append(f"training steps from the run of {kept['step']}")
        lines.append(result["step"]["model"])
        lines.append(f"{'residual':<18}{'precision':<19}{'step ms':>9}{'standard':>10}{'overhead':>10}"
                     f"{'peak GiB':>10}{'model ms':>10}")
        for r in result["step"]["rows"]:
            peak = f"{r['peak_GiB']:.2f}" if r["peak_GiB"] else "-"
            model = f"{r['model_extra_ms_at_4TBps']:.1f}" if r.get("model_extra_ms_at_4TBps") else "-"
            # Runs before the paired timing had one standard row and no precision (bf16 autocast).
            std = f"{r['standard_ms']:.1f}" if "standard_ms" in r else "-"
            lines.append(f"{r['variant']:<18}{r.get('precision', 'autocast'):<19}{r['step_ms']:>9.1f}{std:>10}"
                         f"{100 * r['overhead']:>9.2f}%{peak:>10}{model:>10}")
    if "lm_experiment" in result:
        if "lm_experiment" in kept:
            lines.append(f"LM experiment from the run of {kept['lm_experiment']}")
        c = result["lm_experiment"]["config"]
        lines.append(f"LM experiment: d={c['d_model']}, {c['sublayers']} sublayers, {c['steps']} steps x "
                     f"{c['batch']}x{c['seq']} tokens")
        for name, hist in result["lm_experiment"]["runs"].items():
            lines.append(f"  {name:<14} final train {hist['loss'][-1]:.4f}  val {hist['val_loss'][-1]:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
