# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · FlashKDA: KDA in fused Triton kernels
#
# **Why.** 69 of K3's 93 layers are KDA layers, trained at 8K–64K tokens and served up to 1M tokens
# (K3 report, Table 1). Linear attention is only worth its linear cost if its kernels keep the tensor
# cores busy, and the recurrence of chapter 01 is a chain of rank-1 updates, one token at a time.
# This chapter builds `k3lab.kernels.kda.flash_kda`: forward **and** backward in Triton, with K3's
# lower-bounded gate, the q/k L2 norm and the β sigmoid fused in, packed sequences of different lengths
# (`cu_seqlens`), GVA (more value heads than q/k heads) and states. Its targets: a forward at least
# 1.5x and a forward+backward at least 1.2x as fast as fla-core 0.6.0's `chunk_kda` on an H200 at
# K = V = 128, bf16, for B ∈ {1, 4, 8}, T ∈ {4K, 8K, 32K}, H ∈ {16, 32, 64}.
#
# 1. The math: why chunks map onto tensor cores, and why K3's gate lets every sub-tile use them.
# 2. The simplest correct code: the fused op as a recurrence (`k3lab.kda.naive_fused_kda`).
# 3. The fast code: the kernel stages, and two of them read line by line.
# 4. The check: the Triton kernels against the float64 recurrence, output and all eight gradients.
# 5. The measured result on one H200, with its roofline.
# 6. Experiments: where the factored sub-tile overflows; the UT inverse by powers or by doubling.
#
# Code: `kernels/kda/` (`utils.py`, `chunk_fwd.py`, `chunk_bwd.py`, `fused.py`), the benchmark
# `k3lab/bench/flash_kda.py`, tests `tests/test_flash_kda*.py`; designs that were measured and dropped
# are in `docs/flash_kda.md`.

# %% tags=["parameters"]
profile: str = "cpu"
seed: int = 0
check_T: int = 100
check_heads: int = 2
check_dim: int = 16
bench_cases: list = []
results_path: str = "data/results/flash_kda_h200.json"  # from the repository root

# %% tags=["nbval-ignore-output"]
import k3lab

device = k3lab.setup(seed=seed, profile=profile)

# %%
import inspect
import itertools
import json
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

from k3lab.bench.flash_kda import fwd_bytes, fwd_flops, make_inputs
from k3lab.book import ROOT
from k3lab.kda import chunk_kda, naive_fused_kda, naive_recurrent_kda
from k3lab.kernels.kda import chunk_fwd, flash_kda
from k3lab.kernels.kda.fused import MIN_LOWER_BOUND
from k3lab.testing import rel_rms_error

result = json.loads((ROOT / results_path).read_text())
hw, cases = result["hardware"], result["cases"]
peak, bw = hw["bf16_matmul_tflops"], hw["copy_gbps"] / 1e3  # TFLOP/s and TB/s, measured by the benchmark
ridge = peak / bw  # FLOP per byte where the roofline bends


def show_source(fn, docstring=False):
    """Print a function's source (a Triton kernel's Python body too), without its docstring."""
    while hasattr(fn, "fn"):  # an autotuner wraps a JITFunction, which wraps the Python function
        fn = fn.fn
    src = inspect.getsource(fn)
    if not docstring and '"""' in src:
        head, _, rest = src.partition('"""')
        src = head.rstrip() + "\n" + rest.partition('"""')[2].lstrip("\n")
    print(src)


# %% [markdown]
# ## 1. The math
#
# ### From rank-1 updates to matrix products
#
# Token by token, KDA reads and rewrites the whole `K × V` state per head: about `6 K V` FLOPs (decay,
# read `kᵀS`, rank-1 write, read `qᵀS`) against `2 · 4 K V` bytes if the fp32 state streams through
# memory — under 1 FLOP per byte, and matrix–*vector* work that tensor cores cannot run. The chunkwise
# (UT/WY) form of chapter 01 touches the state once per chunk of `C` tokens and turns everything else
# into products of `C × K`, `C × C` and `K × V` tiles. With `Γ` the in-chunk cumulative decay,
# `T = (I + L)⁻¹` the UT inverse of `L = Diag(β) StrictTril((ΓK)(K/Γ)ᵀ)`, `W = T Diag(β) ΓK` and
# `U = T Diag(β) V`:
#
# $$\tilde V = U - W S,\qquad O = (\Gamma Q) S + \mathrm{Tril}\big((\Gamma Q)(K/\Gamma)^\top\big)\tilde V,\qquad
#   S \leftarrow \mathrm{Diag}(\gamma_C) S + (\Gamma_{i\to C} K)^\top \tilde V .$$
#
# Per chunk and head that is about `6 C K V + 5 C² K` FLOPs of tensor-core work for one pass over the
# state. The state stays in registers across chunks, so what streams is q, k, v, gate and output, and
# the intensity grows with `C`. The H200's ceilings below are the ones the benchmark measured
# (`hardware` in `data/results/flash_kda_h200.json`); every figure in this chapter uses them.

# %%
K = V = 128
rows = []
for C in (1, 16, 64, 128):
    flops_token = fwd_flops(1, C, 1, K, V, C=C) / C if C > 1 else 6 * K * V
    # Compulsory bytes per token (bf16 q, k, v, z, beta in, o out); the chunked kernel keeps the state in
    # registers, the recurrence streams it (fp32, read and written every token).
    bytes_token = fwd_bytes(1, 1, 1, K, V) + (2 * 4 * K * V if C == 1 else 0)
    rows.append((C, flops_token, bytes_token, flops_token / bytes_token))
    print(f"C = {C:4d}: {flops_token / 1e3:7.1f} kFLOP/token, {bytes_token / 1e3:6.2f} kB/token, "
          f"intensity {flops_token / bytes_token:6.1f} FLOP/B" + ("  (the recurrence)" if C == 1 else ""))
assert rows[0][3] < 1 and rows[2][3] > 50 * rows[0][3]

print(f"H200 ceilings (measured): bf16 matmul {peak:.0f} TFLOP/s, copy {bw:.2f} TB/s -> ridge {ridge:.0f} FLOP/B")
intensity_64 = rows[2][3]
print(f"C = 64 is at {intensity_64 / ridge:.0%} of the ridge and {intensity_64 / rows[0][3]:.0f}x the recurrence's intensity")
assert intensity_64 < ridge

# %% [markdown]
# At `C = 64` the forward is on the memory side of the ridge, but close enough that neither the
# bandwidth nor the tensor cores alone set its time: it is bound by *latency and fusion* — how many
# launches, how many round trips of intermediates through HBM, and how long the one sequential loop
# over chunks takes. That is where a fused kernel can win.
#
# ### Why K3's lower bound keeps `1/Γ` in bf16
#
# Inside a chunk the score matrices have entries $\sum_c a_{ic} b_{jc}\,e^{G_{ic} - G_{jc}}$ with $G$
# the cumulative log-decay. A tensor core wants this as one product $(a\,e^{G - r})(b\,e^{r - G})^\top$
# for a reference point $r$, i.e. $\Gamma a$ times $b/\Gamma$, and the factor $e^{r - G_j}$ must fit the
# operand type: bf16 has fp32's exponent range, `exp(x)` is finite below `ln(3.39e38) = 88.7`.
#
# * Kimi Linear's gate $-e^{A}\,\mathrm{softplus}(z)$ is unbounded below: one strongly forgetting token
#   can push $G$ down by hundreds, so $1/\Gamma$ overflows on any span — fla then computes the diagonal
#   sub-tiles element by element on CUDA cores.
# * K3's gate $g = g_{\min}\,\sigma(e^{A}(z + b))$ (Eq. 5) keeps every step above $g_{\min} = -5$. Over a
#   16-token sub-tile with $r$ at its middle token no factor exceeds $e^{8 \cdot 5}$; even with $r$ at the
#   first token it is $e^{75}$. Both fit, so **all** sub-tiles, diagonal included, run on tensor cores
#   in bf16. FlashKDA takes $r$ at the middle, which allows $g_{\min} \ge -10$ (section 6 finds the edge).

# %%
ln_bf16_max = math.log(torch.finfo(torch.bfloat16).max)
span = np.arange(0, 65)
fig, ax = plt.subplots(figsize=(6.5, 3.2))
for g_min, style in ((-5.0, "-"), (-10.0, "--")):
    ax.plot(span, -g_min * span, style, label=f"worst case, g_min = {g_min:g}")
# Kimi Linear's gate for a strongly forgetting head (A = log 16, z ~ N(2, 1)): the worst span.
gen = torch.Generator().manual_seed(seed)
g_kimi = -(16.0 * torch.nn.functional.softplus(torch.randn(20000, generator=gen) + 2.0)).numpy()
worst = [-np.min(np.convolve(g_kimi, np.ones(n), "valid")) if n else 0.0 for n in span]
ax.plot(span, worst, ":", label="Kimi Linear gate (A = log 16, z ~ N(2, 1)), worst span")
ax.axhline(ln_bf16_max, color="k", lw=0.8)
ax.text(1, ln_bf16_max + 8, "ln(bf16 max) = 88.7: 1/Γ overflows above", fontsize=8)
for x, lbl in ((8, "half sub-tile"), (16, "sub-tile")):
    ax.axvline(x, color="gray", lw=0.5)
    ax.text(x + 0.5, 300, lbl, fontsize=8, rotation=90)
ax.set(xlabel="tokens spanned by the factor", ylabel="log of the largest 1/Γ", ylim=(0, 400),
       title="Cumulative decay over a span vs bf16's range")
ax.legend(fontsize=8)
plt.show()
print(f"g_min = -5: half sub-tile needs e^{5 * 8:.0f}, a whole one e^{5 * 15:.0f}; bf16 holds up to e^{ln_bf16_max:.1f}")
print(f"Kimi Linear gate: the worst 8-token span needs e^{worst[8]:.0f}")
assert 5 * 15 < ln_bf16_max < worst[8]

# %% [markdown]
# ## 2. The simplest correct code
#
# The fused op takes what a KDA layer's projections produce: un-normalised q and k, the gate
# pre-activation `z` and the β logits. Written plainly, it normalises, applies the gate and the sigmoid,
# and runs chapter 01's recurrence, one token at a time. This is the ground truth every fast path below
# is checked against (in float64), in this chapter, in the benchmark and in the tests:

# %%
show_source(naive_fused_kda)
src = inspect.getsource(naive_recurrent_kda)
print("# ... and the loop of naive_recurrent_kda it calls:")
print(src[src.index("    for n in range(N):"):src.index("    o = torch.stack")])

# %% [markdown]
# ## 3. The fast code
#
# Six forward kernels and six backward kernels, each a `@triton.jit` function
# (`kda_<stage>_{fwd,bwd}_kernel`) with a launcher, one `autograd.Function` and the public `flash_kda`,
# which validates the inputs and builds the chunk table from the sequence lengths once per shape.
# Chunks are 64 tokens, cut into 16-row sub-tiles.
#
# | stage | grid | what it does |
# |---|---|---|
# | `gate_fwd` | K tiles × chunks × value heads | `g = lb·σ(exp(A_log)(z + b))` and its in-chunk cumsum `G` |
# | `scores_fwd` | sub-tiles × chunks × value heads | q/k L2 norm, β sigmoid, `ΓK`, `ΓQ`; the sub-tile's row of `L` and `Aqk` |
# | `inverse_fwd` | chunks × value heads | `T = (I + L)⁻¹` by 16×16 blocks, the diagonal ones by recursive doubling |
# | `wu_fwd` | chunks × value heads | `W = T Diag(β) ΓK`, `U = T Diag(β) V` |
# | `state_fwd` | sequences × value heads × V tiles | the one sequential loop: `Ṽ`, the output `O`, the next `S` |
# | `state_bwd` | sequences × value heads × V tiles | the reverse loop: `dṼ`, `dS` |
# | `dqk_bwd`, `dwv_bwd` | (K tiles ×) chunks × value heads | the gradients through `ΓQ`, `ΓK`, `W`, `U` and `T` |
# | `intra_bwd` | sub-tiles × K tiles × chunks × value heads | the gradients of both score matrices |
# | `gate_bwd`, `qk_norm_bwd` | K tiles × chunks × value heads; token blocks | the gate's and the norms' backward, the GVA sum |
#
# Four choices shape it:
#
# * **The output inside the state loop.** Each step of `state_fwd` already holds `S` and `Ṽ`, the two
#   things the output's products need; a separate output kernel would write every chunk's state to
#   memory and read it back.
# * **The forward keeps what the backward reads.** When autograd records, the forward saves `G`, `T`,
#   `Aqk`, `W`, `KG`, `QG` and the chunk states `h`, `Ṽ` as saved tensors (so activation checkpointing
#   and `save_on_cpu` see them), and the backward runs no forward kernel again. An inference forward
#   stores none of it, packs `G` into int16 codes and runs the inverse and W/U as one kernel.
# * **bf16 where it is safe.** For bf16 inputs the intermediates are bf16 tensor-core operands with
#   float32 accumulators; `G` and `L` stay float32, and `intra_bwd`, whose gate gradient is a sum of
#   large cancelling terms, uses TF32 operands. float16 and float32 inputs use float32 intermediates.
# * **Autotuned warps.** The chunk-parallel kernels' `num_warps` is tuned per head count, K, V, dtype
#   and grid size class on the GPU at hand; the scores kernel runs at 2 warps capped at 168 registers,
#   so 6 programs share an SM.
#
# Here are two of the stages as they are in `kernels/kda/chunk_fwd.py`. The gate kernel: each program
# owns a K tile of one chunk and value head, loads `z`, applies the gate and sums it down the chunk.
# The `PACKED` branch is the inference forward's int16 store; the other branch is the whole stage:

# %%
show_source(chunk_fwd.kda_gate_fwd_kernel)
show_source(chunk_fwd.gate_value)

# %% [markdown]
# The UT inverse's diagonal blocks by recursive doubling. `L` is strictly lower triangular, so each
# 16×16 diagonal block of `I + L` is `I + N` with `N` strictly lower, and a unit lower triangular matrix
# inverts by its halves:
#
# $$\begin{pmatrix} A & 0 \\ C & B \end{pmatrix}^{-1} = \begin{pmatrix} A^{-1} & 0 \\ -B^{-1} C A^{-1} & B^{-1} \end{pmatrix}
# = X - (X N_s) X, \qquad X = \begin{pmatrix} A^{-1} & 0 \\ 0 & B^{-1} \end{pmatrix},\;
# N_s = \begin{pmatrix} 0 & 0 \\ C & 0 \end{pmatrix}.$$
#
# Starting from the 2×2 blocks (whose inverses are `I − N`), three doublings reach 16×16, two products
# each, on the four diagonal blocks of a chunk at once as one `[4, 16, 16]` batch. `b_` names a block
# held in registers, `o_` an offset vector; `PREC` is the `tl.dot` input precision the launcher picks:

# %%
show_source(chunk_fwd.doubling_step)
show_source(chunk_fwd.unit_lower_inverse)

# %% [markdown]
# ## 4. The check: Triton kernels vs the float64 recurrence
#
# On the CPU profile the kernels run under `TRITON_INTERPRET=1` in float32 (the interpreter has no bf16
# arithmetic), at a small size with GVA, an initial state and a tail chunk; on the GPU profile in bf16 at
# K = V = 128. The reference is `naive_fused_kda` in float64 on the same device, fed the very inputs the
# kernels got (after their rounding to bf16 or float32), so the error measured is the kernels' own.
# Output, final state and all eight gradients:

# %% tags=["nbval-ignore-output"]
dt = torch.bfloat16 if device.type == "cuda" else torch.float32
B, T, H, HV = 2, check_T, 1, check_heads
Kc = Vc = check_dim if device.type == "cpu" else 128
gen = torch.Generator().manual_seed(seed)
r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
inputs = [r(B, T, H, Kc), r(B, T, H, Kc), r(B, T, HV, Vc), r(B, T, HV, Kc), r(B, T, HV),
          0.5 * r(HV), 0.5 * r(HV * Kc), r(B, HV, Kc, Vc)]
ours = [x.to(device, dt if i < 5 else torch.float32).requires_grad_() for i, x in enumerate(inputs)]
# bf16 rounding of the inputs alone moves the output by ~3e-3 RMS, most of the bf16 tolerance.
ref = [x.detach().double().requires_grad_() for x in ours]
o, s = flash_kda(*ours[:7], initial_state=ours[7], output_final_state=True)
o_ref, s_ref = naive_fused_kda(*ref[:7], initial_state=ref[7])
do, ds = torch.randn_like(o_ref), torch.randn_like(s_ref)
((o.double() * do).sum() + (s.double() * ds).sum()).backward()
((o_ref * do).sum() + (s_ref * ds).sum()).backward()
errors = {"o": rel_rms_error(o_ref, o), "final_state": rel_rms_error(s_ref, s)}
for name, a, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"), ref, ours):
    errors[name] = rel_rms_error(a.grad, x.grad)
tol_out, tol_grad = (5e-3, 1e-2) if device.type == "cuda" else (1e-4, 1e-4)
print(f"flash_kda ({dt}, B={B}, T={T}, H={H}, HV={HV}, K=V={Kc}) vs float64 naive, rel RMS error:")
for name, e in errors.items():
    tol = tol_grad if name.startswith("d") else tol_out
    print(f"  {name:12s} {e:.2e}  (tol {tol:.0e})")
    assert e <= tol, name

# %% [markdown]
# The same bad inputs raise the same errors as the PyTorch operator of `k3lab.kda` (both call
# `check_kda_inputs`), each naming its own arguments: `flash_kda` takes the gate pre-activation `z` and
# `beta_logits` where `chunk_kda` takes the log-decay `g` and the strengths `beta`:

# %%
# chunk_kda's arguments in place of flash_kda's: the log-decay g (any valid one) for the gate
# pre-activation z, the strengths beta for the logits.
as_reference = {"z": "g", "beta_logits": "beta"}
for label, kwargs in (
    ("duplicate offsets", dict(cu_seqlens=torch.tensor([0, 4, 4, T]))),
    ("z shape", dict(z=torch.randn(1, T, HV, Kc + 1))),
):
    args = dict(q=ours[0][:1].detach(), k=ours[1][:1].detach(), v=ours[2][:1].detach(),
                z=ours[3][:1].detach(), beta_logits=ours[4][:1].detach())
    args.update({k_: v_.to(device) for k_, v_ in kwargs.items()})
    try:
        flash_kda(A_log=ours[5].detach(), dt_bias=ours[6].detach(), **args)
    except ValueError as e:
        msg_fast = str(e)
    ref_args = {as_reference.get(k_, k_): v_ for k_, v_ in args.items()}
    try:
        chunk_kda(**dict(ref_args, g=-ref_args["g"].abs()))
    except ValueError as e:
        msg_ref = str(e)
    print(f"{label}: {msg_fast}")
    # The same check and message, each naming its own op's argument.
    assert msg_fast == msg_ref.replace("g must", "z must")

# %% [markdown]
# ## 5. The measured result on one H200
#
# `python -m k3lab.bench.flash_kda` checks correctness in bf16 first (against the float64 recurrence,
# fixed-length and varlen, T not a multiple of 64, GVA, initial state), measures the ceilings, then times
# ours and fla's `chunk_kda` with the same settings (bf16, K = V = 128, lower bound −5, gate, norm and
# sigmoid fused, `safe_gate=True`) by `triton.testing.do_bench`, the forward under `no_grad`. It writes
# `data/results/flash_kda_<card>.json`, recording the date, versions and, per shape, whether fla was
# timed in the same run (`fla_same_run`): fla autotunes for minutes per new shape, so a sweep may take
# its times from separate runs of the same benchmark on the same GPU model.

# %%
ver = result["versions"]
print(f"{result['device']} | {result['date']} | torch {ver['torch']} | "
      f"triton {ver['triton']} | fla-core {ver['fla-core']}")
check = result["check"]
print(f"bf16 check: o {check['o']:.2e} (tol {check['tol_out']:.0e}), final state {check['final_state']:.2e}, "
      f"worst gradient {check['worst_gradient']:.2e} (tol {check['tol_grad']:.0e})")
fmt = lambda x, f: "n/a".rjust(int(f.split(".")[0])) if x is None else format(x, f)  # noqa: E731
host_bound = {tuple(s) for s in result["host_bound"]}
print(f"\n{'B':>2} {'T':>6} {'H':>3} | {'ours fwd':>8} {'fla fwd':>8} {'x':>5} | {'ours f+b':>8} {'fla f+b':>8} "
      f"{'x':>5} | {'TFLOP/s':>7} {'GB/s':>6} | {'ours MiB':>8} {'fla MiB':>8} | fla same run")
for c in cases:
    gbps = fwd_bytes(c["B"], c["T"], c["H"], c["K"], c["K"]) / c["ours_fwd_ms"] / 1e6
    mark = " (host-bound)" if (c["B"], c["T"], c["H"]) in host_bound else ""
    print(f"{c['B']:>2} {c['T']:>6} {c['H']:>3} | {c['ours_fwd_ms']:8.3f} {fmt(c['fla_fwd_ms'], '8.3f')} "
          f"{fmt(c['speedup_fwd'], '5.2f')} | {c['ours_fwd_bwd_ms']:8.3f} {fmt(c['fla_fwd_bwd_ms'], '8.3f')} "
          f"{fmt(c['speedup_fwd_bwd'], '5.2f')} | {c['tflops_fwd']:7.1f} {gbps:6.0f} | "
          f"{fmt(c['ours_peak_mib'], '8.0f')} {fmt(c['fla_peak_mib'], '8.0f')} | {c['fla_same_run']}{mark}")
timed = [c for c in cases if c["fla_fwd_ms"] is not None]
fwd_x, fb_x = [c["speedup_fwd"] for c in timed], [c["speedup_fwd_bwd"] for c in timed]
print(f"\nat the {len(timed)} shapes fla ran: forward {min(fwd_x):.2f}-{max(fwd_x):.2f}x, forward+backward "
      f"{min(fb_x):.2f}-{max(fb_x):.2f}x; peak memory below fla's at {sum(c['ours_peak_mib'] < c['fla_peak_mib'] for c in timed)}; "
      f"fla timed in the same run as ours at {sum(c['fla_same_run'] for c in timed)} of them")
print("no fla time (fla ran out of GPU memory, the JSON's notes): "
      + ", ".join(f"B{c['B']} T{c['T']} H{c['H']}" for c in cases if c["fla_fwd_ms"] is None))
# The floors a reader relies on: the targets, the bf16 check, every shape present.
assert sorted((c["B"], c["T"], c["H"]) for c in cases) == sorted(itertools.product((1, 4, 8), (4096, 8192, 32768), (16, 32, 64)))
assert min(fwd_x) >= 1.5 and min(fb_x) >= 1.2
assert check["o"] <= check["tol_out"] and check["worst_gradient"] <= check["tol_grad"]

# %% [markdown]
# The same forward times on the roofline, with the ceilings the benchmark measured in its run:

# %%
x = np.logspace(0, 4, 200)
fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.loglog(x, np.minimum(peak, x * bw), "k-", lw=1, label=f"roofline ({peak:.0f} TFLOP/s, {bw:.2f} TB/s)")
ax.axvline(ridge, color="gray", lw=0.5)
for c in cases:
    flops, nbytes = fwd_flops(c["B"], c["T"], c["H"], c["K"], c["K"]), fwd_bytes(c["B"], c["T"], c["H"], c["K"], c["K"])
    assert abs(flops / nbytes / intensity_64 - 1) < 1e-9  # the same intensity as section 1's, shape by shape
    ax.plot(flops / nbytes, flops / c["ours_fwd_ms"] / 1e9, "o", color="C0", ms=4)
    if c["fla_fwd_ms"] is not None:
        ax.plot(flops / nbytes * 1.04, flops / c["fla_fwd_ms"] / 1e9, "s", color="C1", ms=4)
ax.plot([], [], "o", color="C0", label=f"ours, forward, {len(cases)} shapes")
ax.plot([], [], "s", color="C1", label=f"fla-core {ver['fla-core']}, forward, {len(timed)} shapes")
ax.set(xlabel="arithmetic intensity (useful FLOPs / compulsory bytes)", ylabel="TFLOP/s",
       title="KDA forward on one H200 vs the roofline", ylim=(1, 2000))
ax.legend(fontsize=7, loc="upper left")
plt.show()
best = max(cases, key=lambda c: c["tflops_fwd"])
ai = intensity_64  # section 1's count: every shape has it
print(f"intensity {ai:.0f} FLOP/B, where the roofline allows {min(peak, ai * bw):.0f} TFLOP/s; ours reach "
      f"{best['tflops_fwd']:.0f} TFLOP/s at best ({best['tflops_fwd'] / min(peak, ai * bw):.0%} of it, "
      f"B{best['B']} T{best['T']} H{best['H']})")
slowest = min((c for c in cases if (c["B"], c["T"], c["H"]) not in host_bound), key=lambda c: c["tflops_fwd"])
print(f"lowest rate where the GPU bounds the time: {slowest['tflops_fwd']:.0f} TFLOP/s at "
      f"B{slowest['B']} T{slowest['T']} H{slowest['H']}")

# %% [markdown]
# **What limits it.** Every shape has the same intensity (FLOPs and bytes both scale with B·T·H), so the
# points stack in one column, far under the roofline: the kernels are bound by latency, not by compute
# or bandwidth. The one sequential loop is the reason: `state_fwd` runs one program per sequence, value
# head and V tile, each walking its chunks one after another, so with one long sequence and few heads
# (B1 T32768) the grid has about one program per SM and each chunk step waits on the last. The shapes
# marked host-bound are too small to measure the GPU: launching the kernels from Python takes about as
# long as running them, and their times swing between calls (`docs/flash_kda.md`). fla's times in this
# file come from its own runs of the benchmark on the same GPU model, not from the same run as ours.
#
# On the GPU profile (`python -m k3lab.book run --profile gpu --only 02`), the cell below reruns the
# benchmark (its bf16 check first) on the shapes in `bench_cases` and writes to `build/`, leaving
# `data/results` unchanged. fla is timed too where `fla-core` is installed (expect minutes of autotuning per
# new shape); without it, ours alone, beside the stored H200 figures for the same shapes.

# %% tags=["nbval-ignore-output"]
if device.type == "cuda" and bench_cases:
    import importlib.util

    from k3lab.bench.flash_kda import main as bench_main

    with_fla = importlib.util.find_spec("fla") is not None
    live = bench_main(["--cases", *bench_cases, "--out", str(ROOT / "build" / "flash_kda_live.json")]
                      + ([] if with_fla else ["--no-fla"]))
    print(f"live run on {live['hardware']['name']}: {len(live['cases'])} cases"
          + ("" if with_fla else " (fla-core not installed: ours only)"))
    committed = {(c["B"], c["T"], c["H"]): c for c in cases}
    for c in live["cases"]:
        prev = committed.get((c["B"], c["T"], c["H"]))
        then = f"; committed ({result['device']}): {prev['ours_fwd_ms']:.3f} / {prev['ours_fwd_bwd_ms']:.3f} ms" if prev else ""
        print(f"B{c['B']} T{c['T']} H{c['H']}: fwd {c['ours_fwd_ms']:.3f} ms, fwd+bwd {c['ours_fwd_bwd_ms']:.3f} ms{then}")
else:
    print("CPU profile: the benchmark needs a CUDA GPU; the table above is the stored H200 run")

# %% [markdown]
# ## 6. Experiments
#
# **Where does the factored sub-tile break?** One 16×16 diagonal sub-tile, computed as a bf16 product of
# the two factored operands (what a tensor core does) against the direct float64 sum, for gates pinned
# at `g_min`, with the reference at the first token or at the middle one:

# %% tags=["nbval-ignore-output"]
def factored_block_error(g_min, ref_row, n=16, d=32, seed=0):
    """Rel. error of the factored bf16 sub-tile vs float64, or inf if a factor overflowed."""
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, d, generator=gen, dtype=torch.float64), torch.randn(n, d, generator=gen, dtype=torch.float64)
    G = torch.cumsum(torch.full((n, d), g_min, dtype=torch.float64), 0)
    exact = torch.einsum("ic,jc,ijc->ij", a, b, (G[:, None] - G[None]).exp()).tril()
    r = G[ref_row]
    left, right = (a * (G - r).exp()).bfloat16(), (b * (r - G).exp()).bfloat16()
    if not (torch.isfinite(left).all() and torch.isfinite(right).all()):
        return float("inf")
    return rel_rms_error(exact, (left.float() @ right.float().T).tril())


print(" g_min | ref = first token | ref = middle token")
table_rows = {}
for g_min in (-2.0, -5.0, -6.0, -8.0, -10.0, -11.0, -12.0):
    e_first, e_mid = factored_block_error(g_min, 0), factored_block_error(g_min, 8)
    table_rows[g_min] = (e_first, e_mid)
    print(f"{g_min:6.1f} | {e_first:17.2e} | {e_mid:18.2e}")
assert table_rows[-5.0][0] < 2e-2 and table_rows[-10.0][1] < 2e-2
assert math.isinf(table_rows[-6.0][0]) and math.isinf(table_rows[-12.0][1])
assert MIN_LOWER_BOUND == -10.0

# %% [markdown]
# With the first token as reference the factors overflow a little below `g_min = -5.9`; the midpoint
# doubles the room to about `-11`, which is why `flash_kda` accepts `lower_bound` in `[-10, 0)` and
# raises outside it. The errors that remain are bf16's 8-bit mantissa, as in any bf16 product.
#
# **The UT inverse by powers or by doubling.** `N` is nilpotent (`N¹⁶ = 0`), so the power form
# $(I - N)(I + N^2)(I + N^4)(I + N^8)$ also inverts `I + N` in six products. But where the entries of `N`
# are near 1 (near-identical consecutive keys, β near 1, little decay) the powers hold numbers in the
# thousands that cancel back to `|T| ≤ 1`. The cell inverts a typical block and such a worst case both
# ways, against `torch.linalg.inv` in float64 and forward substitution in float32, and prints the largest
# number each form holds on the way:

# %% tags=["nbval-ignore-output"]
def inverse_by_powers(N):
    """(I + N)^-1 of strictly lower [..., 16, 16] blocks N as (I - N)(I + N^2)(I + N^4)(I + N^8);
    also the largest |entry| formed on the way."""
    N2 = N @ N
    N4 = N2 @ N2
    N8 = N4 @ N4
    X = torch.eye(N.shape[-1], dtype=N.dtype) - N
    for P in (N2, N4, N8):
        X = X + X @ P
    return X, max(float(M.abs().max()) for M in (N2, N4, N8, X))


def inverse_by_doubling(N):
    """(I + N)^-1 of strictly lower [..., 16, 16] blocks N by recursive doubling (the kernel's
    ``unit_lower_inverse``); also the largest |entry| formed on the way."""
    i, j = torch.arange(N.shape[-1])[:, None], torch.arange(N.shape[-1])[None, :]
    X = torch.eye(N.shape[-1], dtype=N.dtype) - torch.where(i // 2 == j // 2, N, 0)
    largest = float(X.abs().max())
    for s in (2, 4, 8):
        E = X @ torch.where((i // (2 * s) == j // (2 * s)) & (i // s > j // s), N, 0)
        X = X - E @ X
        largest = max(largest, float(E.abs().max()), float(X.abs().max()))
    return X, largest


def diagonal_blocks(keys, beta, g):
    """[4, 16, 16] float64 blocks Diag(beta) StrictTril(sum_c k_ic k_jc e^(G_ic - G_jc)), k = keys L2-normalised."""
    k, G = torch.nn.functional.normalize(keys, dim=-1), g.cumsum(1)
    return (beta[..., None] * torch.einsum("bic,bjc,bijc->bij", k, k, (G[:, :, None] - G[:, None]).exp())).tril(-1)


gen = torch.Generator().manual_seed(seed)
r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
ones, zeros = torch.ones(4, 16, dtype=torch.float64), torch.zeros(4, 16, 128, dtype=torch.float64)
blocks = {
    "random keys, β = σ(N(0,1)), g = -5σ(N(0,1))":
        diagonal_blocks(r(4, 16, 128), torch.sigmoid(r(4, 16)), -5 * torch.sigmoid(r(4, 16, 128))),
    "near-identical keys (noise 1e-3), β = 1, g = 0": diagonal_blocks(r(1, 1, 128) + 1e-3 * r(4, 16, 128), ones, zeros),
}
eye = torch.eye(16, dtype=torch.float64)
inv_errors = []
for name, N in blocks.items():
    exact = torch.linalg.inv(eye + N)
    N32 = N.float()
    subst = torch.linalg.solve_triangular(eye.float() + N32, eye.float().expand(4, 16, 16), upper=False,
                                          unitriangular=True)
    (pow64, _), (dbl64, _) = inverse_by_powers(N), inverse_by_doubling(N)
    (pow32, pow_max), (dbl32, dbl_max) = inverse_by_powers(N32), inverse_by_doubling(N32)
    e_pow64, e_dbl64, e_pow, e_dbl, e_sub = (rel_rms_error(exact, x) for x in (pow64, dbl64, pow32, dbl32, subst))
    inv_errors.append((e_pow, e_dbl, e_sub, pow_max, dbl_max))
    print(f"{name}: max|N| {N.abs().max():.2f}, largest entry formed: powers {pow_max:.0f}, doubling {dbl_max:.2f}")
    print(f"  rel. RMS error vs torch.linalg.inv in float64: in float64 powers {e_pow64:.1e}, doubling {e_dbl64:.1e}; "
          f"in float32 powers {e_pow:.1e}, doubling {e_dbl:.1e}, forward substitution {e_sub:.1e}")
    assert max(e_pow64, e_dbl64) < 1e-12 and e_sub < 1e-6 and e_dbl < 1e-6
(typical, typical_dbl, _, _, _), (worst, worst_dbl, worst_sub, worst_pow_max, worst_dbl_max) = inv_errors
assert typical < 1e-6 and worst > 100 * worst_sub and worst_dbl < 10 * worst_sub and worst_pow_max > 1000 > 100 * worst_dbl_max

# %% [markdown]
# In float64 both forms are exact identities. In float32 the typical block loses nothing either way; on
# the worst case the power form carries far more error than substitution, and doubling, whose largest
# intermediate is about 1, stays at substitution's level. That is why the kernel doubles: float32
# intermediates need no Newton step, and bf16 ones can run the diagonal's products as three bf16 passes
# (`inverse_precisions`).
#
# ## Exercises
#
# 1. Change `lower_bound` in the check of section 4 to `-10` and then `-10.5`. What does `flash_kda`
#    do, and which line of `kernels/kda/fused.py` decides it?
# 2. Print the intensity of section 1 for `K = V = 64` and `K = V = 256`. Which way does the ridge move
#    relative to KDA, and what would that mean for the state loop?
# 3. In the factored-sub-tile experiment, put the reference at token 15 (the last). Which gates overflow
#    now, and why is the middle the best single reference?
# 4. `inverse_by_doubling` doubles three times from 2×2 blocks. Write the version that starts from 1×1
#    (four doublings) and compare its largest intermediate and its error on the worst block.
# 5. Find the varlen tests among the FlashKDA tests (`pytest tests -k "flash_kda and varlen"`) and read
#    how they build the reference. Why is a loop over sequences a stronger check than one long sequence?
#
# ## References
#
# - Kimi Team, *Kimi K3: Open Frontier Intelligence*, arXiv 2607.24653 — Sec. 2.1, Eq. 3–5 (KDA and
#   the lower-bounded gate), Table 1.
# - Kimi Team, *Kimi Linear: An Expressive, Efficient Attention Architecture*, arXiv 2510.26692 — KDA's
#   chunkwise algorithm.
# - S. Yang, B. Wang, Y. Zhang, Y. Shen, Y. Kim, *Parallelizing Linear Transformers with the Delta Rule
#   over Sequence Length*, NeurIPS 2024 — the UT/WY transform on tensor cores.
# - MoonshotAI/FlashKDA — CUTLASS forward kernels for KDA (the 1.72–2.22x claim over fla on H20).
# - fla-org/flash-linear-attention, `fla/ops/kda` (fla-core 0.6.0) — the baseline, its `safe_gate`
#   tensor-core path for bounded gates.
# - P. Tillet, H. T. Kung, D. Cox, *Triton: An Intermediate Language and Compiler for Tiled Neural
#   Network Computations*, MAPL 2019.
# - S. Williams, A. Waterman, D. Patterson, *Roofline: An Insightful Visual Performance Model*, CACM 2009.
