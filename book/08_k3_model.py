# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · The K3 model: Gated MLA, the 3:1 hybrid, Per-Head Muon and the FLOPs it costs
#
# Kimi K3 has **2.78T parameters, of which 104.2B are activated per token** (K3 report, Table 1). The
# earlier chapters built its parts one at a time: KDA (01-03), Block AttnRes (04), Stable LatentMoE (05).
# This chapter puts them together as `k3lab.model.K3Model` and adds the two pieces not yet covered:
# **Gated MLA**, the softmax-attention layer K3 places after every three KDA layers, and **Per-Head
# Muon**, the optimizer it trains with.
#
# Sections: (1) the full-size count; (2) Gated MLA; (3) the layout; (4) Per-Head Muon; (5) FLOPs and MFU;
# (6) K3 at a tiny size trained and decoded; (7) where the parameters go; (8) memory policies.

# %% tags=["parameters"]
profile: str = "cpu"
seed: int = 0
preset: str = "k3-tiny"
steps: int = 60
batch_size: int = 16
seq_len: int = 64
lr: float = 1e-2
log_every: int = 10
max_seconds: float = 0.0
gen_tokens: int = 24

# %% tags=["nbval-ignore-output"]
import k3lab

device = k3lab.setup(seed=seed, profile=profile)

# %%
import inspect
import json

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import torch
# torch.optim.Muon's Newton-Schulz, the one PerHeadMuon runs per block.
from torch.optim._muon import _zeropower_via_newtonschulz

import k3lab.data as kdata
import k3lab.lm as lm
from k3lab.bench.memory import SET_DOCS, check_policies, measure, policy_sets
from k3lab.bench.memory import table as memory_table
from k3lab.book import ROOT
from k3lab.mla import GatedMLA, absorbed_attention, naive_gated_mla
from k3lab.model import K3Config, K3Model, count_params, flops_per_token, format_table, mfu, param_table
from k3lab.model.accounting import PEAK_FLOPS
from k3lab.moe import update_biases
from k3lab.optim import (NS_COEFFICIENTS, PerHeadMuon, adjusted_lr, head_blocks, muon_loop_reference,
                         newton_schulz_blocks, per_head_muon, per_head_steps)
from k3lab.testing import rel_rms_error
from k3lab.widgets import explore


def show(fn):
    """Print a function's source without its docstring."""
    head, _, body = inspect.getsource(fn).partition('"""')
    print(head + "..." + body.partition('"""')[2])


# %% [markdown]
# ## 1. K3 at full size, on the meta device
#
# `K3Config()` holds K3's shape under the released config's field names; `"k3-full"` is that default.
# Built under `torch.device("meta")`, every parameter has a shape and no storage: the full model takes no
# memory and is counted exactly. "Activated" needs a convention; Table 1's numbers match only k3lab's
# (`k3lab.model.accounting`): a token activates every parameter it is multiplied by, so all but the routed
# experts it does not visit (16 of 896 per MoE layer) and the **input embedding** (a lookup, not a matmul);
# the LM head (a $[d, V]$ matmul) and the router (all 896 scores are computed) count in full. **KDA's
# output gate is low rank** (rank 128, Kimi Linear's $W_{g2} W_{g1}$), its decay projection full rank. The
# count, then the other readings:

# %%
k3 = K3Config.preset("k3-full")
print({f: getattr(k3, f) for f in ("hidden_size num_hidden_layers num_attention_heads head_dim q_lora_rank "
                                   "kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim n_routed_experts "
                                   "num_experts_per_tok n_shared_experts moe_intermediate_size moe_latent_size "
                                   "first_k_dense_replace intermediate_size attn_res_block_size vocab_size").split()})
with torch.device("meta"):
    full = K3Model(k3)
table = param_table(full)
print(format_table(table))
total, active = table["total"]
print(f"\ntotal  {total / 1e12:.4f}T against K3's 2.78T   ({100 * (total / 2.78e12 - 1):+.2f}%)")
print(f"active {active / 1e9:.2f}B against K3's 104.2B ({100 * (active / 104.2e9 - 1):+.2f}%)")
assert abs(total / 2.78e12 - 1) < 0.01 and abs(active / 104.2e9 - 1) < 0.02
t_, a_ = count_params(K3Config.preset("k3-full", kda_gate_rank=None))["total"]
print(f"{'full-rank KDA output gate':<28} total {t_ / 1e12:.4f}T, active {a_ / 1e9:.2f}B")
emb = table["embedding"][0]
print(f"{'input embedding counted':<28} total {total / 1e12:.4f}T, active {(active + emb) / 1e9:.2f}B")
routed = table["moe routed experts"]
print(f"routed experts: {100 * routed[0] / total:.1f}% of the total, "
      f"{100 * routed[1] / active:.1f}% of the active count")

# %% [markdown]
# The routed experts hold almost all of the total and under half of what a token touches; of the rest,
# KDA is the largest part (table above).
#
# ## 2. Gated MLA (K3 Eq. 7)
#
# Every fourth layer is softmax attention, in DeepSeek's multi-head latent form with K3's changes. With
# $x$ a token's input, $H = 96$ heads, latent width $R = 512$, query rank $R_q = 1536$, per-head key
# widths $D_n = 128$ (from the latent) and $D_r = 64$ (shared by all heads), value width $D_v = 128$:
#
# $$c^q = \mathrm{RMSNorm}(W_{dq}x),\quad [q^n_h \,|\, q^s_h] = (W_{uq}c^q)_h,\qquad
#   c = \mathrm{RMSNorm}(W_{dkv}x),\quad k^s = W_{kr}x,$$
# $$k_h = [W_{uk,h}\,c \,|\, k^s],\quad v_h = W_{uv,h}\,c,\qquad
#   o_h = \mathrm{softmax}\Big(\frac{q_h k_h^\top}{\sqrt{D_n + D_r}} + M\Big) v_h,$$
# $$y = W_o\big[\sigma(W_g x) \odot o\big].$$
#
# Three things differ from DeepSeek-V2's MLA. **NoPE**: the $D_r = 64$ channels DeepSeek rotates stay
# unrotated; position reaches the model only through the KDA layers' recurrence and short convolutions.
# **The scale** is $1/\sqrt{D_n + D_r} = 1/\sqrt{192}$, the width $q_h \cdot k_h$ sums over. **The output
# gate** $\sigma(W_g x)$, full rank, multiplies the attention output channel by channel before $W_o$.
#
# **Decoding** caches only $c$ and $k^s$, $R + D_r = 576$ numbers per token and layer, instead of the
# $H(D_n + D_r + D_v) = 30720$ of materialised keys and values. Reading them needs the **absorbed** form:
# $q^n_h \cdot (W_{uk,h} c_j) = (W_{uk,h}^\top q^n_h) \cdot c_j$, so each head's score against token $j$
# is one dot product of width 576, $[W_{uk,h}^\top q^n_h \,|\, q^s_h] \cdot [c_j \,|\, k^s_j]$, and
# $o_h = W_{uv,h} \sum_j p_{hj}\, c_j$ applies $W_{uv}$ once, after the weighted sum: multi-query attention
# over the latent, with the scale still $1/\sqrt{192}$, not SDPA's default $1/\sqrt{576}$ for that width.
# The simplest code (the formula in float64, looping over documents, heads and positions), then the fast:

# %%
show(naive_gated_mla)
show(absorbed_attention)

# %% [markdown]
# **The checks**, in float64 at $T \ge 2$: the layer (SDPA, materialised) against the loop reference; the
# absorbed form against the materialised one; decoding (a prefill, then one token at a time from the latent
# cache) against one forward over the whole sequence.

# %%
torch.manual_seed(seed)
mla = GatedMLA(d_model=64, num_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
               v_head_dim=8).double()
x = torch.randn(2, 11, 64, dtype=torch.float64)
(y_mat, _), (y_abs, _) = mla(x), mla(x, absorbed=True)
y_pre, cache = mla(x[:, :5], use_cache=True)
steps_out = [y_pre]
for t in range(5, x.shape[1]):
    y_t, cache = mla(x[:, t : t + 1], cache=cache, use_cache=True)
    steps_out.append(y_t)
errors = {"materialised vs reference": rel_rms_error(naive_gated_mla(mla, x), y_mat),
          "absorbed vs materialised": rel_rms_error(y_mat, y_abs),
          "decoded (5 + 6 x 1) vs one forward": rel_rms_error(y_mat, torch.cat(steps_out, 1))}
for name, err in errors.items():
    print(f"{name:<36} rel RMS error {err:.1e}")
print(f"cache after decoding: latent {list(cache.latent.shape)}, k_shared {list(cache.k_shared.shape)}")
assert max(errors.values()) < 1e-12

# %% [markdown]
# **Why $T \ge 2$**: give the absorbed path SDPA's default scale for its width, $1/\sqrt{R + D_r}$. With one
# token the softmax has one key whose weight is 1 whatever the scale, so the wrong code agrees exactly; with
# two it does not. A suite that checks decoding only on one-token prompts passes this bug:

# %%
right = mla.scale
for T in (1, 2):
    ref, _ = mla(x[:, :T])
    mla.scale = (mla.R + mla.Dr) ** -0.5
    try:
        bad, _ = mla(x[:, :T], absorbed=True)
    finally:
        mla.scale = right
    print(f"T = {T}: absorbed with scale 1/sqrt({mla.R + mla.Dr}) vs materialised with 1/sqrt({mla.Dn + mla.Dr}): "
          f"rel RMS error {rel_rms_error(ref, bad):.1e}")
    assert (rel_rms_error(ref, bad) < 1e-12) == (T == 1)

# %%
# What the cache saves at K3's size, per layer kind, for one sequence (bf16 latents; KDA's state in float32).
mla_per_token = k3.kv_lora_rank + k3.qk_rope_head_dim
mat_per_token = k3.num_attention_heads * (k3.qk_nope_head_dim + k3.qk_rope_head_dim + k3.v_head_dim)
print(f"numbers per token and MLA layer: latent cache {mla_per_token}, materialised K/V {mat_per_token}")
H, Kd = k3.num_attention_heads, k3.head_dim
kda_layers = k3.num_hidden_layers - k3.num_mla_layers
kda_state = kda_layers * (H * Kd * Kd * 4 + 3 * (k3.kda_conv_size - 1) * H * Kd * 2)
for T in (8192, 1 << 20):
    print(f"T = {T:>7}: MLA latent cache {k3.num_mla_layers * mla_per_token * 2 * T / 1e9:7.2f} GB "
          f"(materialised K/V: {k3.num_mla_layers * mat_per_token * 2 * T / 1e9:8.1f} GB); "
          f"KDA states {kda_state / 1e9:.2f} GB at any T")

# %% [markdown]
# ## 3. The layout: 3 KDA : 1 MLA, one dense FFN, Block AttnRes
#
# `full_attn_layers` = [4, 8, ..., 92, 93]: 23 groups of three KDA layers and one Gated MLA, plus a
# final Gated MLA (69 KDA, 24 MLA). Layer 1's FFN is dense (SiTU-GLU, hidden 33792); the other 92 are
# Stable LatentMoE. Block AttnRes groups the layers into blocks of 12, the last one partial; a layer's
# mixer and FFN always share a block, and as 12 is a multiple of the period 4 the full blocks are alike.
# Each row below is one AttnRes block of the model built above, read from its `residual.sizes` (a layer is
# a mixer and an FFN sublayer). **Multi-token prediction**: Table 1 lists one MTP layer, the released config
# none; `num_nextn_predict_layers` = D appends D DeepSeek-V3-style modules (docs/model.md), counted last.

# %%
def layer_blocks(model):
    """Layer indices (0-based) of each Block AttnRes block of a K3Model (two sublayers per layer)."""
    sizes = model.residual.sizes
    assert all(n % 2 == 0 for n in sizes), sizes
    starts = [sum(sizes[:i]) // 2 for i in range(len(sizes))]
    return [list(range(start, start + n // 2)) for start, n in zip(starts, sizes)]


def draw_layout(model):
    """Print and draw each Block AttnRes block's layers: KDA, Gated MLA, dense FFN (*)."""
    c, rows = model.config, layer_blocks(model)
    kinds, ffns, width = c.layer_types(), c.ffn_types(), max(len(r) for r in rows)
    grid = np.full((len(rows), width), np.nan)
    fig, ax = plt.subplots(figsize=(0.55 * width + 2, 0.45 * len(rows) + 1))
    for r, layers in enumerate(rows):
        print(f"block {r + 1}: layers {layers[0] + 1:>2}-{layers[-1] + 1:<2} "
              + "".join("M" if kinds[i] == "mla" else "k" for i in layers))
        grid[r, : len(layers)] = [kinds[i] == "mla" for i in layers]
        for col, i in enumerate(layers):
            ax.text(col, r, f"{i + 1}{'*' if ffns[i] == 'dense' else ''}", ha="center", va="center", fontsize=7,
                    color="white")
    ax.imshow(grid, cmap=matplotlib.colors.ListedColormap(["tab:blue", "tab:orange"]))
    ax.set(xticks=[], yticks=range(len(rows)), yticklabels=[f"block {r + 1}" for r in range(len(rows))],
           title=f"{c.num_hidden_layers} layers: KDA (blue), Gated MLA (orange), dense FFN (*)")
    plt.show()


draw_layout(full)
k3_blocks = [list(range(s, min(s + 12, 93))) for s in range(0, 93, 12)]
print(f"K3's blocks of 12 layers: {[len(b) for b in k3_blocks]}; this model's: {[len(b) for b in layer_blocks(full)]}")
assert layer_blocks(full) == k3_blocks
n_blk = len(full.residual.sizes)
print(f"sources of a read in the last block: the embedding + {n_blk - 1} completed blocks + its partial sum = "
      f"{n_blk + 1}; of the output's aggregation: the embedding + {n_blk} blocks = {n_blk + 1}")
with torch.device("meta"):
    full_mtp = K3Model(K3Config.preset("k3-full", num_nextn_predict_layers=1))
mtp_total, mtp_active = param_table(full_mtp)["mtp"]
print(f"one MTP module: {mtp_total / 1e9:.2f}B parameters, {mtp_active / 1e9:.2f}B activated; "
      f"with it K3 would count {param_table(full_mtp)['total'][0] / 1e12:.4f}T: Table 1's 2.78T leaves it out")
del full_mtp

# %% [markdown]
# ## 4. Per-Head Muon
#
# Muon (Moonlight; `torch.optim.Muon`) replaces a matrix's momentum $U$ by its orthogonalisation
# $\mathrm{NS}(U) \approx U (U^\top U)^{-1/2}$ (five quintic Newton-Schulz steps), scaled so its RMS
# matches AdamW's: $W \leftarrow (1 - \eta\lambda) W - \eta \cdot 0.2\sqrt{\max(A, B)}\,\mathrm{NS}(U)$
# for an $A \times B$ matrix. A Q, K or V projection is $H$ maps stacked by rows, one per head; as one
# matrix, $\mathrm{NS}$ equalises the singular values of the whole stack, so a head with a small gradient
# gets a small share of the update. K3 (Sec. 2.5) runs Newton-Schulz on each head's row block, scaled for
# its own shape. `head_blocks` gives them: $K$ rows per KDA head; $D_n + D_r$ per MLA query head; $D_n$ key
# and $D_v$ value rows per head of `kv_b_proj`; blocks of one shape, across all layers, go through one
# batched Newton-Schulz (docs/model.md). Split, Newton-Schulz, reassembly:

# %%
for fn in (PerHeadMuon._blocks, newton_schulz_blocks, PerHeadMuon._update):
    show(fn)

# %% [markdown]
# **The check**: three steps of per-head Muon equal a loop of `torch.optim.Muon`, one parameter per head, on
# one KDA and one Gated MLA layer of `k3-tiny`, to bf16 rounding (both run Newton-Schulz in bf16; batched
# GEMMs may round differently); last, how far the full-matrix update that per-head Muon replaces lies:

# %%
show(muon_loop_reference)
torch.manual_seed(seed)
tiny = K3Model(K3Config.preset("k3-tiny"))
blocks_of, names = head_blocks(tiny), {p: n for n, p in tiny.named_parameters()}
g = torch.Generator().manual_seed(seed)
for p, blocks in list(blocks_of.items())[:3] + list(blocks_of.items())[-2:]:
    grads = [torch.randn(p.shape, generator=g) for _ in range(3)]
    w = p.detach()
    ours = per_head_steps(p, blocks, grads, 0.02, 0.1) - w
    err = rel_rms_error(muon_loop_reference(p, blocks, grads, 0.02, 0.1) - w, ours)
    err_matrix = rel_rms_error(muon_loop_reference(p, None, grads, 0.02, 0.1) - w, ours)
    print(f"{names[p]:<28} {list(p.shape)} in blocks {blocks}: vs the loop {err:.1e}; vs one matrix {err_matrix:.0%}")
    assert err < 1e-2 and err_matrix > 0.1

# %% [markdown]
# **Update RMS per block.** A query projection whose head $h$ has its gradient rows scaled by $10^{-h}$,
# one step at $\eta = 1$ without decay: the RMS of each head's block of the update, per head and as one
# matrix. AdamW-matched Muon aims at RMS 0.2 per orthogonalised block:

# %%
def update_rms(shape, blocks, grad):
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = grad
    PerHeadMuon([dict(params=[p], algorithm="muon", row_blocks=blocks)], lr=1.0, weight_decay=0.0).step()
    return [float(b.pow(2).mean().sqrt()) for b in (-p.detach()).split([shape[0] // 4] * 4)]


q_shape = (4 * 32, 96)
gq = torch.randn(q_shape, generator=g) * torch.repeat_interleave(10.0 ** -torch.arange(4.0), 32)[:, None]
print(f"{'':<20}" + "".join(f"{'head ' + str(h):>10}" for h in range(4)))
for name, blocks in (("per head", [32] * 4), ("one matrix", None)):
    print(f"{name:<20}" + "".join(f"{v:>10.4f}" for v in update_rms(q_shape, blocks, gq)))
print(f"target: 0.2 per block; one matrix scaled for {list(q_shape)}: lr factor {adjusted_lr(1.0, q_shape):.2f}, "
      f"per head for [32, 96]: {adjusted_lr(1.0, (32, 96)):.2f}")
sv = torch.linalg.svdvals(_zeropower_via_newtonschulz(gq[:32], NS_COEFFICIENTS, 5, 1e-7).float())
print(f"singular values of one head's NS(G): {sv.min():.2f} .. {sv.max():.2f} (exact orthogonalisation: all 1)")

# %% [markdown]
# Per head, every head moves by about the same RMS whatever its gradient's scale; as one matrix, the
# smallest barely move. Under 0.2: five quintic steps bring the singular values near 1, not onto it. What
# is not a hidden matrix (embedding, LM head, norms, router, KDA's $\beta$ and gate vectors, conv taps,
# AttnRes queries) goes to AdamW in the same optimizer at the same learning rate, with the same decay on
# its matrices and none on its vectors (norm weights, `A_log`, ...: the last line):

# %%
for grp in per_head_muon(tiny).param_groups:
    rb = f", {len(grp['row_blocks'])} blocks" if grp.get("row_blocks") else ""
    print(f"{grp['algorithm']:<6} wd {grp['weight_decay']:<4} {len(grp['params']):>3} tensors{rb}: "
          f"{', '.join(grp['names'][:2])}{', ...' if len(grp['names']) > 2 else ''}")

# %% [markdown]
# ## 5. FLOPs per token and MFU
#
# MFU is achieved model FLOP/s over peak FLOP/s; only the numerator needs a convention. k3lab's
# (`flops_per_token`, after PaLM and torchtitan):
#
# $$F(T) = 6\,N_\text{active} + 24 \cdot 6\,H (D_n + D_r + D_v)\,T,$$
#
# $N_\text{active}$ the activated parameters of Section 1 (no input embedding; routed experts at the
# **latent** width 3584 they run at; the LM head in), and for each of the 24 MLA layers the score and
# weighted-sum matmuls, forward $2H(D_n + D_r)T + 2H D_v T$ and backward twice that, not halved for the
# causal mask; KDA's state work, norms, element-wise ops and AttnRes mixing are left out. The hand count
# against the function; as K3's report gives no MFU, the tokens/s per GPU an MFU needs at 8K context on an
# H100's dense bf16 peak, at MegaScale's 55.2% and at 40%; and the MFU chapter 09 measured (`train_h100.json`):

# %%
routed_latent = k3.num_experts_per_tok * 3 * k3.moe_latent_size * k3.moe_intermediate_size
routed_full = k3.num_experts_per_tok * 3 * k3.hidden_size * k3.moe_intermediate_size
print(f"routed experts per MoE layer and token: {routed_latent / 1e6:.0f}M parameters at the latent width "
      f"({routed_full / 1e6:.0f}M if counted at d)")
print(f"{'T':>8}{'6 N_active (GFLOP)':>20}{'MLA attention (GFLOP)':>23}{'total (GFLOP)':>15}")
for T in (8192, 65536, 1 << 20):
    attn = k3.num_mla_layers * 6 * H * (k3.qk_nope_head_dim + k3.qk_rope_head_dim + k3.v_head_dim) * T
    f = flops_per_token(k3, T)
    assert f == 6 * active + attn
    print(f"{T:>8}{6 * active / 1e9:>20.1f}{attn / 1e9:>23.1f}{f / 1e9:>15.1f}")
f8k = flops_per_token(k3, 8192)
print(f"H100 dense bf16 peak: {PEAK_FLOPS['h100'] / 1e12:.1f} TFLOP/s")
for u in (0.552, 0.40):
    tps = u * PEAK_FLOPS["h100"] / f8k
    assert abs(mfu(tps, f8k, "h100") - u) < 1e-12
    print(f"MFU {100 * u:.1f}%: {tps:,.0f} tokens/s per GPU; 1T tokens on 4096 GPUs in "
          f"{1e12 / (tps * 4096) / 86400:.1f} days")
run = json.loads((ROOT / "data" / "results" / "train_h100.json").read_text())
assert abs(mfu(run["tokens_per_s"], run["flops_per_token"], run["peak_flops_key"]) - run["mfu"]) < 1e-9
print(f"measured: {run['preset']}, {run['batch_size']} x {run['seq_len']} tokens a step on one {run['device']}: "
      f"{run['tokens_per_s']:,.0f} tokens/s x {run['flops_per_token'] / 1e9:.2f} GFLOP = MFU {100 * run['mfu']:.1f}%")

# %% [markdown]
# ### The head's loss without the logits
#
# K3's vocabulary has 163,840 ids. The head's logits are then the largest tensors of a training step:
# $N \times V$ numbers for $N$ tokens (whatever the width), made only to be reduced to one loss per token. The
# plain path (bf16 logits, a float32 copy, `F.cross_entropy`, its backward, the cast back) writes and reads them
# several times over, mostly in float32. `k3lab.model.loss.linear_cross_entropy` runs the head on chunks of rows and turns each chunk's
# logits into its loss and its gradient $g = \mathrm{softmax}(z) - \mathrm{onehot}(t)$ at once,
# folding $g$ into $dh = g W$ and $dW \mathrel{+}= g^\top h$ before the next chunk (Liger-Kernel's fused linear
# cross-entropy, in PyTorch); `K3Model.forward(idx, targets, return_logits=False)` and the trainer use it. Below:
# the head's share of the FLOPs and the size of the logits at K3's vocabulary (this book's corpus has 4,096 ids,
# where both are small), the chunked loss against `F.cross_entropy` in float64, and, where a GPU run stored it,
# `python -m k3lab.bench.loss`'s table.

# %%
from k3lab.bench.loss import table as loss_table
from k3lab.model.loss import linear_cross_entropy

for name in ("k3-1b", "k3-full"):
    c_ = K3Config.preset(name)
    head = 6 * c_.vocab_size * c_.hidden_size
    N = 16 * 2048
    print(f"{name}: head {head / flops_per_token(c_, 2048):.0%} of the FLOPs per token at T = 2048; logits of "
          f"{N:,} tokens: {N * c_.vocab_size * 4 / 1e9:.0f} GB in float32")
g_ = torch.Generator().manual_seed(seed)
h_ = torch.randn(300, 48, dtype=torch.float64, generator=g_, requires_grad=True)
w_ = torch.randn(1000, 48, dtype=torch.float64, generator=g_, requires_grad=True)
t_ = torch.randint(0, 1000, (300,), generator=g_)
t_[::7] = -100
plain_loss = torch.nn.functional.cross_entropy(h_ @ w_.t(), t_)
plain_grads = torch.autograd.grad(plain_loss, (h_, w_))
chunked_loss = linear_cross_entropy(h_, w_, t_, chunk=64)
chunked_grads = torch.autograd.grad(chunked_loss, (h_, w_))
errs = [rel_rms_error(chunked_loss, plain_loss)] + [rel_rms_error(a, b) for a, b in zip(chunked_grads, plain_grads)]
print("float64, chunks of 64 rows against F.cross_entropy: loss, dh, dW relative errors",
      ", ".join(f"{e:.1e}" for e in errs))
assert max(errs) < 1e-12
found = sorted((ROOT / "data" / "results").glob("loss_h*.json"))
if found:
    print(loss_table(json.loads(found[-1].read_text())))

# %% [markdown]
# ## 6. Experiment: the architecture at a tiny size, Per-Head Muon against AdamW
#
# `preset` is `k3-tiny` on the CPU (`k3-1b` on the GPU profile): K3's architecture at $d = 64$, 5 layers
# (KDA, KDA, KDA, MLA, MLA), the first FFN dense, the rest LatentMoE with Quantile Balancing, Block
# AttnRes; the vocabulary is the corpus tokenizer's.
# Two runs share initialisation, batches, schedule, learning rate, weight decay (RMS matching lets Muon
# share AdamW's) and clipping; only the optimizer differs (`k3lab.lm.train`, MoE bias update `after_step`).

# %% tags=["nbval-ignore-output"]
cfg = K3Config.preset(preset, vocab_size=kdata.vocab_size())
tot_tiny, act_tiny = count_params(cfg)["total"]
print(f"{preset}: {tot_tiny:,} parameters, {act_tiny:,} activated; {batch_size} x {seq_len} tokens a step")
optimizers = {"Per-Head Muon": lambda m, lr_, wd: per_head_muon(m, lr_, wd), "AdamW": None}
runs, models = {}, {}
for name, make in optimizers.items():
    torch.manual_seed(seed)
    models[name] = K3Model(cfg)
    runs[name] = lm.train(models[name], steps, batch_size, seq_len, lr, device, seed=seed, log_every=log_every,
                          optimizer=make, after_step=lambda step, m: update_biases(m),
                          max_seconds=max_seconds or None, desc=name)
fig, ax = plt.subplots(1, 2, figsize=(11, 3.4))
for a_, key, label in ((ax[0], "loss", "train loss (mean since last log)"), (ax[1], "val_loss", "validation loss")):
    for name, hist in runs.items():
        a_.plot(hist["step"], hist[key], marker="o", label=name)
    a_.set(xlabel="step", ylabel=label)
ax[0].legend()
plt.tight_layout()
plt.show()
f_tiny = flops_per_token(cfg, seq_len)
for name, hist in runs.items():
    print(f"{name:<14} val loss {hist['val_loss'][-1]:.3f} after {hist['step'][-1]} steps; "
          f"{np.mean(hist['tokens_per_s']):,.0f} tokens/s = {np.mean(hist['tokens_per_s']) * f_tiny / 1e9:.1f} GFLOP/s")
assert all(np.isfinite(h["val_loss"]).all() and h["val_loss"][-1] < h["val_loss"][0] for h in runs.values())

# %% [markdown]
# One seed, one learning rate, a short run (its tokens a step printed above): both optimizers train the
# architecture; it is not a tuned comparison (exercise 4).
#
# ### Decoding from the caches
#
# `generate()` prefills the prompt once, then feeds one token a step: each KDA layer carries its state and
# convolution tail, each MLA layer its latent cache, read in the absorbed form. The check, in float64 on a
# fresh `k3-tiny`: prefill plus one-token steps equal one forward, up to the float32 MoE router scores;
# then a greedy continuation from each trained model, on a validation prompt. Models trained for a few
# minutes on a CPU repeat themselves (greedy decoding falls into the most likely loop): the point is that the
# cached path decodes, not what it says.

# %%
torch.manual_seed(seed)
m64 = K3Model(K3Config.preset("k3-tiny")).double().eval()
ids = torch.randint(0, 256, (2, 12), generator=g)
with torch.no_grad():
    full_logits, _ = m64(ids)
    logits_p, _, caches = m64(ids[:, :5], use_cache=True)
    parts = [logits_p]
    for t in range(5, ids.shape[1]):
        lg, _, caches = m64(ids[:, t : t + 1], caches=caches, use_cache=True)
        parts.append(lg)
err = rel_rms_error(full_logits, torch.cat(parts, 1))
print(f"prefill 5 + 7 single-token steps vs one forward of 12: rel RMS error {err:.1e}")
print("caches per layer:", [type(c).__name__ for c in caches])
assert err < 1e-7

# %% tags=["nbval-ignore-output"]
tok = kdata.load_tokenizer()
prompt = torch.as_tensor(kdata.load_split("val")[1000:1032].astype(np.int64))[None].to(device)
print("prompt:", repr(tok.decode(prompt[0].tolist())))
for name, model in models.items():
    out = model.eval().generate(prompt, gen_tokens, temperature=0)
    print(f"{name:<14}", repr(tok.decode(out[0, prompt.shape[1]:].tolist())))
    assert out.shape == (1, prompt.shape[1] + gen_tokens)

# %% [markdown]
# ## 7. Explore: where the parameters go
#
# The counts as the MoE's shape changes (meta device, other fields at K3's); JupyterLab's explorer redraws.

# %%
def plot_counts(n_routed_experts: int = 896, num_experts_per_tok: int = 16, moe_latent_size: int = 3584):
    tab = count_params(K3Config.preset("k3-full", n_routed_experts=n_routed_experts,
                                       num_experts_per_tok=num_experts_per_tok, moe_latent_size=moe_latent_size))
    comps = [k for k in tab if k != "total" and tab[k][0] > 0]
    fig_, ax_ = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)
    for a_, col, unit in ((ax_[0], 0, "total"), (ax_[1], 1, "activated")):
        a_.barh(comps, [tab[k][col] / 1e9 for k in comps])
        a_.set(xscale="log", xlabel="billions of parameters", title=f"{unit}: {tab['total'][col] / 1e9:,.1f}B")
    plt.tight_layout()
    plt.show()


plot_counts()
explorer = explore(plot_counts, n_routed_experts=[128, 256, 384, 512, 896, 1024], num_experts_per_tok=(1, 32, 1),
                   moe_latent_size=[1792, 3584, 7168])

# %% [markdown]
# ## 8. Memory policies: what each costs
#
# Training holds every tensor backward will read until it reads it; at K3's width that, not the weights,
# decides how many tokens fit on a card. K3's *unified activation manager* gives each saved tensor a
# storage policy by module name, outside the model code (K3 report, "Training system"); `k3lab.memory` has four:
#
# | policy | what stays on the device until backward | what backward pays |
# |---|---|---|
# | keep | every saved tensor | nothing |
# | recompute | the region's inputs | the region's forward, run again |
# | offload | nothing (a copy in host memory) | the copy back (PCIe on a GPU) |
# | fp8 | 1 byte per value and a float32 scale per 128 values | dequantising; ~$2^{-4}$ relative error per value |
#
# K3 saves only the MoE's dispatch input and recomputes the dispatch, keeps Block AttnRes fully
# checkpointed and recomputes element-wise ops. `k3lab.bench.memory.policy_sets` names the sets as rules on
# `K3Model`'s module names; `k3_mix` is the K3-like one (MoE FFNs recomputed, the dense FFN in fp8, the
# mixers kept); every set but `plain` names every sublayer (docs/model.md).
#
# The check: one float32 step of each set against `keep` on the same weights and tokens, routed to the
# keep run's experts. Recompute and offload store the same values, so their gradients must be equal (on a
# CPU bitwise); fp8 changes what backward reads, never the forward: equal loss, gradients within fp8's error.
# Then each set's step time on these 2 x 64 tokens, and what it holds at the end of forward (device bytes
# per policy as the manager counts them, offload's host copies).

# %% tags=["nbval-ignore-output"]
torch.manual_seed(seed)
mem_model = K3Model(K3Config.preset("k3-tiny", vocab_size=kdata.vocab_size())).to(device).train()
sets = policy_sets(mem_model)
mem_idx = torch.randint(0, mem_model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(seed)).to(device)
mem_check = check_policies(mem_model, mem_idx, sets)

# %%
print("sublayers 0, 2, 4, ... are the mixers, 1 the dense FFN, 3, 5, ... the MoE FFNs")
for name, rules in sets.items():
    groups = {}
    for module, policy in sorted(rules.items(), key=lambda kv: int(kv[0].rpartition(".")[2] or -1)):
        groups.setdefault(policy, []).append(module.removeprefix("sublayers.") or "root")
    print(f"{name:<14}{SET_DOCS[name]}\n{'':<14}" + ("; ".join(f"{p}: {' '.join(m)}" for p, m in groups.items())
                                                   or "(no rules)"))
exact = [n for n, c in mem_check["sets"].items() if c["bound"] == mem_check["exact_bound"]]
fp8_sets = [n for n in mem_check["sets"] if n not in exact]
assert all(c["ok"] for c in mem_check["sets"].values())
print(f"loss and gradients equal to keep's within {mem_check['exact_bound']:.0e}: {', '.join(exact)}")
print(f"within fp8's bound {mem_check['fp8_bound']:.0e}: {', '.join(fp8_sets)}")
if device.type == "cpu":
    assert all(mem_check["sets"][n]["grad_rel_err"] == 0 for n in exact)
    print("on this CPU the exact sets are bitwise equal to keep")

# %% tags=["nbval-ignore-output"]
mem_runs = {}
# Two rounds, each set's fastest step kept: a load spike on a shared CPU slows one round, not the figure.
for _ in range(2):
    for name, rules in sets.items():
        r = measure(mem_model, mem_idx, rules, steps=3, warmup=1)
        # measure reports a CUDA out-of-memory or a recompute replay that routed elsewhere instead of timings.
        assert "step_ms" in r, f"{name}: {r.get('oom') or r.get('error')}"
        if name not in mem_runs or r["step_ms_min"] < mem_runs[name]["step_ms_min"]:
            mem_runs[name] = r
for name, r in mem_runs.items():
    print(f"{name:<15}{r['step_ms_min']:.1f} ms ({r['step_ms_min'] / mem_runs['keep']['step_ms_min']:.2f}x keep)")
names = [n for n in mem_runs if sets[n]]
saved_kib = [mem_runs[n]["saved_total_bytes"] / 2**10 for n in names]
fig, ax = plt.subplots(1, 2, figsize=(11, 3.2))
ax[0].barh(names, saved_kib, label="device")
ax[0].barh(names, [mem_runs[n]["host_bytes"] / 2**10 for n in names], left=saved_kib, label="host (offload)")
ax[0].set(xlabel="KiB held for backward at the end of forward")
ax[0].legend()
ax[1].barh(list(mem_runs), [mem_runs[n]["step_ms_min"] for n in mem_runs])
ax[1].set(xlabel="ms per forward + backward (fastest of 6)")
plt.tight_layout()
plt.show()

# %%
keep_bytes = mem_runs["keep"]["saved_total_bytes"]
print(f"{'set':<15}{'saved KiB':>10}{'host KiB':>10}{'vs keep':>9}   by policy (KiB)")
for name, r in mem_runs.items():
    if not sets[name]:
        print(f"{name:<15}{'n/a':>10}{'n/a':>10}{'':>9}   no policies: the manager sees nothing")
        continue
    by = ", ".join(f"{p} {b / 2**10:.0f}" for p, b in r["saved_bytes"].items())
    print(f"{name:<15}{r['saved_total_bytes'] / 2**10:>10.0f}{r['host_bytes'] / 2**10:>10.0f}"
          f"{r['saved_total_bytes'] / keep_bytes:>9.2f}   {by}")
# What every set keeps at the root (embedding, the AttnRes mixing, head) is the same; the policies change the
# sublayers' share, and recompute keeps only each sublayer's input of it.
rec = mem_runs["recompute"]["saved_bytes"]
sublayer_share = (rec["recompute"] / (keep_bytes - rec["keep"]))
print(f"recompute holds {sublayer_share:.3f} of the bytes keep holds inside the sublayers")
assert sublayer_share < 1 / 3
assert mem_runs["offload"]["host_bytes"] > 0

# %% [markdown]
# On a CPU at this size the times say little (Python overhead dominates; offload copies within one memory).
# What matters is a GPU step's peak memory (`torch.cuda.max_memory_allocated`) against its time, for `k3-1b`
# in bf16 autocast, as `python -m k3lab.bench.memory` measures it into `data/results/memory_<card>.json`:

# %% tags=["nbval-ignore-output"]
found = sorted((ROOT / "data" / "results").glob("memory_h*.json"))
mem_gpu = json.loads(found[-1].read_text()) if found else None
if mem_gpu is None:
    print("no GPU result recorded yet: python -m k3lab.bench.memory on a GPU writes data/results/memory_<card>.json")
else:
    print(memory_table(mem_gpu))
    done = {n: r for n, r in mem_gpu["sets"].items() if "step_ms" in r}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for n, r in done.items():
        ax.scatter(r["step_ms"], r["peak_bytes"] / 2**30)
        ax.annotate(n, (r["step_ms"], r["peak_bytes"] / 2**30), textcoords="offset points", xytext=(5, 3))
    ax.set(xlabel="ms per forward + backward", ylabel="peak GiB of a step",
           title=f"{mem_gpu['preset']}, {mem_gpu['batch_size']} x {mem_gpu['seq_len']}, {mem_gpu['device']}")
    plt.tight_layout()
    plt.show()
    base = done["plain"]
    for n, r in done.items():
        print(f"{n:<14} peak {r['peak_bytes'] / 2**30:5.1f} GiB ({r['peak_bytes'] / base['peak_bytes'] - 1:+.0%}), "
              f"step {r['step_ms']:5.0f} ms ({r['step_ms'] / base['step_ms'] - 1:+.0%}) against plain")
    frontier = [n for n, r in done.items() if not any(
        o is not r and o["peak_bytes"] <= r["peak_bytes"] and o["step_ms"] <= r["step_ms"] for o in done.values())]
    print("no other set both smaller and faster:", ", ".join(frontier))
    above = [f"{n} {r['base_bytes'] / 2**30:.2f}" for n, r in done.items() if r["base_bytes"] > base["base_bytes"] + 2**30 / 100]
    print(f"allocated as a step begins, over 0.01 GiB above plain's {base['base_bytes'] / 2**30:.2f} GiB: {', '.join(above) or 'none'}")

# %% [markdown]
# Read the plot as a frontier: a set earns its place only if no other set is both smaller and faster (the
# second last line). A `start` above plain's (the last line) would be memory one step leaves to the next:
# the recompute sets are the ones at risk, since backward replays their forward, and the MoE layer keeps only
# the forward's routing in `MoE.last_routing`, not the replay's with its graph (`tests/test_moe.py` checks it).
# fp8 pays for quantising with plain PyTorch ops; offload for copies backward waits on.
#
# ## Exercises
#
# 1. In `k3lab.mla.absorbed_attention`, drop `scale=scale` (SDPA's default) and run
#    `tests/test_mla.py`. Which tests fail, and which would pass if every test used $T = 1$?
# 2. Take a real gradient of `k3-tiny`'s MLA `kv_b_proj` from the trained model of Section 6 and print
#    the per-block update RMS per head and as one matrix. How unequal are the heads' gradients?
# 3. At which context does MLA attention reach 10% of $6 N_\text{active}$ (`flops_per_token`), for K3 and `k3-1b`?
# 4. Tune each optimizer's learning rate (three values each): does Per-Head Muon's place against AdamW change?
# 5. With the cache sizes of Section 2, how many 1M-token sequences fit in the memory of one H200
#    (141 GB) beside nothing else, and which layer kind's cache dominates?
# 6. Put fp8 on the KDA mixers (`sublayers.0`, `sublayers.2`, ...) and run `check_policies`. Which
#    gradient leaves fp8's bound, and why does a decay's cumulative sum amplify a 2^-4 error?
#
# ## References
#
# - Kimi Team, *Kimi K3 technical report* (arXiv 2607.24653): Table 1 (shape and counts), Eq. 7 (Gated
#   MLA), Sec. 2.5 (Per-Head Muon).
# - DeepSeek-AI, *DeepSeek-V2* (arXiv 2405.04434), Sec. 2.1: multi-head latent attention and its
#   absorbed form.
# - Kimi Team, *Kimi Linear* (arXiv 2510.26692): KDA, the 3:1 hybrid, NoPE MLA, the low-rank output gate.
# - Kimi Team, *Attention Residuals* (arXiv 2603.15031): Block AttnRes.
# - J. Liu et al., *Muon is Scalable for LLM Training* (Moonlight, arXiv 2502.16982): the RMS-matched
#   learning rate; K. Jordan et al., *Muon* (2024); `torch.optim.Muon` (PyTorch >= 2.9).
# - P.-L. Hsu et al., *Liger Kernel: Efficient Triton Kernels for LLM Training* (arXiv 2410.10989): the
#   fused linear cross-entropy that `linear_cross_entropy` follows.
# - A. Chowdhery et al., *PaLM* (arXiv 2204.02311), App. B: model FLOPs utilisation; Z. Jiang et al.,
#   *MegaScale* (arXiv 2402.15627): 55.2% MFU at 12,288 GPUs.
