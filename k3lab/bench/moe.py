"""One MoE layer, forward + backward in bf16: LatentMoE vs the full-width MoE vs torchtitan's layer.

    python -m k3lab.bench.moe                        # on a GPU -> data/results/moe_h200.json
    python -m k3lab.bench.moe --small --device cpu   # tiny sizes, for checking the script

Cases: a K3-shaped slice (d 7168, latent 3584, expert hidden 3072, 64 experts, top-8, 2 shared,
16K tokens) and a small shape (d 2048, latent 1024, hidden 1024, 64 experts, top-8, 1 shared, 16K
tokens). For each: k3lab's LatentMoE (SiTU-GLU, K3's layer), k3lab's full-width MoE (SiTU-GLU and
SwiGLU) and ``torchtitan.models.common.moe.MoE`` at the same full-width config (SwiGLU, sigmoid
router with renormalised top-k, its own aux-free bias counting), all timed in one run; then the
grouped expert GEMMs alone at exactly balanced load against the bf16 matmul ceiling measured in the
same run (the nine GEMMs alone, and the expert block: GEMMs plus the activation). Correctness first: k3lab's bf16 layer against its float32 twin, and torchtitan's layer
loaded with the same weights against k3lab's SwiGLU layer. torchtitan is optional (``--no-torchtitan``;
its wheel and tyro's are carried to GPU nodes without internet).
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import replace

import torch

from k3lab.bench import check_out, gpu_device, run_info, timed_flags, write_result
from k3lab.moe import MoE, MoEConfig, expert_ffn
from k3lab.testing import rel_rms_error

CASES = {
    "k3_slice": (MoEConfig(d_model=7168, n_experts=64, top_k=8, expert_hidden=3072, latent_dim=3584, n_shared=2,
                           n_layers=93), 16384),
    "small": (MoEConfig(d_model=2048, n_experts=64, top_k=8, expert_hidden=1024, latent_dim=1024, n_shared=1,
                        n_layers=24), 16384),
}
TINY = {"tiny": (MoEConfig(d_model=64, n_experts=8, top_k=2, expert_hidden=32, latent_dim=32, n_shared=1), 256)}


def time_ms(fn, device, warmup: int = 5, rep: int = 20) -> float:
    """Median wall time of ``fn()`` in ms (CUDA events on a GPU)."""
    import statistics
    import time

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def ceiling_tflops(device, n: int = 8192) -> float:
    """bf16 n^3 matmul TFLOP/s: the ceiling the grouped GEMMs are held against."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = time_ms(lambda: a @ b, device, warmup=10, rep=50)
    return 2 * n**3 / ms / 1e9


def torchtitan_moe(c: MoEConfig, device):
    """torchtitan's MoE at ``c``'s full-width config (SwiGLU experts, sigmoid router, renormalised)."""
    from functools import partial

    import torch.nn as nn
    from torchtitan.models.common import config_utils as cu

    init = {"weight": partial(nn.init.normal_, std=c.init_std)}
    einit = {n: partial(nn.init.normal_, std=c.init_std) for n in ("w1_EFD", "w2_EDF", "w3_EFD")}
    cfg = cu.make_moe_config(
        num_experts=c.n_experts,
        router=cu.make_router_config(dim=c.d_model, num_experts=c.n_experts, gate_param_init=init, top_k=c.top_k,
                                     score_func="sigmoid", route_norm=True),
        routed_experts=cu.make_routed_experts_config(dim=c.d_model, hidden_dim=c.expert_hidden,
                                                     num_experts=c.n_experts, top_k=c.top_k, param_init=einit,
                                                     comm_backend="standard"),
        shared_experts=cu.make_ffn_config(dim=c.d_model, hidden_dim=c.n_shared * c.expert_hidden,
                                          w1_param_init=init, w2w3_param_init=init) if c.n_shared else None,
        load_balance_coeff=1e-3)
    with torch.device(device):
        m = cfg.build()
        m.init_states()
    return m


def copy_into_torchtitan(ours: MoE, tt) -> None:
    """Load k3lab's full-width layer's weights into torchtitan's (their experts store [E, out, in])."""
    e, inner = ours.experts, tt.routed_experts.inner_experts
    with torch.no_grad():
        inner.w1_EFD.copy_(e.w_gate.transpose(1, 2))
        inner.w3_EFD.copy_(e.w_up.transpose(1, 2))
        inner.w2_EDF.copy_(e.w_down.transpose(1, 2))
        tt.router.gate.weight.copy_(ours.router.weight)
        if ours.shared is not None:
            h = ours.shared.down.weight.shape[1]
            tt.shared_experts.w1.weight.copy_(ours.shared.gate_up.weight[:h])
            tt.shared_experts.w3.weight.copy_(ours.shared.gate_up.weight[h:])
            tt.shared_experts.w2.weight.copy_(ours.shared.down.weight)


def check(c: MoEConfig, device, tokens: int, with_torchtitan: bool) -> dict:
    """Errors of the bf16 paths: k3lab bf16 vs float32 (same weights, output and input gradient), and
    torchtitan vs k3lab's SwiGLU layer (outputs). Raises AssertionError past the bounds."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, tokens, c.d_model, generator=gen).to(device)
    dy = torch.randn(1, tokens, c.d_model, generator=gen).to(device)
    errors = {}
    for name, cfg in (("latent", c), ("full", replace(c, latent_dim=None))):
        torch.manual_seed(0)
        ref = MoE(replace(cfg, balance="none", init_std=0.05)).to(device)
        fast = copy.deepcopy(ref).to(torch.bfloat16)
        x32, x16 = x.clone().requires_grad_(), x.bfloat16().requires_grad_()
        y32, y16 = ref(x32), fast(x16)
        same = (ref.last_routing.topk_idx.sort(-1).values == fast.last_routing.topk_idx.sort(-1).values).all(-1)
        (y32 * dy).sum().backward()
        (y16 * dy.bfloat16()).sum().backward()
        # Tokens whose bf16 router picks another expert differ by design; compare the others.
        keep = same.view(1, tokens, 1)
        errors[f"{name}_y"] = rel_rms_error(y32 * keep, y16.float() * keep)
        errors[f"{name}_dx"] = rel_rms_error(x32.grad * keep, x16.grad.float() * keep)
        errors[f"{name}_same_routing"] = float(same.float().mean())
    if with_torchtitan:
        torch.manual_seed(0)
        ours = MoE(replace(c, latent_dim=None, activation="swiglu", balance="none", init_std=0.05)).to(device)
        tt = torchtitan_moe(c, device)
        copy_into_torchtitan(ours, tt)
        with torch.no_grad():
            ours_b = copy.deepcopy(ours).to(torch.bfloat16)
            # torchtitan's float32 layer (its experts run in bf16 inside): the same function as ours?
            y_ours, y_tt = ours_b(x.bfloat16()), tt(x)
            ref = ours(x)
        same = (ours.last_routing.topk_idx.sort(-1).values == ours_b.last_routing.topk_idx.sort(-1).values).all(-1)
        keep = same.view(1, tokens, 1)
        errors["torchtitan_vs_fp32"] = rel_rms_error(ref * keep, y_tt.float() * keep)
        errors["k3lab_swiglu_vs_fp32"] = rel_rms_error(ref * keep, y_ours.float() * keep)
    for k, v in errors.items():
        bound = 0.9 if k.endswith("same_routing") else 3e-2
        ok = v >= bound if k.endswith("same_routing") else v <= bound
        if not ok:
            raise AssertionError(f"MoE bench check {k} = {v:.3e} (bound {bound})")
    return errors


def step_ms(layer, x, dy, device, rep: int) -> float:
    """Forward + backward of one layer (parameter gradients dropped between calls)."""
    params = list(layer.parameters())

    def step():
        y = layer(x)
        torch.autograd.backward(y, dy, inputs=[x] + params)
        for p in params:
            p.grad = None
        x.grad = None

    return time_ms(step, device, rep=rep)


def gemm_tflops(c: MoEConfig, tokens: int, device, rep: int) -> dict:
    """The grouped expert GEMMs alone (forward + backward) at exactly balanced load, bf16."""
    E, K, h, l = c.n_experts, c.top_k, c.expert_hidden, c.routed_dim
    rows = tokens * K
    offsets = torch.arange(1, E + 1, device=device, dtype=torch.int32) * (rows // E)
    x = torch.randn(rows, l, device=device, dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(E, l, h, device=device, dtype=torch.bfloat16, requires_grad=True) / 30,
          torch.randn(E, l, h, device=device, dtype=torch.bfloat16, requires_grad=True) / 30,
          torch.randn(E, h, l, device=device, dtype=torch.bfloat16, requires_grad=True) / 30]
    ws = [w.detach().requires_grad_() for w in ws]
    dy = torch.randn(rows, l, device=device, dtype=torch.bfloat16)

    def step():
        y = expert_ffn(x, offsets, *ws, activation=c.activation)
        torch.autograd.backward(y, dy, inputs=[x] + ws)

    ms = time_ms(step, device, rep=rep)
    # The same weights stored [E, out, in] (nn.Linear's order, torchtitan's) and passed transposed:
    # does grouped_mm care which dimension of the weight is contiguous?
    ws_t = [w.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for w in ws]

    def step_t():
        y = expert_ffn(x, offsets, *ws_t, activation=c.activation)
        torch.autograd.backward(y, dy, inputs=[x] + ws_t)

    ms_t = time_ms(step_t, device, rep=rep)

    def gemms_only():
        # The same nine GEMMs (three forward, six backward) with the activation left out.
        from k3lab.moe.experts import grouped_mm

        a = grouped_mm(x, ws[0], offs=offsets)
        u = grouped_mm(x, ws[1], offs=offsets)
        y = grouped_mm(a, ws[2], offs=offsets)
        torch.autograd.backward([y, u], [dy, a.detach()], inputs=[x] + ws)

    ms_g = time_ms(gemms_only, device, rep=rep)
    flops = 3 * (3 * 2 * rows * l * h)  # three GEMMs forward, twice that backward
    return {"expert_block_ms": ms, "expert_block_tflops": flops / ms / 1e9, "gemm_ms": ms_g,
            "grouped_gemm_tflops": flops / ms_g / 1e9, "expert_block_ms_weights_in_major": ms_t}


def time_case(name: str, c: MoEConfig, tokens: int, device, with_torchtitan: bool, rep: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(1, tokens, c.d_model, generator=gen).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(1, tokens, c.d_model, generator=gen).to(device, torch.bfloat16)
    row = {"name": name, "tokens": tokens, "d": c.d_model, "latent": c.latent_dim, "E": c.n_experts,
           "K": c.top_k, "h": c.expert_hidden, "shared": c.n_shared}
    layers = {"latent": replace(c, balance="qb"), "full": replace(c, latent_dim=None, balance="qb"),
              "full_swiglu": replace(c, latent_dim=None, activation="swiglu", balance="qb")}
    for key, cfg in layers.items():
        layer = MoE(cfg).to(device, torch.bfloat16)
        ms = step_ms(layer, x, dy, device, rep)
        row[f"{key}_ms"] = ms
        row[f"{key}_tokens_per_s"] = tokens / ms * 1e3
        row[f"{key}_flops_per_token"] = cfg.flops_per_token()
        del layer
    if with_torchtitan:
        tt = torchtitan_moe(c, device).to(torch.bfloat16)
        ms = step_ms(tt, x, dy, device, rep)
        row["torchtitan_ms"], row["torchtitan_tokens_per_s"] = ms, tokens / ms * 1e3
        del tt
    row.update(gemm_tflops(c, tokens, device, rep))
    row["flops_ratio_full_over_latent"] = row["full_flops_per_token"] / row["latent_flops_per_token"]
    row["speedup_latent_over_full"] = row["full_ms"] / row["latent_ms"]
    if with_torchtitan:
        row["full_swiglu_over_torchtitan"] = row["torchtitan_ms"] / row["full_swiglu_ms"]
    return row


def table(result: dict) -> str:
    lines = [f"One MoE layer, fwd+bwd bf16, on {result['device']} ({result['date']}); "
             f"bf16 matmul ceiling {result['ceiling_tflops']:.0f} TFLOP/s (measured in this run)",
             f"{'case':<10}{'tokens':>7}{'latent tok/s':>14}{'full tok/s':>12}{'full swiglu':>12}{'torchtitan':>12}"
             f"{'latent/full':>12}{'flops ratio':>12}{'GEMM TF/s':>11}{'% ceil':>8}{'block TF/s':>11}"]
    for r in result["cases"]:
        tt = r.get("torchtitan_tokens_per_s")
        lines.append(f"{r['name']:<10}{r['tokens']:>7}{r['latent_tokens_per_s']:>14.0f}{r['full_tokens_per_s']:>12.0f}"
                     f"{r['full_swiglu_tokens_per_s']:>12.0f}{(f'{tt:.0f}' if tt else 'n/a'):>12}"
                     f"{r['speedup_latent_over_full']:>12.2f}{r['flops_ratio_full_over_latent']:>12.2f}"
                     f"{r['grouped_gemm_tflops']:>11.0f}{100 * r['grouped_gemm_tflops'] / result['ceiling_tflops']:>7.0f}%"
                     f"{r['expert_block_tflops']:>11.0f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m k3lab.bench.moe", description=__doc__.split("\n")[0])
    timed_flags(p, "moe", rep=20)
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES), help="which shapes")
    p.add_argument("--no-torchtitan", action="store_true", help="skip torchtitan's layer")
    args = p.parse_args(argv)
    check_out(args.out)
    if args.rep is None:
        args.rep = 2 if args.small else 20
    device = gpu_device(p, args)
    cases = TINY if args.small else {k: CASES[k] for k in args.cases}
    with_tt = not args.no_torchtitan
    if with_tt:
        import importlib.util

        if importlib.util.find_spec("torchtitan") is None:
            raise SystemExit("torchtitan is not installed: install it or pass --no-torchtitan")
    result = run_info(device)
    result["ceiling_tflops"] = ceiling_tflops(device, 256 if args.small else 8192)
    result["checks"], result["cases"] = {}, []
    for name, (c, tokens) in cases.items():
        # The check runs the case's widths with fewer experts: a float32 twin of 64 K3-wide experts
        # and its gradients would not fit beside the bf16 layer on an 80 GB card.
        result["checks"][name] = check(replace(c, n_experts=min(c.n_experts, 16)), device, min(tokens, 2048), with_tt)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{name}: checks {result['checks'][name]}", flush=True)
        result["cases"].append(time_case(name, c, tokens, device, with_tt, args.rep))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_result("moe", result, args.out, args.small)
    print("\n" + table(result))
    return result


if __name__ == "__main__":
    main()
