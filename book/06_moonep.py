# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · MoonEP: perfectly balanced expert parallelism
#
# **Why.** Every K3 MoE layer routes each token to 16 of 896 experts (K3 report, Table 1). Expert
# parallelism (EP) spreads the experts over R ranks, E/R on each, and sends every token-expert pair to
# the rank that holds its expert. The layer finishes when its busiest rank does: whatever one rank gets
# above the mean, every other rank spends waiting. And because the counts change with every batch,
# plain all-to-all EP must read them back to the host to size its buffers (a sync per layer) and
# allocates buffers of a new size each time.
#
# **MoonEP** (K3 report, Sec. 4 and App. E) gives every rank *exactly* S·K pairs per micro-batch
# (S tokens a rank, top-K), on static shapes, by replicating hot experts from the current router
# output onto under-loaded ranks; App. E proves that at most E/R redundant experts per rank always
# suffice. This chapter:
# 1. measures the imbalance a router produces, at K3's E and K;
# 2. states the E/R theorem, its proof idea and the example that shows the bound is nearly tight;
# 3. runs the planner (App. E's constructive fill: the plain-Python reference and the tensor version
#    with no host sync), shows the fill as one Triton kernel, and draws the plan as a rank × expert
#    grid, with an explorer;
# 4. runs dispatch, experts and combine on 2 CPU ranks (gloo) and checks them against one process;
# 5. reads the planner latency and the simulated step time under routing skew from the GPU benchmark.
#
# All code is in `k3lab.moonep` (`planner.py`, `naive.py`, `dispatch.py`, `alltoall.py`, `ep.py`,
# `workers.py`) and `k3lab.bench.moonep`; this notebook imports it.

# %% tags=["parameters"]
profile: str = "cpu"
seed: int = 0
router_tokens: int = 4096
router_dim: int = 64
token_mean: float = 0.3
k3_ranks: int = 64
demo_E: int = 32
demo_R: int = 8
demo_S: int = 64
demo_K: int = 2
demo_maxvio: float = 2.0
reference_trials: int = 200
ep_ranks: list = [2]

# %% tags=["nbval-ignore-output"]
import k3lab

device = k3lab.setup(seed=seed, profile=profile)

# %%
import importlib.util
import json
import math
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Rectangle

from k3lab.bench.moonep import skew_counts, sync_check
from k3lab.book import ROOT
from k3lab.dist import launch
from k3lab.kernels import numpy_supports_interpreter
import k3lab.moe as moe
from k3lab.moe import MoEConfig, Router
from k3lab.moonep import layout, plan, plan_reference
from k3lab.moonep.workers import Case, check_worker, gather_ranks, make_routing, reference, tightness_counts
from k3lab.testing import rel_rms_error
from k3lab.widgets import explore

# %% [markdown]
# ## 1. The imbalance
#
# A freshly initialised K3-shaped router (`k3lab.moe.Router`, chapter 05: sigmoid scores, top-K) on
# synthetic tokens that share a mean direction, as hidden states do. Its experts are grouped into
# `k3_ranks` EP ranks of E/R consecutive experts each, as plain EP places them.

# %%
k3 = MoEConfig.k3()
E3, K3 = k3.n_experts, k3.top_k
gen = torch.Generator().manual_seed(seed)
router = Router(router_dim, E3, K3, init_std=router_dim ** -0.5)
with torch.no_grad():
    router.weight.copy_(torch.randn(E3, router_dim, generator=gen) * router_dim ** -0.5)
x = torch.randn(router_tokens, router_dim, generator=gen) + token_mean * torch.randn(router_dim, generator=gen)
with torch.no_grad():
    routing = router(x)
load = torch.zeros(E3).scatter_add_(0, routing.topk_idx.reshape(-1), torch.ones(router_tokens * K3))
rank_load = load.view(k3_ranks, -1).sum(1)
busiest = float(rank_load.max() / rank_load.mean())
print(f"K3 router: E = {E3} experts, top-{K3}, {router_tokens} tokens -> {router_tokens * K3} pairs")
print(f"expert maxvio (max / mean - 1): {moe.maxvio(load):.2f}")
print(f"over R = {k3_ranks} ranks ({E3 // k3_ranks} experts each): busiest rank {busiest:.2f}x the mean, "
      f"idlest {float(rank_load.min() / rank_load.mean()):.2f}x")
print(f"-> in the expert GEMMs the other ranks wait {100 * (1 - 1 / busiest):.0f}% of the busiest rank's time")

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3))
ax0.bar(range(E3), load.numpy(), width=1.0, color="C0")
ax0.axhline(float(load.mean()), color="k", lw=0.8, ls="--", label="mean")
ax0.set(xlabel="expert", ylabel="pairs", title="pairs per expert (one batch)")
ax0.legend(fontsize=8)
ax1.bar(range(k3_ranks), (rank_load / rank_load.mean()).numpy(), width=1.0, color="C3")
ax1.axhline(1.0, color="k", lw=0.8, ls="--")
ax1.set(xlabel="EP rank (home experts)", ylabel="load / mean", title=f"all-to-all EP over {k3_ranks} ranks")
plt.tight_layout()
plt.show()

# %% [markdown]
# Load balancing (chapter 05's Quantile Balancing) pushes the router towards even loads over many
# steps, but any one micro-batch still deviates. MoonEP removes the deviation inside the EP step
# itself.
#
# ## 2. The E/R theorem
#
# Setting: R ranks, E experts, L = E/R homed on each (expert e on rank e // L). Rank r routes S tokens
# to K experts: `counts[r, e]` pairs, each row summing to S·K, so all ranks hold R·S·K pairs and the
# balanced load is C = S·K per rank.
#
# **Theorem (App. E).** For any counts there is an assignment of pairs to ranks in which every rank
# processes exactly C pairs, all of a rank's non-home (redundant) experts come from a single home rank
# (its *donor*), hence at most E/R redundant experts per rank, and no expert is replicated twice on
# one rank.
#
# **Proof idea: a constructive fill.** Let `load(h)` be the pairs of rank h's home experts. While some
# rank is below C, take the least-loaded rank u (the receiver) and the most-loaded rank d (the donor,
# necessarily above C since the total is R·C), and move exactly `C − load(u)` of the donor's pairs to
# u, the donor's experts with the most pairs left first. A donor was never a receiver, so its load is
# its own experts' pairs, more than C ≥ the need: it has enough. After the fill u sits at C for good
# (a rank at C is never below C, and never the most loaded unless every rank is at C), so each fill
# brings one more rank to C, and once R − 1 ranks are at C the last one is too: **at most R − 1
# fills**. (A donor may drop below C and be filled later itself; a rank at C never donates.) A
# receiver is filled once, from one donor, so its redundant experts are some of that donor's L
# experts: **at most E/R**, never the same expert twice.
#
# **Nearly tight.** Let rank 0's experts receive nothing and the other (R − 1)·L experts share the
# R·C pairs evenly, n = R·C / ((R − 1) L) each. Rank 0 must take C pairs, none of them its own, at
# most n per expert: it needs at least C / n = E(R − 1)/R² distinct redundant experts. The planner,
# live, on that load (`k3lab.moonep.workers.tightness_counts` builds it):

# %%
for E, R in [(demo_E, demo_R), (E3, k3_ranks)]:
    counts, S = tightness_counts(E, R, K=demo_K)
    p = plan(counts, S, demo_K)
    lower = math.ceil(E * (R - 1) / R**2)
    print(f"E={E:4d} R={R:3d}: rank 0 hosts {int(p.redundant()[0])} redundant experts; lower bound "
          f"ceil(E(R-1)/R^2) = {lower}, theorem's bound E/R = {E // R}; every rank processes "
          f"{sorted(set(p.offsets[:, -1].tolist()))} pairs (S*K = {S * demo_K})")
k3_extra = (E3 // k3_ranks) * 3 * k3.latent_dim * k3.expert_hidden * 2
print(f"K3 at R = {k3_ranks}: room for {E3 // k3_ranks} redundant experts per rank = "
      f"{k3_extra / 2**30:.2f} GiB of bf16 expert weights (3 x {k3.latent_dim} x {k3.expert_hidden} each)")

# %% [markdown]
# ## 3. The planner
#
# `plan_reference` (`naive.py`) is the fill exactly as the proof states it, over Python lists: a
# `while` loop, the donor's experts sorted each time. `plan` (`planner.py`, its torch backend, which a
# CPU runs) is the same fill on tensors, as a model step needs it: always R − 1 steps (a step with no rank below C moves nothing),
# `argmin`/`argmax`/`sort`/`cumsum` on the device, no `.item()`, no `.tolist()`, no shape that depends
# on the data, so it can run inside a CUDA graph. The two must agree on every field:

# %%
gen = torch.Generator().manual_seed(seed + 1)
agree = 0
for trial in range(reference_trials):
    R = [2, 4, 8][trial % 3]
    L = 1 + trial % 5
    S, K = 16, 1 + trial % 3
    E = R * L
    w = torch.rand(E, generator=gen) ** (1 + trial % 4) + 1e-3
    counts = torch.stack([torch.zeros(E, dtype=torch.int64).scatter_add_(
        0, torch.multinomial(w, S * K, replacement=True, generator=gen), torch.ones(S * K, dtype=torch.int64))
        for _ in range(R)])
    a, b = plan(counts, S, K), plan_reference(counts, S, K)
    agree += all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("keep", "give", "donor", "assign", "offsets"))
print(f"plan == plan_reference on {agree} of {reference_trials} random loads (R in 2, 4, 8; skewed weights)")
assert agree == reference_trials

gen = torch.Generator().manual_seed(seed)
demo_idx = make_routing("zipf", demo_R, demo_S, demo_K, demo_E, gen)
demo_counts = torch.stack([torch.bincount(demo_idx[r].reshape(-1), minlength=demo_E) for r in range(demo_R)])
print("no host sync in plan + layout:", sync_check(demo_counts, demo_idx[0], demo_S, demo_K))

# %% tags=["nbval-ignore-output"]
t0 = time.perf_counter()
for _ in range(20):
    plan(demo_counts, demo_S, demo_K)
t_plan = (time.perf_counter() - t0) / 20
t0 = time.perf_counter()
for _ in range(20):
    plan_reference(demo_counts, demo_S, demo_K)
t_ref = (time.perf_counter() - t0) / 20
print(f"E={demo_E}, R={demo_R} on this CPU: plan {1e3 * t_plan:.2f} ms, plan_reference {1e3 * t_ref:.2f} ms "
      f"(the tensor version pays a fixed R-1 steps of small ops; its point is the GPU, no sync)")

# %% [markdown]
# ### The fill as one Triton kernel
#
# On a GPU each of the torch path's R − 1 steps is a chain of small kernels. The fill's whole state is
# small, so `plan` (with `backend=None` or `"triton"`) runs it in one launch of one program,
# `k3lab.kernels.moonep.plan_fill`, whenever the tiles fit (next_pow2(L) ≤ 128 and next_pow2(R) ·
# next_pow2(L) ≤ 2048, so every E ≤ 1024 with L ≤ 128; else the torch path, or a `ValueError` for an
# explicit `"triton"`). **In registers:** the pairs still on each home rank (`keep`) and those given to
# each receiver (`give`) as two `[R, L]` tiles, the loads and donors as `[R]` vectors. A fill is a few
# block reductions: `min` with its index gives the receiver u and its load, `argmax` the donor d (first
# index on ties, as torch). **The greedy take without a sort:** with the unique key
# `vals_l · BLOCK_L + (BLOCK_L − 1 − l)` (most pairs first, the lower expert index on ties), the pairs
# taken before expert l are one `[L, L]` compare-and-sum, `before_l = Σ_j vals_j [key_j > key_l]`, and
# `take_l = min(max(need − before_l, 0), vals_l)` is the torch path's cumsum formula: every field equals
# the torch planner's, not merely close. The loop ends after R − 1 fills or once no rank is under C. Its
# core, read from `kernels/moonep/fill.py`, then the kernel run against the torch planner on the demo load
# and on the tightness example (on CPU under Triton's interpreter; `tests/test_moonep.py` checks many more
# loads). Section 5 times it on a GPU (the "triton" and "fill kernel" columns):

# %%
fill_py = Path(importlib.util.find_spec("k3lab.kernels").origin).parent / "moonep" / "fill.py"
fill_src = fill_py.read_text()
print(fill_src[fill_src.index("    b_give = tl.zeros"):fill_src.index("    tl.store(keep")].rstrip())

fields = ("keep", "give", "donor", "assign", "slot_experts", "slot_counts", "offsets")
if device.type == "cuda" or numpy_supports_interpreter():
    for name, (c_, S_) in (("demo load", (demo_counts, demo_S)),
                           ("tightness example", tightness_counts(demo_E, demo_R, K=demo_K))):
        c_ = c_.to(device)
        fused, stepwise = plan(c_, S_, demo_K, backend="triton"), plan(c_, S_, demo_K, backend="torch")
        same = [f for f in fields if torch.equal(getattr(fused, f), getattr(stepwise, f))]
        print(f"\nplan_fill kernel == torch planner on the {name} (E={demo_E}, R={demo_R}): {len(same)} of "
              f"{len(fields)} fields equal")
        assert len(same) == len(fields)
else:
    print("\nthe kernel check is skipped: Triton's interpreter needs numpy<2.4 on a CPU")
# %% [markdown]
# ### The plan, drawn
#
# Rows are processing ranks, columns experts; a cell's shade is the share of that rank's C rows spent
# on that expert. Black frames mark each rank's home experts; red crosses mark **redundant copies**
# (an expert processed away from home). On the right, each rank's load under plain all-to-all EP
# (its home experts' pairs) against MoonEP's S·K on every rank. The skewed counts come from
# `k3lab.bench.moonep.skew_counts` (the benchmark's: experts drawn with a power-law profile at the
# asked maxvio, scattered over the ranks or, in the explorer, packed on rank 0).

# %%
def draw_plan(E: int = demo_E, R: int = demo_R, maxvio: float = demo_maxvio, placement: str = "scattered",
              K: int = demo_K, S: int = demo_S):
    """The MoonEP plan of skewed counts as a rank x expert grid, and the per-rank loads before and after."""
    m = min(maxvio, E / K - 1)
    counts = skew_counts(E, R, S, K, m, seed, placement)
    p = plan(counts, S, K)
    L, C = E // R, S * K
    grid = p.assign.T.double() / C                    # [R, E]
    home = torch.arange(E) // L
    copies = (p.assign.T > 0) & (home[None] != torch.arange(R)[:, None])
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 0.45 * R + 1.6), gridspec_kw=dict(width_ratios=[3, 1]))
    ax0.imshow(grid.numpy(), cmap="Blues", aspect="auto", vmin=0, vmax=float(grid.max()))
    for r in range(R):
        ax0.add_patch(Rectangle((r * L - 0.5, r - 0.5), L, 1, fill=False, ec="k", lw=0.8))
    rr, ee = copies.nonzero(as_tuple=True)
    ax0.scatter(ee.numpy(), rr.numpy(), marker="x", color="C3", s=25, label="redundant copy")
    ax0.set(xlabel="expert", ylabel="processing rank",
            title=f"MoonEP plan: E={E}, R={R}, K={K}, S={S}, maxvio {m:g}, hot experts {placement}")
    ax0.legend(fontsize=7, loc="upper right")
    base = counts.sum(0).view(R, L).sum(1).double() / C
    ax1.barh(range(R), base.numpy(), color="C7", label="all-to-all (home)")
    ax1.axvline(1.0, color="C0", lw=2, label="MoonEP (S·K)")
    ax1.invert_yaxis()
    ax1.set(xlabel="load / S·K", title="per-rank load")
    ax1.legend(fontsize=7)
    plt.tight_layout()
    plt.show()
    fills = [(v, int(p.donor[v]), int(p.give[v].sum())) for v in range(R) if int(p.donor[v]) != v]
    print(f"realised maxvio {moe.maxvio(counts.sum(0)):.2f}; {len(fills)} fills (<= R-1 = {R - 1}); "
          f"busiest rank under all-to-all {float(base.max()):.2f} x S·K")
    print("receiver <- donor: pairs moved = " + ", ".join(f"{v}<-{d}: {n}" for v, d, n in fills))
    print(f"redundant experts per rank: {p.redundant().tolist()} (<= E/R = {L})")
    return p


demo_plan = draw_plan()

# %% [markdown]
# The explorer: E, R and the skew as sliders in JupyterLab. A headless run (papermill, nbval, the
# book runner) has no front end to draw them, so `explore` builds no widget there and prints one
# line; the figure above is the static copy.

# %% tags=["nbval-ignore-output"]
explorer = explore(draw_plan, E=[16, 32, 64], R=[2, 4, 8], maxvio=(0.0, 6.0, 0.5), placement=["scattered", "packed"])

# %% [markdown]
# ### Where each pair goes
#
# Every rank computes the same plan from the same all-gathered counts, then its own `layout`: each of
# its pairs' destination rank and row, and for each row of its own `[S·K, d]` buffer the rank it
# comes from. The buffer is laid out as `[L local slots | L redundant slots]`; `offsets` are the
# slots' cumulative ends (`cu_seqlens` without the leading 0), which the grouped GEMM takes directly.
# Expert e's pairs are numbered rank by rank and cut into consecutive pieces, one per processing rank,
# so no indices need to be exchanged.

# %%
lay0 = layout(plan(demo_counts, demo_S, demo_K), demo_counts, demo_idx[0], 0)
print(f"rank 0 slot experts: {lay0.slot_experts.tolist()}")
print(f"rank 0 slot offsets: {lay0.offsets.tolist()} (last = S*K = {demo_S * demo_K})")
print(f"rank 0's first 8 pairs go to (rank, row): "
      f"{list(zip(lay0.dest_rank[:8].tolist(), lay0.dest_row[:8].tolist()))}")
print(f"rank 0's buffer rows come from ranks: {torch.bincount(lay0.src_rank, minlength=demo_R).tolist()} rows each")

# %% [markdown]
# ## 4. Dispatch, experts and combine on CPU ranks
#
# `moonep_experts(x, topk_idx, topk_weight, experts, group, mode=...)` (`ep.py`) is one EP MoE step:
# all-gather the counts, plan, dispatch every pair into the fixed `[S·K, d]` buffer (one
# `all_to_all_single` with equal splits), fetch the donor's expert weights for the redundant slots,
# one grouped FFN (`k3lab.moe.experts.expert_ffn`), and combine back (the transpose of dispatch).
# Backward mirrors it, and the redundant copies' weight gradients are summed back onto their home
# rank. `mode="alltoall"` is the baseline: counts exchanged, read on the host, uneven splits.
#
# `k3lab.dist.launch` spawns the ranks (gloo); each runs `k3lab.moonep.workers.check_worker` on its S
# tokens and L home experts, forward and backward on `<out, w_o>`. The parent runs the whole batch
# through `dense_moe` in one process. Float32; routings: Zipf, everything to one expert, rank 0's
# experts idle, and uniform with a quarter of the tokens padding.

# %% tags=["nbval-ignore-output"]
cases = [Case(routing="zipf", seed=seed), Case(routing="one_expert", seed=seed + 1),
         Case(routing="idle_rank", seed=seed + 2), Case(routing="uniform", padded=True, seed=seed + 3),
         Case(routing="zipf", mode="alltoall", seed=seed), Case(routing="one_expert", mode="alltoall", seed=seed + 1)]
worst, rows = {}, {}
for R in ep_ranks:
    t0 = time.perf_counter()
    out = launch(check_worker, R, cases, timeout_s=300)
    for i, case in enumerate(cases):
        per_rank = [o["world"][i] for o in out]
        got, ref = gather_ranks(per_rank), reference(case, R)
        pairs = [(got[k], ref[k]) for k in ("out", "grad_x", "grad_topk_weight")]
        pairs += [(got["grads"][n], ref["grads"][n]) for n in ref["grads"]]
        max_abs = max(float((a - b).abs().max()) for a, b in pairs)
        tag = f"{case.mode:8s} {case.routing + (' +pad' if case.padded else ''):13s}"
        worst[(R, tag)] = max(rel_rms_error(b, a) for a, b in pairs)
        rows[(R, tag)] = [res["rows"] for res in per_rank]
        print(f"R={R} {tag}: vs one process max |error| {max_abs:.1e}, worst relative RMS error "
              f"{worst[(R, tag)]:.1e} (out, grad x, grad weights, grad of every expert)")
    print(f"  ({time.perf_counter() - t0:.1f} s for {R} processes)")
assert max(worst.values()) <= 1e-5

# %%
C_case = Case().S * Case().K
print("every rank's output and gradients within 1e-5 (relative RMS) of one process:", max(worst.values()) <= 1e-5)
for (R, tag), r in rows.items():
    kind = "S*K on every rank" if tag.startswith("moonep") else f"busiest {max(r) / C_case:.2f} x S*K"
    print(f"R={R} {tag}: rows per rank {r} ({kind})")

# %% [markdown]
# MoonEP gives every rank S·K rows whatever the routing; the baseline's busiest rank takes all of
# them when everything goes to one expert. The gloo implementation pays for static shapes in bytes:
# every rank sends every other a full `[S·K, d]` block (zeros where it has no pair), R times the pairs'
# own bytes, and the weight fetch all-gathers every shard to keep one. On GPUs one-sided writes and
# reads (NVSHMEM, `torch.ops.symm_mem`) move only the pairs and the donor's experts; see
# `docs/moonep.md`.
#
# ## 5. On one GPU: planner latency and a simulated EP step
#
# `python -m k3lab.bench.moonep` checks the planner on the GPU against `plan_reference` at every
# shape, checks that `plan` + `layout` run under `torch.cuda.set_sync_debug_mode("error")`, and times
# them eagerly and as a CUDA-graph replay for E in {64, 256, 896}, R in {8, 64}, S = 8192, K in
# {8, 16}. The EP step is a **simulation** on one GPU: R = 8 ranks' counts at expert skew maxvio in
# {0, 0.5, 1, 2, 4} (E = 64, K = 8, S = 8192, experts at a latent width of 1024 with hidden 1024),
# with the hot experts scattered over the ranks or packed on one (the baseline's worst case);
# each simulated rank's expert GEMMs (forward + backward, bf16) are timed at that rank's load, and
# communication is priced from a measured all-to-all bandwidth, not run (the figure and its source are
# in the JSON). Step time = communication (for MoonEP, plus the redundant experts' weight fetch) + the
# slowest rank's GEMMs. The committed result is `data/results/moonep_h100.json`: GEMMs timed on one H100,
# communication priced from an NVLink measurement between two H200s (its source is printed below the
# figure).

# %% tags=["nbval-ignore-output"]
results_dir = ROOT / "data" / "results"
found = [path for path in (results_dir / "moonep_h200.json", results_dir / "moonep_h100.json") if path.exists()]
bench = json.loads(found[0].read_text()) if found else None
if bench is None:
    print("no stored GPU result yet (data/results/moonep_h200.json or moonep_h100.json): run "
          "`python -m k3lab.bench.moonep` on a GPU; the plot below is skipped")
else:
    from k3lab.bench.moonep import floors, table

    # The floors judged from the stored measurements (the planner at every K timed).
    bench["floors"] = floors(bench)
    # The table's first line names the run's revision; the card and the date are what a reader needs.
    print(f"{found[0].name}: MoonEP on {bench['device']} ({bench['date']})\n{table(bench).split(chr(10), 1)[1]}")
    timed = sorted({"torch"} | {"triton" for r in bench["planner"] if "triton_us" in r})
    print(f"planner backends timed in this result: {', '.join(timed)}")

# %% tags=["nbval-ignore-output"]
if bench is not None and bench["skew"]:
    assert all(r["simulated"] for r in bench["skew"])
    placements = list(dict.fromkeys(r.get("placement", "scattered") for r in bench["skew"]))
    fig, axes = plt.subplots(1, len(placements), figsize=(6 * len(placements), 3.6), squeeze=False)
    for ax, placement in zip(axes[0], placements):
        sk = sorted((r for r in bench["skew"] if r.get("placement", "scattered") == placement),
                    key=lambda r: r["maxvio"])
        mv = [r["maxvio"] for r in sk]
        ax.plot(mv, [r["moonep_ms"] for r in sk], "o-", color="C0", label="MoonEP")
        ax.plot(mv, [r["alltoall_ms"] for r in sk], "s-", color="C3", label="all-to-all EP")
        ax.plot(mv, [r["moonep"]["gemm_ms"] for r in sk], "o:", color="C0", lw=1, label="MoonEP, GEMMs only")
        ax.plot(mv, [r["alltoall"]["gemm_ms"] for r in sk], "s:", color="C3", lw=1, label="all-to-all, GEMMs only")
        ax.set(xlabel="routing skew maxvio", ylabel="step time (ms), SIMULATED", ylim=(0, None),
               title=f"SIMULATED, hot experts {placement}")
        ax.legend(fontsize=7)
    s = bench["shapes"]["skew"]
    fig.suptitle(f"Simulated EP step, GEMMs timed on one {bench['device']}: E={s['E']}, R={s['R']}, K={s['K']}, "
                 f"S={s['S']}", fontsize=10)
    plt.tight_layout()
    plt.show()
    print(f"communication priced from: {bench['skew'][0]['comm_source']}")
    for placement in placements:
        sk = sorted((r for r in bench["skew"] if r.get("placement", "scattered") == placement),
                    key=lambda r: r["maxvio"])
        wins = [r["maxvio"] for r in sk if r["moonep_ms"] < r["alltoall_ms"]]
        first_win = f"from maxvio {min(wins):g} on" if wins else "at no skew in this result"
        print(f"hot experts {placement}: at maxvio {sk[0]['maxvio']:g} MoonEP's step is "
              f"{100 * (sk[0]['moonep_ms'] / sk[0]['alltoall_ms'] - 1):+.1f}% against all-to-all's; "
              f"MoonEP is faster {first_win}")

# %% [markdown]
# **What limits it.** The torch planner (the "torch" columns) runs up to R − 1 fills, each depending on
# the last and each a handful of small kernels; captured as one CUDA graph the launches go but the chain
# stays, so its time grows with R, not with E or K, to milliseconds at R = 64. Section 3's one-kernel fill
# (the "triton" columns) runs the whole chain in one program: at E = 896, R = 64 the fill kernel alone
# is the "fill kernel" column, against the same kernel with its state in int64 beside it (integer
# reductions and shuffles take twice the instructions in int64). Plan + layout of one rank, replayed,
# is the "graph" column after "triton": the fill, with the layout's sort on a second stream beside it,
# then one layout launch. The floor line judges it at every K timed.
#
# Under skew, MoonEP's busiest rank always holds exactly S·K pairs, so its step grows elsewhere: the
# weight fetch, which grows with the redundant experts a plan uses (the "fetch" column), the grouped GEMM
# (the "gemm" column), and the priced communication, which grows with the pairs that leave their rank (the
# "comm" column). With the hot experts packed on one home rank, a receiver holds a
# few cold local experts and one large redundant group. Forward, that is the same work in the same tiles;
# the weight gradient of a group, $x_g^\top dy_g$, is one [in, out] output reduced over the group's rows, and
# the grouped GEMM spreads groups x output tiles over the SMs, so the large group's few tiles run long
# after the others finish. (Cutting groups into pieces of bounded rows removes that tail but costs an extra
# float32 sum of the pieces; `docs/moonep.md` has the measurement.) The all-to-all baseline's busiest rank
# simply holds more pairs. Without skew the fetch and the plan are pure overhead, so MoonEP starts slightly
# behind (the lines under the figure). That tail is why the floor line for packed hot experts can read NOT
# met (the step may grow by at most 10% from maxvio 0 to 4): what would remove it is split-K for the large
# groups inside the grouped GEMM, a kernel torch's grouped GEMM does not offer.

# %% [markdown]
# ## Exercises
#
# 1. In the explorer, find a load for which the fill needs all R − 1 steps. Which loads need none?
# 2. Replace "the donor's experts with the most pairs first" by "lowest expert index first" in a copy
#    of `plan_reference`. Does the E/R bound still hold? How does the number of redundant experts
#    actually used (`plan.redundant()`) change on Zipf loads?
# 3. For which E and R does the tightness example's lower bound ceil(E(R − 1)/R²) reach the
#    theorem's E/R? Check your answer against the two rows printed in section 2.
# 4. The gloo dispatch sends R·S·K·d values per rank. Count the bytes a one-sided implementation would
#    move for the demo plan (`k3lab.bench.moonep.pair_traffic` gives the pairs moved between ranks).
# 5. In the benchmark's JSON, each simulated row keeps the per-rank GEMM times and the priced
#    communication. Find the all-to-all bandwidth below which MoonEP's weight fetch costs more than it
#    saves on the busiest rank, and rerun the pricing with `--comm-gbps` to check.
#
# ## References
#
# - Kimi Team, *Kimi K3: Open Frontier Intelligence*, arXiv 2607.24653 (2026): Sec. 4 (MoonEP) and
#   App. E (the E/R theorem, its constructive proof and the tightness example); Table 1 (896 experts,
#   top-16).
# - DeepSeek-AI, *EPLB* (expert-parallel load balancer: redundant experts placed from load statistics)
#   and *DeepEP* (GPU dispatch/combine with a layout step and one-sided NVSHMEM transfers).
# - NVIDIA Megatron-Core, `MoEAlltoAllTokenDispatcher`: the all-to-all baseline with counts exchanged
#   first.
# - Code: `k3lab/moonep/` (planner, naive, dispatch, alltoall, ep, workers), `k3lab/dist.py`,
#   `k3lab/bench/moonep.py`, `docs/moonep.md`; tests in `tests/test_moonep.py`,
#   `tests/test_bench_moonep.py`.
