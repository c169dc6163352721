"""The LM head and its loss, forward + backward in bf16: the plain head + ``F.cross_entropy`` against
``linear_cross_entropy`` (row chunks, no [N, V] logits), eager and with its chunk compiled.

    python -m k3lab.bench.loss                        # on a GPU -> data/results/loss_<card>.json
    python -m k3lab.bench.loss --small --device cpu   # tiny sizes, for checking the script

Cases at K3's vocabulary (163,840): k3-1b's width (d 1024) on a 16 x 2048 micro-batch, and K3's (d 7168) on
8192 tokens. Each method runs under bf16 autocast with float32 weights, as in the
trainer. Correctness first: each method's loss and gradients (dh, dW) against the plain head's in the same
precision (and, on the small check, against float64). Then the time of forward + backward (median, CUDA
events), the head's 6 N d V FLOPs over that time, the bf16 matmul ceiling measured in the same run
(``k3lab.bench.moe.ceiling_tflops``), and the peak memory each method adds above its inputs.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from k3lab.bench import check_out, gpu_device, run_info, timed_flags, write_result
from k3lab.bench.moe import ceiling_tflops, time_ms
from k3lab.model.loss import linear_cross_entropy
from k3lab.testing import rel_rms_error

CASES = {"k3-1b": (16 * 2048, 1024, 163840), "k3_slice": (8192, 7168, 163840)}
TINY = {"tiny": (300, 32, 1000)}
METHODS = ("plain", "chunked", "chunked_compiled")
#: bf16 bound on the relative error of a method's loss and gradients against the plain head's.
BOUND = 2e-2


def plain(h, w, t):
    """The plain head: bf16 logits under autocast, cast to float32, ``F.cross_entropy``."""
    return F.cross_entropy(F.linear(h, w).float(), t)


def method(name: str):
    if name == "plain":
        return plain
    return lambda h, w, t: linear_cross_entropy(h, w, t, compiled=name == "chunked_compiled")


def inputs(N: int, d: int, V: int, device, seed: int = 0):
    """h [N, d] (normed-scale float32, as the final RMSNorm gives), W [V, d] (std 0.02), targets with every
    16th ignored."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(N, d, device=device, generator=g).requires_grad_()
    w = (0.02 * torch.randn(V, d, device=device, generator=g)).requires_grad_()
    t = torch.randint(0, V, (N,), device=device, generator=g)
    t[::16] = -100
    return h, w, t


def run(fn, h, w, t):
    h.grad = w.grad = None
    with torch.autocast(h.device.type, dtype=torch.bfloat16):
        loss = fn(h, w, t)
    loss.backward()
    return loss.detach().float()


def check(N: int, d: int, V: int, device) -> dict:
    """Each method's loss, dh and dW against the plain head's (bf16 autocast), and, in float64, the chunked
    path against the plain one. AssertionError past ``BOUND`` (bf16) or 1e-10 (float64)."""
    h, w, t = inputs(N, d, V, device)
    ref = (run(plain, h, w, t), h.grad.clone(), w.grad.clone())
    out = {}
    for name in METHODS[1:]:
        got = (run(method(name), h, w, t), h.grad, w.grad)
        out[name] = dict(zip(("loss", "dh", "dW"), (rel_rms_error(a, b) for a, b in zip(got, ref))))
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    F.cross_entropy(h64 @ w64.t(), t).backward()
    ref64 = (h64.grad.clone(), w64.grad.clone())
    h64.grad = w64.grad = None
    linear_cross_entropy(h64, w64, t, chunk=max(1, N // 3)).backward()
    out["float64"] = dict(dh=rel_rms_error(h64.grad, ref64[0]), dW=rel_rms_error(w64.grad, ref64[1]))
    bad = [(k, v) for k, v in out.items() for e in v.values() if not e <= (1e-10 if k == "float64" else BOUND)]
    if bad:
        raise AssertionError(f"linear_cross_entropy disagrees with the plain head: {bad}")
    return out


def time_case(name: str, N: int, d: int, V: int, device, rep: int, ceiling: float) -> dict:
    h, w, t = inputs(N, d, V, device)
    flops = 6 * N * d * V
    row = dict(name=name, tokens=N, d=d, vocab=V, head_tflop=flops / 1e12)
    for m in METHODS:
        fn = method(m)
        run(fn, h, w, t)  # compiles and autotunes outside the timing
        h.grad = w.grad = None  # each timed run frees them first: the baseline must not hold them
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        ms = time_ms(lambda: run(fn, h, w, t), device, warmup=2, rep=rep)
        row[f"{m}_ms"] = ms
        row[f"{m}_tflops"] = flops / ms / 1e9
        row[f"{m}_peak_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
        print(f"{name} {m}: {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    row["speedup"] = row["plain_ms"] / row["chunked_compiled_ms"]
    row["ceiling_ms"] = flops / ceiling / 1e9
    return row


def table(result: dict) -> str:
    lines = [f"The head's loss, forward + backward, bf16 autocast, on {result['device']} ({result['date']}); "
             f"bf16 matmul ceiling {result['ceiling_tflops']:.0f} TFLOP/s measured in this run",
             f"{'case':<10}{'method':<18}{'ms':>9}{'TFLOP/s':>9}{'% ceil':>8}{'peak GiB':>10}"]
    for r in result["cases"]:
        for m in METHODS:
            peak = r[f"{m}_peak_GiB"]
            lines.append(f"{r['name']:<10}{m:<18}{r[m + '_ms']:>9.2f}{r[m + '_tflops']:>9.0f}"
                         f"{100 * r[m + '_tflops'] / result['ceiling_tflops']:>7.0f}%"
                         f"{'-' if peak is None else f'{peak:.1f}':>10}")
        lines.append(f"{'':<10}{'at the ceiling':<18}{r['ceiling_ms']:>9.2f}   chunked compiled / plain: "
                     f"{r['speedup']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.loss", description=__doc__.split("\n")[0])
    timed_flags(p, "loss", rep=10)
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES), help="which shapes")
    args = p.parse_args(argv)
    check_out(args.out)
    rep = args.rep or (2 if args.small else 10)
    device = gpu_device(p, args)
    cases = TINY if args.small else {k: CASES[k] for k in args.cases}
    result = run_info(device)
    result["ceiling_tflops"] = ceiling_tflops(device, 256 if args.small else 8192)
    result["bound"], result["checks"], result["cases"] = BOUND, {}, []
    for name, (N, d, V) in cases.items():
        # The check runs the case's width and vocabulary on fewer tokens (a float64 copy of the head fits).
        result["checks"][name] = check(min(N, 2048), d, V, device)
        print(f"{name}: checks {result['checks'][name]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["cases"].append(time_case(name, N, d, V, device, rep, result["ceiling_tflops"]))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_result("loss", result, args.out, args.small)
    print("\n" + table(result))
    return result


if __name__ == "__main__":
    main()
