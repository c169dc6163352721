"""Pipeline parallelism in the trainer: this rank's stages of the model and the schedule that runs them.

``build_pipeline`` cuts the model into S balanced stages (``k3lab.model.split_model``; S = pp, or 2 pp for
interleaved 1F1B, rank p holding stages p and p + pp), shards each for the rank's dp x cp x ep sub-mesh
(``parallelize``) and wraps them in ``torch.distributed.pipelining``'s ``PipelineStage`` and schedule.
``PipelineRun.step`` runs one step's forward and backward over M micro-batches: the schedule sends each
stage's Block AttnRes state (one tensor) forward and its gradient back over the pp group, scales the
gradients by 1/M (each micro-batch's loss is its mean), and the queries' gradient is summed over the
stages (``sum_queries_grad``) so that every stage applies the same update to its copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from k3lab.model import K3Model, K3Stage, split_model, sum_queries_grad
from k3lab.train.config import ConfigError
from k3lab.train.parallel import Parallel, parallelize


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages rank ``pp_rank`` of ``pp`` runs: [p] or, interleaved, [p, p + pp] (the loop order
    ``ScheduleInterleaved1F1B`` expects)."""
    return [pp_rank, pp_rank + pp] if schedule == "interleaved-1f1b" else [pp_rank]


def _loss(loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # The last stage returns each micro-batch's mean loss itself (its targets came along the stages); the
    # schedule's scale_grads makes the step's gradient the mean.
    return loss


# Token ids travel between stages as float32, exact below 2^24.
MAX_CARRIED_ID = 2 ** 24


class _CarryTargets(nn.Module):
    """What the schedule runs for one stage: ``part`` with the targets passed on as float32.

    torch 2.11's ``PipelineStage`` marks every tensor a stage receives as requiring grad (an int64 one
    raises) and sends a gradient back for each; torch 2.13 follows the metadata's ``requires_grad``. So the
    targets cross each boundary as float32 ids (exact below ``MAX_CARRIED_ID``), every stage reads them as
    int64, and the last adds ``0 * targets.sum()`` to its loss: the targets' gradient is zeros where torch
    asks for one and nothing where it does not; the loss and the other gradients are unchanged."""

    def __init__(self, part: K3Stage):
        super().__init__()
        self.part = part

    def forward(self, x: torch.Tensor, targets: torch.Tensor):
        out = self.part(x, targets.long())
        if self.part.is_last:
            return out + 0 * targets.sum().to(out.dtype)
        state, _ = out
        return state, targets if targets.is_floating_point() else targets.float()


@dataclass
class PipelineRun:
    """One rank's share of the pipeline.

    Attributes:
        parts (list[K3Stage]): this rank's stages (sharded), in ``stage_ids`` order.
        schedule: the ``torch.distributed.pipelining`` schedule over them.
        has_first (bool), has_last (bool): whether this rank runs stage 0 / the last stage.
        microbatches (int): M. group: the pp process group.
    """

    parts: list
    schedule: object
    has_first: bool
    has_last: bool
    microbatches: int
    group: object

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one step: x, y [M * b, T] (or [M, T_local] under cp, one micro-batch's piece
        a row) cut into M micro-batches along dim 0. Leaves every stage's gradient of the mean loss (queries
        summed over the stages).

        Returns:
            Tensor: scalar float32, this data rank's mean loss on the last stage's ranks, 0 elsewhere (no host sync).
        """
        losses = [] if self.has_last else None
        # Stage 0 takes the targets with the tokens and every stage passes them on, so that the last one
        # forms the loss without the logits.
        # Contiguous: torch 2.11 checks each micro-batch's strides against the stage's metadata (a cp slice of
        # the rows is a strided view).
        x, y = x.contiguous(), y.contiguous()
        args = (x, y) if self.has_first else ()
        self.schedule.step(*args, target=y if self.has_last else None, losses=losses, return_outputs=False)
        sum_queries_grad(self.parts, self.group)
        if not self.has_last:
            return torch.zeros((), device=x.device)
        return torch.stack([v.detach().float() for v in losses]).mean()


def build_pipeline(model: K3Model, par: Parallel, schedule: str, microbatches: int, ep_mode: str,
                   device: torch.device, micro_shape: tuple[int, int], cp=None) -> PipelineRun:
    """This rank's stages of ``model`` (built the same on every rank; its modules are taken over), sharded
    for ``par``, and the schedule over ``microbatches`` micro-batches.

    Every stage is given the shapes it receives and sends (``k3lab.attnres.carried_sources``), so the
    schedule runs no shape-finding forward: such a forward would feed uninitialised tensors to the routers
    and count them in Quantile Balancing's histogram.

    Args:
        model (K3Model), par (Parallel): with par.pp > 1. schedule (str): ``PP_SCHEDULES``.
        microbatches (int): M. ep_mode (str): for ``parallelize``. device (torch.device).
        micro_shape (tuple[int, int]): a micro-batch's token ids (b, T), or (1, T_local) under cp.
        cp (KCPContext | None): the context-parallel layout of every micro-batch (shape-only, the same each step).

    Raises:
        ConfigError: the model cannot be split (tied embeddings, MTP), more stages than sublayers, an M the
            schedule refuses (the message names --microbatches), or a vocabulary past ``MAX_CARRIED_ID``.
    """
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,  # noqa: PLC0415
                                              ScheduleInterleaved1F1B)

    if model.config.vocab_size > MAX_CARRIED_ID:
        raise ConfigError(f"--pp {par.pp}: the targets cross the stages as float32 ids, exact below "
                          f"{MAX_CARRIED_ID}; this model's vocabulary has {model.config.vocab_size}")
    ids = stage_ids(par.pp_rank, par.pp, schedule)
    S = par.pp * (2 if schedule == "interleaved-1f1b" else 1)
    try:
        parts = split_model(model, S, ids)
    except ValueError as e:
        raise ConfigError(f"--pp {par.pp} ({S} stages): {e}") from e
    stages = []
    for part, s in zip(parts, ids):
        part.cp = cp
        inputs, outputs = _stage_metas(part, micro_shape)
        parallelize(part, par, ep_mode)
        stages.append(PipelineStage(_CarryTargets(part), s, S, device, input_args=inputs, output_args=outputs,
                                    group=par.pp_group))
    try:
        if schedule == "interleaved-1f1b":
            sched = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=_loss)
        else:
            cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
            sched = cls(stages[0], microbatches, loss_fn=_loss)
    except ValueError as e:
        raise ConfigError(f"--microbatches {microbatches} with --pp-schedule {schedule} and --pp {par.pp}: {e}") from e
    return PipelineRun(parts, sched, 0 in ids, S - 1 in ids, microbatches, par.pp_group)


def _stage_metas(part: K3Stage, micro_shape: tuple[int, int]) -> tuple[tuple, tuple | torch.Tensor]:
    """Meta-device stand-ins of what ``part`` (run as ``_CarryTargets``) receives and returns for one
    micro-batch: (token ids [b, T] int64 and the targets int64 on stage 0, else the state [n (+ 1), b, T, d]
    and the targets as float32); (the next state, the targets float32) or the loss, a float32 scalar."""
    from k3lab.attnres import carried_sources  # noqa: PLC0415

    c, res = part.config, part.residual
    dtype = res.queries.dtype

    def state(cut):
        n, partial = carried_sources(res.sizes, res.n_sublayers, cut)
        return torch.empty(n + partial, *micro_shape, c.hidden_size, device="meta", dtype=dtype).requires_grad_()

    ids = torch.empty(micro_shape, device="meta", dtype=torch.int64)
    targets = torch.empty(micro_shape, device="meta", dtype=torch.float32)  # as _CarryTargets passes them
    inputs = (ids, ids) if part.is_first else (state(part.start), targets)
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    outputs = (torch.empty((), device="meta", dtype=loss_dtype).requires_grad_() if part.is_last
               else (state(part.stop), targets))
    return inputs, outputs


def all_loads(parts: list[K3Stage], loads: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Every MoE layer's [E] loads in model order on every rank of the pp group, from each rank's own
    (``update_biases`` of its stages, in stage order): one all-reduce of a zero-padded [n_moe, E] table.
    Which rows a rank fills follows from the stages' sublayer ranges."""
    cfg = parts[0].config
    moe_subs = [2 * i + 1 for i, kind in enumerate(cfg.ffn_types()) if kind == "moe"]
    if not moe_subs:
        return []
    own = [moe_subs.index(i) for p in parts for i in range(p.start, p.stop) if i in moe_subs]
    table = torch.zeros(len(moe_subs), cfg.n_routed_experts, dtype=torch.int64,
                        device=parts[0].residual.queries.device)
    for row, load in zip(own, loads):
        table[row] = load
    dist.all_reduce(table, group=group)
    return list(table.unbind(0))
