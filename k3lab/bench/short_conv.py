"""KDA's short convolution and its SiLU, forward + backward: PyTorch eager, PyTorch under ``torch.compile`` and
the fused Triton kernels (``k3lab.kernels.kda.short_conv``), against the bytes they must move.

    python -m k3lab.bench.short_conv                        # on a GPU -> data/results/short_conv_<card>.json
    python -m k3lab.bench.short_conv --small --device cpu   # tiny sizes, Triton interpreted: checks the script

The case is one of k3-1b's q/k/v convolutions on a 16 x 2048 micro-batch (C = H*K = 1024, W = 4, bf16
activations, a float32 weight as under autocast). Correctness first: every method's y, dx and dweight against
float64 on a small shape, and against eager PyTorch at the timed shape. Then the median time of forward +
backward, and the floor: the bytes the pair must move at least (x and y forward; x, dy and dx backward) at
the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from k3lab.bench import check_out, gpu_device, run_info, timed_flags, write_result
from k3lab.testing import rel_rms_error

CASES = {"k3-1b": (16, 2048, 1024, 4)}
TINY = {"tiny": (2, 40, 32, 4)}
METHODS = ("torch", "torch_compiled", "triton")
#: Bound on a method's relative error against eager PyTorch in bf16, and against float64 in float32.
BF16_BOUND, FP32_BOUND = 2e-2, 1e-5


def torch_conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The PyTorch form the layer runs without the kernel: ``causal_short_conv`` then SiLU."""
    from k3lab.kda.layer import causal_short_conv  # noqa: PLC0415  (imports triton: after the CPU's setup)

    return F.silu(causal_short_conv(x, w)[0])


def method(name: str):
    if name == "torch":
        return torch_conv_silu
    if name == "torch_compiled":
        return torch.compile(torch_conv_silu, dynamic=False)
    from k3lab.kernels.kda.short_conv import short_conv_silu  # noqa: PLC0415  (CUDA or interpreter only)

    return short_conv_silu


def inputs(B: int, T: int, C: int, W: int, device, dtype, seed: int = 0):
    """x [B, T, C] (unit scale, as a projection gives), weight [C, W] float32, dy [B, T, C]."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, T, C, device=device, generator=g).to(dtype).requires_grad_()
    w = (0.5 * torch.randn(C, W, device=device, generator=g)).requires_grad_()
    dy = torch.randn(B, T, C, device=device, generator=g).to(dtype)
    return x, w, dy


def run(fn, x, w, dy):
    x.grad = w.grad = None
    y = fn(x, w)
    y.backward(dy)
    return y.detach()


def check(shape: tuple, timed: tuple, device) -> dict:
    """Each method against float64 (float32 inputs, ``shape``) and against eager PyTorch (bf16, ``timed``).
    AssertionError past ``FP32_BOUND`` or ``BF16_BOUND``."""
    out = {}
    for label, dims, dtype, bound in (("float32_vs_float64", shape, torch.float32, FP32_BOUND),
                                      ("bf16_vs_torch", timed, torch.bfloat16, BF16_BOUND)):
        x, w, dy = inputs(*dims, device, dtype)
        if dtype == torch.float32:
            x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
            ref = (run(torch_conv_silu, x64, w64, dy.double()), x64.grad, w64.grad)
        else:
            ref = (run(torch_conv_silu, x, w, dy), x.grad.clone(), w.grad.clone())
        for name in METHODS if dtype == torch.float32 else METHODS[1:]:
            got = (run(method(name), x, w, dy), x.grad, w.grad)
            errs = dict(zip(("y", "dx", "dweight"), (rel_rms_error(a, b) for a, b in zip(got, ref))))
            out.setdefault(label, {})[name] = errs
            if not max(errs.values()) <= bound:
                raise AssertionError(f"short conv {name} ({label}) disagrees: {errs} (bound {bound:.0e})")
    return out


def time_ms(fn, device, warmup: int = 5, rep: int = 20) -> float:
    from k3lab.bench.moe import time_ms as median_ms  # noqa: PLC0415  (imports triton: after the CPU's setup)

    return median_ms(fn, device, warmup, rep)


def copy_tbps(device, n: int) -> float:
    """Read + write bandwidth of a bf16 copy of n elements, TB/s (the floor's yardstick)."""
    a = torch.randn(n, device=device).to(torch.bfloat16)
    b = torch.empty_like(a)
    return 2 * a.numel() * 2 / (time_ms(lambda: b.copy_(a), device) * 1e-3) / 1e12


def time_case(name: str, dims: tuple, device, rep: int, tbps: float) -> dict:
    B, T, C, W = dims
    x, w, dy = inputs(B, T, C, W, device, torch.bfloat16)
    nbytes = 5 * x.numel() * x.element_size()  # x, y forward; x, dy, dx backward
    row = dict(name=name, B=B, T=T, C=C, W=W, min_bytes=nbytes, floor_ms=nbytes / tbps / 1e9)
    for m in METHODS:
        fn = method(m)
        run(fn, x, w, dy)  # compiles outside the timing
        row[f"{m}_ms"] = time_ms(lambda: run(fn, x, w, dy), device, warmup=2, rep=rep)
        print(f"{name} {m}: {row[f'{m}_ms']:.3f} ms", flush=True)
    return row


def table(result: dict) -> str:
    lines = [f"Short convolution + SiLU, forward + backward, bf16, on {result['device']} ({result['date']}); "
             f"copy bandwidth {result['copy_TBps']:.2f} TB/s measured in this run",
             f"{'case':<8}{'method':<16}{'ms':>9}{'x floor':>9}"]
    for r in result["cases"]:
        lines += [f"{r['name']:<8}{m:<16}{r[m + '_ms']:>9.3f} {r[m + '_ms'] / r['floor_ms']:>7.1f}x" for m in METHODS]
        lines.append(f"{'':<8}{'floor':<16}{r['floor_ms']:>9.3f}   ({r['min_bytes'] / 1e6:.0f} MB at the copy "
                     f"bandwidth; [B, T, C, W] = {[r['B'], r['T'], r['C'], r['W']]})")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.short_conv", description=__doc__.split("\n\n")[0])
    timed_flags(p, "short_conv", rep=20, small="tiny sizes, Triton interpreted; for checking the script")
    args = p.parse_args(argv)
    check_out(args.out)
    rep = args.rep or (2 if args.small else 20)
    device = gpu_device(p, args)
    if device.type == "cpu":
        import k3lab  # noqa: PLC0415

        # The Triton interpreter, on before any Triton import (this module imports none at load time).
        k3lab.setup(verbose=False)
    cases = TINY if args.small else CASES
    result = run_info(device)
    result["copy_TBps"] = copy_tbps(device, 2**12 if args.small else 2**28)
    result["bounds"] = dict(bf16=BF16_BOUND, float32=FP32_BOUND)
    result["checks"], result["cases"] = {}, []
    for name, dims in cases.items():
        small = TINY["tiny"] if args.small else (2, 300, 256, dims[3])
        result["checks"][name] = check(small, dims, device)
        print(f"{name}: checks {result['checks'][name]}", flush=True)
        result["cases"].append(time_case(name, dims, device, rep, result["copy_TBps"]))
    write_result("short_conv", result, args.out, args.small)
    print("\n" + table(result))
    return result


if __name__ == "__main__":
    main()
