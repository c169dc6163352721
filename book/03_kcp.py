# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · KCP: context parallelism for Kimi Delta Attention
#
# **Why.** K3 trains with a 1M-token context (8K → 64K in pre-training, 256K → 1M in the cooldown;
# K3 report, Table 1), and 69 of its 93 layers are KDA. A 512K-token sequence through them (32 heads,
# d = 128, bf16) is a long step on one H200 even with chapter 02's `flash_kda` (the first cell prints it
# from `data/results/kcp_h200x2.json`): the sequence must be split across GPUs, and the recurrence must
# cross the split. Softmax attention passes K/V blocks around a ring (ring attention), traffic growing
# with T. KDA's whole past fits in a fixed `d_k × d_v` state per head, so a rank needs only the state
# entering its slice: **KCP** (K3 report, Sec. 4) gets it with one all-gather of a fixed-size summary
# per rank, whatever T is.
#
# Sections: (1) the math: why summing per-rank states fails, the affine maps that work, a backward of
# one local backward per rank; (2) the simplest code, gathering everything; (3) the fast code,
# `kcp_flash_kda`; (4) the check, rank by rank, on this CPU; (5) the 2 × H200 result; (6) an
# experiment: sequential fold vs log-depth scan; exercises. The code is `k3lab.kcp`, imported here.

# %% tags=["parameters"]
profile: str = "cpu"
seed: int = 0
demo_T: int = 256
demo_heads: int = 2
demo_dim: int = 16
fold_ranks: list = [2, 4, 8, 16, 32, 64, 128]
fold_heads: int = 4
fold_dim: int = 32
rank_counts: list = [2, 4]
flash_ranks: int = 3
flash_T: int = 144
flash_dim: int = 16

# %% tags=["nbval-ignore-output"]
import k3lab

device = k3lab.setup(seed=seed, profile=profile)

# %%
import inspect
import json
import os
import time
import timeit
from pathlib import Path
from unittest import mock

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

from k3lab.book import ROOT
from k3lab.dist import launch
from k3lab.kcp import make_context, naive_kcp_kda
from k3lab.kernels import numpy_supports_interpreter
from k3lab.kcp.affine import apply_map, compose, fold_scan, fold_sequential, segment_map
from k3lab.kcp.layout import draw_layout, folded_ranks, sent_map
from k3lab.kcp.workers import (FLASH_REPLICATED, FLASH_SHARDED, Case, FlashCase, check_worker, errors_vs_reference,
                               flash_check_worker, reference)
from k3lab.kda import chunk_kda, naive_recurrent_kda
from k3lab.testing import rel_rms_error
from k3lab.widgets import explore

gpu = json.loads((ROOT / "data" / "results" / "kcp_h200x2.json").read_text())
longest = max((c for c in gpu["cases"] if "skipped" not in c), key=lambda c: c["T"])
one_layer_s = longest["one_gpu_fwd_bwd_ms"] / 1e3
print(f"one KDA layer, T = {longest['T'] // 1024}K, H = {longest['H']}, K = V = {gpu['settings']['K']}, bf16, on one "
      f"H200: forward + backward {one_layer_s:.2f} s; K3's 69 KDA layers {69 * one_layer_s:.1f} s a sequence")


def show_source(fn, start=None, end=None):
    """Print ``fn``'s source (a function, or a file not to import) from the line holding start to end's."""
    src = fn.read_text() if isinstance(fn, Path) else inspect.getsource(fn)
    i = src.index(start) if start else 0
    j = src.index(end, i) if end else len(src)
    print(src[src.rfind("\n", 0, i) + 1:j].rstrip())

# %% [markdown]
# ## 1. The math
#
# ### Why summing states fails for the delta rule
#
# Split a sequence in two halves A and B, held by two ranks. Each rank can compute the state its
# tokens produce from a zero state.
#
# * **Linear attention**, `S_t = S_{t-1} + k_t v_tᵀ`: the final state is `Σ_t k_t v_tᵀ`, a sum, so
#   `S = S_A + S_B`. Context parallelism is one all-reduce.
# * **The delta rule** (KDA with its gate switched off, `g = 0`):
#   `S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ`. Each token first *erases* what the state holds
#   along `k_t`, so what rank B writes depends on what A left: B's tokens act on A's state through the
#   product of their `(I − β k kᵀ)` factors, and `S ≠ S_A + S_B`.

# %% tags=["nbval-ignore-output"]
gen = torch.Generator().manual_seed(seed)
T, H, D = demo_T, demo_heads, demo_dim
q = torch.randn(1, T, H, D, generator=gen, dtype=torch.float64)
k = F.normalize(torch.randn(1, T, H, D, generator=gen, dtype=torch.float64), dim=-1)
v = torch.randn(1, T, H, D, generator=gen, dtype=torch.float64)
beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
no_decay = torch.zeros(1, T, H, D, dtype=torch.float64)
half = T // 2

# Linear attention: the state is a sum of outer products.
linear_full = torch.einsum("thk,thv->hkv", k[0], v[0])
linear_sum = torch.einsum("thk,thv->hkv", k[0, :half], v[0, :half]) + torch.einsum(
    "thk,thv->hkv", k[0, half:], v[0, half:])


def delta_final(sl):
    """Final state of the delta rule over tokens `sl`, from a zero state (the k3lab reference)."""
    return naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], no_decay[:, sl], beta[:, sl],
                               output_final_state=True)[1][0]


delta_full = delta_final(slice(0, T))
delta_sum = delta_final(slice(0, half)) + delta_final(slice(half, T))
err_linear = rel_rms_error(linear_full, linear_sum)
err_delta = rel_rms_error(delta_full, delta_sum)
print(f"linear attention: |S - (S_A + S_B)| / |S| = {err_linear:.1e}")
print(f"delta rule:       |S - (S_A + S_B)| / |S| = {err_delta:.2f}")
assert err_linear < 1e-12 and err_delta > 0.3

# %% [markdown]
# The summed delta-rule state is off by order one (the gate would also decay `S_A` over B's tokens).
#
# ### The affine-map view
#
# One KDA token maps the state by `S_t = A_t S_{t-1} + b_t` with `A_t = (I − β_t k_t k_tᵀ) Diag(α_t)`
# (`d_k × d_k`) and `b_t = β_t k_t v_tᵀ` (`d_k × d_v`), affine in the state. So any run of tokens is one map
#
# $$S_\text{end} = M\,S_\text{start} + \tilde S, \qquad M = A_T \cdots A_1,\quad \tilde S = \text{the state reached from } S_\text{start} = 0,$$
#
# and running A then B is the composition
# $[M_B \mid \tilde S_B] \circ [M_A \mid \tilde S_A] = [M_B M_A \mid M_B \tilde S_A + \tilde S_B]$, which is
# associative. KCP stores a map as one `[HV, K, K+V]` float32 tensor `[M | S̃]`
# (`k3lab.kcp.affine`). With the two halves above:

# %% tags=["nbval-ignore-output"]
def half_map(sl):
    """[M | S~] of tokens `sl` (heads first, as segment_map wants them)."""
    return segment_map(k[0, sl].transpose(0, 1), v[0, sl].transpose(0, 1), no_decay[0, sl].transpose(0, 1),
                       beta[0, sl].T, chunk_size=16)


map_A, map_B = half_map(slice(0, half)), half_map(slice(half, T))
composed = compose(map_A, map_B)
err_affine = rel_rms_error(delta_full, composed[..., D:])
err_apply = rel_rms_error(delta_full, apply_map(map_B, map_A[..., D:]))
print(f"affine composition: |S - (M_B S_A + S~_B)| / |S| = {err_affine:.1e}")
assert err_affine < 1e-12 and err_apply < 1e-12

# %% [markdown]
# ### A rank's map without a loop
#
# The chunkwise (UT) form of KDA already gives each C-token chunk's map. With the chunk's cumulative
# decay Γ, `W = M(Γ ⊙ K)`, `U = M V` from the UT transform and `k_end = Γ_{i→C} ⊙ K`,
#
# $$S_\text{next} = \mathrm{Diag}(\gamma_C) S + k_\text{end}^\top (U - W S) = \underbrace{(\mathrm{Diag}(\gamma_C) - k_\text{end}^\top W)}_{A_\text{chunk}} S + \underbrace{k_\text{end}^\top U}_{\tilde S_\text{chunk}},$$
#
# so `affine.chunk_maps` computes every chunk's map at once and `affine.reduce_maps` composes them by a
# tree: ⌈log₂ #chunks⌉ batched matmuls, no loop over chunks. The check: the same map from the
# *identity-state trick* — run `chunk_kda` with initial state `[I | 0]` and values `[0 | v]`: its final
# state is `[M | S̃]`, because the state map is affine in the initial state.

# %% tags=["nbval-ignore-output"]
g = -0.3 * torch.rand(1, T, H, D, generator=gen, dtype=torch.float64)
start = torch.cat([torch.eye(D, dtype=torch.float64).expand(1, H, D, D), torch.zeros(1, H, D, D, dtype=torch.float64)], -1)
values = torch.cat([torch.zeros_like(v), v], -1)
_, trick = chunk_kda(q, k, values, g, beta, initial_state=start, output_final_state=True, chunk_size=16)
tree = segment_map(k[0].transpose(0, 1), v[0].transpose(0, 1), g[0].transpose(0, 1), beta[0].T, chunk_size=16)
err_M, err_S = rel_rms_error(trick[0, ..., :D], tree[..., :D]), rel_rms_error(trick[0, ..., D:], tree[..., D:])
print(f"tree-reduced chunk maps vs identity-state trick: M {err_M:.1e}, S~ {err_S:.1e}")
assert err_M < 1e-10 and err_S < 1e-10

# %% [markdown]
# ### The backward is one local backward per rank
#
# Fix rank j. Its entering state `S_in(j)` depends only on earlier ranks' inputs, and its own inputs
# `x_j` reach the loss only through its outputs `o_j` and the state it leaves, `S_end(j)`: later ranks
# see rank j through nothing else. With `dO_j = ∂L/∂o_j` and `D_j = ∂L/∂S_end(j)`,
#
# $$\frac{\partial L}{\partial x_j} = \frac{\partial}{\partial x_j}\Big[\langle dO_j,\, o_j(x_j, S_\text{in})\rangle + \langle D_j,\, S_\text{end}(x_j, S_\text{in})\rangle\Big]_{S_\text{in} = S_\text{in}(j)\ \text{fixed}},$$
#
# which is the ordinary local KDA backward from `S_in(j)` with output gradient `dO_j` and final-state
# gradient `D_j`. To get `D_j`: `S_end(j)` is rank j+1's entering state, and rank j+1's local backward
# is linear in its final-state gradient, `∂L/∂S_in(j+1) = M_{j+1}ᵀ D_{j+1} + b_{j+1}`, where
# `b_{j+1}` is its entering-state gradient with `D_{j+1} = 0`. Unrolled to the rank e where the
# document ends (whose `b_e` already contains the final-state gradient):
#
# $$D_j = b_{j+1} + M_{j+1}^\top\big(b_{j+2} + M_{j+2}^\top(\cdots + M_{e-1}^\top b_e)\big),$$
#
# a **reverse fold** `D ← M_rᵀ D + b_r` from e down to j+1, the forward fold on the maps `[M_rᵀ | b_r]`.
# The ranks between j and e lie inside the document, so their `M_r` are the true maps gathered in the
# forward. No map is differentiated: `M` and `S̃` enter the backward only as data.
#
# ## 2. The simplest correct code: gather everything
#
# The reference, `naive_kcp_kda`, all-gathers every input along T (backward: reduce-scatter) and runs
# one-process `chunk_kda` on the whole sequence; its traffic grows with T. Its body after the checks:

# %%
show_source(naive_kcp_kda, "    full = ")

# %% [markdown]
# `kcp_kda` (`kcp.py`, PyTorch) is the affine view written plainly: each rank computes its map from zero
# with `segment_map`, the maps are all-gathered and folded, and autograd differentiates through both (a
# reduce-scatter of `[R, HV, K, K+V]` backward, twice the bytes of the design below). Its map algebra:

# %%
for fn in (apply_map, compose):
    show_source(fn)
    print()
show_source(fold_sequential, "def ", '    """')
show_source(fold_sequential, "    K = ")

# %% [markdown]
# ## 3. The fast code: `kcp_flash_kda` on FlashKDA's stages
#
# The sequence holds packed documents (`cu_seqlens`), split into R equal rank slices. A rank's tokens
# fall into *pieces* (parts of documents): only the first, `p_0`, may continue a document from an
# earlier rank, only the last, `p_{n−1}`, on the next; every other piece's entering state is **known**. `flash_kda`'s stages (chapter 02) are *intra* (gate, norms, UT transform; parallel over
# chunks), *state* (the one loop over chunks) and *output*. On every rank at once (`kcp/flash.py`):
#
# 1. **intra**, once: the map and the local pass share it.
# 2. **state** over the pieces whose entering state is known, then the map `[M | S̃]` this rank sends
#    for its last piece if it continues: the **constant map** `[0 | S_end]` when its entering state is
#    known (`S_end` from this very stage: no extra work); the identity-state trick of section 1 (the
#    state stage from `[I | 0]` at width K+V) when the rank lies inside one document; else `[0 | 0]`,
#    which nobody folds, but every rank joins the collective.
# 3. **one all-gather** of the R maps, `R · HV · K · (K+V) · 4` bytes whatever T, and the **fold**
#    `S ← M_r S + S̃_r` over the earlier ranks of `p_0`'s document, from zero: the document's first rank
#    sent a constant map, whose `S_end` carries the initial state and whose `M = 0` discards the rest.
# 4. **local**: the state stage for `p_0` from the folded state; the output stage over all pieces.
#
# The backward mirrors it: intra again; the reverse state stage where the end-state gradient is known
# (giving `b_j`); **one all-gather** of the float32 `[HV, K, V]` `b_r` (the forward's chunk states are
# recomputed from the saved `S_in` meanwhile) and section 1's reverse fold (giving `D_j`); the reverse
# state stage of `p_{n−1}` from `D_j`; the gradient stages. The forward in `KCPFlashFunction`:

# %%
show_source(Path(k3lab.__file__).with_name("kcp") / "flash.py", "        # 1. intra", "        fctx.save_for_backward")

# %% [markdown]
# `k3lab.kcp.layout.draw_layout` reads `KCPContext` for a layout with a document across three ranks,
# one ending on a boundary, one starting on one, one starting mid-rank. Above each rank: the map it
# sends; red: the maps a rank folds forward; blue: the state gradients `b_r` it folds backward.

# %%
fig, ax = plt.subplots(figsize=(10, 3.2))
draw_layout(128, (0, 10, 80, 96, 100, 128), 4, ax)
plt.show()
for r in range(4):
    c = make_context(128, (0, 10, 80, 96, 100, 128), rank=r, world_size=4)
    print(f"rank {r}: pieces {c.pieces()}, sends {sent_map(c)}, folds maps, b of ranks {folded_ranks(c)}")

# %% [markdown]
# Rank 0 starts document 1 mid-rank, knows its entering state (the document's initial state) and sends
# the constant `[0 | S_end]`. Rank 1 lies inside document 1 and sends its true map (identity-state
# trick). Rank 2 folds both, `S_in = M_1 S_end(0) + S̃_1`; rank 3's first document starts on its
# boundary: it folds nothing. Backward, document 1 ends on rank 2: rank 1 folds `b_2`, rank 0 `b_2` and
# `b_1` (`D_0 = b_1 + M_1ᵀ b_2`). On 2 ranks every map sent is constant, free; with R > 2 a middle rank
# pays one state pass at width K+V. Drag the boundaries in JupyterLab (headless: one line, no widget).

# %% tags=["nbval-ignore-output"]
def plot_layout(R=4, b1=10, b2=80, b3=100):
    fig, ax = plt.subplots(figsize=(10, 3))
    draw_layout(128, tuple(sorted({0, b1, b2, b3, 128})), R, ax)
    plt.show()


explorer = explore(plot_layout, R=[1, 2, 4, 8], b1=(1, 126), b2=(2, 126), b3=(3, 127))

# %% [markdown]
# ## 4. The check: KCP equals one process, rank by rank
#
# A context-parallel backward can be wrong on every rank but the last and still look right in a summed
# loss (a public CP implementation once shipped wrong gate offsets that way), so
# every rank's outputs and gradient slices are compared with one process separately.
# `k3lab.dist.launch` spawns R gloo processes running `k3lab.kcp.workers`: each runs KDA's token mixer
# without projections (short convs with the W−1 halo from the previous rank, SiLU, L2 norm for q, k;
# then `kcp_kda`) on its slice with initial and final states and backpropagates `<o, w_o> + <final
# state, w_s>`; the parent runs the same on the whole sequence with `chunk_kda`. Replicated parameters
# (conv weights, initial states) are compared by the sum of the ranks' contributions. Float32, GVA,
# the 5-document layout above, both folds (section 6) and the gather-everything reference.

# %% tags=["nbval-ignore-output"]
case = Case(T=128, cu_seqlens=(0, 10, 80, 96, 100, 128), H=1, HV=2, K=8, V=8, seed=seed + 1)
ref = reference(case)
worst, comm = {}, {}
for R in rank_counts:
    t0 = time.perf_counter()
    results = launch(check_worker, R, [case], timeout_s=200)
    for i, fold in enumerate(case.folds):
        ranks = [per_rank[i] for per_rank in results]
        errs = errors_vs_reference(ref, ranks)
        worst[(R, fold)] = max(errs.values())
        comm[(R, fold)] = sum(n for _, n in ranks[0]["comm"])
        per_rank_err = {r: max(e for name, e in errs.items() if name.endswith(f"@r{r}")) for r in range(R)}
        print(f"R={R} {fold:10s}: worst rel err {worst[(R, fold)]:.1e}; per rank "
              + ", ".join(f"r{r} {e:.1e}" for r, e in per_rank_err.items())
              + f"; bytes/layer (fwd+bwd) {comm[(R, fold)]:,}")
    print(f"  ({time.perf_counter() - t0:.1f} s for {R} processes)")
assert max(worst.values()) <= 1e-5

# %%
print("every rank's outputs and gradients within 1e-5 of one process:", max(worst.values()) <= 1e-5)
for R in rank_counts:
    print(f"R={R}: KCP moves {comm[(R, 'sequential')]:,} bytes per layer, the gather-everything "
          f"reference {comm[(R, 'naive')]:,}")

# %% [markdown]
# ### `kcp_flash_kda` on the Triton kernels
#
# The same check for `kcp_flash_kda` against one-process `flash_kda`, on FlashKDA's raw inputs (q, k,
# v, gate pre-activation z, β logits, `A_log`, `dt_bias`, initial states): 3 ranks in Triton's
# interpreter, float32, tiny; rank 0 sends `[0 | S_end]`, rank 1 the identity-state map, rank 2 folds
# both. `tests/test_kcp_flash.py` checks more layouts, and one rank bit for bit against `flash_kda`.

# %% tags=["nbval-ignore-output"]
flash_case = FlashCase(T=flash_T, cu_seqlens=(0, 20, flash_T - 24, flash_T), H=1, HV=1, K=flash_dim, V=flash_dim,
                       seed=seed + 2)
for r in range(flash_ranks):
    c = make_context(flash_case.T, flash_case.cu_seqlens, rank=r, world_size=flash_ranks)
    print(f"rank {r}: pieces {[(n, a, b) for n, a, b in c.pieces()]}, sends {sent_map(c)}")
# Triton 3.6's interpreter needs numpy<2.4: a node with a newer numpy (the GPU image) skips the check
# here; `tests/test_kcp_flash.py` and `python -m k3lab.bench.kcp` run it on CPUs and GPUs.
interpretable = numpy_supports_interpreter()
if not interpretable:
    print(f"skipped: the Triton interpreter needs numpy<2.4, this node has numpy {np.__version__}")
else:
    t0 = time.perf_counter()
    # The ranks (and the reference, on rank 0) run the kernels in the interpreter; this process never imports them.
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        flash_results = launch(flash_check_worker, flash_ranks, [flash_case], timeout_s=300)
    flash_ref = flash_results[0]["refs"][0]
    flash_out = [res["runs"][0] for res in flash_results]
    flash_errs = errors_vs_reference(flash_ref, flash_out, FLASH_SHARDED, FLASH_REPLICATED)
    for r in range(flash_ranks):
        mine = {name: e for name, e in flash_errs.items() if name.endswith(f"@r{r}")}
        worst_name = max(mine, key=mine.get)
        print(f"rank {r}: o and grads of q, k, v, z, beta: worst {worst_name} {mine[worst_name]:.1e}")
    print("summed over ranks: " + ", ".join(f"{name} {e:.1e}" for name, e in flash_errs.items() if "@" not in name))
    print(f"({time.perf_counter() - t0:.1f} s for {flash_ranks} processes under the interpreter)")
    assert max(flash_errs.values()) <= 1e-5

# %%
if interpretable:
    print("kcp_flash_kda: every rank's outputs and gradients within 1e-5 of one-process flash_kda:",
          max(flash_errs.values()) <= 1e-5)
    for name, nbytes in flash_out[0]["comm"]:
        print(f"  {name}: {nbytes:,} bytes")
    HVf, Kf, Vf = flash_case.HV, flash_case.K, flash_case.V
    expected = flash_ranks * HVf * Kf * (Kf + Vf) * 4 + flash_ranks * HVf * Kf * Vf * 4
    print(f"  total {sum(n for _, n in flash_out[0]['comm']):,} = R·HV·K·(K+V)·4 + R·HV·K·V·4 = {expected:,}")
    assert all(sum(n for _, n in res["comm"]) == expected for res in flash_out)

# %% [markdown]
# ## 5. Measured on two H200s
#
# `python -m k3lab.bench.kcp` (2 processes, NCCL) checks float32 varlen outputs, final states and every
# gradient on each rank against one GPU, and bf16 against the 1-GPU run, then times bf16 forward and
# forward+backward (autograd on; wall-clock medians of the slower rank), H = 32, K = V = 128, K3's gate,
# one document of T tokens:
#
# * **1 GPU**: `flash_kda` over all T tokens (in slabs chained through the state, so 512K fits);
# * **2 GPUs**: `kcp_flash_kda`, T/2 tokens per GPU, on the same kernel stages;
# * **local alone**: one rank's T/2 tokens through `flash_kda` on one GPU, no KCP. It is the ceiling:
#   the time of perfect 2-way scaling, and *2 GPUs − local alone* is what KCP itself costs.

# %%
# The target (f+b speedup at T >= 128K); the all_gather bandwidth measured on these 2 H200s (NVLink;
# not in the JSON), bytes/s: the ceiling that puts the collectives' bytes in milliseconds.
GOAL, ALL_GATHER_BPS = 1.8, 254e9
print(gpu["hardware"], "|", gpu["date"], "| torch", gpu["versions"]["torch"], "| triton", gpu["versions"]["triton"])
print("kernels:", gpu["settings"]["local_kda"], "\ntimed:", gpu["settings"]["fwd"])
print(f"checks: float32 varlen max rel err {gpu['check']['float32_varlen_max_rel_err']:.1e} "
      f"(bound {gpu['check']['float32_tol']:g}), bf16 vs 1 GPU {gpu['check']['bfloat16_vs_1gpu_max_rel_err']:.1e}")
done = [c for c in gpu["cases"] if "skipped" not in c]
for c in gpu["cases"]:
    if "skipped" in c:
        print(f"T={c['T']} skipped: {c['skipped']}")
print(f"\n{'':>6} {'forward, ms':^34} {'forward + backward, ms':^34}")
print(f"{'T':>6} {'1 GPU':>8} {'2 GPUs':>8} {'x':>6} {'alone':>8} {'1 GPU':>8} {'2 GPUs':>8} {'x':>6} {'alone':>8} "
      f"{'perfect x':>9} {'bytes/layer':>12}")
for c in done:
    print(f"{c['T'] // 1024:>5}K {c['one_gpu_fwd_ms']:>8.1f} {c['two_gpu_fwd_ms']:>8.1f} {c['speedup_fwd']:>6.2f} "
          f"{c['local_alone_fwd_ms']:>8.1f} {c['one_gpu_fwd_bwd_ms']:>8.1f} {c['two_gpu_fwd_bwd_ms']:>8.1f} "
          f"{c['speedup_fwd_bwd']:>6.2f} {c['local_alone_fwd_bwd_ms']:>8.1f} "
          f"{c['one_gpu_fwd_bwd_ms'] / c['local_alone_fwd_bwd_ms']:>9.2f} {c['bytes_per_layer']:>12,}")
print("\n'perfect x' = 1 GPU / local alone (forward + backward): the speedup perfect scaling would give.")
print(gpu["notes"])

# %%
labels = [f"{c['T'] // 1024}K" for c in done]
x = np.arange(len(done))
fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
ax[0].plot(x, [c["speedup_fwd"] for c in done], "o-", label="forward")
ax[0].plot(x, [c["speedup_fwd_bwd"] for c in done], "s-", label="forward + backward")
ax[0].plot(x, [c["one_gpu_fwd_bwd_ms"] / c["local_alone_fwd_bwd_ms"] for c in done], "k^--",
           label="perfect scaling (f+b: 1 GPU / local alone)")
ax[0].axhline(GOAL, color="crimson", ls=":", label="target at T ≥ 128K")
top = max(max(c["speedup_fwd_bwd"], c["one_gpu_fwd_bwd_ms"] / c["local_alone_fwd_bwd_ms"]) for c in done)
ax[0].set(xticks=x, xticklabels=labels, xlabel="T", ylabel="speedup, 2 H200s vs 1", ylim=(1.0, top + 0.15),
          title="KCP speedup (flash_kda on both sides)")
ax[0].legend(fontsize=7, loc="lower center", ncol=2)
gap_f = np.array([c["two_gpu_fwd_ms"] - c["local_alone_fwd_ms"] for c in done])
gap_fb = np.array([c["two_gpu_fwd_bwd_ms"] - c["local_alone_fwd_bwd_ms"] for c in done])
alone = np.array([c["local_alone_fwd_bwd_ms"] for c in done])
# side by side, not stacked: the backward part is f+b minus forward (two separate medians) and can be < 0
ax[1].bar(x - 0.2, gap_f / alone * 100, 0.4, label="forward: rank 1 waits for rank 0's state")
ax[1].bar(x + 0.2, (gap_fb - gap_f) / alone * 100, 0.4, label="backward: rank 0 waits for rank 1's reverse pass")
ax[1].axhline(0, color="k", lw=0.5)
ax[1].set(xticks=x, xticklabels=labels, xlabel="T", ylabel="% of local alone (f+b)",
          ylim=(min(0, 1.4 * min((gap_fb - gap_f) / alone) * 100), 1.6 * max(gap_f / alone) * 100),
          title="2 GPUs − local alone: KCP's overhead")
ax[1].legend(fontsize=7, loc="upper right")
plt.show()

# %%
for c, gf, gfb, a in zip(done, gap_f, gap_fb, alone):
    verdict = ("met" if c["speedup_fwd_bwd"] >= GOAL else "NOT met") if c["T"] >= 131072 else "no target below 128K"
    print(f"T={c['T'] // 1024}K: f+b {c['speedup_fwd_bwd']:.2f}x ({verdict}); overhead over perfect scaling: "
          f"forward {gf:.1f} ms ({gf / c['local_alone_fwd_ms']:.0%} of the local forward), backward "
          f"{gfb - gf:.1f} ms, f+b {gfb:.1f} ms ({gfb / a:.0%})")
    if c["T"] >= 131072:
        need = c["one_gpu_fwd_bwd_ms"] / GOAL
        slack = need - c["two_gpu_fwd_bwd_ms"]
        print(f"  {GOAL}x needs 2 GPUs <= {need:.1f} ms, measured {c['two_gpu_fwd_bwd_ms']:.1f} ms: "
              f"{abs(slack):.1f} ms {'to spare' if slack >= 0 else 'too slow'}")
goal_cases = [c for c in done if c["T"] >= 131072]
met = all(c["speedup_fwd_bwd"] >= GOAL for c in goal_cases)
print(f"target {GOAL}x f+b at T >= 128K: {'met' if met else 'NOT met'} ("
      + ", ".join(f"{c['T'] // 1024}K {c['speedup_fwd_bwd']:.2f}x" for c in goal_cases) + ")")
# The reading below says the target is met: a re-measurement that misses it must change the text.
assert met
nbytes = {c["bytes_per_layer"] for c in done}
assert len(nbytes) == 1
print(f"bytes per layer {nbytes.pop():,} at every T: ~{done[0]['bytes_per_layer'] / ALL_GATHER_BPS * 1e3:.2f} ms "
      f"at {ALL_GATHER_BPS / 1e9:.0f} GB/s")
ring = [c["ring_attention_kv_bytes_per_layer"] for c in done]
print(f"ring attention would pass {min(ring) / 1e9:.2f} to {max(ring) / 1e9:.1f} GB of K/V per layer forward "
      f"at T = {done[0]['T'] // 1024}K .. {done[-1]['T'] // 1024}K")

# %% [markdown]
# **Reading.** KCP is exact on the GPUs too, moves the same bytes per layer at every T (ring
# attention's K/V traffic grows with T), and its forward+backward speedup grows with T and meets the
# 1.8× target at T ≥ 128K (margins above). The ceiling, perfect scaling (dashed), is about 2×, more at
# the longest T, where the 1-GPU baseline runs chained slabs (`one_gpu_slab_tokens`) and grows more
# than linearly, so the 2-GPU speedup can pass 2 there. The gap to it is KCP's own overhead (right-hand
# bars): not the collectives (a fraction of a millisecond, printed above) but the state stages that
# wait on the other rank:
#
# * **forward**: rank 1 runs its intra stage at once, but its state stage for `p_0` needs the folded
#   state — rank 0's intra and state pass, then the gather: most of what is left. (Pipelining that
#   wait over head groups was measured slower at every length: `docs/kcp.md`.)
# * **backward**, mirrored: rank 0's reverse state stage for its last piece needs `D_0` — rank 1's
#   intra and reverse state pass, then the gather. Rank 0 recomputes its forward chunk states while
#   it waits, so only what outlasts that recompute shows. A bar below zero is the difference of two
#   separate medians (alone runs chained slabs, a KCP rank one call): read it as "no wait measurable".
#
# The state stage is FlashKDA's one sequential stage, so it cannot be split along T: whatever comes
# off the state kernel comes off that wait. With R > 2 ranks on one document (not measured here) the
# middle ranks send identity-state maps, a K+V-wide state pass every later rank waits for.
#
# ### Communication per layer against T
#
# Per layer and rank, forward + backward, at K3's KDA shape (96 heads, d = 128), R ranks:
#
# * **KCP** (`kcp_flash_kda`): the maps, `R · H · K · (K+V) · 4` bytes gathered forward; the state
#   gradients, `R · H · K · V · 4` gathered backward; three short-conv halos of `R · (W−1) · H·K` bf16
#   values, gathered forward and reduce-scattered backward: independent of T (tests count the buffers).
# * **Ring attention**: every rank's K and V blocks travel the ring, `(R−1) · T/R · H · (K+V)` bf16
#   values forward; backward passes K, V and their gradients (3× the forward in all).
# * **Gather everything** (`naive_kcp_kda`): q, k, v, g, β of all T tokens.

# %%
H3, K3, W3 = 96, 128, 4


def kcp_bytes(R, H=H3, K=K3, W=W3):
    """kcp_flash_kda, fwd+bwd: maps [R, H, K, 2K] and state gradients [R, H, K, K] float32 gathered;
    three conv halos [R, W-1, H*K] bf16, gathered forward and reduce-scattered backward."""
    return R * H * K * (2 * K + K) * 4 + 2 * 3 * R * (W - 1) * H * K * 2


def ring_bytes(R, T):
    """Ring attention: K and V blocks of (R-1)/R of the tokens forward; K, V and dK, dV backward (bf16)."""
    return 3 * (R - 1) / R * T * H3 * 2 * K3 * 2


for c in gpu["cases"]:
    if "skipped" not in c:
        formula = kcp_bytes(2, c["H"], gpu["settings"]["K"], gpu["settings"]["conv"])
        assert formula == c["bytes_per_layer"], (c["T"], formula, c["bytes_per_layer"])
print(f"formula = the 2 x H200 benchmark's count at H = 32 for every T: {kcp_bytes(2, 32):,} bytes")
Ts = np.logspace(np.log10(4096), np.log10(1 << 20), 40)
fig, ax = plt.subplots(figsize=(7, 3.8))
for R, style in [(2, "-"), (8, "--")]:
    ax.loglog(Ts, np.full_like(Ts, kcp_bytes(R)), "C0" + style, label=f"KCP, R={R}")
    ax.loglog(Ts, ring_bytes(R, Ts), "C3" + style, label=f"ring attention K/V, R={R}")
    cross = kcp_bytes(R) / ring_bytes(R, 1.0)
    print(f"R={R}: KCP {kcp_bytes(R) / 2**20:.0f} MiB per layer at any T; ring attention passes more "
          f"beyond T = {cross:,.0f} tokens; at T = 1M it moves {ring_bytes(R, 2**20) / kcp_bytes(R):.0f}x KCP's bytes")
ax.loglog(Ts, 2 * Ts * H3 * (4 * K3 + 1) * 2, "C7:", label="gather everything (q, k, v, g, β)")
ax.axvline(1 << 20, color="k", lw=0.5)
ax.set(xlabel="context length T (tokens)", ylabel="bytes per layer per rank (fwd+bwd)",
       title="Communication per layer: KCP vs ring attention (K3 shape: 96 heads, d=128)")
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# ## 6. Experiment: sequential fold vs log-depth scan
#
# The fold is up to R − 1 dependent steps. Composition is associative, so a (segmented) Hillis–Steele
# prefix scan gives every rank's entering map in ⌈log₂ R⌉ rounds, at the price of `R log R` compositions
# of `K × K × (K+V)` instead of R applications of `K × K × V`. Which wins? First, the two agree:

# %% tags=["nbval-ignore-output"]
fold_gen = torch.Generator().manual_seed(seed + 1)
rows = []
for R in fold_ranks:
    M = 0.9 * torch.eye(fold_dim) + 0.05 * torch.randn(R, fold_heads, fold_dim, fold_dim, generator=fold_gen)
    maps = torch.cat([M, torch.randn(R, fold_heads, fold_dim, fold_dim, generator=fold_gen)], -1)
    seq, scan = fold_sequential(maps, 0, R), fold_scan(maps, torch.arange(R) == 0, 0, R)
    assert rel_rms_error(seq, scan) < 1e-5
    rows.append((R, seq, scan))
print(f"sequential fold == scan for R in {fold_ranks}: max rel err "
      f"{max(rel_rms_error(s, c) for _, s, c in rows):.0e} < 1e-5")

# %% tags=["nbval-ignore-output"]
def best_ms(fn, reps=3):
    """Best of ``reps`` calls in ms of one thread's CPU time (a shared machine's wall clock is noisy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return min(timeit.repeat(fn, timer=time.process_time, number=1, repeat=reps)) * 1e3
    finally:
        torch.set_num_threads(threads)


timing = []
for R, _, _ in rows:
    maps = torch.randn(R, fold_heads, fold_dim, 2 * fold_dim, generator=fold_gen) * 0.1
    resets = torch.arange(R) == 0
    timing.append((R, best_ms(lambda: fold_sequential(maps, 0, R)), best_ms(lambda: fold_scan(maps, resets, 0, R))))
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.loglog([t[0] for t in timing], [t[1] for t in timing], "o-", label="sequential fold (CPU)")
ax.loglog([t[0] for t in timing], [t[2] for t in timing], "s-", label="scan (CPU)")
gpu_R = [r["R"] for r in gpu["fold_vs_scan"]]
ax.loglog(gpu_R, [r["sequential_ms"] for r in gpu["fold_vs_scan"]], "o--", label="sequential fold (H200, H=32, K=128)")
ax.loglog(gpu_R, [r["scan_ms"] for r in gpu["fold_vs_scan"]], "s--", label="scan (H200)")
ax.set(xlabel="ranks R", ylabel="ms", title=f"Fold vs scan (CPU: H={fold_heads}, K={fold_dim})")
ax.legend(fontsize=7)
plt.show()
for R, ts, tc in timing:
    print(f"CPU  R={R:4d}: fold {ts:7.3f} ms   scan {tc:7.3f} ms")
for r in gpu["fold_vs_scan"]:
    print(f"H200 R={r['R']:4d}: fold {r['sequential_ms']:7.3f} ms   scan {r['scan_ms']:7.3f} ms  (H={r['H']}, K={gpu['settings']['K']})")
assert all(ts > 0 and tc > 0 for _, ts, tc in timing)

# %% [markdown]
# On both machines the sequential fold wins at every R measured: each step is a small `K×K · K×V`
# product, the scan does `R log R` full compositions, and at these sizes a step costs about a kernel
# launch (GPU) or a small matmul (CPU), whatever the depth. The scan would pay off only with far more
# ranks than a node holds. KCP defaults to `fold="sequential"`; `fold="scan"` is exact and tested too.
#
# ## Exercises
#
# 1. In section 1, give the delta rule a gate (`g = -0.3 * torch.rand(...)` in place of `no_decay`). Does
#    `S_A + S_B` get further from `S`, and does the affine composition still agree to round-off?
# 2. Draw `draw_layout(128, (0, 128), 4, ax)`: one document over four ranks. Which map does each rank
#    send, and how many state passes at width K+V does the forward then need?
# 3. From `kcp_bytes`, at what R does KCP's traffic per layer at K3's shape reach ring attention's at
#    T = 1M? What does that say about where KCP stops paying?
# 4. Time `fold_sequential` and `fold_scan` at `fold_dim = 128` on this machine. Does the crossover move?
# 5. Section 5 prints the forward's overhead as a share of the local forward at each T. If it were one
#    state pass of rank 0 and the state stage a fixed share of the local forward, that share would be
#    constant. It falls as T grows: what fixed cost per call would explain it?

# %% [markdown]
# ## References
#
# - Kimi Team, *Kimi K3: Open Frontier Intelligence*, arXiv 2607.24653 — Sec. 4 (KCP), Table 1
#   (context lengths), Eq. 5 (lower-bounded gate).
# - Kimi Team, *Kimi Linear*, arXiv 2510.26692 — KDA and its chunkwise algorithm.
# - S. Yang, B. Wang, Y. Zhang, Y. Shen, Y. Kim, *Parallelizing Linear Transformers with the Delta Rule
#   over Sequence Length*, NeurIPS 2024 — the UT/WY chunkwise form the chunk maps come from.
# - H. Liu, M. Zaharia, P. Abbeel, *Ring Attention with Blockwise Transformers for Near-Infinite
#   Context*, ICLR 2024 — the K/V ring KCP is compared with.
# - W. D. Hillis, G. L. Steele, *Data Parallel Algorithms*, CACM 1986 — the prefix scan; G. Blelloch,
#   *Prefix Sums and Their Applications*, 1990 — scans of associative operators.
# - fla-org/flash-linear-attention — context-parallel KDA/GDN (`cp_context`), whose gradient bug on
#   all ranks but the last motivates the rank-by-rank test.
