# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Training K3 end to end: FSDP2 × MoonEP × KCP × pipeline, resumable, measured
#
# **Why.** A model is only as good as the run that trains it. K3 trains a 2.78T-parameter hybrid on
# thousands of GPUs with expert parallelism, ZeRO data parallelism, pipelining and context
# parallelism (K3 report, training system); the public record for utilisation at that scale is
# MegaScale's 55.2% MFU (175B, 12,288 GPUs). Every component of the earlier chapters (KDA and Gated
# MLA, Block AttnRes, Stable LatentMoE with Quantile Balancing, MoonEP, Per-Head Muon) runs here
# together, on the book's corpus, across ranks, and the run meets the failure a long run always meets:
# it is killed, and must continue exactly where it stopped.
#
# This chapter:
# 1. launches `k3lab.train` under torchrun on 2 CPU ranks (gloo) with experts split over both
#    ranks (`--ep 2`, MoonEP) and follows its JSONL log;
# 2. kills the run with SIGKILL after a checkpoint, resumes it, and shows that the loss curves join:
#    the steps replayed since the checkpoint have the losses the killed run logged;
# 3. plots the loss and the expert balance (maxvio per MoE layer) over the steps;
# 4. runs one sequence across 2 ranks with context parallelism (`--cp 2`: KCP in the KDA layers, the
#    MLA latents all-gathered) and checks it against one process;
# 5. cuts the model into pipeline stages (`--pp 2`, 1F1B and interleaved 1F1B) and checks those runs
#    against one process;
# 6. loads the final checkpoint, written with the experts split over 2 ranks, into one process and
#    samples text with `generate()`.
#
# All code is in `k3lab.train` (`parallel.py` builds the mesh and shards the model, `loader.py`,
# `checkpoint.py`, `metrics.py`, `pipeline.py`, `loop.py`, `runner.py`); this notebook imports it.

# %% tags=["parameters"]
profile: str = "cpu"
seed: int = 0
preset: str = "k3-tiny"
nproc: int = 2
dp: int = 1
ep: int = 2
ep_mode: str = "moonep"
steps: int = 60
batch_size: int = 8
seq_len: int = 64
lr: float = 1e-2
ckpt_every: int = 20
kill_at_step: int = 30
log_every: int = 4
cp_steps: int = 4
cp_seq_len: int = 128
pp_steps: int = 5
pp_microbatches: int = 4
run_dir: str = "build/train_09"

# %% tags=["nbval-ignore-output"]
import k3lab

device = k3lab.setup(seed=seed, profile=profile)

# %%
import copy
import json
import os
import shutil
from pathlib import Path
from unittest import mock

import matplotlib.pyplot as plt
import torch

from k3lab.data import load_tokenizer
from k3lab.model import K3Config
from k3lab.train import TrainConfig, latest_checkpoint, load_checkpoint
from k3lab.train.loop import build_model
from k3lab.train.metrics import read_records
from k3lab.train.runner import ROOT, run_and_follow, torchrun_command

# %% [markdown]
# ## The layout
#
# One `DeviceMesh` with axes (pp, dp, cp, ep) gives every group. With `--dp 1 --ep 2` both ranks are
# *data ranks* (each reads half of the global batch) and *expert ranks* (each holds 4 of k3-tiny's 8
# routed experts per MoE layer):
#
# | parameters | how they are placed | gradient |
# |---|---|---|
# | routed experts `[E, l, h]` | DTensor `Shard(0)` over ep; FSDP2 over dp | MoonEP's backward brings every ep rank's contribution home, the MoE layer averages it over ep, FSDP over dp |
# | everything else | FSDP2 `fully_shard` over the flattened dp × cp × ep axis (ZeRO-3) | reduce-scatter average over the data ranks |
# | router biases (QB) | replicated buffers | none: the histogram is summed over the data ranks once per step |
#
# So the global loss is the mean over all data ranks' tokens, exactly as one process on the whole
# batch (the tests check losses over 5 steps and first-step gradients against 1 process to 1e-4, for
# dp = 2, ep = 2 with MoonEP and with all-to-all, and dp = 2 x ep = 2 on 4 ranks). The command the
# notebook runs:

# %%
run = Path(ROOT) / run_dir
shutil.rmtree(run, ignore_errors=True)
flags = dict(preset=preset, dp=dp, ep=ep, ep_mode=ep_mode, steps=steps, batch_size=batch_size, seq_len=seq_len,
             lr=lr, seed=seed, ckpt_dir=str(run / "ckpt"), ckpt_every=ckpt_every, log_jsonl=str(run / "log.jsonl"),
             log_every=log_every, progress=False)
cmd = torchrun_command(nproc, **flags, kill_at_step=kill_at_step)
print(" ".join(["torchrun"] + cmd[cmd.index("--nproc-per-node"):]).replace(str(ROOT) + "/", ""))

# %% [markdown]
# ## A run that is killed
#
# `--kill-at-step` makes every rank SIGKILL itself after that step: no handler runs, no file is
# closed, as when a node dies. Checkpoints are written every `ckpt_every` steps with
# `torch.distributed.checkpoint` into a temporary folder that rank 0 renames to `step_NNNNNNNN` once all
# ranks are done: a save cut short leaves only a `.tmp-` folder, which is never taken as the latest.
# The `.lock` file beside them is held by the run while it writes there (the lock dies with the process),
# so a second run started into the same folder is refused instead of mixing its checkpoints with these.

# %% tags=["nbval-ignore-output"]
# `check` raises with the run's stderr unless its log ends at the kill step: a crash exits nonzero too.
first = run_and_follow(cmd, run / "log.jsonl").check(last_step=kill_at_step)
print("exit status", first.returncode, "| steps logged", len(first.steps))

# %%
print("killed:", first.returncode != 0, "| last step logged:", first.steps[-1]["step"])
print("checkpoints:", sorted(p.name for p in (run / "ckpt").iterdir()))
print("latest complete:", latest_checkpoint(run / "ckpt").name)

# %% [markdown]
# ## Resume
#
# The same command with `--resume` (and without the kill) reads the latest checkpoint: the model, the
# optimizer state (Muon momentum, AdamW moments and step counts), the Quantile Balancing router biases
# (buffers of the model), the step, and the loader's position. The position is one integer, the
# global sequences consumed, and each data rank derives its own windows from it, so the data continue
# exactly (and a checkpoint written at one layout resumes at another).

# %% tags=["nbval-ignore-output"]
second = run_and_follow(torchrun_command(nproc, **flags, resume=True), run / "log.jsonl").check()
print("exit status", second.returncode)

# %%
records = read_records(run / "log.jsonl")
starts = [r for r in records if r["event"] == "start"]
print("runs in the log:", len(starts), "| resumed from step", starts[-1]["resumed_from"])
killed = {r["step"]: r["loss"] for r in first.steps}
replayed = [(r["step"], killed[r["step"]], r["loss"]) for r in second.steps if r["step"] in killed]
print(f"steps replayed since the checkpoint: {[s for s, _, _ in replayed]}")
print(f"largest loss difference on them: {max(abs(a - b) for _, a, b in replayed):.1e}")

# %% [markdown]
# On these CPU ranks the replayed steps reproduce the killed run's losses to the last bit (the largest
# difference printed above): nothing the run depends on is left out of the checkpoint. On a GPU, kernels
# that accumulate floats in whatever order their threads arrive (a fused attention backward may add into dQ with
# atomics; k3lab's own kernels and the MoE's gathers do not) may make the replay differ in the last bits,
# not more. Below, the two curves: the killed run (to step `kill_at_step`) and the resumed one
# (from the checkpoint to the end) lie on each other where they overlap.

# %%
fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(15, 3.6))
ax.plot([r["step"] for r in first.steps], [r["loss"] for r in first.steps], lw=3, alpha=0.5, label="killed run")
ax.plot([r["step"] for r in second.steps], [r["loss"] for r in second.steps], lw=1.2, label="resumed run")
ax.axvline(starts[-1]["resumed_from"], color="grey", ls=":", label="checkpoint")
ax.set(xlabel="step", ylabel="loss (nats)", title=f"{preset}, {nproc} ranks, dp={dp} ep={ep} ({ep_mode})")
ax.legend()
joined = sorted({r["step"]: r for r in first.steps + second.steps}.values(), key=lambda r: r["step"])
# maxvio is read back on the last step of each --log-every window only (None on the others).
balanced = [r for r in joined if r["maxvio"] is not None]
# The first first_k_dense_replace layers have a dense FFN; layers are numbered from 1 here.
first_moe = K3Config.preset(preset).first_k_dense_replace + 1
for i in range(len(balanced[0]["maxvio"])):
    bx.plot([r["step"] for r in balanced], [r["maxvio"][i] for r in balanced], lw=1, marker=".",
            label=f"MoE layer {first_moe + i}")
bx.set(xlabel="step", ylabel="maxvio", title="expert load: max / mean - 1 (Quantile Balancing)")
bx.legend(fontsize=8)
clip = flags.get("max_grad_norm", TrainConfig.max_grad_norm)
cx.semilogy([r["step"] for r in joined], [r["grad_norm"] for r in joined], lw=1)
cx.axhline(clip, color="grey", ls=":", label=f"--max-grad-norm {clip}")
cx.set(xlabel="step", ylabel="global gradient norm", title="gradient norm before clipping")
cx.legend(fontsize=8)
fig.tight_layout()
plt.show()
print(f"steps clipped: {sum(r['grad_norm'] > clip for r in joined)} of {len(joined)}")

# %% [markdown]
# **Balance.** maxvio is the busiest expert's load over the mean, minus 1, for a step's routing
# summed over both data ranks. The trainer reads it back with the losses, on the last step of each
# `log_every` window (and at a checkpoint), so the steps in between carry none. Quantile Balancing sets
# each router bias from the previous step's score histogram (chapter 05), so it corrects with one step
# of lag: while the routers move fast early in training (lr 1e-2 here) the balance slips, then settles
# near the noise floor of the CPU profile's step (k3-tiny's 8 experts top-2, 8 x 64 = 512 tokens): a few
# tenths, as `final_maxvio_mean` in the summary below says.
#
# **Gradient norm.** Before each optimizer step the trainer takes the global norm of the raw gradients,
# over every rank's shards (`k3lab.optim.grad_norm`: the FSDP shards and the expert shards live on two
# meshes and are reduced mesh by mesh), and scales them down to `--max-grad-norm` when it is larger.
# Muon's update does not see a gradient's scale, but AdamW's parameters (embedding, norms, router) take
# every spike. The norm is read back with the loss, so a NaN gradient under a finite loss stops the run
# at the next read-back. The right panel shows it before clipping; the line above counts the steps it clipped.
# On this tiny model at lr 1e-2 the norm stays above the default bound of 1.0 (the line above counts the
# steps), so here the bound rescales the gradients rather than catching a rare spike.
#
# ## Throughput, MFU and memory
#
# The run's summary (from its last record). MFU uses `k3lab.model.flops_per_token`'s convention, stated
# in every log; on CPU there is no bf16 peak to divide by, so it is n/a here (the GPU profile reports it).

# %% tags=["nbval-ignore-output"]
print(second.stdout[second.stdout.index("metric"):])

# %%
summary = records[-1]
print(f"flops per token at T={seq_len}: {summary['flops_per_token']:.4g}")
print("convention:", summary["flops_convention"])

# %% [markdown]
# ## On one GPU: k3-1b on the corpus
#
# `python -m k3lab.bench.train` runs the same trainer with the `k3-1b` preset (17 layers, d = 1024, 64
# experts top-8) on one GPU, bf16 autocast, `--log-every 10`, and in the same run times the step with
# Block AttnRes against the same model with the standard residual. The committed result, with the FLOPs
# convention beside the MFU and the card's dense bf16 peak as the ceiling:

# %% tags=["nbval-ignore-output"]
results = Path(ROOT) / "data" / "results"
found = [p for p in (results / "train_h200.json", results / "train_h100.json") if p.exists()]
gpu = json.loads(found[0].read_text()) if found else None
if gpu is None:
    print("no committed GPU result yet: run python -m k3lab.bench.train on a GPU")
else:
    from k3lab.model import PEAK_FLOPS

    # A step is microbatches x batch_size sequences (bench.train --microbatches accumulates).
    micro = gpu.get("microbatches", 1)
    step_flops = gpu["flops_per_token"] * gpu["tokens_per_step"]
    peak = PEAK_FLOPS[gpu["peak_flops_key"]]
    print(f"{found[0].name}: {gpu['device']}, {gpu['preset']} ({gpu['params']['total'] / 1e6:.0f}M total, "
          f"{gpu['params']['active'] / 1e6:.0f}M active), B x T = {gpu['batch_size']} x {gpu['seq_len']}"
          + (f", {micro} micro-batches a step" if micro > 1 else "") + f", {gpu['minutes']:.1f} min")
    print(f"{gpu['steps']} steps, {gpu['epochs']:.1f} passes over the train split; final loss {gpu['final_loss']:.2f}")
    print(f"tokens/s {gpu['tokens_per_s']:,.0f} | MFU {100 * gpu['mfu']:.1f}% | peak memory {gpu['peak_GiB']:.1f} GiB")
    ar = gpu["attnres"]
    print(f"Block AttnRes against the standard residual, {ar['steps']} timed steps each: "
          f"{100 * ar['overhead']:+.1f}% on the median step, {100 * ar['overhead_min']:+.1f}% on the fastest")
    print(f"a step's FLOPs {step_flops / 1e12:.1f} TFLOP: {1e3 * step_flops / peak:.0f} ms at the dense bf16 peak, "
          f"{1e3 * gpu['tokens_per_step'] / gpu['tokens_per_s']:.0f} ms measured")
    print("FLOPs convention:", gpu["flops_convention"])
    print("peer (torchtitan DeepSeek-V3):", gpu.get("peer_error") or gpu.get("peer") or "not timed in this result")
    if gpu.get("peer_tokens_per_s"):
        print(f"  same card and run, {gpu['peer_config']['batch_size']} x {gpu['seq_len']} micro-batches (its "
              f"warm-up's fit), active parameters matched ({gpu['peer_params']['active'] / 1e6:.0f}M): "
              f"{gpu['peer_tokens_per_s']:,.0f} tokens/s, MFU {100 * gpu['peer_mfu']:.1f}% on its FLOPs; "
              f"k3lab runs at {gpu['vs_peer']:.2f}x its speed")
    compiled = results / found[0].name.replace("train_", "train_compile_")
    if compiled.exists():
        c = json.loads(compiled.read_text())
        print(f"{compiled.name} (both models' blocks under torch.compile, another run): {c['tokens_per_s']:,.0f} "
              f"tokens/s, MFU {100 * c['mfu']:.1f}%"
              + (f"; the peer {c['peer_tokens_per_s']:,.0f} tokens/s, k3lab at {c['vs_peer']:.2f}x"
                 if c.get("peer_tokens_per_s") else ""))
    steps_, losses_ = zip(*gpu["loss_curve"])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps_, losses_, lw=1)
    ax.set(xlabel="step", ylabel="loss (nats)", title=f"{gpu['preset']} on the corpus, {gpu['device']}")
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The step is far from its FLOPs: at d = 1024 most of its time is memory-bound work around the
# matmuls (norms and gates, dtype casts, the AttnRes mixing) and Per-Head Muon's Newton-Schulz over
# thousands of small head and expert blocks, whose cost per optimizer step does not depend on the batch.
# As in pretraining, the run accumulates micro-batches (the first line says how many) so that one
# optimizer step serves a larger global batch; the peer, torchtitan's DeepSeek-V3 at the same active
# size, accumulates as many micro-batches on the same card (each halved when it does not fit: its line
# says its batch), and the ratio above compares tokens per second. Eager
# against eager k3lab is well ahead; with both models compiled its lead is smaller, since the peer compiles
# each block whole while k3lab's FlashKDA, grouped GEMMs, AttnRes mixing and optimizer stay outside its
# compiled regions.
# `docs/train.md` has the step's profile by kernel category. The curve falls fast because the corpus is small
# (about 2M tokens, chapter 00): the run passes over it more than once, so it measures the system, not
# what a 1B model learns. The paper puts Block AttnRes's cost at a few percent of a training step; its
# line in the output above gives the median and the fastest of the timed steps, which a shared card
# makes noisy (`docs/train.md` records reruns of the same code).
#
# ## Context parallel: one sequence over several ranks
#
# K3 trains at 1M tokens of context; one sequence then no longer fits one GPU's activations, so its
# tokens are cut across ranks. With `--cp R` the trainer packs a data row's windows into one stream
# (each window a document, or each real document with `--doc-mask`), cuts it into R contiguous pieces,
# and runs every layer on its piece:
#
# | layer | what crosses ranks | bytes per layer, whatever T |
# |---|---|---|
# | KDA (chapter 03) | the short convolution's halo (W - 1 = 3 tokens) and one all-gather of the pieces' affine state maps `[HV, K, K + V]` | R x HV x K x (K + V) x 4 |
# | Gated MLA | the latents `[T_local, R_kv + D_r]` of every piece, all-gathered (their gradients reduce-scattered home) | T x (R_kv + D_r) x 2 |
# | MoE, AttnRes, norms | nothing: they act per token | 0 |
#
# MLA's latent all-gather grows with T, but it is 576 numbers a token at full size against 30,720 for
# materialised keys and values; MLA is one layer in four. Quantile Balancing's histogram is summed over
# data x context ranks, so each token is counted once. Below, 2 CPU ranks with `--cp 2 --doc-mask` (the
# documents of a row cross the cut) against one process on the same batches. These parity runs are
# float32 on CPU ranks (gloo) on either profile: the ranks spawned for them see no GPU.

# %% tags=["nbval-ignore-output"]
from k3lab.dist import launch
from k3lab.train.workers import train_worker


def runs_on_cpu_ranks(nranks, configs):
    """Rank 0's step records of ``train_worker`` for each config, on ``nranks`` fresh CPU processes."""
    with mock.patch.dict(os.environ, CUDA_VISIBLE_DEVICES=""):
        return launch(train_worker, nranks, configs, timeout_s=900)[0]["runs"]


# The tests' learning rate: at the run's 1e-2 a near-tie in a router flips within a few steps, and the
# clipped updates carry float32 rounding far enough to flip it on one side only.
cp_flags = dict(preset="k3-tiny", steps=cp_steps, batch_size=2, seq_len=cp_seq_len, lr=3e-3, seed=seed,
                progress=False, doc_mask=True)
[one_rank] = runs_on_cpu_ranks(1, [cp_flags])
[two_ranks] = runs_on_cpu_ranks(2, [dict(cp_flags, cp=2)])

# %%
worst = max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(one_rank, two_ranks))
print("step   one process   cp=2 (2 ranks)")
for a, b in zip(one_rank, two_ranks):
    print(f"{a['step']:4d}   {a['loss']:11.6f}   {b['loss']:14.6f}")
print(f"largest relative loss difference: {worst:.1e}")
assert worst < 1e-4

# %% [markdown]
# The losses agree to float32 rounding: KCP is exact (chapter 03), and the MLA pieces see every key
# they would see in one process. The tests check more layouts (cp = 2 alone, cp = 2 x ep = 2,
# dp = 2 x cp = 2 on 4 ranks) and the first step's gradients of every parameter to 1e-4.
#
# ## Pipeline parallel: the layers over several ranks
#
# K3 also cuts the model's depth across ranks: an interleaved-1F1B pipeline, each rank holding several
# virtual stages (K3 report, training system). With `--pp P` the trainer cuts the 2L sublayers (each
# layer's mixer and its FFN) into P stages, one per rank of the pp axis (2P with `--pp-schedule
# interleaved-1f1b`, rank p holding stages p and p + P), and `torch.distributed.pipelining` runs them over
# `--microbatches M` micro-batches of each data row (1F1B, interleaved 1F1B or GPipe).
#
# **What crosses a cut.** With the standard residual a stage boundary carries one hidden state. Block
# AttnRes (chapter 04) lets every sublayer read all completed blocks, so the boundary at sublayer c
# carries b_0 = h0, the blocks completed before c and, when c falls inside a block, that block's partial
# sum, stacked as one tensor `[n (+ 1), B, T, d]` sent forward (its gradient back). Which entries it holds
# follows from c and the block sizes alone (`k3lab.attnres.carried_sources`); a cut at a block boundary
# carries one tensor fewer.
#
# **Where to cut.** `k3lab.model.split_model(model, S)` takes `balanced_cuts` of `sublayer_costs`: the
# cuts that make the largest stage's activated parameters as small as possible, the final norm and head
# counted on the last stage. Every stage keeps the model's parameter names (other stages' sublayers are
# parameter-free placeholders), so a checkpoint does not depend on the cuts.
#
# **The pseudo-queries.** `[2L + 1, d]` stay whole on every stage, but a stage's gradient touches only its
# own rows (and row 2L on the last): after the backward, `sum_queries_grad` sums them over the pp group (one
# all-reduce of `[2L + 1, d]`) and every stage applies the same update to its copy.
#
# The trainer's k3-tiny (on the corpus's 4,096-token vocabulary) in float64, cut for 2 and for 4 stages,
# and the 2 stages chained in one process against the whole model, logits and every gradient:

# %%
from k3lab.attnres import carried_sources
from k3lab.model import balanced_cuts, split_model, sublayer_costs, sum_queries_grad
from k3lab.testing import rel_rms_error

whole = build_model(TrainConfig(preset="k3-tiny", seed=seed), torch.device("cpu")).double()
costs, head = sublayer_costs(whole)
sizes, n_sub = whole.residual.sizes, len(costs)
print(f"{n_sub} sublayers in Block AttnRes blocks of {sizes}; activated parameters per sublayer (thousands): "
      f"{[round(c / 1e3) for c in costs]}, final norm + head {head / 1e3:.0f}")
for S in (2, 4):
    cuts = balanced_cuts(costs, S, head)
    loads = [sum(costs[a:b]) + (head if b == n_sub else 0) for a, b in zip(cuts, cuts[1:])]
    carried = []
    for c in cuts[1:-1]:
        n, partial = carried_sources(sizes, n_sub, c)
        carried.append(f"{n}{' + 1 partial' if partial else ''}")
    print(f"S={S}: cuts {cuts}, stage parameters (thousands) {[round(x / 1e3) for x in loads]}, "
          f"tensors carried at each cut {carried}")

stages = split_model(copy.deepcopy(whole), 2)
g = torch.Generator().manual_seed(seed)
idx = torch.randint(0, whole.config.vocab_size, (2, 24), generator=g)
tgt = torch.randint(0, whole.config.vocab_size, (2, 24), generator=g)
logits, loss = whole(idx, tgt)
loss.backward()
x = idx
for s in stages:
    x = s(x)
    print(f"stage sublayers [{s.start}, {s.stop}) -> {list(x.shape)}")
torch.nn.functional.cross_entropy(x.flatten(0, 1), tgt.flatten()).backward()
sum_queries_grad(stages)
grads = dict(whole.named_parameters())
err_logits = rel_rms_error(logits, x)
err_grads = max(rel_rms_error(grads[n].grad, p.grad) for s in stages for n, p in s.named_parameters())
print(f"stages vs whole model: logits rel RMS error {err_logits:.1e}, largest over "
      f"{len(grads)} parameters' gradients {err_grads:.1e} (float64)")
assert err_logits < 1e-12 and err_grads < 1e-12

# %% [markdown]
# The head (4,096 x 64 weights) outweighs any sublayer of k3-tiny, so the balanced cut for 2 stages gives
# the last stage a single sublayer: stage 0 sends `[4, B, T, d]` (h0, two completed blocks and the third
# block's partial sum) where a standard residual would send `[B, T, d]`. At K3's size that is up to 9
# tensors per boundary. The stages' gradients equal the whole model's once the queries' rows are summed.
#
# A live run: the trainer with `--pp 2` on 2 gloo ranks, 1F1B and interleaved 1F1B (4 stages, two per
# rank), each over `pp_microbatches` micro-batches, against one process on the whole batch:

# %% tags=["nbval-ignore-output"]
# The tests' learning rate: at 1e-2 the float32 rounding differences grow about 3x a step.
pp_flags = dict(preset="k3-tiny", steps=pp_steps, batch_size=4, seq_len=64, lr=3e-3, seed=seed, progress=False)
[whole_run] = runs_on_cpu_ranks(1, [pp_flags])
pp_runs = runs_on_cpu_ranks(2, [dict(pp_flags, pp=2, microbatches=pp_microbatches, pp_schedule=schedule)
                                for schedule in ("1f1b", "interleaved-1f1b")])

# %% tags=["nbval-ignore-output"]
print("step   one process   pp=2 1f1b   pp=2 interleaved 1f1b")
for a, b, c in zip(whole_run, *pp_runs):
    print(f"{a['step']:4d}   {a['loss']:11.6f}   {b['loss']:9.6f}   {c['loss']:21.6f}")
worst = max(abs(a["loss"] - b["loss"]) / a["loss"] for run_ in pp_runs for a, b in zip(whole_run, run_))
print(f"largest relative loss difference: {worst:.1e}")
assert len(whole_run) == pp_steps and all(len(r) == pp_steps for r in pp_runs)
assert worst < 1e-4

# %% [markdown]
# The pipeline runs follow the one-process losses to float32 rounding (the micro-batches sum their
# gradients in another order). The tests check more: pp = 2 with dp, ep or cp = 2 on 4 ranks, the
# first step's gradients of every parameter to 1e-4, and a pp = 2 checkpoint resumed by one process. Pipeline parallel does not combine
# with `--mtp` (the MTP modules read the embedding on stage 0), tied embeddings or `--doc-mask`; the
# trainer refuses them by name.
#
# ## Sampling from the trained model
#
# The final checkpoint was written by 2 ranks with the experts split between them; DCP stores every
# tensor under its global shape (experts under their global ids), so one process loads it into a
# plain `K3Model` and decodes with the KDA states and MLA latent caches (`generate`, chapter 08).

# %% tags=["nbval-ignore-output"]
# On the chapter's device (the training processes have exited): k3-1b decodes far faster on the GPU.
model = build_model(TrainConfig(preset=preset, seed=seed), device).eval()
final = latest_checkpoint(run / "ckpt")
load_checkpoint(final, model, None, {"step": 0})
tok = load_tokenizer()
prompt = torch.tensor([tok.encode("def ").ids], device=device)
out = model.generate(prompt, max_new_tokens=48, temperature=0.8, top_k=40,
                     generator=torch.Generator(device).manual_seed(seed))
print(f"from {final.name}:")
print(tok.decode(out[0].tolist()))

# %% [markdown]
# A few dozen steps of a 5-layer model on Python's standard library: the text has the corpus's
# surface (indentation, keywords, `self`), not its sense. The GPU profile (`profile="gpu"`,
# `preset="k3-1b"`) runs the same code on every GPU present with bf16 autocast and NCCL.
#
# **Also in the trainer.** `--activations "PATTERN=POLICY,..."` attaches chapter 08's activation manager
# (keep, recompute, offload, block-wise fp8 by module name; recompute and offload leave the losses
# unchanged, as the tests check). `--log-every N` reads the losses back once per N steps, the step's only
# host synchronisation; `--sync-debug` runs the steps in between under
# `torch.cuda.set_sync_debug_mode("error")`, so a hidden sync fails loudly.
#
# **Not here:** a document mask for MLA that scales to long rows (`--doc-mask` builds MLA's mask
# densely), and Block AttnRes's memory-efficient two-phase path inside pipeline stages (they autograd
# through the formula).
#
# ## Exercises
#
# 1. Change `kill_at_step` to a step just after a checkpoint and just before the next one: how many
#    steps are replayed, and what does a checkpoint interval cost a run that dies at a random step?
# 2. Resume the killed run with `--dp 2 --ep 1` instead of `--ep 2`: do the replayed losses still match,
#    and to what precision? (The loader's position is global; the experts' layout is not.)
# 3. Run the context-parallel check without `--doc-mask`. Which of the bytes in the table change?
# 4. For K3's sizes (chapter 08), compute the bytes an interleaved-1F1B boundary carries with Block
#    AttnRes against a standard residual, per micro-batch of 1 x 8192 tokens, at the worst cut.
# 5. From the committed GPU result, how many milliseconds of the step would remain at the dense bf16
#    peak, and how many did the peer spend? Where would you look first for k3lab's difference?
#
# ## References
# - K3 technical report: architecture (Table 1), MoonEP (Sec. 4, App. E), Per-Head Muon (Sec. 2.5).
# - Jiang et al. 2024, "MegaScale: Scaling Large Language Model Training to More Than 10,000 GPUs".
# - PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) and Distributed Checkpoint documentation.
# - torchtitan (pytorch/torchtitan): the mesh-per-axis and expert-sharding layout this trainer follows.
