"""``train(config)``: the training loop on every rank, and the process-group setup around it."""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import math
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch._functorch.config
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from k3lab.data import load_split, resolve_data_dir, vocab_size
from k3lab.dist import local_shard
from k3lab.kda.checks import NonFiniteError
from k3lab.memory import apply_policies
from k3lab.kcp import make_context
from k3lab.model import K3Config, K3Model, flops_per_token, mfu
from k3lab.moe import maxvio, update_biases
from k3lab.optim import clip_grads_, grad_norm, per_head_muon
from k3lab.testing import forbid_host_sync
from k3lab.train.checkpoint import latest_checkpoint, load_checkpoint, read_train_state, save_checkpoint
from k3lab.train.config import ConfigError, TrainConfig, build_parser, leave_quietly, parse_args
from k3lab.train.loader import TokenLoader, pack_documents
from k3lab.train.metrics import FLOPS_CONVENTION, MetricsLog, peak_key, peak_memory_gib
from k3lab.train.parallel import Parallel, build_parallel, compile_blocks, parallelize
from k3lab.train.pipeline import PipelineRun, all_loads, build_pipeline

PG_TIMEOUT = datetime.timedelta(minutes=10)
# The clock --stop-after-minutes reads, in seconds (module-level so a test can replace it).
wall_clock = time.monotonic
# <|endoftext|>'s id in the book's tokenizer (k3lab.data trains it as special token 0).
EOT_ID = 0
# What a diverged run's error advises, after naming the step.
DIVERGED = ("stopping before it reaches a checkpoint (check the data, or start a new --ckpt-dir with a lower --lr or "
            "--max-grad-norm: a resume keeps both)")


def lr_at(step: int, total: int, peak: float, warmup: float, floor: float = 0.1) -> float:
    """K3's schedule: linear warmup over ceil(warmup * total) steps, then cosine from ``peak`` to
    ``floor * peak`` at ``total``; ``step`` counts from 1.

    Raises:
        ValueError: ``total`` < 1, ``step`` outside [1, total], or ``warmup`` outside [0, 1].
    """
    if not (isinstance(total, int) and total >= 1):
        raise ValueError(f"lr_at: total must be an int >= 1 (the run's steps), got {total!r}")
    if not (isinstance(step, int) and 1 <= step <= total):
        raise ValueError(f"lr_at: step must be an int in [1, total={total}] (steps count from 1), got {step!r}")
    if not 0 <= warmup <= 1:
        raise ValueError(f"lr_at: warmup must be a fraction of the run in [0, 1], got {warmup!r}")
    w = math.ceil(warmup * total)
    if step <= w:
        return peak * step / w
    t = (step - w) / max(total - w, 1)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


# What a resumed run must share with the saved one: the model, what its loss attends to (document masking)
# and the learning-rate schedule. (The batch,
# sequence length and seed are the loader's state, checked by ``TokenLoader.load_state_dict``; the layout,
# logging and checkpoint cadence may change.)
RUN_SETTINGS = ("preset", "mtp", "doc_mask", "steps", "lr", "warmup", "weight_decay", "max_grad_norm")


def state_finite(parts, opts) -> bool:
    """Whether every parameter of this rank's model parts and every tensor of their optimizers' state (local
    shards) is finite here and on every other rank: one all-reduce and one host read, made only around a
    checkpoint."""
    tensors = [p for m in parts for p in m.parameters()]
    tensors += [v for o in opts for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    # AdamW's step counts stay on the CPU (torch's non-capturable Adam) beside CUDA weights.
    dev = local_shard(tensors[0]).device
    ok = torch.stack([local_shard(t).detach().isfinite().all().to(dev) for t in tensors]).all().to(torch.int32).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def nonfinite_names(parts, opts, limit: int = 5) -> str:
    """This rank's first ``limit`` non-finite tensors, named (``param`` or ``param: optimizer key``), and how
    many there are: what a refused checkpoint reports. Reads every tensor back; called only on failure."""
    names = {id(p): n for m in parts for n, p in m.named_parameters()}
    found = [n for m in parts for n, p in m.named_parameters() if not _finite(p)]
    found += [f"{names.get(id(p), '?')}: {k}" for o in opts for p, st in o.state.items() for k, v in st.items()
              if isinstance(v, torch.Tensor) and not _finite(v)]
    if not found:
        return "none on this rank (another rank's)"
    return f"{len(found)} on this rank, first {', '.join(found[:limit])}"


def counted_once(parts) -> list:
    """This rank's parameters with each parameter of the model counted once over the pipeline: every stage
    holds a copy of the AttnRes pseudo-queries (with the same, summed gradient), counted in the first stage
    only, so the gradient norm equals the unpipelined model's."""
    return [p for part in parts for n, p in part.named_parameters()
            if getattr(part, "is_first", True) or not n.startswith("residual.queries")]


def _finite(t: torch.Tensor) -> bool:
    return bool(local_shard(t).detach().isfinite().all())


def _dcp_error(e: BaseException) -> BaseException:
    """DCP's CheckpointException behind ``e`` (``k3lab.train.checkpoint`` re-raises it as the first failed
    rank's error), else ``e``."""
    return e.__cause__ if isinstance(e.__cause__, CheckpointException) else e


def _first_failure(e: BaseException) -> str:
    """One line for a failed checkpoint read: DCP's CheckpointException holds each rank's (exception,
    stack) pair."""
    e = _dcp_error(e)
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))
        e = e[0] if isinstance(e, tuple) else e
    return f"{type(e).__name__}: {str(e).strip()[:200]}".rstrip(": ")


def _absent_settings(e: BaseException) -> list[str]:
    """The flags of the ``RUN_SETTINGS`` that a failed train-state read reports missing from the checkpoint
    (DCP's "Missing key in checkpoint state_dict: train.run.<name>"), in ``RUN_SETTINGS`` order."""
    e = _dcp_error(e)
    failures = getattr(e, "failures", None) or {}
    text = " ".join([str(e)] + [str(f[0] if isinstance(f, tuple) else f) for f in failures.values()])
    return [f"--{k.replace('_', '-')}" for k in RUN_SETTINGS if re.search(rf"train\.run\.{k}\b", text)]


def run_settings(config: TrainConfig) -> dict:
    """The ``RUN_SETTINGS`` of ``config``, saved with every checkpoint and compared on resume."""
    return {k: getattr(config, k) for k in RUN_SETTINGS}


class TrainRecords(list):
    """What ``train`` returns: rank 0's step records (a list, [] on the other ranks), and ``stopped_at``: the
    step at which ``--stop-after-minutes`` stopped the run (its checkpoint saved), on every rank; None when
    the run reached ``--steps``."""

    stopped_at: int | None = None


def out_of_time(t0: float, minutes: float, device: torch.device) -> bool:
    """Whether ``minutes`` have passed since ``t0`` by rank 0's ``wall_clock``, the same answer on every rank:
    rank 0's decision broadcast over the default group (one int, one host read). Called only at the steps
    that read the losses back anyway, so it adds no host sync to the others; each rank deciding on its own
    clock could stop one rank a window before another, in the middle of the others' collectives."""
    over = torch.tensor([int(wall_clock() - t0 >= 60.0 * minutes)], dtype=torch.int32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(over, src=0)
    return bool(over.item())


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


@contextlib.contextmanager
def process_group(device: torch.device):
    """The default process group for the run: torchrun's (RANK/WORLD_SIZE in the environment), one created
    here for a single process, or the caller's when one is already initialised (left as it is)."""
    if dist.is_initialized():
        yield
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        # "cuda" without an index (a benchmark's --device cuda) is the current device; set_device refuses it.
        torch.cuda.set_device(torch.cuda.current_device() if device.index is None else device.index)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=PG_TIMEOUT)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=PG_TIMEOUT)
    try:
        yield
        # No rank tears its group down while another still uses it (rank 0 hosts the store).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def build_model(config: TrainConfig, device: torch.device) -> K3Model:
    """The run's ``K3Model`` (preset, the data's vocabulary), initialised from ``config.seed``; the same
    weights on every rank before sharding; Block AttnRes's buffer dtype and input recompute as configured;
    ``config.activations``' policies attached (``k3lab.memory``)."""
    torch.manual_seed(config.seed)
    cfg = K3Config.preset(config.preset, vocab_size=vocab_size(resolve_data_dir(config.data_dir)),
                          num_nextn_predict_layers=config.mtp)
    model = K3Model(cfg).to(device)
    model.residual.buffer_dtype = torch.bfloat16 if config.attnres_buffer == "bfloat16" else None
    model.residual.recompute_input = not config.attnres_keep_inputs
    rules = config.activation_rules()
    if rules:
        try:
            apply_policies(model, rules, default=None)
        except ValueError as e:
            raise ConfigError(f"--activations: {e}") from e
    return model


def forward(model: K3Model, x: torch.Tensor, y: torch.Tensor, doc_mask: bool, par: Parallel | None = None):
    """``model(x, y)`` (the loss only: logits None), or with ``doc_mask`` the windows packed into one row with document boundaries
    (``pack_documents``); the loss is the mean over the same B*T targets either way.

    With context parallel (``par.cp > 1``) the row's B windows are packed into one stream of B*T tokens
    (each window a document, or with ``doc_mask`` each document of the windows), cut into cp contiguous
    pieces; this rank runs its piece with the layout as ``cp`` (``K3Model.forward``) and its loss is the
    mean over its B*T/cp targets. Reading the documents of a ``doc_mask`` batch is one host sync; without
    it the layout is known from the shapes alone."""
    cp_group = None if par is None else par.cp_group
    if cp_group is None:
        if doc_mask:
            x, y, cu = pack_documents(x, y, EOT_ID)
            return model(x, y, cu_seqlens=cu, return_logits=False)
        return model(x, y, return_logits=False)
    B, T = x.shape
    if doc_mask:
        x, y, cu = pack_documents(x, y, EOT_ID)
        cu = cu.tolist()
    else:
        x, y, cu = x.reshape(1, B * T), y.reshape(1, B * T), list(range(0, B * T + 1, T))
    ctx = make_context(B * T, cu, group=cp_group)
    return model(x[:, ctx.start:ctx.stop], y[:, ctx.start:ctx.stop], cp=ctx, return_logits=False)


def _compile_caches(config: TrainConfig):
    """The compile caches a run may use: with --compile and --cp > 1 AOTAutograd's cache is off for the run.
    Its entries for the context-parallel sublayers (graphs split at the eager KCP collectives) are unsafe in
    torch 2.11-2.13: saving one at the first backward crashed a rank (SIGSEGV while pickling it), and one
    loaded in a later run replayed an output view with garbage sizes. Inductor's own graph cache stays on."""
    if config.compile and config.cp > 1:
        return torch._functorch.config.patch(enable_autograd_cache=False)
    return contextlib.nullcontext()


# Held by the run writing a --ckpt-dir (rank 0), so a second run there is refused at start-up.
LOCK = ".lock"


def _claim(path: Path, what: str, held: list) -> str | None:
    """Take an exclusive advisory lock on ``path`` (created if missing) for the run, appending the open file
    to ``held``; why not (None: taken). The lock goes with the process, so a killed run leaves none behind."""
    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return (f"{what} is in use by another run (its lock {path} is held): two runs writing one place would mix "
                f"their checkpoints and records; wait for it or choose another path")
    held.append(f)
    return None


def _output_problem(config: TrainConfig, held: list) -> str | None:
    """Why the run may not write where ``config`` says (None: it may), having made what it needs there: the
    --ckpt-dir folder and the --log-jsonl file (empty if new), which the first checkpoint and the first record
    would otherwise meet only after training (the checks of ``TrainConfig`` see only the existing folders above
    a path, not a name too long or a file system that refuses new entries), each locked for the run (``held``:
    the open lock files)."""
    if config.ckpt_dir:
        try:
            # A fresh run among another run's checkpoints would mix with them: --keep-checkpoints would delete
            # its own (the old ones count as newer) and a later --resume would continue the old run.
            found = None if config.resume else latest_checkpoint(config.ckpt_dir)
            if found is not None:
                return (f"--ckpt-dir {config.ckpt_dir} already holds the checkpoints of a run (newest: step "
                        f"{int(found.name.removeprefix('step_'))}): pass --resume to continue that run, or choose an "
                        f"empty folder")
            Path(config.ckpt_dir).mkdir(parents=True, exist_ok=True)
            problem = _claim(Path(config.ckpt_dir) / LOCK, f"--ckpt-dir {config.ckpt_dir}", held)
            if problem:
                return problem
        except OSError as e:
            return f"--ckpt-dir {config.ckpt_dir} cannot be created ({e.strerror or e})"
    if config.log_jsonl:
        try:
            Path(config.log_jsonl).parent.mkdir(parents=True, exist_ok=True)
            return _claim(Path(config.log_jsonl), f"--log-jsonl {config.log_jsonl}", held)
        except OSError as e:
            return f"--log-jsonl {config.log_jsonl} cannot be created ({e.strerror or e})"
    return None


@contextlib.contextmanager
def prepare_outputs(config: TrainConfig):
    """Make the run's checkpoint folder and log file before its first step, on rank 0 (the rank that writes
    them), and hold a lock on each while the context is open; the verdict is broadcast, so every rank stops
    alike (the default process group initialised).

    Raises:
        ConfigError: --ckpt-dir or --log-jsonl cannot be created or is in use by another run (locked), or a run
            without --resume would start in a --ckpt-dir that already holds complete checkpoints.
    """
    held: list = []
    try:
        problem = _output_problem(config, held) if dist.get_rank() == 0 else None
        if dist.get_world_size() > 1:
            box = [problem]
            dist.broadcast_object_list(box, src=0)
            problem = box[0]
        if problem:
            raise ConfigError(problem)
        yield
    finally:
        for f in held:
            f.close()


def build_run(config: TrainConfig, device: torch.device) -> tuple[Parallel, TokenLoader, list, PipelineRun | None]:
    """This rank's layout, loader and sharded model for ``config`` (the default process group initialised).

    Returns:
        (par, loader, parts, pipe): ``parts`` is [the K3Model] without pipeline parallelism, else this rank's
        ``K3Stage``s, which ``pipe`` (None without pp) runs.

    Raises:
        ConfigError: the layout does not match the world, ep does not divide the preset's routed experts, the
            batch is not divisible by the data ranks and micro-batches, a cp piece is too short, or the model does
            not split into the pipeline's stages.
        FileNotFoundError: no token shards.
    """
    ep, cp, pp, M = config.ep, config.cp, config.pp, config.microbatches
    dp = config.dp if config.dp is not None else max(dist.get_world_size() // (pp * ep * cp), 1)
    try:
        par = build_parallel(dp, ep, device.type, cp=cp, pp=pp)
        # parallelize checks it too, but only once the model is built: a layout mistake is named before that.
        E = K3Config.preset(config.preset).n_routed_experts
        if E % ep:
            raise ConfigError(f"--ep {ep} must divide the {E} routed experts of --preset {config.preset}")
        if config.batch_size % par.rows:
            raise ConfigError(f"--batch-size {config.batch_size} must be divisible by the {par.rows} data rows "
                              f"(--dp {par.dp} x --ep {par.ep})")
        tokens = load_split("train", resolve_data_dir(config.data_dir) / "shards")
        loader = TokenLoader(tokens, config.batch_size, config.seq_len, par.row, par.rows, config.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    V = vocab_size(resolve_data_dir(config.data_dir))
    if len(tokens) and not 0 <= int(tokens.min()) <= int(tokens.max()) < V:
        raise ConfigError(f"the token split holds ids outside [0, {V}) (min {tokens.min()}, max {tokens.max()}): "
                          f"rebuild the shards with python -m k3lab.data build")
    row = config.batch_size // par.rows
    if row % M:
        raise ConfigError(f"--microbatches {M} must divide the {row} sequences of a data row (--batch-size "
                          f"{config.batch_size} / {par.rows} rows)")
    piece_tokens = row // M * config.seq_len
    # KDA's short convolution reads conv_size - 1 tokens of the previous piece (the KCP halo).
    min_piece = max(1, K3Config.preset(config.preset).kda_conv_size - 1)
    if cp > 1 and (piece_tokens % cp or piece_tokens // cp < min_piece):
        raise ConfigError(f"--cp {cp} must divide the {piece_tokens} tokens of a data row's micro-batch (--batch-size "
                          f"{config.batch_size} / {par.rows} rows / --microbatches {M} x --seq-len {config.seq_len}) "
                          f"into pieces of at least {min_piece} tokens")
    model = build_model(config, device)
    if pp == 1:
        model = parallelize(model, par, config.ep_mode)
        return par, loader, [compile_blocks(model) if config.compile else model], None
    # Without --doc-mask a micro-batch's KCP layout depends on its shape only: one context serves every step.
    ctx = None if par.cp_group is None else make_context(
        piece_tokens, list(range(0, piece_tokens + 1, config.seq_len)), group=par.cp_group)
    micro_shape = (row // M, config.seq_len) if ctx is None else (1, ctx.T_local)
    pipe = build_pipeline(model, par, config.pp_schedule, M, config.ep_mode, device, micro_shape, ctx)
    if config.compile:
        for part in pipe.parts:
            compile_blocks(part)
    return par, loader, pipe.parts, pipe


def train_autocast(device: torch.device):
    """The precision a training step runs in on ``device``: bf16 autocast on CUDA (float32 weights), plain
    float32 on a CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def forward_backward(parts: list, pipe: PipelineRun | None, x: torch.Tensor, y: torch.Tensor, config: TrainConfig,
                     par: Parallel) -> torch.Tensor:
    """One step's forward and backward over ``config.microbatches`` = M micro-batches of this data row's
    x, y [B_row, T]: each micro-batch's loss / M backpropagated in turn (FSDP reduces only after the last),
    or with pipeline parallelism the schedule's micro-batches (under cp, micro-batch m's packed piece is row
    m of the schedule's input). Leaves the gradient of the mean loss; bf16 autocast on CUDA.

    Returns:
        Tensor: scalar float32 on the device, this data rank's mean loss (0 on a pipeline rank without the
        last stage).
    """
    M = config.microbatches
    if pipe is not None:
        ctx = parts[0].cp
        if ctx is not None:
            b = x.shape[0] // M
            x, y = (t.reshape(M, b * t.shape[1])[:, ctx.start:ctx.stop] for t in (x, y))
        with train_autocast(x.device):
            return pipe.step(x, y)
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    model, total = parts[0], 0.0
    for m, (xm, ym) in enumerate(zip(x.chunk(M), y.chunk(M))):
        if M > 1 and isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(m == M - 1)
        with train_autocast(x.device):
            _, loss = forward(model, xm, ym, config.doc_mask, par)
        (loss / M if M > 1 else loss).backward()
        total = total + loss.detach().float() / M
    return total


def build_optimizers(parts: list, config: TrainConfig) -> list:
    """One ``per_head_muon`` per model part (each pipeline stage's queries get identical gradients and
    updates), at ``config.lr`` and ``config.weight_decay``."""
    return [per_head_muon(p, lr=config.lr, weight_decay=config.weight_decay) for p in parts]


def optimizer_step(opts: list, params: list, counted: list, config: TrainConfig, step: int,
                   pp_group=None) -> tuple[torch.Tensor, float]:
    """The update after a step's backward: the gradient norm of ``counted`` (``counted_once``) over every rank
    and stage, ``params``' gradients clipped to ``config.max_grad_norm``, the schedule's lr at ``step`` (from
    1), then each optimizer's step and its gradients set to None.

    Returns:
        (norm: scalar tensor on the device, not read back; lr: float).
    """
    # The norm stays on the device (logged with the loss): a bf16 spike is clipped before AdamW's moments or
    # Muon's momentum take it.
    norm = grad_norm(counted, pp_group)
    if config.max_grad_norm:
        clip_grads_(params, config.max_grad_norm, norm)
    lr = lr_at(step, config.steps, config.lr, config.warmup)
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norm, lr


def train(config: TrainConfig) -> TrainRecords:
    """Run ``config`` on this rank (every rank of the world calls it); returns rank 0's step records
    (the JSONL "step" objects, see ``k3lab.train.metrics``), [] on the other ranks, as a ``TrainRecords``
    whose ``stopped_at`` is the step ``stop_after_minutes`` stopped at (None: the run reached ``steps``).

    Steps: batch from the loader -> forward and backward over the micro-batches (bf16 autocast on GPU,
    float32 on CPU; FSDP reduce-scatters; with pp the pipeline schedule, then the queries' gradient summed
    over the stages) -> the global gradient norm, and clipping to ``max_grad_norm`` -> lr of the schedule ->
    Per-Head Muon step (per stage) -> Quantile Balancing's bias
    update with the histogram summed over the data ranks -> loss averaged over the data ranks (kept on the
    device; with pp summed over the world from the last stage's ranks, so rank 0 holds it too) ->
    every ``log_every`` steps (and before a checkpoint) the window's losses read back, the step's one host
    sync -> checkpoint every ``ckpt_every`` steps and at the end. With ``stop_after_minutes``, at each of
    those read-back steps rank 0's clock decides for every rank whether the budget is spent; if so, a
    checkpoint of that step, a "stop" record, and a normal return.

    Raises:
        ConfigError (a ValueError): the layout does not match the world (``build_parallel``), the global
            batch is not divisible by the data ranks and micro-batches, the pipeline does not fit the model
            (``build_pipeline``), an output path cannot be created or a fresh run's ``ckpt_dir`` holds another
            run's checkpoints (``prepare_outputs``), or a resumed checkpoint cannot be read, or its loader or
            ``RUN_SETTINGS`` differ from ``config``'s.
        FileNotFoundError: no token shards (``k3lab.data``).
        FloatingPointError: the run diverged: a NaN or inf loss or gradient norm (found when the window's values
            are read back, before any checkpoint of that window is written), or a value the KDA operator
            refuses (``k3lab.kda.checks.NonFiniteError``) in a step; the message names the step.
    """
    t0 = wall_clock()
    device = _device()
    # Muon orthogonalises each expert stack as its full logical tensor; the 2-step all-gather of a
    # (dp, ep)-sharded DTensor is expected there, and torch warns about it on every step.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    with process_group(device), _compile_caches(config), contextlib.ExitStack() as outputs:
        world = dist.get_world_size()
        par, loader, parts, pipe = build_run(config, device)
        outputs.enter_context(prepare_outputs(config))
        rank0 = dist.get_rank() == 0
        opts = build_optimizers(parts, config)
        start = 0
        if config.resume:
            path = latest_checkpoint(config.ckpt_dir)
            if path is not None:
                wanted = {"step": 0, "loader": loader.state_dict(), "run": run_settings(config)}
                try:
                    # The settings first: a model of another preset or MTP depth would fail to load, and the
                    # message must name the flag rather than call the checkpoint damaged.
                    saved = read_train_state(path, wanted)
                    changed = [f"--{k.replace('_', '-')} {getattr(config, k)} (saved: {v})"
                               for k, v in saved["run"].items() if getattr(config, k) != v]
                    if changed:
                        raise ConfigError(f"{path}: a resumed run continues the saved run's model and schedule, but "
                                          f"{', '.join(changed)} differ; pass the saved values, or start a new "
                                          f"--ckpt-dir")
                    state = load_checkpoint(path, parts, opts, wanted)
                except ConfigError:
                    raise
                except (CheckpointException, RuntimeError, ValueError, OSError, EOFError) as e:
                    absent = _absent_settings(e)
                    if absent:
                        # Not damage: an older trainer's checkpoint, whose earlier checkpoints lack them too.
                        raise ConfigError(f"{path} does not record {', '.join(absent)}, which a resume compares (a "
                                          f"checkpoint of an older trainer): start a new --ckpt-dir") from e
                    raise ConfigError(f"{path} cannot be read ({_first_failure(e)}): remove it to "
                                      f"resume from the checkpoint before it, or start without --resume") from e
                start = int(state["step"])
                try:
                    loader.load_state_dict(state["loader"])
                except ValueError as e:
                    raise ConfigError(f"{path}: {e}") from e
                # DCP keeps no checksums: damaged bytes load as values, and would surface steps later.
                if not state_finite(parts, opts):
                    raise ConfigError(f"{path} holds NaN or inf weights or optimizer state (a damaged file): remove "
                                      f"it to resume from the checkpoint before it")
            elif rank0:
                print(f"--resume: no complete checkpoint in {config.ckpt_dir}; starting at step 1", file=sys.stderr)
            if start >= config.steps and rank0:
                print(f"--resume: the run in {config.ckpt_dir} already reached its last step ({start} of "
                      f"{config.steps}); nothing is left to train", file=sys.stderr)
        mcfg = parts[0].config
        fpt = flops_per_token(mcfg, config.seq_len)
        peak = peak_key(device)
        log = MetricsLog(config.log_jsonl, config.steps, start, config.progress, enabled=rank0,
                         log_every=config.log_every)
        log.write(dict(event="start", preset=config.preset, world=world, dp=par.dp, ep=par.ep, cp=par.cp, pp=par.pp,
                       microbatches=config.microbatches, pp_schedule=config.pp_schedule if par.pp > 1 else None,
                       ep_mode=config.ep_mode, device=str(device), global_batch=config.batch_size,
                       seq_len=config.seq_len, doc_mask=config.doc_mask, vocab_size=mcfg.vocab_size,
                       resumed_from=start, steps=config.steps, log_every=config.log_every,
                       activations=config.activation_rules(), compile=config.compile, flops_per_token=fpt,
                       flops_convention=FLOPS_CONVENTION, peak=peak))
        # The token split was checked against the vocabulary once (build_run): no per-call range or
        # NaN checks, so nothing in a step reads a value back to the host.
        for part in parts:
            part.value_checks(False)
            part.train()
        params, counted = [p for part in parts for p in part.parameters()], counted_once(parts)
        pending, loads, t_window = [], [], time.perf_counter()
        stopped_at = None
        for step in range(start + 1, config.steps + 1):
            # The run's first step is exempt: it compiles kernels and copies their index tables to the device.
            check = config.sync_debug and device.type == "cuda" and step > start + 1
            with forbid_host_sync(device) if check else contextlib.nullcontext():
                x, y = loader.next_batch(device)
                try:
                    loss = forward_backward(parts, pipe, x, y, config, par)
                    norm, lr = optimizer_step(opts, params, counted, config, step, par.pp_group)
                except NonFiniteError as e:
                    # The value checks are off, but the KDA operator still refuses the overflow of huge
                    # weights (a learning rate far too high) before the loss can show it.
                    raise FloatingPointError(f"the run diverged at step {step} ({e}): {DIVERGED}") from e
                loads = [load for part in parts for load in update_biases(part, par.batch_group)]
                if pipe is not None:
                    # Only the last stage's ranks hold a loss (the others 0): the world's sum over the data
                    # ranks' count is the global mean, on every rank.
                    dist.all_reduce(loss)
                    loss = loss / par.data_size
                elif par.batch_group is not None:
                    dist.all_reduce(loss, group=par.batch_group)
                    loss = loss / par.data_size
                pending.append((step, lr, loss, norm))
            save = config.ckpt_dir and ((config.ckpt_every and step % config.ckpt_every == 0) or step == config.steps)
            if step % config.log_every == 0 or step == config.steps or save or config.kill_at_step == step:
                # The step's host sync: the window's losses read back at once (it also closes its timing).
                values = torch.stack([torch.stack([v, n.to(v.dtype)]) for _, _, v, n in pending]).tolist()
                bad = next(((s_, v, n) for (s_, *_), (v, n) in zip(pending, values)
                            if not (math.isfinite(v) and math.isfinite(n))), None)
                if bad is not None:
                    # The per-call value checks are off in the step: the loss and the gradient norm are where
                    # a NaN or inf shows.
                    raise FloatingPointError(f"the loss is {bad[1]} and the gradient norm {bad[2]} at step {bad[0]}: "
                                             f"{DIVERGED}")
                dt = (time.perf_counter() - t_window) / len(pending)
                tok_s = config.batch_size * config.seq_len / dt
                mem, mem_kind = peak_memory_gib(device)
                if pipe is not None:
                    loads = all_loads(parts, loads, par.pp_group)
                vio = [maxvio(l) for l in loads]
                for (s_, lr_, *_), (v, n) in zip(pending, values):
                    log.write(dict(event="step", step=s_, loss=v, grad_norm=n, lr=lr_, step_s=dt, tokens_per_s=tok_s,
                                   mfu=mfu(tok_s, fpt, peak, world) if peak else None,
                                   maxvio=vio if s_ == step else None, peak_mem_GiB=mem, peak_mem_kind=mem_kind))
                pending = []
                # The budget is checked only here, where the host has just synchronised: one broadcast of
                # rank 0's decision over the default group, so every rank stops at this same step.
                if config.stop_after_minutes and step < config.steps and out_of_time(t0, config.stop_after_minutes,
                                                                                      device):
                    stopped_at, save = step, True
                if save:
                    # A finite loss can still come with non-finite gradients (a bf16 backward overflowing),
                    # which the optimizer writes into the weights: never save those as the latest checkpoint.
                    if not state_finite(parts, opts):
                        raise FloatingPointError(f"the weights or optimizer state hold NaN or inf after step {step} "
                                                 f"(non-finite gradients): stopping before writing its checkpoint "
                                                 f"(start a new --ckpt-dir with a lower --lr: a resume keeps it); "
                                                 f"non-finite: {nonfinite_names(parts, opts)}")
                    save_checkpoint(config.ckpt_dir, step, parts, opts, {"step": step, "loader": loader.state_dict(),
                                                                          "run": run_settings(config)},
                                    keep=config.keep_checkpoints)
                if stopped_at is not None:
                    minutes = (wall_clock() - t0) / 60
                    how = (f"stopped at step {step} of {config.steps} after {minutes:.2f} min of this invocation's "
                           f"{config.stop_after_minutes:.3g}-minute budget, checkpoint {config.ckpt_dir}: run the same command "
                           + ("again" if config.resume else "with --resume") + " to continue")
                    log.write(dict(event="stop", step=step, steps=config.steps, minutes=minutes,
                                   stop_after_minutes=config.stop_after_minutes, ckpt_dir=config.ckpt_dir,
                                   message=how))
                    if rank0:
                        print(how, file=sys.stderr)
                    break
                if config.kill_at_step == step:
                    dist.barrier()
                    os.kill(os.getpid(), signal.SIGKILL)
                t_window = time.perf_counter()
        log.summary(dict(preset=config.preset, dp=par.dp, ep=par.ep, cp=par.cp, pp=par.pp, ep_mode=config.ep_mode,
                         world=world, microbatches=config.microbatches,
                         device=str(device), flops_per_token=fpt, flops_convention=FLOPS_CONVENTION),
                    stopped_at=stopped_at)
        out = TrainRecords(log.records)
        out.stopped_at = stopped_at
        return out


def main(argv: list[str] | None = None) -> int:
    """``python -m k3lab.train [flags]`` (and under torchrun): parse, train, 0 on success.

    Raises:
        SystemExit: 2 on a bad flag, a layout that does not match the launched world, an output path that cannot be
            made, or missing token shards; 1 when the run diverged (rank 0 prints the one line saying where).
    """
    # Every rank of a torchrun world meets the same error; rank 0 prints it (argparse's usage and message).
    quiet = os.environ.get("RANK", "0") != "0"
    config = parse_args(argv, quiet=quiet)
    try:
        train(config)
    except (ConfigError, FileNotFoundError) as e:
        # A layout that does not fit, or no token shards: the message says what to run.
        if quiet:
            leave_quietly()
        build_parser().error(str(e))
    except FloatingPointError as e:
        # Not a usage error: the flags were valid and the run went wrong; its message names the step and the fix.
        if not quiet:
            print(f"{build_parser().prog}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from e
    return 0
