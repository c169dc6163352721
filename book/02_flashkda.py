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
# **Why.** 69 of K3's 93 layers are KDA layers, trained at 8K–64K tokens and served up to 1M
# (K3 report, Table 1). Linear attention is only worth its linear cost if its kernels keep the
# tensor cores busy: the recurrence of chapter 01 is a chain of rank-1 updates, one token at a time.
# MoonshotAI's FlashKDA (CUDA/CUTLASS, forward only) claims 1.72–2.22x over fla's Triton forward.
# This chapter builds `k3lab.kernels.kda.flash_kda`: forward **and** backward in Triton, with K3's
# lower-bounded gate, the q/k L2 norm and the beta sigmoid fused in, varlen (packed sequences of
# different lengths, `cu_seqlens`), GVA (more value heads than query/key heads) and states; and
# measures it honestly against fla-core 0.6.0 on an H200. The targets (the project's issue 3): a
# forward at least 1.5x fla's and a forward+backward at least 1.2x, at every one of 27 shapes
# (B ∈ {1, 4, 8}, T ∈ {4K, 8K, 32K}, H ∈ {16, 32, 64}, K = V = 128, bf16). Section 5 shows them met
# at every shape where fla runs.
#
# 1. Why the chunkwise form maps onto tensor cores (arithmetic intensity).
# 2. Why K3's lower-bounded gate keeps `1/Γ` inside bf16's range on 16-token sub-tiles (a plot and an
#    experiment on where the factoring overflows).
# 3. The kernel design: stages, what is fused, tiles, what the forward keeps for the backward, the
#    UT inverse by recursive doubling (six batched matrix products), where bf16 is safe.
# 4. The check: the Triton kernels (under the interpreter on CPU) against the float64 recurrence,
#    outputs and all eight gradients.
# 5. The benchmark on one H200: roofline and speed table from the committed JSON; the GPU profile
#    reruns it live.
#
# Code: `kernels/kda/` (`utils.py`, `chunk_fwd.py`, `chunk_bwd.py`, `flash_kda.py`), the benchmark
# `k3lab/bench/flash_kda.py`, tests `tests/test_flash_kda.py`.
#
# Terms used below:
#
# - **chunk** (64 tokens) and **sub-tile** (16 tokens): the blocks the kernels cut a sequence into.
# - **intermediates**: what one kernel writes for the next (`G`, `W`, `U`, `KG`, `QG`, `Aqk`, `T`, the
#   chunk states), in bf16 for bf16 inputs; "float32 intermediates" is the exact path the CPU tests run.
# - **TF32 / 3xTF32**: tensor-core products that round their float32 inputs to 10 mantissa bits, or
#   split each input in a high and a low part and sum three such products (about float32's accuracy).
#   **`ieee`**: full float32 products on CUDA cores.
# - **`do_bench`**: `triton.testing.do_bench`, which times a function on the GPU over many runs.
# - **host-bound**: a shape so small that launching the kernels from Python takes longer than the GPU
#   takes to run them, so its timings measure the CPU that launches them.
# - **`REPLAY`**, **`STORE_STATES`**, **`OUTPUT`**: compile-time flags (Triton `constexpr`s) that make
#   one kernel serve several callers (section 3's table).
# - **fills**: two small kernels in fla's forward profile that fill a buffer with a constant before use.

# %% tags=["parameters"]
profile: str = "cpu"
seed: int = 0
check_T: int = 100
check_heads: int = 2
check_dim: int = 16
bench_cases: list = []
results_path: str = "../data/results/flash_kda_h200.json"

# %% tags=["nbval-ignore-output"]
import k3lab

device = k3lab.setup(seed=seed, profile=profile)

# %%
import itertools
import json
import math
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

from k3lab.bench.flash_kda import fwd_bytes, fwd_flops, reference
from k3lab.kda import chunk_kda, lower_bounded_gate
from k3lab.kernels.kda import flash_kda
from k3lab.kernels.kda.flash_kda import MIN_LOWER_BOUND
from k3lab.testing import rel_rms_error

# %% [markdown]
# ## 1. Why chunks: from rank-1 updates to matrix products
#
# Token by token, KDA reads and rewrites the whole `K × V` state per head: about `6 K V` FLOPs
# (decay, read `kᵀS`, rank-1 write, read `qᵀS`) against `2 · 4 K V` bytes if the fp32 state streams
# through memory — under 1 FLOP per byte, and in any case matrix–*vector* work that tensor cores
# cannot run. The chunkwise (UT/WY) form of chapter 01 touches the state once per chunk of `C`
# tokens and turns everything else into products of `C × K`, `C × C` and `K × V` tiles:
#
# $$\tilde V = U - W S,\qquad O = (\Gamma Q) S + \mathrm{Tril}\big((\Gamma Q)(K/\Gamma)^\top\big)\tilde V,\qquad
#   S \leftarrow \mathrm{Diag}(\gamma_C) S + (\Gamma_{i\to C} K)^\top \tilde V .$$
#
# Per chunk and head that is ~`6 C K V + 5 C² K` FLOPs of tensor-core work for one pass over the
# state. The state stays in registers across chunks (one program per sequence, head and V tile),
# so what streams is q, k, v, gate and output: the intensity grows with `C`.

# %%
K = V = 128
rows = []
for C in (1, 16, 64, 128):
    flops_token = fwd_flops(1, C, 1, K, V, C=C) / C if C > 1 else 6 * K * V
    # Compulsory bytes per token (bf16 q, k, v, z, beta in, o out) + the state once per chunk (fp32, r+w).
    bytes_token = fwd_bytes(1, 1, 1, K, V) + 2 * 4 * K * V / C
    rows.append((C, flops_token, bytes_token, flops_token / bytes_token))
    print(f"C = {C:4d}: {flops_token / 1e3:7.1f} kFLOP/token, {bytes_token / 1e3:6.2f} kB/token, "
          f"intensity {flops_token / bytes_token:6.1f} FLOP/B" + ("  (the recurrence)" if C == 1 else ""))
assert rows[0][3] < 1 and rows[2][3] > 50 * rows[0][3]

# %% [markdown]
# The H200's ridge point (bf16 dense ~750 TFLOP/s measured, over ~4.3 TB/s copy bandwidth) is about
# 175 FLOP/B. At `C = 64` KDA's forward does about 47 FLOP per byte by the count above, a quarter of
# that: on the memory side, but over 60 times the recurrence's intensity, and close enough to the ridge
# that neither the bandwidth nor the tensor cores alone set its time — it is bound by *latency and
# fusion*: how many launches, how many round trips of
# intermediates through HBM, and how long the one sequential loop over chunks takes. That is where a
# fused kernel can win, and (section 5) where ours still falls short of its targets.
#
# ## 2. Why the lower bound keeps `1/Γ` in bf16
#
# Inside a chunk, the score matrices have entries $\sum_c a_{ic} b_{jc}\,e^{G_{ic} - G_{jc}}$ with
# $G$ the cumulative log-decay. A tensor core wants this as one product
# $(a\,e^{G - r})(b\,e^{r - G})^\top$ for a reference point $r$ — i.e. $\Gamma a$ times $b/\Gamma$.
# The factor $e^{r - G_j}$ is $1/\Gamma$ relative to $r$, and it must fit the operand type:
# bf16 has fp32's exponent range, `exp(x)` is finite for `x < ln(3.39e38) = 88.7`.
#
# * Kimi Linear's gate $-e^{A}\,\mathrm{softplus}(z)$ is unbounded below: one strongly-forgetting
#   token can push $G$ down by hundreds, so $1/\Gamma$ overflows on any span of tokens — fla then
#   computes the diagonal sub-tiles element by element on CUDA cores.
# * K3's gate $g = g_{\min}\,\sigma(e^{A}(z + b))$ (Eq. 5) keeps every step above $g_{\min} = -5$.
#   Over a 16-token sub-tile with $r$ at its middle token, no factor exceeds $e^{8 \cdot 5} = e^{40}$;
#   even with $r$ at the first token it is $e^{75}$. Both fit: **all** sub-tiles, diagonal included,
#   run on tensor cores in bf16. FlashKDA takes $r$ at the middle, which allows $g_{\min} \ge -10$.

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
# **Experiment: where does the factoring break?** One 16×16 diagonal sub-tile, computed as a bf16
# product of the two factored operands (what a tensor core does) vs the direct float64 sum, for gates
# pinned at `g_min`, with the reference at the first token or at the middle one:

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
# With the first token as reference, anything below about `g_min = -5.9` overflows; the midpoint
# doubles the room (`-11`), which is why `flash_kda` accepts `lower_bound` in `[-10, 0)` and raises
# outside it. The errors that remain (~1e-2 per entry here, with random unnormalised data) are bf16's
# 8-bit mantissa, the same as any bf16 matmul. The off-diagonal sub-tiles of a row tile use the same
# middle reference: their rows are the diagonal's, and their columns `k_j exp(m − G_j)` come from
# earlier tokens, where `G_j ≥ m`, so every column factor is ≤ 1 and can only underflow. The rows'
# factor is at most `exp(7.5|g_min|)`, so what a flushed column factor loses is below
# `exp(7.5|g_min| − 87.3)`: 4.4e-6 at the bound −10, under 1e-8 from −9 on, beside entries up to 1.
#
# ## 3. The kernel design
#
# Six forward kernels and six backward kernels, each a `@triton.jit` function
# (`kda_<stage>_{fwd,bwd}_kernel`) with a launcher, one `autograd.Function` (`FlashKDAFunction`) and
# the public `flash_kda`, which validates (shapes always; NaN/inf with `check_values=True`, the
# default) and builds the chunk table on the host from the sequence lengths, once per shape (cached:
# a training loop at fixed shapes never copies it again). Chunk `C = 64`, sub-tile 16, `K` in tiles of
# 64 in the forward's gate kernel (32 in its backward), whole in the scores kernel, in two halves in the state kernels and in tiles
# of 64 in the intra backward, `V` in tiles of 16–64. The intra forward is four kernels: `gate_fwd`,
# `scores_fwd`, `inverse_fwd` and `wu_fwd` (`kda_intra_fwd`), or three when no backward follows (bf16:
# `inverse_wu_fwd` in place of the last two); then `state_fwd` walks the chunks and writes
# the output as it goes, and, when autograd records, also the chunk states `h` and `Ṽ`. Without a
# backward (bf16) the gate is also packed (section 3b). The backward
# runs the six backward kernels of the table and nothing else: it replays no forward kernel.
#
# | stage | grid | what it does | fused |
# |---|---|---|---|
# | `gate_fwd` | K tiles (64) × chunks × value heads | `g = lb·σ(exp(A_log)(z + b))` and its cumsum in the chunk, `G` (float32, summed in float64 for float32 intermediates; padded rows get `g = 0`) | gate activation |
# | `gate_fwd`, packed (no backward, bf16) | K tiles (128) × chunks × value heads | the same gate, walked row by row with `G` a running sum in registers: each row stored as the int16 code of `G − r` (`r` = `G` before its 16-row sub-tile), each sub-tile's last `G` to `E` (float32) | half `G`'s bytes |
# | `scores_fwd` | 16-row sub-tiles × chunks × value heads | for its sub-tile: q/k L2-normalised, β sigmoid, two exponentials per element at the sub-tile's middle reference (`exp2`), `KG`, `QG` and `W`'s right operand `Diag(β)ΓK`; then its row of 16×16 sub-tiles of `Diag(β)(ΓK)(K/Γ)ᵀ` and `(ΓQ)(K/Γ)ᵀ` on tensor cores, all at that middle reference: the rows' operands formed once, each earlier sub-tile's keys reloaded, normalised again and decayed into columns `k_j exp(m − G_j)` (factors ≤ 1, one exponential each); writes the strictly lower `L = Diag(β)StrictTril(…)` (float32), and `Aqk` | all elementwise prep, both score matrices |
# | `inverse_fwd` | chunks × value heads | the UT inverse `T = (I + L)⁻¹` by 16×16 blocks: the 4 diagonal blocks as one `[4, 16, 16]` batch by recursive doubling (2×2 → 4×4 → 8×8 → 16×16, two products per level; below), then the 6 blocks under them by block products; for bf16 intermediates on tensor cores (the doubling in three bf16 passes, the blocks in TF32), for float32 ones full fp32 (`ieee`); `T` stored in the intermediates' dtype | the whole inverse |
# | `wu_fwd` | chunks × value heads | `W = T·Diag(β)ΓK` (in place over its right operand), `U = T·Diag(β)V`, in column tiles of up to 64 | W/U |
# | `inverse_wu_fwd` (no backward, bf16) | chunks × value heads | `inverse_fwd`'s blocks put together in registers as one `[64, 64]` `T`, rounded to bf16 as the stored one would be, then `wu_fwd`'s products: the same bits, and `T` never goes to memory (nothing reads it without a backward) | the inverse and W/U |
# | `scores_fwd` with `REPLAY`, then `wu_fwd` (KCP's backward, chapter 03) | as above | from the saved `G` and `T`: only the prep (`KG`, `QG`, `W`'s operand) and `W`, `U` — no sub-tile scores, no inverse | one constexpr |
# | `state_fwd` | sequences × value heads × V tiles | the one sequential loop: per chunk `Ṽ = U − W S`, then the chunk's output `O = (ΓQ) S + Aqk Ṽ` while `S` and `Ṽ` are in registers, then `S ← γ_C S + (Γ_{i→C}K)ᵀ Ṽ`; `S` stays in registers (fp32) as two `[K/2, BV]` halves; when autograd records (`STORE_STATES` with `OUTPUT`) it also stores `S` before each chunk (`h`, bf16) and `Ṽ` for the backward, otherwise neither; at narrow V tiles (`PREFETCH`, below) the next chunk's `U` and decay are loaded one step ahead | the output, final state, the backward's `h` and `Ṽ` |
# | `state_fwd`, `STORE_STATES` without `OUTPUT` (KCP's backward, as `REPLAY`) | as above | the same loop storing `h` and `Ṽ`, and no output | same kernel, two constexprs |
# | `state_bwd` | sequences × value heads × V tiles | reverse loop: `dṼ = Aqkᵀ dO + (Γ_{i→C}K) dS'`, `dS ← γ_C dS' + (ΓQ)ᵀ dO − Wᵀ dṼ`, `dS` in two K halves; at V tiles of 16 the next chunk's decay is loaded one step ahead | d(initial state) |
# | `dqk_bwd` | K tiles × chunks × value heads | `d(ΓQ) = dO Sᵀ`, `d(Γ_{i→C}K) = Ṽ dS'ᵀ`, `dW = −dṼ Sᵀ`, the state-decay terms of dg | L2-norm rows, G chain |
# | `dwv_bwd` | chunks × value heads | `dAqk = dO Ṽᵀ`, dV and dβ through `U`, dT, then `dL = −Tᵀ dT Tᵀ` | inverse backward |
# | `intra_bwd` | 16-row sub-tiles × K tiles (64) × chunks × value heads | one sub-tile's rows of the gradients of both score matrices, as rows (sub-tiles before it) and as columns (sub-tiles after it), each side at one reference where every factor is ≤ 1, on `[16, 64]` tiles, the decay factors as `exp2`; dβ's score term as one partial sum per K tile; float32 operands (tf32 for bf16 inputs) | q/k norms from `dqk_bwd` |
# | `gate_bwd` | K tiles (32) × chunks × value heads | the reverse cumsum of dG in the chunk, the gate backward | dz, dA_log and ddt_bias partials |
# | `qk_norm_bwd` | token blocks × q/k heads | the GVA group's sum of the q and k gradients, the L2-norm backward (a row reduction over K), dβ's sigmoid backward | GVA sum, casts |
#
# *Why the output costs the state loop nothing.* The state kernel is one program per sequence, value
# head and V tile, walking the chunks one after another; each step waits on the previous state. The
# output's two products need only what that program holds at the step (`S` and `Ṽ`) plus `QG` and
# `Aqk`, which do not depend on the recurrence and can be loaded ahead. A separate output kernel needs
# the state of every chunk written out and read back: `h` is `B·NT·HV·K·V` bf16 (256 MiB at B4 T8192
# H16), `Ṽ` another 128 MiB. Measured on an H200 at B4 T8192 H16: the state kernel took 303.6 µs
# before and 303.9 µs with the output in it; the output kernel it replaced took 203 µs.
#
# *Registers vs shared memory.* The state (two `K/2 × BV` fp32 halves per program, `BV` the widest
# of 64, 32, 16 whose grid still gives about every SM a program) and all accumulators live in
# registers; `tl.dot` stages its operands through shared memory (Triton's software pipeline,
# `num_stages = 3` for the bf16 state loops, 2 for float32, whose third stage does not fit; at K = 256
# only one stage fits an H200's 227 KiB, and `launch_fitting` drops stages until a launch fits). The
# pipeline stages only loads that feed a `tl.dot`: the forward state loop's `U` (the accumulator `Ṽ`
# starts from) and both state loops' decay `γ_C` feed elementwise work on the chain, so each chunk
# waited for them. Loaded one chunk ahead by hand (`state_prefetch`), they took the inference
# forward's state stage from 0.871 to 0.653 ms at B1 T32768 H16 (V tiles of 16, 108 registers; with
# `h` and `Ṽ` stored 0.966 → 0.744, the backward's state loop 0.968 → 0.924) and from 0.245 to 0.201
# ms at B1 T8192 H32 (tiles of 32), but cost at tiles of 64 (0.308 → 0.330 ms at B4 T8192 H16, 248
# registers before the extra tile) and at 32 in the loops that also store per-chunk tensors (0.278 →
# 0.348 ms storing `h` and `Ṽ`, backward 0.265 → 0.314), so they run at 16, and at 32 in the inference
# forward (`flash_kda_h200_session13.json`). On this CPU profile the tile is `V` rounded up to a power
# of two (at most 64), so the `V = 16` tests take the prefetching loops and section 4's `V = 128` ones
# do not; `tests/test_flash_kda.py` runs both on the same inputs.
# Compiled offline for sm_90 with ptxas (`tests/sm90_compile.py`: `triton.compile(...,
# target=GPUTarget("cuda", 90, 32))` + `cuobjdump -res-usage`, no GPU needed, with every pointer
# marked 16-byte aligned as a GPU launch marks torch's allocations; without that mark the counts come
# out far too high, e.g. 255 registers and 152 B of stack for the state kernel that Nsight Compute
# measured at 100), the bf16 kernels at K = V = 128 spill only in the backward at 2 warps (the intra
# backward 160 B, dq/dk 1 KB, dW/dv 4 KB of stack per thread) and not at 4 or 8. Fewer warps mean
# more resident programs, so the chunk-parallel kernels' `num_warps` is left to `triton.autotune`,
# timed once per key (head counts, K, V, dtypes, and the grid size class `grid_log2`: the best warps
# at 1024 programs are not those at 8192; tuned at B1 T4096 H16, the forward at B4 T8192 H16 took
# 1.277 ms, tuned at its own grid 1.247) on the GPU at hand, except the scores kernel: 244 registers at 2
# warps (206 at 4, 158 at 8) left 4 programs, 8 warps, per SM, and Nsight Compute showed it
# latency-bound at that occupancy; capped at 168 registers (176 B spilled then, 96 B since its
# sub-tiles share one reference) 6 programs fit, and the
# forward got 1.8–4.3% faster at every shape but the smallest, B1 T4096 H16 (0.9%; a fixed launch for
# bf16 at K ≤ 128, `SCORES_LAUNCH`; a wider K or float32 intermediates would spill more under the cap,
# so there the warps are timed as for the others). One exception the other way: with float32
# intermediates (float32 and float16 inputs) the dW/dv kernel runs at 2 warps, untuned, because
# Triton 3.6's 4- and 8-warp builds of it read shared memory out of bounds at small tiles (K = V = 16:
# NaN gradients or a crash; found by `compute-sanitizer`, `flash_kda_h200_session17.json`).
#
# *What the forward keeps for the backward.* When autograd records (grad enabled and an input that
# requires grad), the forward keeps all the backward reads as saved tensors: the inputs, `G`, `T`,
# `Aqk`, and `W`, `KG`, `QG` and the state kernel's `h` and `Ṽ`. The backward used to rebuild those
# five (the scores kernel with `REPLAY` and the W/U products, then the state scan storing `h` and `Ṽ`): about
# 758 µs of kernels at B4 T8192 H16, against the 88 µs the forward's state kernel now spends storing
# `h` and `Ṽ`. What grows is what a layer holds between its forward and its backward: `h` (256 MiB at
# B4 T8192 H16) and `Ṽ`, `W`, `KG`, `QG` (128 MiB each), 768 MiB more per KDA layer. Because they are
# saved tensors, saved-tensor hooks see them: under non-reentrant activation checkpointing they live
# only while the layer is recomputed, and `save_on_cpu` offloads them (a first version kept them as
# attributes of the autograd context, freed one by one in the backward; hooks never saw them, so
# checkpointing left them on the GPU — `tests/test_flash_kda_keep.py` checks both). Saved tensors live
# until the backward returns, so its peak now holds `h`, `W`, `KG` and `QG` too, about 640 MiB more at
# B4 T8192 H16 by count; the committed sweep (section 5) measures the peak with saved tensors: 2959
# MiB against fla's 3858 there. An inference forward (`no_grad`, or no input
# requiring grad) stores none of it; the forward times of section 5 are such forwards. KCP's backward
# (chapter 03) still replays.
#
# *Precision.* For bf16 inputs the intermediates (`W`, `U`, `KG`, `QG`, `Aqk`, the chunk states) are
# bf16, forward and backward alike: tensor-core operands with float32 accumulators. So is the inverse
# `T` as stored: it is computed from a float32 `L` by block products on tensor cores (bf16x3 and TF32; section 3's inverse paragraphs), then rounded once to
# the bf16 that its products with `Diag(β)ΓK` and `Diag(β)V` use, and the backward reads that same `T`
# (storing it in float32, as before, cost 15 µs of the intra stage and 26 µs of `dwv_bwd` at B4 T8192
# H16, and 64 MiB of peak memory). The gate cumsum `G` and `L` stay float32, and so do the backward's
# intermediate gradients, except the two that only feed bf16
# products (`dS'` per chunk and `dṼ`). One kernel keeps float32 operands: `intra_bwd`. The gate
# gradient is a sum of large terms that cancel (every `e^{G_i - G_j}` appears with `+` for the row
# and `−` for the column); bf16 operands there gave 1.96e-2 on `ddt_bias`, over the 1e-2 bound, while
# tf32 (10 mantissa bits to bf16's 7) gives 3.7e-3 and is what bf16 inputs use. Two
# more cancellations are removed algebraically: the terms that depend on `G_last` go straight to
# `dg` as a prefix sum, and `Aqk`'s diagonal (no decay) is kept out of `dG`. float16 and float32
# inputs use float32 intermediates (products as `bf16x3`, three bf16 passes, ≈ fp32): float16
# cannot hold a diagonal sub-tile's factor `e^{8 |g_min|}`.
#
# *The UT inverse by recursive doubling.* `L` is strictly lower triangular, so each 16×16 diagonal
# block of `I + L` is `I + N` with `N` strictly lower, and a unit lower triangular matrix split in
# halves inverts by its halves:
#
# $$\begin{pmatrix} A & 0 \\ C & B \end{pmatrix}^{-1} = \begin{pmatrix} A^{-1} & 0 \\ -B^{-1} C A^{-1} & B^{-1} \end{pmatrix}
# = X - (X N_s) X, \qquad X = \begin{pmatrix} A^{-1} & 0 \\ 0 & B^{-1} \end{pmatrix},\;
# N_s = \begin{pmatrix} 0 & 0 \\ C & 0 \end{pmatrix}.$$
#
# `inverse_fwd` starts from the 2×2 diagonal blocks (their inverses are `I − N` there) and doubles
# three times (4×4, 8×8, 16×16), two products per level, on the four diagonal blocks at once as one
# `[4, 16, 16]` batch (`unit_lower_inverse`); the six blocks under them follow from the same formula
# at block level, `T_IJ = −T_II Σ L_IM T_MJ`. The intermediates are the inverses of smaller diagonal
# blocks and the products `B⁻¹C`, never powers of `N`, so they hold no numbers much larger than the
# answer.
#
# Until session 20 the kernel used the power form. `N` is nilpotent (`Nᵏ` moves the nonzeros `k`
# diagonals down, so `N¹⁶ = 0`, exactly, in floating point too), the factors commute, and the product
# telescopes, $(I + N)(I - N)(I + N^2)(I + N^4)(I + N^8) = I - N^{16} = I$: also six products. But
# where the entries of `N` are near 1 (near-identical consecutive keys, β near 1, little decay — a
# known hard input) `N⁸` has entries in the thousands that cancel back to `|T| ≤ 1`: float32 products
# lose digits, and the kernel needed a Newton step (two more products) for float32 intermediates and
# 3xTF32 (three TF32 products per product) for bf16 ones. The cell inverts a typical block and such a
# worst case both ways, against `torch.linalg.inv` in float64 and forward substitution in float32,
# and prints the largest number each form holds on the way:

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
# In float64 both forms match `torch.linalg.inv` to rounding: both are exact identities. In float32
# the typical block (entries of `N` ≤ 0.03) loses nothing either way; on the worst case the power form
# forms entries in the thousands and carries about 5e-5 where substitution carries 6e-8, and doubling,
# whose largest intermediate is about 1, stays at substitution's level (`tests/test_flash_kda.py`
# checks the kernel's own inverse on such a block, and on the GPU at bf16 intermediates' precision).
# So float32 intermediates need no Newton step any more, and bf16 ones can run the diagonal's products
# as three bf16 passes (`bf16x3`, about 16 significant bits) instead of three TF32 ones
# (`inverse_precisions`). Plain TF32 was faster still, but on the H200 it lost 2.2e-3 relative on the
# near-identical block (the test's bound is 4e-4, well below `T`'s own bf16 rounding of 3.9e-3), and
# identical consecutive keys are a known hard input, so it was dropped. On the H200, against the power
# form in the same calls (`flash_kda_h200_session20.json`):

# %%
s20 = json.loads(Path(results_path).with_name("flash_kda_h200_session20.json").read_text())
alone = s20["inverse_kernel_alone"]["rows"]
print("UT inverse kernel alone, us at 2 warps (the fastest for each); T's error vs float64 (relative, max):")
for variant, label in (("main bf16", "power form, 3xTF32 + TF32 blocks"), ("dbl bf16x3", "doubling, bf16x3 + TF32 blocks"),
                       ("dbl tf32", "doubling, TF32 (dropped)"),
                       ("main fp32 production (ieee + Newton)", "float32: powers + Newton step (autotuned)"),
                       ("dbl fp32 ieee", "float32: doubling, no Newton step")):
    rows = alone[variant]
    us = lambda s: rows[s].get("us_w2", rows[s].get("us_autotuned"))  # noqa: E731
    stress = ", ".join(f"{rows[s]['T_rel']:.1e} / {rows[s]['T_max_rel']:.1e}" for s in ("1x8192x16 run8", "1x8192x16 run16"))
    print(f"  {label:<42} B4 T8192 H16 {us('4x8192x16'):6.1f}  B8 T4096 H64 {us('8x4096x64'):6.1f} | identical keys: {stress}")
forward = s20["forward"]["session20_call2"]
for shape_key in ("4x8192x16", "8x4096x64", "1x32768x16", "4x4096x16"):
    before, after = (min(r["fwd_ms"] for r in forward[v][shape_key]) for v in ("main", "dbl_bf16x3"))
    inv_b, inv_a = (min(r["inverse_fwd"] for r in forward[v][shape_key]) for v in ("main", "dbl_bf16x3"))
    print(f"forward {shape_key}: {before:.3f} -> {after:.3f} ms ({after / before - 1:+.1%}), inverse {inv_b:.0f} -> {inv_a:.0f} us")
    assert after < before and inv_a < 0.93 * inv_b
adopted, power = alone["dbl bf16x3"], alone["main bf16"]
assert all(adopted[s]["T_max_rel"] < 1.01 * power[s]["T_max_rel"] for s in ("1x8192x16 run8", "1x8192x16 run16"))
assert s20["check"]["doubling dbl_bf16x3"] < 5e-3 and alone["dbl tf32"]["1x8192x16 run16"]["T_max_rel"] > power["1x8192x16 run16"]["T_max_rel"]

# %% [markdown]
# The committed code timed again at the end of the session (`production_check`): inverse 133 µs at B4
# T8192 H16 and 514 at B8 T4096 H64, forward 1.218 and 4.815 ms; the benchmark's check of outputs and
# gradients unchanged (largest 3.93e-3). `T`'s error on keys identical in runs of 8 or 16 is the power
# form's. The float32 path without its Newton step is as accurate as before (2.7e-8 relative against
# 1.2e-8) and faster. Where the kernel's time went before the change, at B8 T4096 H64
# (`inverse_split_us`): 561 µs in all, 265 with the diagonal blocks' products removed, 427 with the
# off-diagonal ones removed — the 18 TF32 passes of the diagonal were half the kernel. Forward
# substitution for the diagonal (15 dependent row steps) was cheaper than them alone but not beside the
# off-diagonal products (646 µs against 561); it is in the table of dropped designs.
#
# ### 3b. The packed gate (a forward with no backward)
#
# The scores kernel reads `G` (float32, 512 B per token and head) for its own rows and again for every
# earlier sub-tile's columns; the gate kernel writes it. Inside one 16-row sub-tile `G − r` lies in
# `[16 lb, 0]` (`r` = `G` before the sub-tile), so 16 bits of fixed point hold it to within
# `16 |lb| / 65534 / 2` = 6.1e-4 at `lb = −5`: a factor `exp(±6.1e-4)` on each decay term, beside bf16's
# rounding (up to 3.9e-3) of the products they enter. The gate kernel stores that int16 code and, per
# sub-tile, its last `G` (`E`, 1/16 of the rows, float32); the scores kernel rebuilds
# `G = r + step·(x − 32767)` and the state kernel takes the chunk's decay from `E`. A training forward
# keeps float32 `G`, which the backward reads. On the H200 (session 22), bf16 vs float64: the output
# without autograd 3.92e-3 against 3.93e-3 with it, final state 2.94e-3 against 2.93e-3.
#
# The first two versions lost: forming the sub-tiles' ends across a `[64, K]` tile's rows (masked
# sums, or a loop of four 16-row cumsums) exchanges values between threads in a kernel that is
# already near its arithmetic limit, and took the gate kernel from 444 µs to 965–1073 µs. Walking the
# chunk one row at a time, each thread keeping its columns' running sum, exchanges nothing:

# %%
s22 = json.loads(Path(results_path).with_name("flash_kda_h200_session22.json").read_text())
gate_rows = s22["gate_kernel_variants"]["rows"]
best = lambda mode, **kw: min(r["us"] for r in gate_rows  # noqa: E731
                              if r["mode"] == mode and all(r[k] == v for k, v in kw.items()))
print("gate kernel alone at B8 T4096 H64, us (best launch of each):")
for mode, label in ((0, "float32 G (training forward)"), (1, "int16 store of G, no sub-tile reference (store cost only)"),
                    (6, "ends by four masked sums over the [64, K] tile, E stored"), (7, "ends stored to E, read back"),
                    (2, "a loop of four 16-row cumsums, E stored"), (8, "row by row (adopted), E stored")):
    print(f"  {label:<58} {best(mode, store_e=int(mode not in (0, 1))):7.1f}")
assert best(8, store_e=1) < best(0) < min(best(m, store_e=1) for m in (2, 6, 7))
head = s22["head_check"]["kernels_us"]["8x4096x64"]
v2 = s22["packed_gate_first_versions"]["v2"]["kernels_us"]["8x4096x64"]
print("B8 T4096 H64 kernels, us, before -> packed (v2's scores kernel; the adopted codes have the same bytes):",
      {k.replace("kda_", "").replace("_kernel", ""): f"{head[k]:.0f} -> {v2[k]:.0f}" for k in head})
assert v2["kda_scores_fwd_kernel"] < 0.9 * head["kda_scores_fwd_kernel"]

# %% [markdown]
# ## 4. The check: Triton kernels vs the float64 recurrence
#
# On the CPU profile the kernels run under `TRITON_INTERPRET=1` in float32 (the interpreter has no bf16
# arithmetic), at a small size with GVA, an initial state and a tail chunk; the reference is
# chapter 01's `naive_recurrent_kda` in float64 with the gate, norms and sigmoid applied in torch.

# %% tags=["nbval-ignore-output"]
dt = torch.bfloat16 if device.type == "cuda" else torch.float32
B, T, H, HV = 2, check_T, 1, check_heads
Kc = Vc = check_dim if device.type == "cpu" else 128
gen = torch.Generator().manual_seed(seed)
r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
inputs = [r(B, T, H, Kc), r(B, T, H, Kc), r(B, T, HV, Vc), r(B, T, HV, Kc), r(B, T, HV),
          0.5 * r(HV), 0.5 * r(HV * Kc), r(B, HV, Kc, Vc)]
ours = [x.to(device, dt if i < 5 else torch.float32).requires_grad_() for i, x in enumerate(inputs)]
ref = [x.clone().requires_grad_() for x in inputs]
o, s = flash_kda(*ours[:7], initial_state=ours[7], output_final_state=True)
o_ref, s_ref = reference(*ref[:7], initial_state=ref[7])
do, ds = torch.randn_like(o_ref), torch.randn_like(s_ref)
((o.double().cpu() * do).sum() + (s.double().cpu() * ds).sum()).backward()
((o_ref * do).sum() + (s_ref * ds).sum()).backward()
errors = {"o": rel_rms_error(o_ref, o.cpu()), "final_state": rel_rms_error(s_ref, s.cpu())}
for name, a, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"), ref, ours):
    errors[name] = rel_rms_error(a.grad, x.grad.cpu())
tol_out, tol_grad = (5e-3, 1e-2) if device.type == "cuda" else (1e-4, 1e-4)
print(f"flash_kda ({dt}, B={B}, T={T}, H={H}, HV={HV}, K=V={Kc}) vs float64 naive, rel RMS error:")
for name, e in errors.items():
    tol = tol_grad if name.startswith("d") else tol_out
    print(f"  {name:12s} {e:.2e}  (tol {tol:.0e})")
    assert e <= tol, name

# %% [markdown]
# The same kernels, same answers as the layer's PyTorch operator — `KDALayer` calls `flash_kda` on
# CUDA and `chunk_kda` (through `reference_kda_op`) elsewhere — and the bad inputs of `k3lab.kda`
# raise the same errors (the shared `check_kda_inputs`):

# %%
for label, kwargs in (
    ("duplicate offsets", dict(cu_seqlens=torch.tensor([0, 4, 4, T]))),
    ("g shape", dict(g=torch.randn(1, T, HV, Kc + 1))),
):
    args = dict(q=ours[0][:1].detach(), k=ours[1][:1].detach(), v=ours[2][:1].detach(),
                g=ours[3][:1].detach(), beta=ours[4][:1].detach())
    args.update({k_: v_.to(device) for k_, v_ in kwargs.items()})
    try:
        flash_kda(A_log=ours[5].detach(), dt_bias=ours[6].detach(), **args)
    except ValueError as e:
        msg_fast = str(e)
    try:
        chunk_kda(**dict(args, g=-args["g"].abs()))
    except ValueError as e:
        msg_ref = str(e)
    print(f"{label}: {msg_fast}")
    assert msg_fast == msg_ref

# %% [markdown]
# ## 5. The benchmark on one H200
#
# `python -m k3lab.bench.flash_kda` checks correctness in bf16 first (against the float64 naive
# recurrence, fixed-length and varlen, T not a multiple of 64, GVA, initial state), measures the
# ceilings, then times ours and fla's `chunk_kda` (same settings: bf16, K = V = 128, lower bound −5,
# gate/norm/sigmoid fused, `safe_gate=True`) with `triton.testing.do_bench` (the forward under
# `no_grad`, so it stores nothing for a backward), and writes `data/results/flash_kda_h200.json`. The
# committed file covers all 27 of the issue's shapes (B ∈ {1, 4, 8}, T ∈ {4K, 8K, 32K},
# H ∈ {16, 32, 64}), all on the kernels of 8a6a5ac (the packed gate of section 3b and, with no
# backward, the fused inverse + W/U): 21 timed in session 22, and six (marked `+`) in session 23 at
# HEAD c9cdd3d, whose kernels are the same: the four that session 22's GPU budget did not reach
# (B1 T32768 H16/H32/H64, B8 T32768 H32), and B1 T4096 H16/H32 again, with fla live beside them.
# fla autotunes for minutes per new shape, so the sweep timed ours only and took fla's times from the live runs of the same benchmark on
# the same GPU model (`--fla-from`), per shape the newest; the last column says which run. fla ran
# out of GPU memory at B8 T32768 H64; ours ran there.

# %%
result = json.loads(Path(results_path).read_text())
hw, cases = result["hardware"], result["cases"]
ver = result["versions"]
print(f"{hw['name']} | torch {ver['torch']} | triton {ver['triton']} | {result['date']}")
print(f"ceilings measured: bf16 matmul {hw['bf16_matmul_tflops']:.0f} TFLOP/s, copy {hw['copy_gbps']:.0f} GB/s")
print(textwrap.fill("notes: " + result["notes"], 100))
issue_shapes = sorted(itertools.product((1, 4, 8), (4096, 8192, 32768), (16, 32, 64)))
swept = sorted((c["B"], c["T"], c["H"]) for c in cases)
no_fla = [(c["B"], c["T"], c["H"]) for c in cases if c["fla_fwd_ms"] is None]
assert swept == issue_shapes and no_fla == [(8, 32768, 64)]
fmt = lambda x, f: "n/a".rjust(int(f.split(".")[0])) if x is None else format(x, f)  # noqa: E731


def speed_table(rows):
    """Print (case, run label) rows of the benchmark's records as one table."""
    print(f"\n{'B':>2} {'T':>6} {'H':>3} | {'ours fwd':>8} {'fla fwd':>8} {'x':>5} | {'ours f+b':>8} {'fla f+b':>8} "
          f"{'x':>5} | {'TFLOP/s':>7} {'GB/s':>6} | {'ours MiB':>8} {'fla MiB':>8} | fla run")
    for c, run in rows:
        gbps = fwd_bytes(c["B"], c["T"], c["H"], c["K"], c["K"]) / c["ours_fwd_ms"] / 1e6
        print(f"{c['B']:>2} {c['T']:>6} {c['H']:>3} | {c['ours_fwd_ms']:8.3f} {fmt(c['fla_fwd_ms'], '8.3f')} "
              f"{fmt(c['speedup_fwd'], '5.2f')} | {c['ours_fwd_bwd_ms']:8.3f} {fmt(c['fla_fwd_bwd_ms'], '8.3f')} "
              f"{fmt(c['speedup_fwd_bwd'], '5.2f')} | {c['tflops_fwd']:7.1f} {gbps:6.0f} | "
              f"{fmt(c['ours_peak_mib'], '8.0f')} {fmt(c['fla_peak_mib'], '8.0f')} | {run}")


session23 = sorted((c["B"], c["T"], c["H"]) for c in cases if c["kernels"].startswith("c9cdd3d"))
assert session23 == [(1, 4096, 16), (1, 4096, 32), (1, 32768, 16), (1, 32768, 32), (1, 32768, 64), (8, 32768, 32)]
assert all(c["kernels"].startswith(("8a6a5ac", "c9cdd3d")) for c in cases)
speed_table([(c, (c.get("fla_times_from") or "-")[:16].replace("T", " ")
              + (" +" if (c["B"], c["T"], c["H"]) in session23 else "")) for c in cases])
timed = [c for c in cases if c["fla_fwd_ms"] is not None]
ratios = [(c["speedup_fwd"], c["speedup_fwd_bwd"]) for c in timed]
fast_fwd = sorted((c["B"], c["T"], c["H"]) for c in timed if c["speedup_fwd"] >= 1.5)
print(f"\nforward+backward {min(b for _, b in ratios):.2f}-{max(b for _, b in ratios):.2f}x at all {len(timed)} shapes "
      f"with an fla time; forward {min(f for f, _ in ratios):.2f}-{max(f for f, _ in ratios):.2f}x, >= 1.5x at {fast_fwd}")
assert len(timed) == 26 and all(c["ours_peak_mib"] < c["fla_peak_mib"] for c in timed)
assert all(f >= 1.5 and b >= 1.2 for f, b in ratios)
# The smallest shapes cost more on the host (Python launching the Triton kernels and, for the
# backward, the autograd graph) than on the GPU, or about as much, so their times measure the host
# and swing between calls and machines. Session 22's sweep timed B1 T4096 H32's forward at 0.605 ms,
# more than B1 T4096 H64's 0.589 for half its GPU work. In session 23 one call timed it at 0.345 ms,
# the same as one CUDA graph replay of the forward (0.343 ms: the kernels alone, no launches from
# Python), and the next at 0.468 ms, with fla at 1.636 ms in the same call (3.49x; the table keeps
# fla's faster 0.775 from an earlier call, and ours' slower 0.468: 1.66x). In session 21 the same
# benchmark timed B1 T4096 H16 at 0.348 ms forward, 2.392 ms forward+backward, with fla live beside
# it (1.099 and 4.937 ms: 3.16x and 2.06x), and a profile of the host there (`host_time_small_shapes`
# in flash_kda_h200_session21.json) found 0.36 ms of host time per forward at H16 and 0.58 ms at
# B1 T4096 H32, against 0.21 and 0.35 ms of GPU kernels. Earlier calls (`small_shapes_host_bound` in
# flash_kda_h200_session14.json, `small_shapes_host_time` in flash_kda_h200_session16.json) found
# the same. Below, four timings from session 11's calls (older kernels,
# `flash_kda_h200_session11_small.json`) and the same-call runs of sessions 21 and 23
# (`flash_kda_h200_session23.json`):
host_bound = [(1, 4096, 16), (1, 4096, 32), (1, 4096, 64), (1, 8192, 16), (4, 4096, 16)]
assert all(b >= 1.2 for (f, b), c in zip(ratios, timed) if (c["B"], c["T"], c["H"]) not in host_bound)
again = json.loads(Path(results_path).with_name("flash_kda_h200_session11_small.json").read_text())
s21 = json.loads(Path(results_path).with_name("flash_kda_h200_session21.json").read_text())
s23 = json.loads(Path(results_path).with_name("flash_kda_h200_session23.json").read_text())
same_call = s21["same_call_with_fla_small"]["cases"] + s23["same_call_with_fla_small"]["cases"]
speed_table([(c, "session 11") for c in again["cases"]]
            + [(c, f"same call, session {21 if c in s21['same_call_with_fla_small']['cases'] else 23}") for c in same_call])
assert all(c["speedup_fwd_bwd"] >= 1.2 for c in again["cases"] + same_call)
assert all(c["speedup_fwd"] >= 3 for c in same_call)
profile = s23["host_profile_1x4096x32"]
print("session 23, B1 T4096 H32 forward, us:", {n: {k: profile[n][k] for k in ("do_bench_us", "cuda_graph_replay_us")}
                                                 for n in ("call_1", "call_2")})
assert all(abs(profile[n]["do_bench_us"] / profile[n]["cuda_graph_replay_us"] - 1) < 0.02 for n in ("call_1", "call_2"))
previous = {(c["B"], c["T"], c["H"]): c for c in
            json.loads(Path(results_path).with_name("flash_kda_h200_session21_sweep.json").read_text())["cases"]}
gpu_bound = [c for c in cases if (c["B"], c["T"], c["H"]) not in host_bound]
for mode, lo, hi in (("ours_fwd_ms", -0.08, -0.04), ("ours_fwd_bwd_ms", -0.01, 0.01)):
    change = [c[mode] / previous[c["B"], c["T"], c["H"]][mode] - 1 for c in gpu_bound]
    print(f"{mode} against the previous sweep, {len(change)} re-timed shapes the GPU bounds: "
          f"{min(change):+.1%} to {max(change):+.1%}")
    assert lo < min(change) and max(change) < hi

# %% [markdown]
# The sweep pairs ours with fla from other calls. Two earlier live runs timed both in one call, at 14
# shapes (`flash_kda_h200_session10_fla.json`: the 11 shapes that had no live fla time before;
# `flash_kda_h200_session10_h16.json`: three H16 shapes again), on the kernels before the scores
# kernel's capped launch and the state loops' prefetch; ours in the sweep is faster than ours in those
# calls at every one of them that the GPU bounds (all but the host-bound ones):

# %%
per_call = []
for name in ("flash_kda_h200_session10_fla.json", "flash_kda_h200_session10_h16.json"):
    run = json.loads(Path(results_path).with_name(name).read_text())
    per_call += [(c, f"same call, {run['date'][11:16]} UTC") for c in run["cases"]]
speed_table(per_call)
sweep = {(c["B"], c["T"], c["H"]): c for c in cases}
change = [sweep[c["B"], c["T"], c["H"]]["ours_fwd_ms"] / c["ours_fwd_ms"] - 1 for c, _ in per_call
          if (c["B"], c["T"], c["H"]) not in host_bound]
print(f"ours' forward in the sweep against these calls, {len(change)} shapes the GPU bounds: "
      f"{min(change):+.1%} to {max(change):+.1%}")
assert max(change) < 0 and all(c["speedup_fwd_bwd"] >= 1.2 for c, _ in per_call)
assert sorted((c["B"], c["T"], c["H"]) for c, _ in per_call if c["speedup_fwd"] >= 1.5) == [
    (1, 4096, 16), (1, 4096, 64), (1, 8192, 16)]

# %% [markdown]
# **Reading the tables.** The kernels are correct in bf16 with margin: the benchmark's GPU check
# (float64 reference, fixed-length and varlen) passed in the sweep's call, with outputs 3.93e-3
# (bound 5e-3; 3.92e-3 without autograd), final state 2.93e-3 and every gradient ≤ 3.71e-3 (bound
# 1e-2). Forward+backward clears the issue's 1.2x floor at every shape (1.28x at the lowest, B8 T4096
# H64 and B1 T32768 H32); peak memory is 23% below fla's at every shape. The forward clears the 1.5x
# floor at all 26 shapes with an fla time: 1.51–1.55x for H64, B1 T8192 H32 and B1 T32768, 1.61–1.65x
# for H16 and H32 at B ≥ 4, and 1.64–2.44x at the five host-bound shapes. Against session 21's sweep, the
# shapes the GPU bounds (all but the five host-bound ones) now take 4.3–6.5% less time forward: the
# packed gate and the fused inverse + W/U. FlashKDA's 1.8x remains a goal for the shapes the GPU bounds.
#
# The rows re-timed here against session 21's sweep (`flash_kda_h200_session21_sweep.json`) are the
# packed gate together with the fused inverse + W/U, which that sweep predates: a forward with no
# backward runs the inverse and W/U as one kernel (`inverse_wu_fwd`, table above); in one call beside
# the split kernels (`inverse_fused_into_wu` in flash_kda_h200_session21.json) it took the forward
# 1.3–1.7% lower, and with `T` stored, as a training forward needs it, it was 0.1–0.3% slower than the
# split, so training keeps the split:

# %%
ab = s21["inverse_fused_into_wu"]
print(f"{'shape':>11} | split (inverse + W/U) | fused, T stored | fused, T not stored (adopted without a backward)")
for shape_key, runs in ab["fwd_ms"].items():
    split, stored, adopted = (min(runs[v]) for v in ("split", "fused", "fused_noT"))
    print(f"{shape_key:>11} | {split:8.3f} ms | {stored:8.3f} ms ({stored / split - 1:+.1%}) | "
          f"{adopted:8.3f} ms ({adopted / split - 1:+.1%})")
    assert adopted < 0.99 * split and stored > split
kernel_us = ab["kernels_us_8x4096x64"]
print("B8 T4096 H64 kernels, us:", {v: {k.replace("kda_", "").replace("_kernel", ""): t for k, t in kt.items()}
                                   for v, kt in kernel_us.items()})
assert ab["fused_vs_split_max_rel"] == 0.0

# %% [markdown]
# **Identical keys, and what bf16 costs the output.** Keys repeated in runs that cross the 16-row
# sub-tiles (runs of 17–100 tokens at offsets 0, 5, 13, weak decay, β ≈ 0.95) are the hardest input
# for `T`'s blocks under the diagonal: in TF32 they reach 5.5e-3 of `T`'s largest entry, against
# 2.0e-3 in three bf16 passes (`T`'s own bf16 rounding is 3.9e-3). The output does not see the
# difference: its error against float64 is the same with either, and the same as fla's on the same
# inputs. It is 0.6% on ordinary keys with these gates and grows to about 2% with the runs' length,
# while float32 intermediates stay near 4e-5: on such inputs the output's error is bf16's rounding of
# the pseudo-values `Ṽ`, whose telescoping sums cancel along a run, not the inverse. So the blocks stay
# in TF32.

# %%
runs = s21["identical_key_runs_crossing_subtiles"]["rows"]
worst = {p: max(r[f"T_max_rel_{p}_blocks"] for r in runs) for p in ("tf32", "bf16x3")}
print(f"T's largest error over {len(runs)} runs/offsets: blocks in TF32 {worst['tf32']:.1e}, in bf16x3 {worst['bf16x3']:.1e}")
print(f"{'run':>4} {'offset':>6} | o vs float64: TF32 blocks  bf16x3 blocks  float32 intermediates  fla")
for r in s21["identical_key_runs_output_error"]["rows"]:
    print(f"{r['run']:>4} {r['offset']:>6} | {r['ours_tf32_blocks']:21.2e} {r['ours_bf16x3_blocks']:14.2e} "
          f"{r['ours_float32_intermediates']:22.2e} {r['fla']:8.2e}")
    assert r["ours_tf32_blocks"] < 1.05 * r["fla"] and r["ours_float32_intermediates"] < 1e-4
assert worst["tf32"] > 2 * worst["bf16x3"]

# %% [markdown]
# Designs for the forward that were measured on the H200 and dropped, with the forward's device time
# per kernel at B4 T8192 H16 for scale (gate 110, scores 491, inverse 133, W/U 170, state 303 µs;
# the `session…` files are in `data/results/`, named `flash_kda_h200_session<N>.json`):
#
# | design | what it would save | measured | why it lost | data |
# |---|---|---|---|---|
# | apply `T` in the state loop: `Ṽ = T (Diag(β)V − (Diag(β)ΓK) S)`, no `W`, `U` | the `wu_fwd` kernel | intra 1.010 → 0.839 ms, state 0.305 → 0.492 ms | one more product on the sequential chain; a third pipeline stage no longer fits | session13 |
# | fold `T` into `KG` and `Aqk` (`TᵀKG`, `Aqk T`) | the `wu_fwd` kernel | intra −37 µs, state +161 µs | `V` and `β` become elementwise operands the pipeline does not stage | session13 |
# | rebuild `G` from the bf16 `z` in the scores kernel | the float32 `G` reads | intra 944 → 1407 µs | sigmoids and cumsums cost more than the reads in a register-capped kernel | session14 |
# | one time segment's state scan on a second stream beside the next segment's intra stage | idle SMs | no faster at any shape | the intra kernels fill every SM, and both stages together want more bandwidth than there is | session14 |
# | one intra kernel per chunk: gate, scores with `L` in registers, inverse, `W`, `U` | launches, round trips of `L` and `T` | 2.3x slower | 255 registers a thread (offline sm_90) | `session_11_experiments` (stages file) |
# | the state held transposed (`Sᵀ`), chained operands read from registers | operand moves on the chain | slower at 5 of 6 shapes (B8 T4096 H64 5.438 → 5.712 ms), 3% faster at B1 T32768 H16 | — | `session_11_experiments` |
# | gate, norms and a whole chunk's scores in one program | `G` never read back | 1183 µs against about 627 (gate + scores) | 255 registers a thread | session16 |
# | the scores kernel walking a chunk's four sub-tiles, earlier keys kept in registers | the column reloads | 591 against 513 µs (best launch of each) | — | session16 |
# | each scores program inverts its own diagonal block of `I + L` | the inverse's diagonal work | inverse −60 µs, scores +269; forward 1.253 → 1.449 ms | the register-capped scores kernel pays more than the inverse saves | session17 |
# | the inverse's off-diagonal blocks by 32-row halves (4 products deep, not 6) | chain depth | 146.5 → 149.1 µs | the chain's depth is not what bounds it | session17 |
# | the state scan at one or two pipeline stages (two programs per SM) | idle SMs in the last wave | 1.5x slower at H64 | the scan needs its loads staged ahead; co-resident programs do not hide them | session17 |
# | the scores kernel at 32-row sub-tiles | two thirds of the column reloads | 2.5% faster, about 1% of the forward | valid only down to `g_min` = −5.5 (float32's range) | session17 |
# | the state scan at V tiles of 128 (`W`, `QG`, `KG`, `Aqk` read once per head) | re-reads across V tiles | 1516 against 1211 µs at B8 T4096 H64 | three stages do not fit; spills at two | session18 |
# | `L` in float16, the zero blocks above the diagonals of `Aqk` and `T` never stored (element-wise masks) | bytes | forward 4.85 → 5.76 ms at B8 T4096 H64 (state 1205 → 1752 µs) | an element-wise triangular mask costs the loads their vector width | session19 |
# | the same with masks by 16×16 blocks, `L` in float32 | bytes | readers −5 to +3 µs; scores +58 µs (B4) and +226 (B8 T4096 H64) | dropping its zero stores alone slows the register-capped scores kernel | session19 |
# | the gate's cumsum in float64 for bf16 intermediates too | (accuracy) | gate 109 → 163 µs, 436 → 647 at B8 T4096 H64: forward +4% | bf16 rounds at 2⁻⁸ anyway, so only float32 intermediates sum in float64 | session19 |
# | `L` stored as float16 (no masks) | 256 B per token and head between the scores and inverse kernels | inverse 146 → 242 µs, scores 493 → 514; forward 1.232 → 1.349 ms (B8 T4096 H64: 4.865 → 5.299) | the inverse's float16 loads cost more than the bytes they save | session20 |
# | the diagonal inverses by forward substitution (15 dependent row steps) | the diagonal's tensor-core passes | inverse 146 → 167 µs, 560 → 645 at B8 T4096 H64 (alone, without the off-diagonal products, 317 against the power form's 427 there) | slower beside the off-diagonal products; recursive doubling (adopted) took it to 133 / 514 | session20 |
# | the packed gate's sub-tile ends formed across a `[64, K]` tile's rows (masked sums, or four 16-row cumsums) | — (the adopted packed gate's bytes) | gate 444 → 965–1073 µs at B8 T4096 H64; forward 4.73 → 5.07–5.17 ms | threads exchange values in a kernel near its arithmetic limit; the row-by-row walk (adopted) took 411 µs | session22 |
# | `inverse_wu_fwd` for training too, storing `T` | a launch and `T`'s read back | 1220 against 512 + 698 µs at B8 T4096 H64; training forward +0.1–0.3%, forward+backward unchanged | nothing to gain: `T` still goes to memory; the split stays for training | session21 |
# | the diagonal's doubling in plain TF32 | two of the three bf16 passes | inverse 109 µs (bf16x3: 134), 424 at B8 T4096 H64 (510); forward −3.0% / −2.7% | 2.2e-3 relative on a near-identical-key block on the H200 (bound 4e-4); a sweep of it is `flash_kda_h200_session20_tf32_sweep.json` | session20 |
#
# fla's own times move between runs: at B1
# T4096 H16 its forward took 0.799 ms in one call and 1.487 ms in another (right after its
# autotuning); at B1 T8192 H16 its forward+backward took 3.125 and 4.123 ms in two runs.
#
# **Where the time goes** at B4 T8192 H16: device time per kernel call from `torch.profiler` on the
# same H200 model, bf16 (`session_8_experiments` in `data/results/flash_kda_h200_stages.json`). The
# forward as it was before the scores kernel's capped launch (Nsight Compute timed that kernel at
# 563 µs, the capped one made the whole forward 52 µs faster), beside the forward of
# 944d9aa and fla-core 0.6.0's (both from `session_7_experiments`), and the forward at B1 T32768 H32:
# %%
# The profiles were checked against the times of the four baseline shapes from their session (`flash_kda_h200_latest.json`, fla-less rows aside).
latest = json.loads(Path(results_path).with_name("flash_kda_h200_latest.json").read_text())
stages = json.loads(Path(results_path).with_name("flash_kda_h200_stages.json").read_text())
s7, s8 = stages["session_7_experiments"], stages["session_8_experiments"]
ours_f = s8["forward profile B4 T8192 H16 at 7d3c5cb (us)"]
before_f = s7["output fused into the state kernel (944d9aa)"]["forward-only profile B4 (us)"]
fla_f = s7["forward-only profile B4, merged (us)"]["fla 0.6.0"]
parts = lambda d: [(n, t) for n, t in d.items() if n not in ("total", "note")]  # noqa: E731
cols = (ours_f, before_f, fla_f)
print("forward only, us per call:")
print(" | ".join(f"{h:<26}" for h in ("ours (7d3c5cb)", "ours (944d9aa)", "fla-core 0.6.0")).rstrip())
for row in itertools.zip_longest(*map(parts, cols), fillvalue=("", None)):
    print(" | ".join(f"{n:<20}{'' if t is None else format(t, '6.0f'):>6}" for n, t in row))
print(" | ".join(f"{'total':<20}{d['total']:6.0f}" for d in cols))
assert all(abs(sum(t for _, t in parts(d)) - d["total"]) < 1 for d in cols)
assert abs(ours_f["total"] / 1e3 - latest["cases"][1]["ours_fwd_ms"]) < 0.02 * ours_f["total"] / 1e3
# Only the solve kernel changed between the two forwards (the batched inverse).
same = (("scores_fwd", "scores"), ("state_fwd", "state_fwd + output"), ("gate_fwd", "gate_fwd"))
assert all(abs(ours_f[a] / before_f[b] - 1) < 0.01 for a, b in same)
inverse = s8["UT inverse as batched products (7d3c5cb)"]
print("the batched inverse, solve kernel: "
      + ", ".join(f"{n[10:]} {d['before']:.1f} -> {d['after']:.1f} us" for n, d in inverse.items()))
ours_intra = sum(ours_f[n] for n in ("gate_fwd", "scores_fwd", "solve_fwd"))
fla_intra = fla_f["total"] - fla_f["fwd_h"] - fla_f["fwd_o"]
print(f"before the state scan: ours {ours_intra:.0f}, fla {fla_intra:.0f} with its fills, "
      f"{fla_intra - fla_f['fills x2']:.0f} without; the scan: ours {ours_f['state_fwd']:.0f}, "
      f"fla {fla_f['fwd_h']:.0f} + {fla_f['fwd_o']:.0f}")
assert ours_intra < fla_intra - fla_f["fills x2"] and ours_f["state_fwd"] < fla_f["fwd_h"] + fla_f["fwd_o"]

big = s8["forward profile B1 T32768 H32 at 8a5415d (us, solve before the batched inverse)"]
b4_then = dict(ours_f, solve_fwd=inverse["solve_fwd B4 T8192 H16"]["before"])  # the same code as `big`
work = (1 * 32768 * 32) / (4 * 8192 * 16)
print(f"\nforward at B1 T32768 H32 ({work:.0f}x B4's work), at 8a5415d (before the batched inverse), us:")
for n, t in parts(big):
    print(f"  {n:<12}{t:7.1f}  {t / b4_then[n]:.2f}x B4's")
print(textwrap.fill(big["note"], 100))
assert max(parts(big), key=lambda p: p[1] / b4_then[p[0]])[0] == "state_fwd"
big_now = big["total"] - big["solve_fwd"] + inverse["solve_fwd B1 T32768 H32"]["after"]
assert abs(big_now / 1e3 / latest["cases"][2]["ours_fwd_ms"] - 1) < 0.02

# %% [markdown]
# At B4 the forward took 1379 µs of kernel time then against fla's 1729. Before the state scan ours is
# ahead too (1076 µs in gate, scores and solve; fla 1124 in its seven kernels there — gate cumsum, two
# L2 norms, sub-chunk scores, fused inverse, W/U recompute, β sigmoid — and 1186 with its two fills),
# and in the scan ours takes 303 µs for the states and the output together, fla 296 + 247 in two
# kernels. The largest forward kernel is the scores kernel (565 µs then). At B1 T32768 H32 the state
# kernel is what scales worse: twice B4's work in 3.15x the time, because its grid is only 128 programs
# (one per head and V tile of 32, for 132 SMs) of 512 chunk steps each, about 1.9 µs a step, one after
# another.
#
# The forward+backward at B4 was profiled at 8a5415d (the forward keeping what the backward needs),
# before the batched inverse; with the solve kernel's time after it, the sum is checked against the
# timed 6.575 ms. Then a sweep of the state kernel's V tile and warps from the same session, and the one
# change that was measured and dropped:

# %%
kept = s8["forward kept for the backward (8a5415d)"]
prof = kept["fwd+bwd profile B4 T8192 H16 (us)"]
# The profiling script's own .grad accumulation: do_bench resets the gradients, so the timing has none.
kernels = {n: t for n, t in prof.items() if not n.startswith("torch adds")}
print("forward+backward at B4, us per call (8a5415d):")
for n, t in kernels.items():
    print(f"  {n:<36}{t:7.1f}")
print(textwrap.fill(kept["note"], 100))
assert not any("replay" in n or "x2" in n for n in kernels)  # each forward kernel runs once
solve = inverse["solve_fwd B4 T8192 H16"]
sum_now = sum(kernels.values()) - solve["before"] + solve["after"]
fb_now = latest["cases"][1]["ours_fwd_bwd_ms"]
print(f"sum {sum(kernels.values()) / 1e3:.3f} ms; with the solve kernel at {solve['after']:.1f} us "
      f"{sum_now / 1e3:.3f} ms; timed forward+backward at 7d3c5cb {fb_now:.3f} ms")
assert abs(sum_now / 1e3 / fb_now - 1) < 0.02

state_sweep = s8["state_fwd sweep (direct launch, ms; inf = output only, grad = output + h and V~ stored; 3 stages)"]
print("\nstate_fwd, fastest V tile and warps (ms; inference forward / forward that stores h and V~):")
for shape in ("4x8192x16", "1x32768x32"):
    best = {mode: min((t, n[len(mode) + 1:]) for n, t in state_sweep[shape].items() if n.startswith(mode))
            for mode in ("inf", "grad")}
    print(f"  {shape}: " + " / ".join(f"{n} {t:.3f}" for t, n in best.values()))
    assert {n for _, n in best.values()} == {"BV64 w4" if shape == "4x8192x16" else "BV32 w4"}
print(textwrap.fill(f"BV128: {state_sweep['BV128']}; {state_sweep['verdict']}", 100))

((variant, rejected),) = s8["rejected"].items()
us, ms = rejected["scores_fwd B4 us"], rejected["fwd ms B4"]
print()
print(textwrap.fill(f"rejected: {variant}: scores {us['main']} -> {us['variant']} us, forward "
                    f"{ms['main']} -> {ms['variant']} ms", 100))
assert us["variant"] > us["main"] and ms["main"] == round(latest["cases"][1]["ours_fwd_ms"], 3)

# %% [markdown]
# Without the replays the backward's kernels at B4 are, largest first, `intra_bwd` (1884 µs), `dqk_bwd`
# (1136) and `dwv_bwd` (1099). The forward's state kernel takes 392 µs here against 303 in an inference
# forward: 88 µs for storing `h` and `Ṽ`, against about 758 µs of replays the backward no longer runs.
# A 1.2x forward+backward at B4 needs ≤ 6.910 ms (fla 8.292): ours took 6.174 in the committed sweep.
# In both modes the launcher's state tile (64 at B4, 32 at B1 T32768 H32, 4 warps) was the fastest; 128
# does not fit in shared memory.
#
# What made the current kernels. The intra forward works sub-tile by sub-tile: each 16-row block of q
# and k gets two exponentials per element, at the block's middle reference (bounded by `exp(8|lb|)`,
# the "1/Γ in bf16" of section 2), and the four diagonal inverses ran as one stacked substitution (15
# dependent steps instead of 60): 2x faster than the K-tiled kernel before it. That one kernel per
# chunk was then split three ways: the gate, the scores with one program per 16-row sub-tile (four
# times the programs; each re-normalises and re-decays the keys of the sub-tiles before it), and the
# solve per chunk, which reads `L` back from memory. The forward went from 1.909 to 1.697 ms at B4
# (`do_bench`, before exp2 was merged), the intra kernels of the forward and the backward's replay
# together from 1822 to 1628 µs. The state kernels hold the state as two `[K/2, BV]` halves, two
# independent products per step: 0.62 → 0.31 ms forward at B4; the output then moved into that loop
# (section 3): 1.688 → 1.484 ms forward, 7.559 → 7.356 ms forward+backward. The intra backward runs
# one program per 16-row sub-tile and K tile of 64: its rows against the sub-tiles before it at one
# reference (the gate just before the sub-tile), as columns against the sub-tiles after it at another
# (its last row), so every factor is ≤ 1; dβ comes from the row side's dk (no score products). Four
# times the programs of one per chunk, each small enough for several per SM: 4.71 → 2.75 ms with the
# gate and norm kernels. Its decay factors then moved to `exp2` (`exp_ftz`: one `MUFU.EX2` per
# element, where `tl.exp` adds a fix-up for results below 2^-126): 2149 → 1898 µs. The rows' inverse
# norms are computed once, by dq/dk, and the chunk-state gradients and `dṼ` are stored as the bf16
# operands they become (−0.08 ms in the state backward, 384 MiB less peak at B4). Then the forward
# kept for the backward what the backward had replayed (section 3: about 758 µs of kernels saved for
# 88 µs of stores), and the diagonal inverses became six batched products
# (section 3: solve 486 → 385 µs). Those two took B4 from 1.484 to 1.376 ms forward and from 7.356
# to 6.575 ms forward+backward; storing dW, dAqk and dAkk in bf16 then took it to 6.372. The tiles
# come from tile sweeps on the GPU
# (`flash_kda_h200_stages.json`). The kernels remain bound by latency, not by compute or bandwidth
# (the TFLOP/s and GB/s columns are far under both ceilings); the largest pieces are still the intra
# backward and the two per-chunk gradient kernels.

# %%
peak, bw = hw["bf16_matmul_tflops"], hw["copy_gbps"] / 1e3  # TFLOP/s, TB/s
x = np.logspace(0, 4, 200)
fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.loglog(x, np.minimum(peak, x * bw), "k-", lw=1, label=f"roofline ({peak:.0f} TFLOP/s, {bw:.1f} TB/s)")
for c in cases:
    flops, nbytes = fwd_flops(c["B"], c["T"], c["H"], c["K"], c["K"]), fwd_bytes(c["B"], c["T"], c["H"], c["K"], c["K"])
    ai = flops / nbytes
    ax.plot(ai, flops / c["ours_fwd_ms"] / 1e9, "o", color="C0")
    if c["fla_fwd_ms"] is not None:
        ax.plot(ai * 1.04, flops / c["fla_fwd_ms"] / 1e9, "s", color="C1")
ax.plot([], [], "o", color="C0",
        label=f"ours, forward, {len(cases)} shapes (sweep, current kernels, {result['date'][11:16]} UTC)")
ax.plot([], [], "s", color="C1", label=f"fla, forward, {len(timed)} shapes (live runs, its notes)")
# Every shape has about the same intensity (FLOPs and bytes both scale with B T H), so the points stack
# in one column; the speed table above gives them shape by shape.
ax.set(xlabel="arithmetic intensity (useful FLOPs / compulsory bytes)", ylabel="TFLOP/s",
       title="KDA forward on one H200 vs the roofline", ylim=(1, 2000))
ax.legend(fontsize=7, loc="upper left")
plt.show()
n_fwd, n_fb = sum(f >= 1.5 for f, _ in ratios), sum(b >= 1.2 for _, b in ratios)
print(f"floors at the {len(ratios)} shapes with an fla time: forward >= 1.5x at {n_fwd}, "
      f"forward+backward >= 1.2x at {n_fb}; fla could not run the other {len(cases) - len(ratios)}")
print(f"ours reach {max(c['tflops_fwd'] for c in cases) / peak:.1%} of the bf16 matmul ceiling "
      f"measured in the same run at best")

# %% [markdown]
# On the GPU profile (`python -m k3lab.book run --profile gpu --only 02`), the cell below reruns the
# benchmark live on the shapes in `bench_cases` (fla included: expect minutes of autotuning per new
# shape) and writes to `build/`, leaving the committed JSON alone.

# %% tags=["nbval-ignore-output"]
if device.type == "cuda" and bench_cases:
    from k3lab.bench.flash_kda import main as bench_main

    live = bench_main(["--cases", *bench_cases, "--out", "../build/flash_kda_live.json"])
    print(f"live run: {len(live['cases'])} cases")
else:
    print("CPU profile: the benchmark needs a CUDA GPU; the table above is the committed H200 run")

# %% [markdown]
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
