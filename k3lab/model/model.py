"""`K3Model`: the K3 architecture built from k3lab's parts (K3 report, Sec. 2 and Table 1).

    h0     = Embed(tokens)                                                [B, T, d]
    mixer  = KDALayer (3 of every 4 layers) | GatedMLA (every 4th and the last)
    ffn    = GatedFFN(SiTU-GLU) in the first layer | Stable LatentMoE in the others
    h      = BlockAttnRes(h0, [norm -> mixer_0, norm -> ffn_0, norm -> mixer_1, ...])
    logits = Head(RMSNorm(h))                                             [B, T, vocab]

With ``num_nextn_predict_layers`` = D > 0, D multi-token-prediction modules (DeepSeek-V3, Sec. 2.2) follow
in sequence, module k predicting token t+k+1 at position t from the previous depth's state and the
embedding of token t+k:

    h^k_t  = MTP_k(h^{k-1}_t, Embed(x_{t+k}))     (h^0 = h, the main stack's output)
    loss   = CE(logits, x_{t+1}) + lambda / D * sum_k CE(Head(RMSNorm_k(h^k_t)), x_{t+k+1})

sharing the embedding and the head; positions whose target lies past the sequence are ignored.

Each sublayer is pre-normed and returns its output without adding it; Block AttnRes (``k3lab.attnres``)
combines the outputs. The token mixers take per-call context (packed-document offsets, decoding
caches) that the residual interface ``f(h)`` does not pass: ``K3Model`` builds one ``_MixerContext`` per
forward and binds it to each mixer sublayer's call as an argument, so an activation-checkpoint replay in
backward (``k3lab.memory``'s recompute) runs the mixer with the same context.

Block AttnRes cuts the 2L sublayers at K3's boundaries (``K3Config.attn_res_sizes``): blocks of
``attn_res_block_size`` whole layers, the last one partial (K3: 7 blocks of 12 layers and one of 9,
9 sources with the embedding).
"""
from __future__ import annotations

import functools
import math
import numbers

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3lab.attnres import BlockAttnRes
from k3lab.kda import KDACache, KDALayer
from k3lab.kda.checks import check_cu_seqlens
from k3lab.norm import RMSNorm
from k3lab.lm import RMSNormSublayer, _check_ids
from k3lab.mla import GatedMLA, MLACache
from k3lab.moe import GatedFFN, MoE, MoEConfig
from k3lab.moe.experts import depth_scaled_std
from k3lab.model.config import K3Config
from k3lab.model.loss import linear_cross_entropy


class _MixerContext:
    """What every token mixer of one forward reads: cu_seqlens, the input caches, whether to return
    new ones, where to put them (one slot per layer), and the context-parallel layout."""

    def __init__(self, cu_seqlens=None, caches=None, use_cache=False, n_layers=0, cp=None):
        self.cu_seqlens, self.caches, self.use_cache, self.cp = cu_seqlens, caches, use_cache, cp
        self.new_caches = [None] * n_layers if use_cache else None


def bind_context(sublayers, context: _MixerContext) -> list:
    """``sublayers`` as Block AttnRes's callables, each mixer sublayer's call given ``context`` as an argument
    (a recompute region keeps its arguments for the replay; a shared object would be reset by then)."""
    return [functools.partial(s, context=context) if isinstance(s, MixerSublayer) else s for s in sublayers]


class MixerSublayer(nn.Module):
    """Layer ``index``'s token mixer as a sublayer: y = mixer(RMSNorm(h)) with the context's
    cu_seqlens, cache and context-parallel layout; [B, T, d] -> [B, T, d]. Called without a context
    (a plain ``f(h)``) it runs one sequence per row, without caches."""

    def __init__(self, d_model: int, mixer: nn.Module, eps: float, index: int):
        super().__init__()
        self.norm = RMSNorm(d_model, eps=eps)
        self.fn = mixer
        self.index = index

    def forward(self, h: torch.Tensor, context: _MixerContext | None = None) -> torch.Tensor:
        c = _MixerContext() if context is None else context
        cache = None if c.caches is None else c.caches[self.index]
        extra = {} if c.cp is None else {"cp": c.cp}
        y, new = self.fn(self.norm(h), cache=cache, cu_seqlens=c.cu_seqlens, use_cache=c.use_cache, **extra)
        if c.use_cache:
            c.new_caches[self.index] = new
        return y


def build_mixer(config: K3Config, kind: str) -> nn.Module:
    """One token mixer of ``config``: ``KDALayer`` for kind "kda", ``GatedMLA`` for "mla".

    Raises:
        ValueError: an unknown kind.
    """
    c = config
    if kind == "kda":
        return KDALayer(c.hidden_size, c.num_attention_heads, c.head_dim, conv_size=c.kda_conv_size,
                        gate="lower_bounded", lower_bound=c.kda_gate_lower_bound, norm_eps=c.rms_norm_eps,
                        chunk_size=c.kda_chunk_size, gate_rank=c.kda_gate_rank)
    if kind == "mla":
        return GatedMLA(c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.q_lora_rank, c.qk_nope_head_dim,
                        c.qk_rope_head_dim, c.v_head_dim, norm_eps=c.rms_norm_eps)
    raise ValueError(f"kind must be 'kda' or 'mla', got {kind!r}")


def moe_config(config: K3Config) -> MoEConfig:
    """The ``k3lab.moe.MoEConfig`` of ``config``'s MoE layers (SiTU-GLU, LatentMoE at ``moe_latent_size``)."""
    c = config
    return MoEConfig(d_model=c.hidden_size, n_experts=c.n_routed_experts, top_k=c.num_experts_per_tok,
                     expert_hidden=c.moe_intermediate_size, latent_dim=c.moe_latent_size,
                     n_shared=c.n_shared_experts, activation="situ", renormalize=c.moe_renormalize,
                     routed_scaling=c.routed_scaling_factor, balance=c.moe_balance,
                     n_layers=c.num_hidden_layers, init_std=c.init_std, norm_eps=c.rms_norm_eps)


class MTPModule(nn.Module):
    """One multi-token-prediction depth (DeepSeek-V3, Sec. 2.2) in K3's parts: the previous depth's
    state and the next token's embedding, each RMS-normed, concatenated and projected back to d, then
    one Gated MLA layer and one Stable LatentMoE with pre-norm residuals, and the depth's final norm.

    ``forward(h [B, T, d], emb [B, T, d], cu_seqlens, mask) -> (state [B, T, d], RMSNorm(state) for the
    head)``; ``mask`` [B, T] bool marks the positions with a target, the only ones the MoE's balancing
    statistics count.
    """

    def __init__(self, config: K3Config):
        super().__init__()
        c, d = config, config.hidden_size
        self.norm_h = RMSNorm(d, eps=c.rms_norm_eps)
        self.norm_emb = RMSNorm(d, eps=c.rms_norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.mixer = RMSNormSublayer(d, build_mixer(c, "mla"), c.rms_norm_eps)
        self.ffn = RMSNormSublayer(d, MoE(moe_config(c)), c.rms_norm_eps)
        self.norm = RMSNorm(d, eps=c.rms_norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                mask: torch.Tensor | None = None):
        x = self.proj(torch.cat([self.norm_h(h), self.norm_emb(emb)], dim=-1))
        x = x + self.mixer.fn(self.mixer.norm(x), cu_seqlens=cu_seqlens)[0]
        x = x + self.ffn.fn(self.ffn.norm(x), mask=mask)
        return x, self.norm(x)


def _shift_left(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """[B, T] -> [B, T]: t[:, k:] then k columns of ``fill``."""
    return torch.cat([t[:, k:], t.new_full((t.shape[0], min(k, t.shape[1])), fill)], dim=1)[:, :t.shape[1]]


def set_value_checks(root: nn.Module, enabled: bool) -> None:
    """Set ``check_values`` on ``root`` (a ``K3Model`` or one of its pipeline stages) and on every module
    inside it that checks values per call: KDA layers, routers, Block AttnRes (``K3Model.value_checks``).

    Raises:
        ValueError: ``enabled`` not a bool.
    """
    from k3lab.moe.router import Router  # noqa: PLC0415

    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be a bool, got {enabled!r}")
    root.check_values = enabled
    for m in root.modules():
        if isinstance(m, (KDALayer, Router, BlockAttnRes)):
            m.check_values = enabled


class K3Model(nn.Module):
    """The K3 language model (K3 report, Sec. 2, Table 1): KDA / Gated MLA hybrid, dense first FFN then
    Stable LatentMoE, Block AttnRes residual, untied head.

    Args:
        config (K3Config): e.g. ``K3Config.preset("k3-tiny")``.
        attn_res_path (str): ``BlockAttnRes``'s path ("auto": the memory-efficient training path under
            autograd, the two-phase inference path otherwise).

    Attributes:
        embed (nn.Embedding), sublayers (nn.ModuleList of 2L: mixer, ffn, mixer, ...), residual
        (BlockAttnRes), norm (RMSNorm), head (nn.Linear [vocab, d]), mtp (nn.ModuleList of D
        ``MTPModule``, empty without MTP).

    ``forward(idx, targets=None, cu_seqlens=None) -> (logits, loss)`` as ``k3lab.lm.LM``;
    ``generate`` decodes with the KDA states and MLA latent caches.

    Example:
        >>> model = K3Model(K3Config.preset("k3-tiny"))
        >>> idx = torch.randint(0, 256, (2, 16))
        >>> logits, loss = model(idx, targets=idx)
        >>> logits.shape
        torch.Size([2, 16, 256])
    """

    def __init__(self, config: K3Config, attn_res_path: str = "auto"):
        super().__init__()
        if not isinstance(config, K3Config):
            raise ValueError(f"config must be a K3Config, got {type(config).__name__}")
        config.check()  # a field set after construction was checked only by torch ("negative dimension")
        self.config = c = config
        d, L = c.hidden_size, c.num_hidden_layers
        self.embed = nn.Embedding(c.vocab_size, d)
        out_std = depth_scaled_std(c.init_std, L)
        layers = []
        for i, (kind, ffn_kind) in enumerate(zip(c.layer_types(), c.ffn_types())):
            mixer = build_mixer(c, kind)
            if ffn_kind == "dense":
                ffn = GatedFFN(d, c.intermediate_size, "situ", c.init_std, out_std)
            else:
                ffn = MoE(moe_config(c))
            layers += [MixerSublayer(d, mixer, c.rms_norm_eps, i),
                       RMSNormSublayer(d, ffn, c.rms_norm_eps)]
        self.sublayers = nn.ModuleList(layers)
        self.residual = BlockAttnRes(d, 2 * L, c.attn_res_sizes(), eps=c.rms_norm_eps, path=attn_res_path)
        self.norm = RMSNorm(d, eps=c.rms_norm_eps)
        self.head = nn.Linear(d, c.vocab_size, bias=False)
        self.mtp = nn.ModuleList([MTPModule(c) for _ in range(c.num_nextn_predict_layers)])
        # Token-id range checks (one host sync per call); ``value_checks`` turns them off.
        self.check_values = True
        self.compile_loss = False
        self._init_weights()
        if c.tie_word_embeddings:
            self.head.weight = self.embed.weight

    @torch.no_grad()
    def _init_weights(self) -> None:
        c = self.config
        # The FFNs (GatedFFN, MoE) initialise themselves, output projections depth-scaled.
        ffns = list(self.sublayers[1::2]) + [m.ffn for m in self.mtp]
        own = {id(m) for s in ffns for m in s.fn.modules()}
        for m in self.modules():
            if id(m) in own:
                continue
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=c.init_std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        # Each mixer's projection into the residual stream, GPT-2's 1/sqrt(2L) scaling.
        for s in list(self.sublayers[0::2]) + [m.mixer for m in self.mtp]:
            nn.init.normal_(s.fn.o_proj.weight, std=depth_scaled_std(c.init_std, c.num_hidden_layers))

    def mixers(self) -> list[nn.Module]:
        """The L token mixers (KDALayer or GatedMLA), in layer order."""
        return [s.fn for s in self.sublayers[0::2]]

    def value_checks(self, enabled: bool) -> None:
        """Turn the per-call value checks on or off: the token-id range of ``forward``, the NaN/inf checks of
        the KDA kernels, the routers and Block AttnRes's training path (each one host sync per call). The
        CPU's PyTorch KDA (``chunk_kda``) always checks its inputs: off is for the GPU path.

        A trainer that checks its token split once turns them off so a step never waits on the host; a NaN
        then shows in the loss.

        Raises:
            ValueError: ``enabled`` not a bool."""
        set_value_checks(self, enabled)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, caches: list | None = None,
                use_cache: bool = False, cp=None, return_logits: bool = True):
        """Next-token logits (and loss).

        Args:
            idx (Tensor): [B, T] integer token ids in [0, vocab_size).
            targets (Tensor | None): [B, T] integer ids (or -100, ignored); the loss is their mean
                cross-entropy in nats (0 when every target is ignored), plus ``mtp_loss_weight`` times the MTP depths' mean loss when the
                config has MTP modules (module docstring).
            cu_seqlens (Tensor | None): int [N+1] offsets of N documents packed into B = 1: every mixer
                keeps them apart (KDA restarts its state and convolution, MLA masks across documents).
            caches (list | None): per layer KDACache / MLACache from an earlier call with use_cache=True.
            use_cache (bool): also return the updated caches.
            cp (KCPContext | None): context parallel (``k3lab.kcp.make_context`` over the cp group):
                idx [1, T_local] is this rank's slice of the packed sequence ``cp`` describes (its
                documents keep apart as with cu_seqlens); KDA layers run KCP, MLA layers gather the
                latents (``GatedMLA``); everything else is per token. The loss is the mean over the local
                targets: average it over the group for the sequence's mean.
            return_logits (bool): False (with targets): the loss without the logits, from the head in
                chunks of rows (``k3lab.model.loss.linear_cross_entropy``: the [B*T, vocab] logits are never
                formed), and None in their place. Training needs only the loss; at K3's vocabulary the logits
                are the largest tensors of a step.

        Returns:
            (logits [B, T, vocab] float32 (float64 for a float64 model) | None, loss scalar | None), and the
            list of L caches as a third element when ``use_cache``.

        Raises:
            ValueError: idx or the model on the meta device (no values to run on: count parameters and FLOPs
                with ``count_params`` and ``flops_per_token``); idx not [B, T] with B, T >= 1, ids out of range,
                targets of another shape, use_cache not a bool,
                cu_seqlens with B > 1, with caches or use_cache, or invalid; caches not a list of L caches; cp with
                cu_seqlens, caches or use_cache, or idx not [1, cp.T_local].
        """
        c = self.config
        self._check_idx(idx)
        if not isinstance(use_cache, bool):
            raise ValueError(f"use_cache must be a bool, got {use_cache!r}")
        if not isinstance(return_logits, bool):
            raise ValueError(f"return_logits must be a bool, got {return_logits!r}")
        if not return_logits and targets is None:
            raise ValueError("return_logits=False needs targets (the call would return nothing)")
        if targets is not None:
            if not isinstance(targets, torch.Tensor) or targets.shape != idx.shape:
                raise ValueError(f"targets must have idx's shape {list(idx.shape)}, got "
                                 f"{list(targets.shape) if isinstance(targets, torch.Tensor) else targets!r}")
            if self.check_values:
                _check_ids("targets", targets, c.vocab_size, ignore_index=-100)
        if self.mtp and cp is not None:
            raise ValueError("MTP with cp is not supported: a position's later tokens may live on the next rank")
        if cu_seqlens is not None:
            if idx.shape[0] != 1:
                raise ValueError(f"with cu_seqlens the documents must be packed into B=1, got B={idx.shape[0]}")
            if caches is not None:
                raise ValueError("cu_seqlens with caches is not supported (decode documents as a batch)")
            if use_cache:
                # The KDA layers would return a state per document, the MLA layers one cache of every packed
                # document together: no later call could continue either.
                raise ValueError("cu_seqlens with use_cache is not supported (prefill documents as a batch)")
            check_cu_seqlens(cu_seqlens, idx.shape[1])
        if caches is not None and not (isinstance(caches, list) and len(caches) == c.num_hidden_layers
                                       and all(isinstance(x, (KDACache, MLACache)) for x in caches)):
            raise ValueError(f"caches must be a list of {c.num_hidden_layers} KDACache/MLACache from a call with "
                             f"use_cache=True, got {type(caches).__name__}")
        if cp is not None:
            from k3lab.kcp import KCPContext  # noqa: PLC0415

            if not isinstance(cp, KCPContext):
                raise ValueError(f"cp must be a k3lab.kcp.KCPContext (make_context) or None, got {type(cp).__name__}")
            if cu_seqlens is not None or caches is not None or use_cache:
                raise ValueError("with cp, pass no cu_seqlens (cp places the documents), caches or use_cache")
            if tuple(idx.shape) != (1, cp.T_local):
                raise ValueError(f"with cp, idx must be this rank's slice [1, T_local={cp.T_local}], "
                                 f"got {list(idx.shape)}")
        context = _MixerContext(cu_seqlens, caches, use_cache, c.num_hidden_layers, cp)
        h = self.residual(self.embed(idx.long()), bind_context(self.sublayers, context))
        new_caches = context.new_caches
        logits, loss = None, None
        if return_logits:
            logits = self.head(self.norm(h))
            logits = logits if logits.dtype == torch.float64 else logits.float()
        if targets is not None:
            tgt = targets.flatten().long()
            if logits is None:
                loss = self.head_loss(self.norm(h), tgt)
            else:
                # The mean over the counted targets (the sum over a count of at least 1): a batch whose targets
                # are all -100 has loss 0, not 0/0 = NaN.
                loss = F.cross_entropy(logits.flatten(0, 1), tgt, reduction="sum") / (tgt != -100).sum().clamp(min=1)
            if self.mtp:
                loss = loss + c.mtp_loss_weight * self.mtp_loss(h, idx.long(), targets.long(), cu_seqlens)
        return (logits, loss, new_caches) if use_cache else (logits, loss)

    def _check_idx(self, idx: torch.Tensor) -> None:
        """ValueError unless idx is [B, T] with B, T >= 1 (and, with value checks on, ids in [0, vocab_size)),
        and neither idx nor the model is on the meta device."""
        # The forward reads values (the id and NaN checks, KDA's kernels, which have no meta versions): on meta
        # it failed deep inside with torch's "Tensor.item() cannot be called on meta tensors".
        if (isinstance(idx, torch.Tensor) and idx.is_meta) or self.head.weight.is_meta:
            raise ValueError("K3Model.forward: meta tensors carry no values; the forward (id and NaN checks, KDA) "
                             f"needs idx and the model on a real device, got idx on "
                             f"{idx.device if isinstance(idx, torch.Tensor) else type(idx).__name__} and the model on "
                             f"{self.head.weight.device}. For shapes alone, count parameters on meta with "
                             "k3lab.model.count_params and FLOPs with k3lab.model.flops_per_token")
        if not isinstance(idx, torch.Tensor) or idx.ndim != 2 or 0 in idx.shape:
            got = list(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"idx must be [B, T] token ids with B, T >= 1, got {got}")
        if self.check_values:
            _check_ids("idx", idx, self.config.vocab_size)

    def mtp_loss(self, h: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor,
                 cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Mean over the D MTP depths of their cross-entropy (module docstring), from the main stack's
        output h [B, T, d], the input ids idx [B, T] and targets [B, T] (targets[:, t] = x_{t+1}; -100
        ignored). Depth k reads the embedding of x_{t+k} = idx[:, t+k] (the input, so a target masked with
        -100 changes no other position's input) and predicts targets[:, t+k]. Positions whose target lies past
        the end of the row, or with ``cu_seqlens`` [N + 1] past the end of their document, are ignored (a
        document of T <= k tokens contributes nothing, and an all-ignored depth counts 0, not NaN)."""
        T = idx.shape[1]
        if cu_seqlens is not None:
            # Each position's document end: a target at t + k >= end belongs to the next document.
            pos = torch.arange(T, device=idx.device)
            cu = cu_seqlens.to(device=idx.device, dtype=torch.long)
            end = cu[torch.searchsorted(cu, pos, right=True).clamp(max=cu.numel() - 1)]
        state, total = h, 0.0
        for k, module in enumerate(self.mtp, start=1):
            emb = self.embed(_shift_left(idx, k, 0))
            tgt = _shift_left(targets, k, -100)
            if cu_seqlens is not None:
                tgt = tgt.masked_fill((pos + k >= end).unsqueeze(0), -100)
            state, normed = module(state, emb, cu_seqlens, mask=tgt != -100)
            total = total + self.head_loss(normed, tgt.flatten())
        return total / len(self.mtp)

    def head_loss(self, normed: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``head(normed)`` [..., d] against ``targets`` [N] (-100 ignored; 0 when all
        are) without forming the logits (``linear_cross_entropy``; its chunk's elementwise part compiled when
        ``compile_loss`` is set, as ``k3lab.train.compile_blocks`` does)."""
        return linear_cross_entropy(normed.flatten(0, -2), self.head.weight, targets, compiled=self.compile_loss)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations: one prefill of ``idx``, then one token per step from
        the caches (KDA state and short-conv tails, MLA latents; the absorbed MLA form). Runs in eval mode
        (the training mode is restored after): decoding adds nothing to the MoE balancers' statistics.

        Args:
            idx (Tensor): [B, T] prompt ids; the B prompts share one length T (there is no padding).
            max_new_tokens (int): >= 0.
            temperature (float): 0 for greedy (argmax), else softmax(logits / temperature) is sampled (a
                temperature below the dtype's smallest normal number acts as that number: greedy, ties shared).
            top_k (int | None): sample only among the top_k logits.
            generator (torch.Generator | None): for reproducible sampling.

        Returns:
            Tensor [B, T + max_new_tokens] int64.

        Raises:
            ValueError: bad max_new_tokens, temperature < 0 or not finite, top_k < 1; idx as in ``forward``.
        """
        # numbers.Integral / numbers.Real: numpy scalars (np.int64(2), np.float32(0.5)) are taken, as the optimizer does.
        if not (isinstance(max_new_tokens, numbers.Integral) and not isinstance(max_new_tokens, bool)
                and max_new_tokens >= 0):
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not (isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
                and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if top_k is not None and not (isinstance(top_k, numbers.Integral) and not isinstance(top_k, bool)
                                      and top_k >= 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
        max_new_tokens, temperature = int(max_new_tokens), float(temperature)
        top_k = None if top_k is None else int(top_k)
        # Before the cast: a float prompt would be truncated to other ids, and max_new_tokens = 0 return it as is.
        self._check_idx(idx)
        out = idx.long()
        if max_new_tokens == 0:
            return out
        # Each module's own mode, restored as it was (a model may hold some modules in eval mode).
        modes = [(m, m.training) for m in self.modules()]
        self.eval()
        try:
            return self._decode(out, max_new_tokens, temperature, top_k, generator)
        finally:
            for m, training in modes:
                m.training = training

    def _decode(self, out: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> torch.Tensor:
        """``generate``'s loop on checked arguments: prefill ``out`` [B, T] int64, then sample step by step."""
        logits, _, caches = self(out, use_cache=True)
        for step in range(max_new_tokens):
            last = logits[:, -1]
            if temperature == 0:
                nxt = last.argmax(-1, keepdim=True)
            else:
                # Shifted by the max first, and divided by at least the dtype's smallest normal number: a tiny
                # temperature (1e-40) overflowed logits / temperature to inf, and softmax gave NaN. The limit
                # is greedy, ties shared.
                last = (last - last.amax(-1, keepdim=True)) / max(temperature, torch.finfo(last.dtype).tiny)
                if top_k is not None:
                    kth = torch.topk(last, min(top_k, last.shape[-1]), dim=-1).values[:, -1:]
                    last = last.masked_fill(last < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(last.float(), -1), 1, generator=generator)
            out = torch.cat([out, nxt], dim=1)
            if step + 1 < max_new_tokens:
                logits, _, caches = self(nxt, caches=caches, use_cache=True)
        return out
