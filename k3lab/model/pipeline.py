"""A ``K3Model`` cut into S pipeline stages at sublayer boundaries (``torch.distributed.pipelining``).

    stage 0      idx [B, T] -> Embed -> sublayers [c_0 = 0, c_1)          -> state(c_1)
    stage s      state(c_s) -> sublayers [c_s, c_{s+1})                   -> state(c_{s+1})
    stage S - 1  state(c_{S-1}) -> sublayers [c_{S-1}, 2L) -> final aggregation -> norm -> head -> logits
                 (or, given the targets, which the stages before pass on: the loss without the logits)

state(c) is Block AttnRes's carried sources, one tensor [n (+ 1), B, T, d] (``k3lab.attnres.stage``):
the completed blocks and, for a cut inside a block, its partial sum. Any cut is allowed; cuts at block
boundaries carry one tensor [B, T, d] fewer.

Every stage keeps the full model's parameter names: sublayers of other stages are parameter-free
placeholders at their indices, and the embedding, final norm and head exist only on the stage that runs
them, so a checkpoint's keys do not depend on the cuts. The pseudo-queries [2L + 1, d] stay whole on every
stage; a stage's gradient touches only its own rows (and row 2L on the last), so summing the queries'
gradients over the stages (``sum_queries_grad``) gives every stage the full gradient and identical
updates.
"""
from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from k3lab.attnres import block_attnres_stage
from k3lab.dist import local_shard
from k3lab.lm import _check_ids
from k3lab.model.model import K3Model, _MixerContext, bind_context, set_value_checks


class _OnAnotherStage(nn.Module):
    """The place of sublayer ``index`` on a stage that does not run it: no parameters, not callable."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def extra_repr(self) -> str:
        return f"index={self.index}"

    def forward(self, h):
        raise RuntimeError(f"sublayer {self.index} runs on another pipeline stage")


def check_pipeline_config(model: K3Model) -> None:
    """ValueError naming the setting when ``model`` cannot be cut into stages: tied embeddings (the table
    would live on the first and the last stage, its two gradients on two ranks) or MTP modules (they read
    the embedding and the head from the last stage)."""
    if not isinstance(model, K3Model):
        raise ValueError(f"model must be a K3Model, got {type(model).__name__}")
    c = model.config
    if c.tie_word_embeddings:
        raise ValueError("tie_word_embeddings=True does not combine with pipeline stages: the embedding (stage 0) "
                         "and the head (last stage) would be one tensor on two ranks")
    if c.num_nextn_predict_layers:
        raise ValueError(f"--mtp (num_nextn_predict_layers={c.num_nextn_predict_layers}) does not combine with "
                         f"pipeline stages: the MTP modules read the embedding, which lives on stage 0")


def sublayer_costs(model: K3Model) -> tuple[list[float], float]:
    """Per-token cost of each of the 2L sublayers and of the head, in activated parameters (2 FLOPs each
    forward): the parameters a token multiplies by, routed experts counted at K of E. Attention's T-dependent
    FLOPs are left out (at the lengths the book trains, MLA layers are one in four and the weights dominate).

    Returns:
        (list of 2L floats, float): the sublayers' costs and the final norm + head's.
    """
    from k3lab.moe import MoE  # noqa: PLC0415

    costs = []
    for sub in model.sublayers:
        routed = {id(p): m.config.top_k / m.config.n_experts
                  for m in sub.modules() if isinstance(m, MoE) for p in m.experts.parameters()}
        costs.append(float(sum(p.numel() * routed.get(id(p), 1.0) for p in sub.parameters())))
    return costs, float(sum(p.numel() for p in (*model.norm.parameters(), *model.head.parameters())))


def balanced_cuts(costs: Sequence[float], n_stages: int, last_extra: float = 0.0) -> list[int]:
    """Cut ``costs`` (one per sublayer, in order) into ``n_stages`` contiguous non-empty runs whose largest
    total (the last run's plus ``last_extra``) is the smallest possible (dynamic programming over prefixes).

    Args:
        costs (Sequence[float]): L >= 1 non-negative costs. n_stages (int): S in [1, L].
        last_extra (float): what the last stage runs besides its sublayers (the head).

    Returns:
        list[int]: S + 1 cuts 0 = c_0 < c_1 < ... < c_S = L.

    Raises:
        ValueError: no costs; S not an int in [1, L]; a cost or last_extra not a finite number >= 0 (an inf cost left
            a stage empty, a NaN one compared false everywhere).
    """
    L = len(costs)
    if L == 0:
        raise ValueError("balanced_cuts: costs is empty (no sublayers to cut into stages)")
    if not (isinstance(n_stages, int) and not isinstance(n_stages, bool) and 1 <= n_stages <= L):
        raise ValueError(f"n_stages must be an int in [1, {L}] (a stage runs at least one sublayer), got {n_stages!r}")
    for name, v in [*((f"costs[{i}]", c) for i, c in enumerate(costs)), ("last_extra", last_extra)]:
        if not (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
            raise ValueError(f"balanced_cuts: {name} must be a finite number >= 0, got {v!r}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest largest run over the first i sublayers in s runs; arg[s][i]: its last cut.
    best = [[inf] * (L + 1) for _ in range(n_stages + 1)]
    arg = [[0] * (L + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, L + 1):
            extra = last_extra if (s == n_stages and i == L) else 0.0
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if v < best[s][i]:
                    best[s][i], arg[s][i] = v, j
    cuts, i = [L], L
    for s in range(n_stages, 0, -1):
        i = arg[s][i]
        cuts.append(i)
    return cuts[::-1]


def check_cuts(cuts: Sequence[int], n_sublayers: int) -> list[int]:
    """``cuts`` as a list after checking 0 = c_0 < c_1 < ... < c_S = L (ValueError naming what is wrong)."""
    cuts = list(cuts)
    if not (len(cuts) >= 2 and all(isinstance(c, int) and not isinstance(c, bool) for c in cuts)
            and cuts[0] == 0 and cuts[-1] == n_sublayers and all(a < b for a, b in zip(cuts, cuts[1:]))):
        raise ValueError(f"cuts must be increasing sublayer indices from 0 to 2L={n_sublayers} (every stage runs "
                         f"at least one sublayer), got {cuts!r}")
    return cuts


class K3Stage(nn.Module):
    """Sublayers [start, stop) of a ``K3Model``, with the embedding when start = 0 and the final
    aggregation, norm and head when stop = 2L (module docstring).

    ``forward(x, targets=None)``: stage 0 takes idx [B, T] int token ids, the others the state [n (+ 1), B, T, d]
    of the previous stage; the last returns logits [B, T, vocab] float32 (float64 for a float64 model), the
    others their state. With ``targets`` [B, T] (integer ids, -100 ignored) every stage but the last returns
    (state, targets), passing them on, and the last returns the mean cross-entropy, a scalar, without forming
    the logits (``K3Model.head_loss``; the trainer's pipeline runs this way). ``cp`` (a ``k3lab.kcp.KCPContext``
    or None) is the context-parallel layout every call runs with (the trainer's does not change between
    micro-batches).

    Attributes:
        start (int), stop (int), is_first (bool), is_last (bool), config (K3Config); embed, norm, head only
        where run; sublayers (nn.ModuleList of 2L, placeholders elsewhere); residual (BlockAttnRes, its
        ``queries`` [2L + 1, d] whole).
    """

    def __init__(self, model: K3Model, start: int, stop: int):
        super().__init__()
        n = len(model.sublayers)
        self.config, self.start, self.stop = model.config, start, stop
        self.is_first, self.is_last = start == 0, stop == n
        self.cp = None
        self.check_values = model.check_values
        self.compile_loss = model.compile_loss
        if self.is_first:
            self.embed = model.embed
        self.sublayers = nn.ModuleList(model.sublayers[i] if start <= i < stop else _OnAnotherStage(i)
                                       for i in range(n))
        # Each stage its own copy: two stages on one rank (interleaved schedules) must not share a tensor.
        self.residual = copy.deepcopy(model.residual)
        if self.is_last:
            self.norm, self.head = model.norm, model.head

    def extra_repr(self) -> str:
        return f"start={self.start}, stop={self.stop}"

    def value_checks(self, enabled: bool) -> None:
        """As ``K3Model.value_checks``, for this stage's modules.

        Raises:
            ValueError: ``enabled`` not a bool.
        """
        set_value_checks(self, enabled)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        c, res = self.config, self.residual
        if self.is_first:
            if not isinstance(x, torch.Tensor) or x.ndim != 2 or 0 in x.shape:
                got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"stage 0 takes idx [B, T] token ids with B, T >= 1, got {got}")
            if self.check_values:
                _check_ids("idx", x, c.vocab_size)
            x = self.embed(x.long())[None]
        if targets is not None:
            # Checked on every stage: in a pipeline the last stage is another rank.
            tokens = x.shape[1:-1]
            if (not isinstance(targets, torch.Tensor) or targets.shape != tokens or targets.device != x.device
                    or targets.is_floating_point() or targets.dtype == torch.bool):
                got = (f"{list(targets.shape)} {targets.dtype} on {targets.device}" if isinstance(targets, torch.Tensor)
                       else type(targets).__name__)
                raise ValueError(f"targets must be integer ids [B, T] = {list(tokens)} on {x.device} (the stage's "
                                 f"tokens), got {got}")
            if self.check_values and self.is_last:
                _check_ids("targets", targets, c.vocab_size, ignore_index=-100)
        sublayers = bind_context(self.sublayers[self.start:self.stop], _MixerContext(cp=self.cp))
        out = block_attnres_stage(x, sublayers, res.queries, res.sizes, self.start, self.stop, res.eps,
                                  check_values=res.check_values)
        if not self.is_last:
            return out if targets is None else (out, targets)
        if targets is not None:
            return self.head_loss(self.norm(out), targets.flatten().long())
        logits = self.head(self.norm(out))
        return logits if logits.dtype == torch.float64 else logits.float()

    head_loss = K3Model.head_loss


def split_model(model: K3Model, cuts: Sequence[int] | int, stages: Sequence[int] | None = None) -> list[K3Stage]:
    """Cut ``model`` into pipeline stages (module docstring).

    The stages take the model's modules over (no copy, except each stage's ``residual``): use ``model``
    no more afterwards. Keys of the stages' state dicts are the model's.

    Args:
        model (K3Model): built the same way on every rank.
        cuts (Sequence[int] | int): S + 1 sublayer indices 0 = c_0 < ... < c_S = 2L, or S for
            ``balanced_cuts`` of ``sublayer_costs``.
        stages (Sequence[int] | None): the stage indices to build (a rank's own); None: all S.

    Returns:
        list[K3Stage], in the order of ``stages``.

    Raises:
        ValueError: ``check_pipeline_config``'s (tied embeddings, MTP), bad cuts or S, a stage index out of range
            or repeated.
    """
    check_pipeline_config(model)
    n = len(model.sublayers)
    if isinstance(cuts, int) and not isinstance(cuts, bool):
        costs, head = sublayer_costs(model)
        cuts = balanced_cuts(costs, cuts, head)
    elif not isinstance(cuts, Sequence):
        raise ValueError(f"cuts must be a stage count S (int) or the sublayer cuts [0, ..., 2L], got {cuts!r}")
    cuts = check_cuts(cuts, n)
    S = len(cuts) - 1
    stages = list(range(S)) if stages is None else list(stages)
    # Two stages built from one model would share its modules: one stage per index.
    if not (all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < S for s in stages)
            and len(set(stages)) == len(stages)):
        raise ValueError(f"stages must be distinct indices in [0, {S}), got {stages!r}")
    return [K3Stage(model, cuts[s], cuts[s + 1]) for s in stages]


def sum_queries_grad(stages: Sequence[K3Stage], group: dist.ProcessGroup | None = None) -> None:
    """Give every stage the full gradient of the pseudo-queries: the sum of the stages' gradients here and,
    with ``group`` (the pp group), over its ranks (one all-reduce). Sharded (FSDP) gradients are summed
    shard by shard: the ranks of a pp group hold the same shard. Call after backward, before the optimizer.

    Raises:
        ValueError: no stages.
        RuntimeError: a stage's queries have no gradient (call after the backward of every micro-batch).
    """
    stages = list(stages)
    if not stages:
        raise ValueError("sum_queries_grad: stages must hold at least one K3Stage, got 0")
    grads = [s.residual.queries.grad for s in stages]
    if any(g is None for g in grads):
        raise RuntimeError("sum_queries_grad: a stage's queries have no gradient yet (call it after backward)")
    local = [local_shard(g) for g in grads]
    total = local[0] if len(local) == 1 else torch.stack(local).sum(0)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    for g in local:
        if g is not total:
            g.copy_(total)
