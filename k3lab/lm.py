"""A small decoder-only language model with pluggable parts, and a single-process training loop.

Every chapter's experiment reuses it: chapter 01 swaps the token mixer (softmax attention vs KDA),
chapter 04 swaps the residual stream (Attention Residuals), later chapters the FFN.

    h0 = Embed(tokens)                                                  [B, T, d]
    h  = residual(h0, sublayers)      sublayers = [mixer_0, ffn_0, mixer_1, ffn_1, ...]
    logits = Head(RMSNorm(h))                                           [B, T, vocab]

Each sublayer applies its own pre-RMSNorm and returns its output f(RMSNorm(h)) without adding it:
the residual module decides how outputs are combined (``PreNormResidual``: h = h + f(h)).

Usage:
    >>> import k3lab.lm as lm
    >>> from k3lab.data import vocab_size
    >>> model = lm.LM(lm.LMConfig.tiny(vocab_size=vocab_size(), mixer="kda"))  # the corpus tokenizer's 4096
    >>> x = torch.randint(0, vocab_size(), (2, 16))
    >>> logits, loss = model(x, targets=x)
    >>> history = lm.train(model, steps=100, batch_size=8, seq_len=128, lr=3e-3, device="cpu")  # reads k3lab.data
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from k3lab.kda.checks import check_chunk_size
from k3lab.kda.layer import GATES, KDALayer
from k3lab.norm import RMSNorm

MIXERS = ("kda", "attention", "hybrid")


@dataclass
class LMConfig:
    """Shape and options of ``LM``.

    Attributes:
        vocab_size (int): number of token ids.
        d_model (int): d, the residual width.
        n_layers (int): number of [mixer, ffn] blocks.
        n_heads (int): H, attention heads (KDA: query/key heads).
        head_dim (int): per-head dim (KDA: K = V).
        mixer (str): "kda", "attention", or "hybrid" (K3's layout: every 4th layer and the last one
            are attention, the others KDA).
        ffn_mult (float): SwiGLU hidden width = ffn_mult * d_model, rounded up to a multiple of 16.
        max_seq_len (int): longest sequence the attention layers take (their RoPE table size; KDA layers
            have no limit).
        n_v_heads (int | None): KDA value heads HV (GVA), default n_heads.
        kda_gate (str): "lower_bounded" (K3) or "kimi_linear".
        kda_chunk_size (int): chunk C of the chunkwise KDA.
        rope_theta (float): RoPE base.
        norm_eps (float): RMSNorm eps.
        tie_embeddings (bool): share the embedding matrix with the output head.
        init_std (float): std of the normal init of linear/embedding weights.
    """

    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int = 64
    mixer: str = "kda"
    ffn_mult: float = 8 / 3
    max_seq_len: int = 512
    n_v_heads: int | None = None
    kda_gate: str = "lower_bounded"
    kda_chunk_size: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self):
        ints = dict(vocab_size=self.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
                    n_heads=self.n_heads, head_dim=self.head_dim, max_seq_len=self.max_seq_len)
        for name, n in ints.items():
            if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
                raise ValueError(f"LMConfig.{name} must be a positive int, got {n!r}")
        if self.mixer not in MIXERS:
            raise ValueError(f"LMConfig.mixer must be one of {MIXERS}, got {self.mixer!r}")
        if self.head_dim % 2:
            raise ValueError(f"LMConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.n_v_heads is not None and not (
            isinstance(self.n_v_heads, int) and not isinstance(self.n_v_heads, bool)
            and self.n_v_heads > 0 and self.n_v_heads % self.n_heads == 0
        ):
            raise ValueError(f"LMConfig.n_v_heads must be None or a positive int multiple of n_heads={self.n_heads}, "
                             f"got {self.n_v_heads!r}")
        if self.kda_gate not in GATES:
            raise ValueError(f"LMConfig.kda_gate must be one of {GATES}, got {self.kda_gate!r}")
        check_chunk_size(self.kda_chunk_size, name="LMConfig.kda_chunk_size")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LMConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        for name, x, low in (("ffn_mult", self.ffn_mult, "> 0"), ("rope_theta", self.rope_theta, "> 0"),
                             ("norm_eps", self.norm_eps, "> 0"), ("init_std", self.init_std, ">= 0")):
            ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            if not (ok and (x > 0 if low == "> 0" else x >= 0)):
                raise ValueError(f"LMConfig.{name} must be a finite number {low}, got {x!r}")

    @property
    def ffn_hidden(self) -> int:
        return 16 * math.ceil(self.ffn_mult * self.d_model / 16)

    def layer_mixers(self) -> list[str]:
        """The mixer of each layer: ["kda", "kda", "kda", "attention", ...]."""
        if self.mixer != "hybrid":
            return [self.mixer] * self.n_layers
        return ["attention" if (i % 4 == 3 or i == self.n_layers - 1) else "kda" for i in range(self.n_layers)]

    @classmethod
    def tiny(cls, **overrides) -> "LMConfig":
        """0.40M (attention) / 0.47M (KDA) non-embedding params: CPU tests and the CPU book
        (d=128, 2 layers, 2 heads x 64)."""
        return replace(cls(d_model=128, n_layers=2, n_heads=2, head_dim=64, max_seq_len=256), **overrides)

    @classmethod
    def small(cls, **overrides) -> "LMConfig":
        """19.0M (attention) / 22.2M (KDA) non-embedding params: GPU experiments (d=512, 6 layers,
        8 heads x 64)."""
        return replace(cls(d_model=512, n_layers=6, n_heads=8, head_dim=64, max_seq_len=1024), **overrides)


class RMSNormSublayer(nn.Module):
    """A sublayer: y = f(RMSNorm(h)) (pre-norm; the residual add is the residual module's job)."""

    def __init__(self, d_model: int, fn: nn.Module, eps: float):
        super().__init__()
        self.norm = RMSNorm(d_model, eps=eps)
        self.fn = fn

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fn(self.norm(h))


class SwiGLU(nn.Module):
    """FFN: W_down( SiLU(W_gate x) * W_up x ) (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def rope_tables(T: int, dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [T, dim/2] for rotary embeddings (Su et al. 2021, RoFormer), float32."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x_i, x_{i+D/2}) of x [B, H, T, D] by position-dependent angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Causal softmax attention with RoPE, via ``F.scaled_dot_product_attention``: [B, T, d] -> [B, T, d]."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        inner = config.n_heads * config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * inner, bias=False)
        self.out = nn.Linear(inner, config.d_model, bias=False)
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        if T > self.cos.shape[0]:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.cos.shape[0]}")
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, self.cos[:T], self.sin[:T]), apply_rope(k, self.cos[:T], self.sin[:T])
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, T, -1))


class KDAMixer(nn.Module):
    """``KDALayer`` as a sublayer function: [B, T, d] -> [B, T, d] (training path, no cache)."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.kda = KDALayer(config.d_model, config.n_heads, config.head_dim, num_v_heads=config.n_v_heads,
                            gate=config.kda_gate, chunk_size=config.kda_chunk_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kda(x, use_cache=False)[0]


class PreNormResidual(nn.Module):
    """The standard residual stream: h = h + f(h) for each sublayer f in order."""

    def forward(self, h0: torch.Tensor, sublayers: nn.ModuleList) -> torch.Tensor:
        h = h0
        for f in sublayers:
            h = h + f(h)
        return h


class LM(nn.Module):
    """Decoder-only LM: embed -> residual(h0, sublayers) -> RMSNorm -> head.

    Args:
        config (LMConfig): shapes and options.
        residual (nn.Module | None): any module with ``forward(h0 [B, T, d], sublayers) -> [B, T, d]``;
            default ``PreNormResidual()``.
        ffn (Callable[[int], nn.Module] | None): builds layer i's FFN, any module [B, T, d] -> [B, T, d]
            (chapter 05 passes ``lambda i: k3lab.moe.MoE(...)``); default a SwiGLU of ``config.ffn_hidden``.
            Modules it builds keep their own initialisation.

    ``forward(idx [B, T] int64, targets [B, T] int64 | None) -> (logits [B, T, vocab] float32,
    loss scalar | None)``; the loss is the mean next-token cross-entropy (nats) over the counted targets
    (0 when every target is -100). Raises ValueError
    for ids outside [0, vocab_size) (targets may also be -100, cross_entropy's ignore index).
    """

    def __init__(self, config: LMConfig, residual: nn.Module | None = None, ffn=None):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        layers, custom = [], []
        for i, kind in enumerate(config.layer_mixers()):
            mixer = CausalSelfAttention(config) if kind == "attention" else KDAMixer(config)
            f = SwiGLU(config.d_model, config.ffn_hidden) if ffn is None else ffn(i)
            if ffn is not None:
                custom.append(f)
            layers += [RMSNormSublayer(config.d_model, mixer, config.norm_eps),
                       RMSNormSublayer(config.d_model, f, config.norm_eps)]
        self.sublayers = nn.ModuleList(layers)
        self.residual = PreNormResidual() if residual is None else residual
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        keep = {id(m) for f in custom for m in f.modules()}
        self.apply(lambda m: None if id(m) in keep else self._init_weights(m))
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        # Scale each sublayer's output projection by 1/sqrt(2 n_layers) (GPT-2) so the stream's
        # variance does not grow with depth at init.
        kept = {id(p) for f in custom for p in f.parameters()}
        for name, p in self.named_parameters():
            if id(p) not in kept and name.endswith(("out.weight", "down.weight", "o_proj.weight")):
                nn.init.normal_(p, std=config.init_std / math.sqrt(2 * config.n_layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if not isinstance(idx, torch.Tensor) or idx.ndim != 2:
            got = list(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"idx must be [B, T] token ids (a torch.Tensor), got {got}")
        if 0 in idx.shape:
            raise ValueError(f"idx must be [B, T] with B >= 1 and T >= 1, got shape {list(idx.shape)}")
        _check_ids("idx", idx, self.config.vocab_size)
        if targets is not None:
            if not isinstance(targets, torch.Tensor) or targets.shape != idx.shape:
                got = list(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
                raise ValueError(f"targets must have idx's shape {list(idx.shape)}, got {got}")
            _check_ids("targets", targets, self.config.vocab_size, ignore_index=-100)
        # Any integer dtype: nn.Embedding takes int32/int64 only, cross_entropy int64 (uint8 ids failed there).
        h = self.residual(self.embed(idx.long()), self.sublayers)
        logits = self.head(self.norm(h)).float()
        if targets is None:
            return logits, None
        tgt = targets.flatten().long()
        # The mean over the counted targets (the sum over a count of at least 1): a batch whose targets are
        # all -100 has loss 0, not 0/0 = NaN.
        return logits, F.cross_entropy(logits.flatten(0, 1), tgt, reduction="sum") / (tgt != -100).sum().clamp(min=1)


def _check_ids(name: str, ids: torch.Tensor, vocab_size: int, ignore_index: int | None = None) -> None:
    """Raise ValueError unless ``ids`` is an integer tensor with values in [0, vocab_size) (or ignore_index)."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of token ids, got dtype {ids.dtype}")
    # Compared in int64: a narrower dtype converts vocab_size to itself (256 is 0 in uint8, and int8 raises).
    ids = ids.long()
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if ids.numel() and bad.any():
        raise ValueError(f"{name} must be token ids in [0, vocab_size={vocab_size}), got min {ids.min().item()}, "
                         f"max {ids.max().item()}")


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once); optionally without the token
    embedding (and a head tied to it)."""
    params = {id(p): p for p in model.parameters()}
    if exclude_embedding and hasattr(model, "embed"):
        params.pop(id(model.embed.weight), None)
    return sum(p.numel() for p in params.values())


def lr_at(step: int, steps: int, lr: float, warmup: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup for ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr`` at ``steps``; ``step``
    counts from 0 (the tiny-LM loop's index). The trainer's schedule, ``k3lab.train.lr_at``, is the same
    shape in the trainer's terms: steps from 1 and warmup as a fraction of the run."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], amp: bool) -> float:
    """Mean loss of ``model`` over fixed (x, y) batches (ValueError when there are none)."""
    if not batches:
        raise ValueError("evaluate needs at least one (x, y) batch")
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            total += model(x, y)[1].item()
    model.train(was_training)
    return total / len(batches)


def train(
    model: nn.Module,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    device: str | torch.device,
    seed: int = 0,
    log_every: int = 10,
    warmup: int | None = None,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    eval_batches: int = 4,
    max_seconds: float | None = None,
    data: tuple | None = None,
    progress: bool = True,
    extra_loss=None,
    after_step=None,
    optimizer=None,
    microbatches: int = 1,
    desc: str | None = None,
) -> dict[str, list]:
    """Train ``model`` (an ``LM`` or anything with ``forward(x, y) -> (logits, loss)``) on next-token
    prediction with AdamW (or ``optimizer``), linear warmup + cosine decay, gradient clipping, bf16 autocast on CUDA.

    Args:
        model (nn.Module): moved to ``device``; trained in place.
        steps (int): optimizer steps.
        batch_size (int), seq_len (int): B and T of each optimizer step's batch.
        microbatches (int): M, a divisor of B: each step runs M forward + backward passes of B / M
            sequences (each loss / M, gradients accumulated) before one optimizer step, so a step of B
            sequences needs the memory of B / M. Validation batches hold B / M sequences. A MoE layer
            counts every micro-batch's tokens, so its bias update sees the whole step's load.
        lr (float): peak learning rate.
        device (str | torch.device): "cpu" or "cuda".
        seed (int): seeds the batch sampler (train and val); set model init seeds before building it.
        log_every (int): log (and evaluate) every this many steps, and at the last step.
        warmup (int | None): warmup steps, default min(100, steps // 10).
        weight_decay (float): AdamW decay on matrices (not on norms, biases or 1-D gate params).
        grad_clip (float): max global gradient norm.
        eval_batches (int): fixed validation batches evaluated at each log.
        max_seconds (float | None): stop early after this much training wall time.
        data (tuple | None): (train_tokens, val_tokens) 1-D integer arrays; default
            ``k3lab.data.load_split("train")`` and ``("val")``.
        progress (bool): show a tqdm bar.
        desc (str | None): the bar's label (default: the model's ``config.mixer``, else "train"), so runs of
            one mixer that differ elsewhere (residuals, experts) can be told apart.
        extra_loss (Callable[[nn.Module], Tensor | float] | None): added to the loss before backward
            (e.g. ``k3lab.moe.balance_loss``); the logged loss stays the language-model loss.
        after_step (Callable[[int, nn.Module], None] | None): called after each optimizer step with the
            step index (e.g. the MoE bias update and its load log).
        optimizer (Callable[[nn.Module, float, float], torch.optim.Optimizer] | None): builds the
            optimizer from (model, lr, weight_decay), e.g. ``lambda m, lr, wd:
            k3lab.optim.per_head_muon(m, lr, wd)``; every group's lr follows the schedule. Default: AdamW
            (betas 0.9, 0.95), decay on matrices only.

    Returns:
        dict of equal-length lists, one entry per log: step, loss (mean train loss since the last
        log), val_loss, tokens_per_s (training throughput since the last log), lr, elapsed_s.

    Raises:
        ValueError: non-positive steps/batch_size/seq_len/log_every/eval_batches, microbatches not a positive
            int dividing batch_size, lr or grad_clip <= 0
            or not finite, weight_decay < 0 or not finite, warmup not an int >= 0, max_seconds not None or
            > 0, data not two 1-D integer np.ndarrays, token ids < 0 or >= the model's ``config.vocab_size``
            (named by split), device "cuda" where torch sees no CUDA device.
        FileNotFoundError: the token shards are missing (from ``k3lab.data``; it names the build command).
    """
    from tqdm.auto import tqdm

    from k3lab import data as kdata

    for name, n in dict(steps=steps, batch_size=batch_size, seq_len=seq_len, log_every=log_every).items():
        if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if not (isinstance(microbatches, int) and not isinstance(microbatches, bool) and microbatches > 0
            and batch_size % microbatches == 0):
        raise ValueError(f"microbatches must be a positive int dividing batch_size={batch_size}, got {microbatches!r}")
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be positive and finite, got {lr!r}")
    # NaN never stopped the run, and a negative value stopped it after one step.
    if max_seconds is not None and not (isinstance(max_seconds, (int, float)) and not isinstance(max_seconds, bool)
                                        and max_seconds > 0):
        raise ValueError(f"max_seconds must be None or a number > 0, got {max_seconds!r}")
    if not (isinstance(eval_batches, int) and eval_batches > 0):
        raise ValueError(f"eval_batches must be a positive int, got {eval_batches!r}")
    # A negative max norm would flip every gradient (clip_grad_norm_ scales by it): gradient ascent.
    real = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if not (real(grad_clip) and grad_clip > 0 and math.isfinite(grad_clip)):
        raise ValueError(f"grad_clip must be a positive finite number, got {grad_clip!r}")
    if not (real(weight_decay) and weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if warmup is not None and not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"warmup must be an int >= 0 or None, got {warmup!r}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but torch sees no CUDA device here; pass device='cpu'")
    if data is not None and not (isinstance(data, (tuple, list)) and len(data) == 2 and all(
            isinstance(t, np.ndarray) and t.ndim == 1 and np.issubdtype(t.dtype, np.integer) for t in data)):
        raise ValueError(f"data must be (train_tokens, val_tokens), two 1-D integer np.ndarrays, got "
                         f"{type(data).__name__} of {[type(t).__name__ for t in data] if isinstance(data, (tuple, list)) else '?'}")
    train_tokens, val_tokens = data if data is not None else (kdata.load_split("train"), kdata.load_split("val"))
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    for name, tokens in (("train", train_tokens), ("val", val_tokens)):
        # Checked once here: a window with an out-of-range id could otherwise fail at any step.
        if len(tokens) and int(tokens.min()) < 0:
            raise ValueError(f"the {name} tokens hold id {int(tokens.min())}: token ids must be >= 0")
        if vocab is not None and len(tokens) and int(tokens.max()) >= vocab:
            raise ValueError(f"the {name} tokens hold id {int(tokens.max())}, beyond the model's "
                             f"vocab_size={vocab} (build the LM with vocab_size=k3lab.data.vocab_size())")
    warmup = min(100, steps // 10) if warmup is None else warmup
    amp = device.type == "cuda"
    model.to(device).train()

    if optimizer is None:
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr, betas=(0.9, 0.95), fused=amp or None)
    else:
        opt = optimizer(model, lr, weight_decay)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"optimizer must return a torch.optim.Optimizer, got {type(opt).__name__}")
    gen = torch.Generator().manual_seed(seed)
    val_gen = torch.Generator().manual_seed(seed + 1)
    val = [kdata.get_batch(val_tokens, batch_size // microbatches, seq_len, val_gen, device)
           for _ in range(eval_batches)]

    history = {k: [] for k in ("step", "loss", "val_loss", "tokens_per_s", "lr", "elapsed_s")}
    running, n_running, t_log, train_time = 0.0, 0, time.perf_counter(), 0.0
    if desc is None:
        desc = getattr(getattr(model, "config", None), "mixer", "train")
    bar = tqdm(range(steps), disable=not progress, desc=desc)
    for step in bar:
        t0 = time.perf_counter()
        cur_lr = lr_at(step, steps, lr, warmup)
        for group in opt.param_groups:
            group["lr"] = cur_lr
        x, y = kdata.get_batch(train_tokens, batch_size, seq_len, gen, device)
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                _, part = model(xs, ys)
            ((part if extra_loss is None else part + extra_loss(model)) / microbatches).backward()
            loss = loss + part.detach() / microbatches
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        if after_step is not None:
            after_step(step, model)
        running += loss.item()
        n_running += 1
        train_time += time.perf_counter() - t0
        last = step == steps - 1 or (max_seconds is not None and train_time >= max_seconds)
        if (step + 1) % log_every == 0 or last:
            now = time.perf_counter()
            history["step"].append(step + 1)
            history["loss"].append(running / n_running)
            history["val_loss"].append(evaluate(model, val, amp))
            history["tokens_per_s"].append(n_running * batch_size * seq_len / (now - t_log))
            history["lr"].append(cur_lr)
            history["elapsed_s"].append(train_time)
            bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", val=f"{history['val_loss'][-1]:.3f}",
                            tok_s=f"{history['tokens_per_s'][-1]:.0f}")
            running, n_running = 0.0, 0
            t_log = time.perf_counter()
        if last:
            break
    bar.close()
    return history
