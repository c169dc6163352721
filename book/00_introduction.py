# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 00 · Introduction: Kimi K3, rebuilt from scratch
#
# **k3lab** rebuilds the infrastructure behind Moonshot AI's *Kimi K3* one component at a time: each
# chapter of this book derives a piece from its paper, writes the simplest correct version, then the
# fast version, checks that the two agree, measures it, and runs a small experiment on real text.
# The code lives in the `k3lab` package (and Triton kernels in `k3lab.kernels`); the notebooks import
# it and never redefine it.
#
# This chapter says what K3 is, maps the book, shows which machine profile you are on, explains the
# three ways to run a chapter, and takes a first look at the real training text every chapter uses.

# %% tags=["parameters"]
profile: str = "cpu"
seed: int = 0
sample_file: str = "Lib/bisect.py"
sample_chars: int = 400
batch_size: int = 4
seq_len: int = 48

# %% tags=["nbval-ignore-output"]
import k3lab

device = k3lab.setup(seed=seed, profile=profile)

# %% [markdown]
# ## What K3 is
#
# From the K3 technical report (*Kimi K3: Open Frontier Intelligence*, arXiv 2607.24653, Table 1):
#
# | | K3 |
# |---|---|
# | parameters | **2.78T** total, **104.2B** activated per token |
# | layers | **93** = 23 × (3 KDA + 1 Gated MLA) + 1 final MLA: 69 KDA, 24 MLA (**3:1**) |
# | hidden size | 7168; 96 heads of dim 128 |
# | MoE | **896** routed experts, **top-16**, 2 shared, expert hidden 3072 at latent width 3584 |
# | residual | Block Attention Residuals, 12 layers per block |
# | context | **1M** tokens (8K → 64K in pre-training, 256K → 1M in the cooldown) |
# | vocabulary | 160K; 1 multi-token-prediction layer |
#
# Three ideas carry most of the design. **Kimi Delta Attention (KDA)** is a linear-attention layer
# whose state has a fixed size, so three of every four layers need no KV cache that grows with the
# context. **LatentMoE** makes the model huge but sparse: each token visits 16 of 896 experts.
# **Attention Residuals** replace the fixed `h + f(h)` residual stream with a learned softmax over
# earlier blocks. Around them sits the system that trains it: context parallelism for KDA,
# perfectly balanced expert parallelism, and the sandboxes that agentic RL runs in.

# %% [markdown]
# The layer stack, drawn from the table: KDA and MLA in a 3:1 pattern (every fourth layer is MLA), and
# the 12-layer blocks over which Attention Residuals attend (8 blocks, the last one partial). The final
# MLA layer after the 23 groups makes the whole-model count 69:24, a ratio just under 3.

# %%
import matplotlib.pyplot as plt
import numpy as np

n_layers, period, attnres_block = 93, 4, 12
is_mla = np.array([(i % period == period - 1) or i == n_layers - 1 for i in range(n_layers)])
print(f"{n_layers} layers: {int((~is_mla).sum())} KDA + {int(is_mla.sum())} MLA "
      f"(ratio {(~is_mla).sum() / is_mla.sum():.2f}:1); "
      f"{-(-n_layers // attnres_block)} AttnRes blocks of {attnres_block}")
assert (~is_mla).sum() == 69 and is_mla.sum() == 24

fig, ax = plt.subplots(figsize=(11, 1.8))
ax.bar(np.arange(n_layers), 1, width=1.0, color=np.where(is_mla, "tab:orange", "tab:blue"), edgecolor="white")
for b in range(attnres_block, n_layers, attnres_block):
    ax.axvline(b - 0.5, color="black", lw=1.5)
ax.set(xlim=(-0.5, n_layers - 0.5), yticks=[], xlabel="layer",
       title="K3's 93 layers: KDA (blue) and Gated MLA (orange); black lines = AttnRes block boundaries")
plt.show()

# %% [markdown]
# Why the 3:1 hybrid matters at a 1M context: per sequence, a KDA layer keeps a fixed state of
# `heads × d_k × d_v` numbers, while an MLA layer caches a 512-wide latent per token (K3's MLA uses
# NoPE, so no extra RoPE key). Plain arithmetic on the table's numbers, in bf16:

# %%
heads, d_k, d_v, kv_lora, bytes_bf16 = 96, 128, 128, 512, 2
n_kda, n_mla = int((~is_mla).sum()), int(is_mla.sum())
contexts = np.array([8_192, 65_536, 262_144, 1_048_576])
kda_state = n_kda * heads * d_k * d_v * bytes_bf16 * np.ones_like(contexts)
mla_cache = n_mla * contexts * kv_lora * bytes_bf16
all_mla = n_layers * contexts * kv_lora * bytes_bf16
for T, a, b, c in zip(contexts, kda_state, mla_cache, all_mla):
    print(f"T={T:>9,d}: KDA state {a / 2**30:6.2f} GiB + MLA cache {b / 2**30:6.2f} GiB "
          f"= {(a + b) / 2**30:6.2f} GiB  (all-MLA: {c / 2**30:6.2f} GiB, {c / (a + b):.1f}x)")

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.loglog(contexts, (kda_state + mla_cache) / 2**30, "o-", label="K3 hybrid (69 KDA + 24 MLA)")
ax.loglog(contexts, all_mla / 2**30, "s--", label="93 MLA layers")
ax.set(xlabel="context length T (tokens)", ylabel="per-sequence cache (GiB, bf16)",
       title="Decoding memory per sequence")
ax.legend()
plt.show()

# %% [markdown]
# ## The chapter map
#
# | # | chapter | component | status |
# |---|---|---|---|
# | 00 | introduction | this page, the data | ready |
# | 01 | KDA | Kimi Delta Attention: delta rule, channel-wise gate, chunkwise form, a tiny LM | ready |
# | 02 | FlashKDA | chunkwise KDA forward and backward as Triton kernels (`k3lab.kernels.kda`) | ready |
# | 03 | KCP | context parallelism for KDA: affine state maps, one all-gather | ready |
# | 04 | AttnRes | Attention Residuals: block softmax over earlier layers, kernels | ready |
# | 05 | LatentMoE | Stable LatentMoE, SiTU-GLU, the sigmoid router, Quantile Balancing | ready |
# | 06 | MoonEP | perfectly balanced expert parallelism: planner, static dispatch and combine | ready |
# | 07 | AgentEnv | sandboxes with pause, fork and snapshots for agentic RL | ready |
# | 08 | the K3 model | Gated MLA, the 3:1 hybrid at full size, Per-Head Muon, MFU | ready |
# | 09 | training | data x expert parallel training on the corpus, resumable | ready (CPU) |
#
# Each chapter follows one order: why (a K3 number), the math, the simplest correct code, the fast
# code, the check that they agree, the measured result beside a ceiling for scale, an experiment,
# exercises, references.

# %% [markdown]
# ## Which profile you are on
#
# Every chapter has a `parameters` cell whose defaults are sized for a 2-core CPU (`profile = "cpu"`):
# Triton kernels then run in Triton's interpreter (`TRITON_INTERPRET=1`, set by `k3lab.setup()` before
# any kernel is defined) and experiments are small. With `profile = "gpu"` the runner reads larger
# sizes from `params/h200.yaml` and `setup()` insists on CUDA.

# %%
import os

print(f"profile = {profile!r}, device = {device.type}, TRITON_INTERPRET = {os.environ.get('TRITON_INTERPRET')}")
assert device.type == ("cuda" if profile == "gpu" else "cpu")

# %% [markdown]
# ## How to run a chapter
#
# - **JupyterLab**: `make venv && .venv/bin/jupyter lab --notebook-dir book` (add `--allow-root` as
#   root). Open `NN_name.ipynb`; with jupytext installed (it is, in `.venv`) saving also updates the
#   paired `NN_name.py`, which is the file under version control that reviewers read.
# - **Papermill / the runner**: `python -m k3lab.book run --only 00` executes chapter 00 into
#   `build/notebooks/` and `build/html/`; `-p seq_len 128` overrides a parameter; on a GPU node
#   `python -m k3lab.book run --profile gpu` uses `params/h200.yaml`. Plain papermill works too:
#   `cd book && papermill -k python3 --execution-timeout 1800 00_introduction.ipynb out.ipynb -p profile gpu`
#   (keep the per-cell timeout: papermill has none of its own).
# - **CI**: `make test` (what `.ci/run` runs) checks that every `.py`/`.ipynb` pair agrees, then runs
#   the package tests and re-executes every notebook with `pytest --nbval`, comparing the text outputs
#   stored in `book/*.ipynb` (cells whose numbers depend on timing or hardware are tagged
#   `nbval-ignore-output`). After editing a chapter, `python -m k3lab.book store NN` refreshes its
#   stored outputs.

# %% [markdown]
# ### The GPU profile, chapter by chapter
#
# `python -m k3lab.book run --profile gpu --record` adds each chapter's outcome on the GPU profile to
# `data/results/book_gpu_<card>.json` (a chapter run again replaces its row, with any `-p` overrides,
# which make a row a trimmed run rather than the profile). The recorded rows (they depend on the hardware,
# so CI does not compare them); a row keeps its chapter's last run on that card, so a FAILED row stands
# until the chapter runs there again (`docs/book.md` says what each failure was):

# %% tags=["nbval-ignore-output"]
import json

from k3lab.book import ROOT

tables = sorted((ROOT / "data" / "results").glob("book_gpu_*.json"))
if not tables:
    print("no GPU-profile run recorded yet: python -m k3lab.book run --profile gpu --record on a GPU node")
for path in tables:
    table = json.loads(path.read_text())
    print(f"{path.name}: {table['device']}")
    for r in table["chapters"]:
        trimmed = f"  overrides {r['overrides']}" if r["overrides"] else ""
        print(f"  {r['name']:<16}{r['status']:<8}{r['seconds']:>8.1f} s  {r['detail']}{trimmed}")
    recorded = {r["chapter"] for r in table["chapters"]}
    missing = [p.stem for p in sorted((ROOT / "book").glob("[0-9][0-9]_*.py")) if p.stem[:2] not in recorded]
    print(f"  no row for: {', '.join(missing)}" if missing else "  every chapter recorded")

# %% [markdown]
# ## The data: real Python source
#
# K3 is trained largely on code, and so is every experiment in this book. `data/corpus.tar.xz` holds
# 397 files (8 MB) of the CPython 3.11 standard library (PSF licence, see `data/README.md`); every
# 20th file is held out for validation. A byte-level BPE tokenizer with 4096 tokens, trained on the
# train split with the `tokenizers` library, turns it into `uint16` token shards
# (`python -m k3lab.data build`, checked against sha256 sums in `data/manifest.json`).

# %%
from k3lab import data

tok = data.load_tokenizer()
train, val = data.load_split("train"), data.load_split("val")
manifest = json.loads((data.resolve_data_dir() / "manifest.json").read_text())
print(f"vocabulary: {data.vocab_size()} tokens ({data.EOT!r} = {tok.token_to_id(data.EOT)})")
for name, tokens in (("train", train), ("val", val)):
    info = manifest["splits"][name]
    assert len(tokens) == info["tokens"]
    print(f"{name:5s}: {info['files']:3d} files, {info['bytes']:>9,d} bytes -> {len(tokens):>9,d} tokens "
          f"= {len(tokens) / info['bytes']:.3f} tokens per byte")
splits = manifest["splits"].values()
print(f"corpus: {sum(i['files'] for i in splits)} files, {sum(i['bytes'] for i in splits) / 1e6:.1f} MB")

# %% [markdown]
# A real snippet, its tokens, and the round trip back to the exact text:

# %%
text = dict(data.read_corpus())[sample_file][:sample_chars]
ids = tok.encode(text).ids
assert tok.decode(ids) == text, "byte-level BPE must round-trip exactly"
print(text)
print(f"--- {len(text.encode())} bytes -> {len(ids)} tokens ({len(ids) / len(text.encode()):.3f} tokens/byte)")
print(" | ".join(tok.decode([i]) for i in ids[:40]).replace("\n", "\\n"))

# %% [markdown]
# How long are the tokens? Frequent Python words (`self`, `return`, four-space indents) become single
# tokens, so most of the text is covered by multi-byte tokens:

# %%
sample = np.asarray(train[:200_000])
lengths = np.array([len(tok.decode([i]).encode()) for i in range(data.vocab_size())])
token_bytes = lengths[sample]
print(f"mean bytes per token in the first 200K train tokens: {token_bytes.mean():.2f}")
print("most frequent tokens:", [tok.decode([int(i)]) for i in np.bincount(sample).argsort()[::-1][:12]])

fig, ax = plt.subplots(figsize=(6, 3))
ax.hist(np.minimum(token_bytes, 16), bins=np.arange(0.5, 17.5), weights=np.ones(len(token_bytes)) / len(token_bytes))
ax.set(xlabel="bytes per token (16 = 16 or more)", ylabel="fraction of tokens", title="Token lengths on real Python")
plt.show()

# %% [markdown]
# The chapters train on random windows: `get_batch` draws `batch_size` start positions with a seeded
# `torch.Generator` and returns inputs `x` and next-token targets `y` (shifted by one):

# %%
import torch

x, y = data.get_batch(train, batch_size, seq_len, torch.Generator().manual_seed(seed), device)
print(f"x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}")
assert torch.equal(x[:, 1:], y[:, :-1])
print(repr(tok.decode(x[0].tolist())))

# %% [markdown]
# ## Exercises
#
# 1. Redo the decoding-memory table for 93 MLA layers with the latent halved to 256: at which context,
#    if any, does it use less memory than K3's hybrid? What does that comparison leave out?
# 2. From the table, count the parameters a K3 token activates in its routed experts alone (16 experts,
#    three projections of 3584 x 3072 each) and compare with the 104.2B it activates in total: where
#    does the rest go?
# 3. Tokenize the validation split's files one by one: which have the most tokens per byte, and what
#    does a higher rate mean for a loss measured in nats per token?
# 4. With the GPU profile's `batch_size` = 8 and `seq_len` = 128, how many steps make one pass over the
#    train split?
#
# ## References
#
# - Kimi Team, *Kimi K3: Open Frontier Intelligence*, arXiv 2607.24653 (Table 1: the model shape).
# - Kimi Team, *Kimi Linear: An Expressive, Efficient Attention Architecture*, arXiv 2510.26692 (KDA).
# - Kimi Team, *Attention Residuals*, arXiv 2603.15031.
# - *LatentMoE*, arXiv 2601.18089.
# - Python Software Foundation, CPython 3.11.7 `Lib/` (the corpus; PSF License Agreement).
# - Hugging Face `tokenizers` (byte-level BPE); papermill, jupytext, nbval (the book's machinery).
