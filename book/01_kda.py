# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Kimi Delta Attention (KDA)
#
# **Why.** 69 of K3's 93 layers are KDA layers (K3 report, Table 1). A KDA layer replaces softmax
# attention's KV cache, which grows with every token, by a fixed-size state: per head a
# `d_k × d_v = 128 × 128` matrix, i.e. 96 × 128 × 128 = 1.57M numbers per layer whether the context is
# 8K or 1M tokens, at a constant cost per token. What lets it carry three quarters of a frontier model
# is *how* that state is written: the **delta rule** (a memory trained online by one gradient step per
# token) with a **channel-wise forget gate** (every key channel forgets at its own rate).
#
# Sections: (1) the delta rule as online regression; (2) the channel-wise gate and K3's lower-bounded
# one; (3) the chunkwise (UT/WY) form and its code; (4) the check that they agree, error vs chunk size,
# time vs length; (5) `KDALayer`; (6) an experiment: a tiny LM with KDA vs softmax attention on Python
# code; exercises. The code is `k3lab.kda` and `k3lab.lm`; this notebook imports it.

# %% tags=["parameters"]
profile: str = "cpu"
seed: int = 0
check_T: int = 300
timing_lengths: list = [128, 256, 512, 1024, 2048]
timing_heads: int = 2
timing_repeats: int = 3
naive_max_T: int = 2048
lm_d_model: int = 128
lm_layers: int = 2
lm_heads: int = 2
lm_steps: int = 60
lm_batch_size: int = 8
lm_seq_len: int = 128
lm_lr: float = 3e-3
lm_max_seconds: float | None = None

# %% tags=["nbval-ignore-output"]
import k3lab

device = k3lab.setup(seed=seed, profile=profile)

# %%
import inspect
import math
import time
import timeit

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

from k3lab.kda import KDALayer, chunk_kda, kimi_linear_gate, lower_bounded_gate, naive_recurrent_kda
from k3lab.kda.chunk import chunk_kda_fwd, decayed_scores
from k3lab.testing import rel_rms_error
from k3lab.widgets import explore


def show_source(fn, start=None, end=None):
    """Print ``fn``'s source from the line containing ``start`` up to the line containing ``end``."""
    src = inspect.getsource(fn)
    i = src.index(start) if start else 0
    j = src.index(end, i) if end else len(src)
    print(src[src.rfind("\n", 0, i) + 1:j].rstrip())

# %% [markdown]
# ## 1. The delta rule is online regression
#
# Think of the state $S \in \mathbb{R}^{d_k \times d_v}$ as the weights of a linear map that should
# send each key to its value: $S^\top k \approx v$. When token $t$ brings the pair $(k_t, v_t)$, take
# **one SGD step** on the squared error of that pair, with learning rate $\beta_t$:
#
# $$\mathcal{L}_t(S) = \tfrac12 \lVert S^\top k_t - v_t \rVert^2, \qquad
#   \nabla_S \mathcal{L}_t = k_t\,(S^\top k_t - v_t)^\top,$$
#
# $$S_t = S_{t-1} - \beta_t k_t (k_t^\top S_{t-1} - v_t^\top)
#       = (I - \beta_t k_t k_t^\top)\, S_{t-1} + \beta_t k_t v_t^\top .$$
#
# That is the delta rule (Widrow–Hoff; DeltaNet, Schlag et al. 2021; Yang et al. 2024): the state is a
# *fast-weight memory* whose write is "store $v_t$ at $k_t$, minus what is already stored there".
# Plain linear attention ($S_t = S_{t-1} + k_t v_t^\top$) only adds, so old associations pile up;
# the delta rule corrects them. The output is a read with the query: $o_t = S_t^\top q_t$ (scaled by
# $d_k^{-1/2}$). `k3lab.kda.naive_recurrent_kda` is this rule with the decay of section 2 in front of
# it, one token at a time; its loop (after the input checks) reads:

# %%
show_source(naive_recurrent_kda, "    bounds = ", "    o = torch.stack")

# %% [markdown]
# The check: one `torch.optim.SGD` step on that loss equals one undecayed ($g = 0$) token of it.

# %% tags=["nbval-ignore-output"]
torch.manual_seed(seed)
d_k, d_v = 8, 5
S0 = torch.randn(d_k, d_v, dtype=torch.float64)
k_t = F.normalize(torch.randn(d_k, dtype=torch.float64), dim=0)
v_t, q_t = torch.randn(d_v, dtype=torch.float64), torch.randn(d_k, dtype=torch.float64)
beta_t = 0.7

S = torch.nn.Parameter(S0.clone())
opt = torch.optim.SGD([S], lr=beta_t)
(0.5 * (S.T @ k_t - v_t).pow(2).sum()).backward()
opt.step()

# The same token through the KDA recurrence: shapes [B=1, T=1, H=1, *].
o, S_kda = naive_recurrent_kda(q_t.view(1, 1, 1, d_k), k_t.view(1, 1, 1, d_k), v_t.view(1, 1, 1, d_v),
                               torch.zeros(1, 1, 1, d_k, dtype=torch.float64), torch.tensor([[[beta_t]]], dtype=torch.float64),
                               initial_state=S0.view(1, 1, d_k, d_v), output_final_state=True)
err_sgd = rel_rms_error(S.detach(), S_kda[0, 0])
err_read = rel_rms_error(S.detach().T @ q_t * d_k**-0.5, o[0, 0, 0])
print(f"state after one SGD step vs KDA recurrence: rel error {err_sgd:.1e}; output: {err_read:.1e}")
assert err_sgd < 1e-14 and err_read < 1e-14

# %% [markdown]
# With $\beta = 1$ and a unit key, one step solves the regression for that pair exactly. With
# orthonormal keys nothing interferes, so a $d_k$-wide state stores $d_k$ pairs perfectly; beyond that,
# keys overlap and recall degrades gracefully, the *most recent* pairs best (every write corrects its
# own key's direction). Store $n$ random pairs one after another and read each key back (queries = keys,
# $g = 0$, scale 1):

# %%
d_k = d_v = 32
recall = {}
for n in (8, 16, 32, 64, 128):
    gen = torch.Generator().manual_seed(n)
    keys = F.normalize(torch.randn(1, n, 1, d_k, generator=gen, dtype=torch.float64), dim=-1)
    if n <= d_k:
        keys = torch.linalg.qr(keys[0, :, 0].T)[0].T.reshape(1, n, 1, d_k)  # orthonormal keys
    vals = torch.randn(1, n, 1, d_v, generator=gen, dtype=torch.float64)
    _, S_n = naive_recurrent_kda(keys, keys, vals, torch.zeros_like(keys), torch.ones(1, n, 1, dtype=torch.float64),
                                 output_final_state=True)
    read = keys[0, :, 0] @ S_n[0, 0]  # [n, d_v]: read every key from the final state
    recall[n] = [rel_rms_error(vals[0, i, 0], read[i]) for i in range(n)]
    print(f"n = {n:3d} pairs in a {d_k}x{d_v} state: mean recall error {np.mean(recall[n]):.3f}")
assert max(recall[32]) < 1e-12 and np.mean(recall[128]) > 0.3

fig, ax = plt.subplots(figsize=(6, 3))
for n in (64, 128):
    ax.plot(np.arange(n) - n, recall[n], ".", label=f"{n} pairs")
ax.set(xlabel="age of the pair when read (tokens before the end)", ylabel="rel. recall error",
       title=f"Delta-rule memory, d_k = {d_k}: recent pairs are recalled best")
ax.legend()
plt.show()

# %% [markdown]
# ## 2. The channel-wise forget gate
#
# A memory that never forgets eventually fills up with stale associations. Gated DeltaNet (Yang et
# al. 2025) decays the whole state by a scalar $\alpha_t \in (0,1)$ per head before each write. KDA
# makes the decay **per key channel**, $\alpha_t \in (0,1)^{d_k}$ (K3 report, Eq. 3):
#
# $$S_t = (I - \beta_t k_t k_t^\top)\,\mathrm{Diag}(\alpha_t)\, S_{t-1} + \beta_t k_t v_t^\top,
#   \qquad o_t = S_t^\top q_t .$$
#
# Row $c$ of $S$ holds what the memory associates with key channel $c$: a per-channel decay lets some
# channels of one head keep facts far longer than others refresh theirs; a scalar gate picks one
# timescale per head. The gate is data-dependent ($\alpha_t$ from $x_t$): the model decides *when* to
# forget. Computations use the log-decay $g_t = \log \alpha_t \le 0$.
#
# **The state norm over time.** With L2-normalised keys and $\beta < 1$,
# $\lVert I - \beta k k^\top \rVert \le 1$: the delta rule cannot blow up; plain linear attention has no
# such bound. Over `T_norm` random tokens: linear attention's state grows like $\sqrt t$, the delta rule
# levels off, and the channel-wise decay (K3's gate on random pre-activations) keeps it lower still.
#
# **Per-channel retention** (right): what channel $c$ held at token 0 survives to token $t$ as
# $\prod_{s \le t} \alpha_{s,c} = \exp(\sum_{s\le t} g_{s,c})$. With the channel biases below, one head
# keeps some channels orders of magnitude longer than others (the half-lives are printed after).

# %% tags=["nbval-ignore-output"]
T_norm, d_k, d_v = 2000, 32, 32
gen = torch.Generator().manual_seed(seed)
k_seq = F.normalize(torch.randn(1, T_norm, 1, d_k, generator=gen), dim=-1)
v_seq = torch.randn(1, T_norm, 1, d_v, generator=gen)
beta_seq = torch.sigmoid(torch.randn(1, T_norm, 1, generator=gen))
z_seq = torch.randn(1, T_norm, 1, d_k, generator=gen)
# Per-channel biases spread over timescales (as KDALayer's init does), K3's gate with A_log = 0.
dt_bias = torch.linspace(-7, 0, d_k)
gates = {"delta rule, no decay (g = 0)": torch.zeros(1, T_norm, 1, d_k),
         "KDA, channel-wise lower-bounded gate": lower_bounded_gate(z_seq, torch.zeros(1), dt_bias)}


def state_norms(g, every=20):
    """||S_t||_F every `every` tokens, by carrying the state from chunk_kda call to call."""
    S, norms = None, []
    for sl in (slice(t0, t0 + every) for t0 in range(0, T_norm, every)):
        _, S = chunk_kda(k_seq[:, sl], k_seq[:, sl], v_seq[:, sl], g[:, sl], beta_seq[:, sl],
                         initial_state=S, output_final_state=True)
        norms.append(S.norm().item())
    return np.array(norms)


steps = np.arange(20, T_norm + 1, 20)
fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(12, 3.2))
lin = torch.cumsum(k_seq[0, :, 0, :, None] * v_seq[0, :, 0, None, :], dim=0).flatten(1).norm(dim=1)
ax.plot(steps, lin[19::20], label="linear attention (S += k v^T)")
norms = {}
for name, g in gates.items():
    norms[name] = state_norms(g)
    ax.plot(steps, norms[name], label=name)
ax.set(xlabel="token t", ylabel="||S_t||_F", yscale="log", title="State norm over time")
ax.legend(fontsize=8)
G_cum = gates["KDA, channel-wise lower-bounded gate"][0, :300, 0].cumsum(0)
for c in range(0, d_k, 4):
    ax_r.plot(G_cum[:, c].exp(), color=plt.cm.viridis(c / d_k), label=f"channel {c}")
ax_r.set(xlabel="tokens since write", ylabel="retention", yscale="log", ylim=(1e-6, 1.5),
         title="Per-channel retention in one head (K3 gate)")
ax_r.legend(fontsize=7, ncol=2)
plt.show()
print(f"at t = {T_norm}: linear attention {lin[-1]:.1f}, "
      + ", ".join(f"{n.split(',')[0]} {v[-1]:.1f}" for n, v in norms.items()))
assert lin[-1] > 3 * max(v[-1] for v in norms.values())
assert norms["KDA, channel-wise lower-bounded gate"][-1] < norms["delta rule, no decay (g = 0)"][-1]
half_life = math.log(2) / -gates["KDA, channel-wise lower-bounded gate"][0, :, 0].mean(0)
print(f"half-lives across channels: {half_life.min():.1f} to {half_life.max():.0f} tokens")
assert half_life.max() > 50 * half_life.min()

# %% [markdown]
# ### Two gate parameterisations
#
# The gate maps a pre-activation $z = W_f x$ (per value head and key channel; full rank in K3) to $g$:
#
# - **Kimi Linear**: $g = -e^{A}\,\mathrm{softplus}(z + b)$. Any decay in $(0, 1]$ is reachable,
#   including $\alpha \approx 0$ (forget everything at once).
# - **K3, lower-bounded** (Eq. 5): $g = g_{\min}\,\sigma(e^{A} (z + b))$ with $g_{\min} = -5$, $A$
#   initialised to 0. Every $\alpha_t > e^{-5} \approx 0.0067$: still a near-total reset in one
#   token, but bounded, which lets chapter 02's kernel run its diagonal tiles on tensor cores in bf16
#   (section 3 and `docs/kda.md`). $A$ sets the slope, `lower_bound` the floor of the K3 gate; below
#   the figure, sliders for them in JupyterLab (a headless run builds no widget and prints one line).

# %%
def plot_gates(A_log: float = 0.0, lower_bound: float = -5.0, dt_bias: float = 0.0):
    z, A, b = torch.linspace(-8, 8, 401).view(1, -1, 1, 1), torch.tensor([A_log]), torch.tensor([dt_bias])
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.plot(z.flatten(), lower_bounded_gate(z, A, b, lower_bound=lower_bound).exp().flatten(),
            label=f"K3 lower-bounded (floor e^{lower_bound:g} = {math.exp(lower_bound):.2g})")
    ax.plot(z.flatten(), kimi_linear_gate(z, A, b).exp().flatten(), label="Kimi Linear")
    ax.axhline(math.exp(lower_bound), color="gray", ls=":", lw=1)
    ax.set(xlabel="pre-activation z", ylabel="retention alpha = exp(g)", yscale="log", ylim=(1e-6, 2),
           title=f"alpha vs z (A_log = {A_log:g}, dt_bias = {dt_bias:g})")
    ax.legend(fontsize=8)
    plt.show()


plot_gates()

# %% tags=["nbval-ignore-output"]
explorer = explore(plot_gates, A_log=(-3.0, 3.0, 0.25), lower_bound=(-10.0, -0.5, 0.5),
                   dt_bias=(-8.0, 4.0, 0.5))

# %% [markdown]
# ## 3. From the recurrence to the chunkwise form
#
# The recurrence is sequential: $T$ tiny rank-1 updates, no matrix multiplies. Training needs
# matmuls, so split the sequence into chunks of $C$ tokens (64 here), carry the state only across
# chunk boundaries, and do everything inside a chunk with $C \times C$ and $C \times d$ matrices.
#
# **Within a chunk.** Let $S$ be the state entering the chunk, positions $i = 1..C$, and
# $\Gamma_i = \prod_{s\le i} \alpha_s \in (0,1]^{d_k}$ the cumulative decay (in log space
# $G_i = \sum_{s \le i} g_s$). Write each token's update as a rank-1 write of a *pseudo-value*
# $\tilde v_i$:
#
# $$S_i = \mathrm{Diag}(\alpha_i) S_{i-1} + k_i \tilde v_i^\top, \qquad
#   \tilde v_i = \beta_i\big(v_i - S_{i-1}^\top \mathrm{Diag}(\alpha_i) k_i\big).$$
#
# Unrolling, $S_i = \mathrm{Diag}(\Gamma_i) S + \sum_{j \le i} \mathrm{Diag}(\Gamma_i/\Gamma_j)\, k_j \tilde v_j^\top$.
# Substituting this into $\tilde v_i$ gives a linear system for all pseudo-values at once:
#
# $$\tilde v_i + \beta_i \sum_{j<i} \big(k_i^\top \mathrm{Diag}(\Gamma_i/\Gamma_j)\, k_j\big)\, \tilde v_j
#   = \beta_i\big(v_i - (\Gamma_i \odot k_i)^\top S\big)$$
#
# $$\big(I + \mathrm{StrictTril}(\mathrm{Diag}(\beta)\,(\Gamma \odot K)(K/\Gamma)^\top)\big)\,\tilde V
#   = \mathrm{Diag}(\beta)\big(V - (\Gamma\odot K) S\big).$$
#
# The matrix is unit lower triangular, so it is always invertible. With
# $M = (I + \mathrm{StrictTril}(\cdot))^{-1}\mathrm{Diag}(\beta)$ (the **UT transform**), $W = M(\Gamma\odot K)$
# and $U = MV$ (the **WY representation** of the product of Householder-like factors
# $I - \beta k k^\top$):
#
# $$\tilde V = U - W S, \qquad
#   O = (\Gamma\odot Q)\, S + \mathrm{Tril}\big((\Gamma\odot Q)(K/\Gamma)^\top\big)\, \tilde V,$$
# $$S_{\text{next}} = \mathrm{Diag}(\Gamma_C)\, S + \big((\Gamma_C/\Gamma) \odot K\big)^\top \tilde V .$$
#
# $U$, $W$ and the $C\times C$ score matrices depend only on the chunk's own inputs, so they are
# computed for all chunks in parallel; only $\tilde V = U - WS$ and the state update are sequential,
# and both are matmuls. `k3lab.kda.chunk_kda` is exactly this; its core, `chunk_kda_fwd`, after the
# inputs are padded to whole chunks and the heads expanded:

# %%
show_source(chunk_kda_fwd, "    B, HV, T, K = k.shape")

# %% [markdown]
# **Why $1/\Gamma$ is never formed.** The factorised form $(\Gamma\odot K)(K/\Gamma)^\top$ is how the
# math reads, but $1/\Gamma_j = e^{-G_j}$ overflows float32 (max $\approx e^{88.7}$) after a few dozen
# tokens of strong decay, and $0 \cdot \infty$ gives NaN. Every entry needed is $\exp(G_i - G_j)$,
# $j \le i$, a number in $(0, 1]$: `decayed_scores` takes pairwise differences inside each 16-token
# diagonal sub-tile, and left of the diagonal a reference point $r$ at the sub-tile's start,
# $e^{G_i - G_j} = e^{G_i - r}\, e^{r - G_j}$, both factors $\le 1$ (`docs/kda.md` has what K3's bound
# allows the Triton kernel instead).

# %% tags=["nbval-ignore-output"]
C, d_k = 64, 16
gen = torch.Generator().manual_seed(seed)
k_c = F.normalize(torch.randn(C, d_k, generator=gen), dim=-1)
for g_value in (-0.5, -2.0, -5.0):
    G = torch.full((C, d_k), g_value).cumsum(0)
    factorised = ((k_c * G.exp()) @ (k_c * (-G).exp()).T).tril()
    stable = decayed_scores(k_c, k_c, G, inclusive=True)
    exact = decayed_scores(k_c.double(), k_c.double(), G.double(), inclusive=True)
    print(f"g = {g_value:4.1f} per token (G down to {G.min().item():6.0f}): factorised (Gamma K)(K/Gamma)^T "
          f"{'finite' if torch.isfinite(factorised).all() else 'has inf/NaN'}, rel err "
          f"{rel_rms_error(exact, factorised):.1e}; decayed_scores rel err {rel_rms_error(exact, stable):.1e}")
    assert rel_rms_error(exact, stable) < 1e-6
assert not torch.isfinite(factorised).all()

# %% [markdown]
# ## 4. The check: chunkwise == recurrence
#
# Fresh random inputs (never zeros) with the awkward features of real use: a length that is not a
# multiple of the chunk, more value heads than query/key heads (GVA: value head $i$ reads q/k head
# $i \cdot H / H_V$), an initial state, and packed variable-length sequences (`cu_seqlens`), some
# shorter than a chunk. Each line prints the error and its bound. `tests/test_kda.py` covers more:
# $T \in \{1, 7, 63, 64, 65, 500, 1000\}$, head dims 64/100/128, $g = 0$, 20 identical keys in a row,
# un-normalised fp16 keys, and gradients.

# %% tags=["nbval-ignore-output"]
def kda_inputs(T, H, HV, K, V, N=1, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    # B = 1; N > 1 initial states are for N sequences packed with cu_seqlens.
    return dict(q=rand(1, T, H, K).to(dtype), k=F.normalize(rand(1, T, H, K), dim=-1).to(dtype), v=rand(1, T, HV, V).to(dtype),
                g=lower_bounded_gate(rand(1, T, HV, K), torch.zeros(HV, dtype=torch.float64)).to(dtype),
                beta=torch.sigmoid(rand(1, T, HV)).to(dtype), initial_state=rand(N, HV, K, V).to(dtype))


lengths = [5, 60, 131, check_T - 196]
cu = torch.tensor(np.cumsum([0] + lengths))
checks = [("float64, T=%d, H=2, HV=4, K=V=32" % check_T, kda_inputs(check_T, 2, 4, 32, 32), None, 1e-12),
          ("float64, varlen %s, GVA" % lengths, kda_inputs(check_T, 2, 4, 32, 32, N=4, seed=1), cu, 1e-12),
          ("float32, T=%d, H=2, HV=4, K=V=32" % check_T, kda_inputs(check_T, 2, 4, 32, 32, dtype=torch.float32, seed=2),
           None, 1e-5)]
for name, inputs, cu_seqlens, tol in checks:
    ref64 = {key: x.double() for key, x in inputs.items()}
    o_ref, s_ref = naive_recurrent_kda(**ref64, output_final_state=True, cu_seqlens=cu_seqlens)
    o, s = chunk_kda(**inputs, output_final_state=True, cu_seqlens=cu_seqlens)
    e_o, e_s = rel_rms_error(o_ref, o), rel_rms_error(s_ref, s)
    print(f"{name:45s} rel error: output {e_o:.1e}, final state {e_s:.1e}  (bound {tol:.0e})")
    assert e_o < tol and e_s < tol

# %% [markdown]
# Bad inputs are refused with a `ValueError` that names the argument (never a hang or a NaN):

# %%
good = kda_inputs(10, 2, 4, 8, 8)
for label, bad in [("HV not a multiple of H", dict(good, v=good["v"][:, :, :3])),
                   ("duplicate cu_seqlens offsets", dict(good, cu_seqlens=torch.tensor([0, 4, 4, 10]))),
                   ("a positive log-decay", dict(good, g=-good["g"])),
                   ("a NaN in k", dict(good, k=good["k"].clone().fill_(float("nan"))))]:
    try:
        chunk_kda(**bad)
        raise AssertionError(f"{label} was accepted")
    except ValueError as err:
        print(f"{label:30s} -> ValueError: {err}")

# %% [markdown]
# **Error vs chunk size.** The chunk size changes the order of operations, not the math ($C = 1$ *is*
# the recurrence): the float32 error grows with $C$ (longer in-chunk sums and triangular solves) but
# stays near float32 round-off for every $C$.

# %% tags=["nbval-ignore-output"]
inputs64 = kda_inputs(512, 1, 2, 64, 64, seed=3)
o_ref, _ = naive_recurrent_kda(**inputs64)
inputs32 = {key: x.float() for key, x in inputs64.items()}
chunk_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
errors = [rel_rms_error(o_ref, chunk_kda(**inputs32, chunk_size=c)[0]) for c in chunk_sizes]
print("\n".join(f"C = {c:3d}: rel error {e:.2e}" for c, e in zip(chunk_sizes, errors)))
assert max(errors) < 1e-5
fig, ax = plt.subplots(figsize=(5.5, 3))
ax.loglog(chunk_sizes, errors, "o-", base=2)
ax.set(xlabel="chunk size C", ylabel="rel. RMS error vs float64 recurrence", ylim=(1e-8, 1e-4),
       title="chunk_kda in float32, T = 512, K = V = 64")
plt.show()

# %% [markdown]
# **Time vs sequence length** (forward, B = 1, K = V = 64, on this machine): the recurrence is $T$
# sequential steps; the chunkwise form $T/C$ sequential steps of matmuls, $O(T C d)$ work; causal
# softmax attention (`F.scaled_dot_product_attention`, one fused kernel) $O(T^2 d)$. At these lengths
# the fused kernel beats plain-PyTorch `chunk_kda`; what carries over is the slopes. Chapter 02 has the
# Triton kernel and its H200 times against the roofline.

# %% tags=["nbval-ignore-output"]
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def best_time(fn, repeats=timing_repeats):
    """The best of ``repeats`` calls of ``fn`` in seconds: wall time on GPU; on CPU one thread's CPU time
    (a shared machine's wall clock, and threads' waits on each other, move with other jobs)."""
    if device.type == "cuda":
        return min(timeit.repeat(lambda: (sync(), fn(), sync()), timer=time.perf_counter, number=1, repeat=repeats))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return min(timeit.repeat(fn, timer=time.process_time, number=1, repeat=repeats))
    finally:
        torch.set_num_threads(threads)


timings = {"naive recurrence": [], "chunk_kda (C=64)": [], "softmax attention (SDPA)": []}
with torch.no_grad():
    for T in timing_lengths:
        x = {key: val.float().to(device) for key, val in kda_inputs(T, timing_heads, timing_heads, 64, 64, seed=T).items()}
        x.pop("initial_state")
        qa, ka, va = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
        chunk_kda(**x)  # warm-up
        for name, fn in zip(timings, (lambda: naive_recurrent_kda(**x), lambda: chunk_kda(**x),
                                      lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True))):
            timings[name].append(float("nan") if name == "naive recurrence" and T > naive_max_T else best_time(fn))
        print(f"T = {T:5d}: " + ", ".join(f"{n} {v[-1] * 1e3:8.2f} ms" for n, v in timings.items()))
fig, ax = plt.subplots(figsize=(6, 3.5))
for name, ts in timings.items():
    ax.loglog(timing_lengths, np.array(ts) * 1e3, "o-", label=name)
ax.loglog(timing_lengths, timings["chunk_kda (C=64)"][0] * 1e3 * np.array(timing_lengths) / timing_lengths[0], "k:",
          lw=1, label="slope 1")
ax.set(xlabel="sequence length T", ylabel="forward time (ms)" + (" of CPU" if device.type == "cpu" else ""),
       title=f"KDA vs attention on {device.type}")
ax.legend(fontsize=8)
plt.show()
assert all(np.isfinite(timings["chunk_kda (C=64)"]))

# %% [markdown]
# ## 5. The KDA layer
#
# `KDALayer` wraps the operator the way K3 uses it (K3 report, Sec. 2.1; Kimi Linear, Sec. 3):
#
# $$q, k = \mathrm{L2Norm}(\mathrm{SiLU}(\mathrm{ShortConv}(W_{q,k}\,x))), \quad
#   v = \mathrm{SiLU}(\mathrm{ShortConv}(W_v x)), \quad \beta = \sigma(W_\beta x), \quad
#   g = \mathrm{gate}(W_f x)$$
# $$y = W_o\big[\sigma(W_g x) \odot \mathrm{RMSNorm}_{\text{head}}(\mathrm{KDA}(q, k, v, g, \beta))\big].$$
#
# **Short convolutions** (depthwise, causal, kernel 4) give each token local context before it is
# written; **L2-normalised keys** keep $\lVert I - \beta k k^\top\rVert \le 1$ (section 2); the decay
# projection and output gate are full rank in K3; with **GVA** several value heads share a q/k head. For
# decoding, the cache holds each convolution's last 3 inputs and $S$: token-by-token generation gives
# the full-sequence output exactly, at a cost per token independent of $T$.

# %% tags=["nbval-ignore-output"]
torch.manual_seed(seed)
layer = KDALayer(d_model=64, num_heads=2, head_dim=16, num_v_heads=4).double()
x_seq = torch.randn(2, 40, 64, dtype=torch.float64)
y_full, cache_full = layer(x_seq)
cache, ys = None, []
for t in range(x_seq.shape[1]):
    y_t, cache = layer(x_seq[:, t : t + 1], cache=cache)
    ys.append(y_t)
err_decode = rel_rms_error(y_full, torch.cat(ys, dim=1))
err_state = rel_rms_error(cache_full.state, cache.state)
print(f"token-by-token decoding vs full sequence: rel error {err_decode:.1e} (state {err_state:.1e})")
assert err_decode < 1e-12 and err_state < 1e-12
print(f"cache per sequence: conv states {list(cache.conv_q.shape[1:])} (q), {list(cache.conv_k.shape[1:])} (k), "
      f"{list(cache.conv_v.shape[1:])} (v); recurrent state {list(cache.state.shape[1:])}")
print("parameters:", {n: list(p.shape) for n, p in layer.named_parameters()})

# %% [markdown]
# ## 6. Experiment: a tiny LM with KDA vs softmax attention, on real Python
#
# Two models identical but for the token mixer (`k3lab.lm.LM`: embedding, [mixer, SwiGLU] blocks with
# pre-RMSNorm, tied head), same seed, batches, schedule and steps, on chapter 00's CPython-stdlib corpus:
# a sanity check that KDA learns language as readily as attention at this scale, not a benchmark (on
# CPU a short run whose tokens the cell prints; `params/h200.yaml` trains a larger model for longer).

# %% tags=["nbval-ignore-output"]
from k3lab import data
from k3lab.lm import LM, LMConfig, count_params, train

histories, models = {}, {}
print(f"{lm_steps} steps of {lm_batch_size} x {lm_seq_len} tokens: {lm_steps * lm_batch_size * lm_seq_len:,} "
      "training tokens per model")
for mixer in ("attention", "kda"):
    torch.manual_seed(seed)
    models[mixer] = LM(LMConfig.tiny(vocab_size=data.vocab_size(), d_model=lm_d_model, n_layers=lm_layers,
                                     n_heads=lm_heads, head_dim=lm_d_model // lm_heads, mixer=mixer,
                                     max_seq_len=lm_seq_len))
    print(f"{mixer}: {count_params(models[mixer], exclude_embedding=True):,} non-embedding parameters")
    histories[mixer] = train(models[mixer], steps=lm_steps, batch_size=lm_batch_size, seq_len=lm_seq_len,
                             lr=lm_lr, device=device, seed=seed, log_every=max(1, lm_steps // 15),
                             max_seconds=lm_max_seconds)

# %% tags=["nbval-ignore-output"]
# Cost of one training step (forward + backward), timed after training with best_time.
x_step, y_step = data.get_batch(data.load_split("train"), lm_batch_size, lm_seq_len,
                                torch.Generator().manual_seed(seed), device)


def train_step(model):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model(x_step, y_step)[1]
    loss.backward()
    model.zero_grad(set_to_none=True)


step_cost = {mixer: best_time(lambda: train_step(m)) for mixer, m in models.items()}

fig, axes = plt.subplots(1, 2, figsize=(11, 3.5), gridspec_kw=dict(width_ratios=(2, 1)))
for (mixer, h), color in zip(histories.items(), ("tab:blue", "tab:orange")):
    axes[0].plot(h["step"], h["loss"], "-", color=color, label=f"{mixer} train")
    axes[0].plot(h["step"], h["val_loss"], "--", color=color, label=f"{mixer} val")
axes[1].bar(list(step_cost), [t * 1e3 for t in step_cost.values()], color=("tab:blue", "tab:orange"))
axes[0].set(xlabel="step", ylabel="loss (nats/token)", title=f"Tiny LM on CPython source, {lm_seq_len}-token windows")
axes[0].legend(fontsize=8)
axes[1].set(ylabel="ms" + (" of CPU" if device.type == "cpu" else ""),
            title=f"One training step, B={lm_batch_size}, T={lm_seq_len} ({device.type})")
plt.show()
print("cost per training step: " + ", ".join(f"{m} {t * 1e3:.0f} ms" for m, t in step_cost.items()))
ln_vocab = math.log(data.vocab_size())
for mixer, h in histories.items():
    print(f"{mixer:9s}: {h['step'][-1]} steps, val loss {h['val_loss'][0]:.3f} -> {h['val_loss'][-1]:.3f} "
          f"(uniform: {ln_vocab:.2f}), {np.median(h['tokens_per_s']):,.0f} tokens/s")
    assert all(np.isfinite(h["val_loss"])) and h["val_loss"][-1] < ln_vocab
    # Budgeted by steps, so a loaded machine changes the time, not the result; holds from ~50 steps on.
    if h["step"][-1] == lm_steps >= 50:
        assert h["val_loss"][-1] < ln_vocab - 1.5, h["val_loss"]
final = {mixer: h["val_loss"][-1] for mixer, h in histories.items()}
gap, ratio = final["kda"] - final["attention"], step_cost["kda"] / step_cost["attention"]
print(f"final validation loss: kda {final['kda']:.2f}, attention {final['attention']:.2f} nats ({gap:+.2f}); "
      f"a KDA step costs {ratio:.1f}x an attention step")

# %% [markdown]
# Reading the run (the last line above): the two models learn at a similar pace per step, and the
# final losses differ by a fraction of a nat (KDA's short convolutions give it cheap local n-gram
# features). One seed, few tokens: "KDA is a working token mixer", not a ranking. On a CPU a KDA step
# costs more because `chunk_kda` is plain PyTorch looping over chunks, against one fused attention
# kernel. On a GPU the layer runs chapter 02's FlashKDA, and at these 512-token windows a KDA step still
# costs more (on the GPU profile the last line above gives the ratio; the stored outputs are the CPU
# run's): the short convolutions, the gate projections and
# several kernel launches per layer against one attention kernel whose $T^2$ term is still small. KDA's advantage is in how its
# cost grows with $T$: linearly, against attention's quadratic growth (the timing table above).
#
# What did the KDA model's gates learn? Per key channel, the mean log-decay on validation text gives a
# half-life $\ln 2 / (-\bar g)$. The `dt_bias` initialisation spreads them on purpose, so the untrained
# model (same seed) is drawn in grey: the difference is what training on real code did to the gates.

# %% tags=["nbval-ignore-output"]
x_val, _ = data.get_batch(data.load_split("val"), 4, lm_seq_len, torch.Generator().manual_seed(seed), device)
torch.manual_seed(seed)
untrained = LM(models["kda"].config).to(device)


def channel_half_lives(model):
    """Per KDA layer, ln 2 / -mean(g) per (value head, key channel) on x_val, from each layer's
    (pre-normed) input captured by a forward hook."""
    layers = [m for m in model.modules() if isinstance(m, KDALayer)]
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, args[0]))
             for i, m in enumerate(layers)]
    with torch.no_grad():
        model.eval()(x_val)
        for hook in hooks:
            hook.remove()
        return [(math.log(2) / -m.log_decay(seen[i]).mean(dim=(0, 1)).flatten()).cpu().numpy()
                for i, m in enumerate(layers)]


fig, axes = plt.subplots(1, lm_layers, figsize=(5 * lm_layers, 3), squeeze=False)
for i, (before, after) in enumerate(zip(channel_half_lives(untrained), channel_half_lives(models["kda"]))):
    bins = np.linspace(-0.5, 3, 36)
    axes[0, i].hist(np.log10(before), bins=bins, color="gray", alpha=0.5, label="at init")
    axes[0, i].hist(np.log10(after), bins=bins, color="tab:orange", alpha=0.6, label="trained")
    axes[0, i].set(xlabel="log10 half-life (tokens)", ylabel="key channels", title=f"KDA layer {i}")
    axes[0, i].legend(fontsize=8)
    moved = np.abs(np.log10(after) - np.log10(before))
    print(f"layer {i}: half-lives {after.min():.1f} to {after.max():.0f} tokens (median {np.median(after):.1f}; "
          f"at init {np.median(before):.1f}); median change x{10 ** np.median(moved):.2f}, max x{10 ** moved.max():.1f}")
    assert np.isfinite(after).all() and after.min() >= math.log(2) / 5
plt.show()

# %% [markdown]
# ## Exercises
#
# 1. Section 1 stores pairs at $\beta = 1$. Rerun the recall experiment with $\beta = 0.5$: which pairs
#    are recalled worse, the old or the recent ones, and why?
# 2. Give the delta rule of section 2 a *scalar* gate (one $g$ per head, the mean of the channel-wise one).
#    Where does its state norm end, and what happens to the spread of half-lives?
# 3. In section 3, add `g_value = -20`. Does `decayed_scores` stay finite in float32, and after how
#    many tokens of that gate does the factorised form overflow?
# 4. Time `chunk_kda` at $C = 16, 64, 256$ for $T = 2048$. Which term of $O(TCd)$ work against $T/C$
#    sequential steps wins on this machine?
# 5. Train the LM experiment with `lm_steps = 200`. Does the gap between the two final losses shrink?

# %% [markdown]
# ## References
#
# - Kimi Team, *Kimi K3: Open Frontier Intelligence*, arXiv 2607.24653 — Sec. 2.1 and Eq. 3–5 (KDA,
#   lower-bounded gate), Table 1.
# - Kimi Team, *Kimi Linear: An Expressive, Efficient Attention Architecture*, arXiv 2510.26692 — KDA,
#   its chunkwise algorithm and gate.
# - S. Yang, B. Wang, Y. Zhang, Y. Shen, Y. Kim, *Parallelizing Linear Transformers with the Delta Rule
#   over Sequence Length*, NeurIPS 2024 — the WY/UT chunkwise delta rule.
# - S. Yang, J. Kautz, A. Hatamizadeh, *Gated Delta Networks*, ICLR 2025 — the scalar-gated delta rule.
# - I. Schlag, K. Irie, J. Schmidhuber, *Linear Transformers Are Secretly Fast Weight Programmers*,
#   ICML 2021 — the delta rule as a fast-weight update.
# - fla-org/flash-linear-attention (`fla/ops/kda`) — the reference implementation and its tests.
