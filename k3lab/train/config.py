"""``TrainConfig`` (one run's settings, validated) and the command line that builds it."""
from __future__ import annotations

import argparse
import math
import os
import re
import time
from dataclasses import dataclass, fields

from k3lab.files import blocked_parent
from k3lab.memory import parse_rules
from k3lab.moonep import MODES
from k3lab.train.loader import MAX_SEED

TRAIN_PRESETS = ("k3-tiny", "k3-1b")
# torch.distributed.pipelining's Schedule1F1B, ScheduleInterleaved1F1B (two stages per rank), ScheduleGPipe.
PP_SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")
ATTNRES_BUFFERS = ("float32", "bfloat16")
# The bool fields given as bare flags (``--compile``); ``progress`` is the one given as ``--no-progress``.
SWITCHES = ("resume", "doc_mask", "sync_debug", "compile", "attnres_keep_inputs")


class ConfigError(ValueError):
    """A setting that does not fit the launched world or the data (``main`` reports it as a usage error)."""


@dataclass
class TrainConfig:
    """One training run. ``python -m k3lab.train --help`` describes every field (flag ``--a-b`` is ``a_b``).

    Attributes:
        preset (str): "k3-tiny" or "k3-1b" (``k3lab.model.K3Config``), vocabulary from the data's tokenizer.
        steps (int): total optimizer steps (the learning-rate schedule spans them; a resumed run keeps it).
        batch_size (int): global batch in sequences, split equally over the dp x ep data rows (the cp
            ranks of a row share its sequences, each holding a contiguous 1/cp of them).
        seq_len (int): T, tokens per sequence.
        lr (float): peak learning rate in (0, 1) (Muon's per-block RMS matching makes one lr serve both groups).
        dp (int | None): data-parallel ranks (None: world size / (pp * ep * cp)). ep (int): expert-parallel ranks.
        cp (int): context-parallel ranks (KCP for the KDA layers, a latent all-gather for MLA).
        pp (int): pipeline-parallel ranks (the outermost mesh axis; ``k3lab.model.split_model``'s stages).
        microbatches (int | None): M, micro-batches per step: each data row's sequences are cut into M equal
            parts, their gradients accumulated (loss / M each) before the one optimizer step; with pp > 1 the
            schedule's micro-batches. None: pp (one micro-batch in flight per stage; 1 without pp).
        pp_schedule (str): "1f1b", "interleaved-1f1b" (two stages per rank) or "gpipe".
        mtp (int): multi-token-prediction depth D (``K3Config.num_nextn_predict_layers``; 0: none), below seq_len
            (depth k has seq_len - k targets in a sequence).
        ep_mode (str): "moonep" or "alltoall".
        ckpt_dir (str | None): where checkpoints go (None: never saved).
        ckpt_every (int): save every this many steps (0: only at the end); needs ckpt_dir.
        keep_checkpoints (int): after each save keep only the newest this many complete checkpoints (0: all).
        resume (bool): continue from the latest complete checkpoint in ckpt_dir (fresh start if none); without
            it, ``train`` refuses a ckpt_dir that holds complete checkpoints (another run's).
        log_jsonl (str | None): metrics file (appended). seed (int): model init and data order, in [0, 2**32 - 1].
        data_dir (str | None): folder with shards/ and tokenizer.json (default ``k3lab.data``'s).
        progress (bool): draw a progress bar on rank 0.
        doc_mask (bool): keep the packed documents apart (``pack_documents``: KDA restarts, MLA masks at every
            ``<|endoftext|>``); the MLA mask is [B*T, B*T], so this is for short rows.
        kill_at_step (int | None): fault injection: every rank SIGKILLs itself after this step.
        weight_decay (float): decoupled weight decay (K3: 0.1). warmup (float): warmup fraction (K3: 0.01).
        max_grad_norm (float): clip the global gradient norm (over every rank and pipeline stage) to this
            before each optimizer step (0: no clipping).
        log_every (int): read the loss and metrics back every this many steps (the step's one host sync);
            the step records in between carry the window's mean step time.
        activations (str | None): activation-manager rules "PATTERN=POLICY,..." (``k3lab.memory``: keep,
            recompute, offload, fp8; patterns on ``K3Model.named_modules()``), e.g. "sublayers.*=recompute".
        sync_debug (bool): on CUDA, run every step but the run's first (kernel compilation, cached index
            tables) under ``torch.cuda.set_sync_debug_mode("error")`` up to the log's read-back: any host
            synchronisation there raises.
        compile (bool): regional compilation (``k3lab.train.parallel.compile_blocks``): each sublayer and MTP
            module under ``torch.compile`` after the model is parallelised; the first steps then compile.
        attnres_buffer (str): storage dtype of Block AttnRes's block buffer, "float32" (the residual stream's
            own dtype) or "bfloat16" (half the bytes its two phases read and write; the partial sums of a block
            are then rounded to bf16, as a bf16 residual stream's would be).
        attnres_keep_inputs (bool): keep each sublayer's input for its backward instead of rebuilding it from
            the block buffer (``BlockAttnRes(recompute_input=False)``): one [B, T, d] tensor per sublayer more
            memory, one mixing pass per sublayer less in backward.
        stop_after_minutes (float | None): a wall-clock budget for this invocation (a job's time limit):
            at the first ``log_every`` step (the steps that read back anyway) at or after this many minutes
            since ``train`` started, by rank 0's clock, every rank saves a checkpoint there and the run
            returns normally, marked stopped; ``--resume`` continues it. Needs ckpt_dir. None: no budget.

    Raises:
        ValueError: any field out of range, or a --ckpt-dir / --log-jsonl that cannot be created or written
            (its nearest existing folder is a file or read-only); the message names the flag. A path the file
            system refuses otherwise (a name too long, /proc) stops ``train`` at start-up (``prepare_outputs``).
    """

    preset: str = "k3-tiny"
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    dp: int | None = None
    ep: int = 1
    cp: int = 1
    pp: int = 1
    microbatches: int | None = None
    pp_schedule: str = "1f1b"
    mtp: int = 0
    ep_mode: str = "moonep"
    ckpt_dir: str | None = None
    ckpt_every: int = 0
    keep_checkpoints: int = 0
    resume: bool = False
    log_jsonl: str | None = None
    seed: int = 0
    data_dir: str | None = None
    progress: bool = True
    doc_mask: bool = False
    kill_at_step: int | None = None
    weight_decay: float = 0.1
    warmup: float = 0.01
    max_grad_norm: float = 1.0
    log_every: int = 1
    activations: str | None = None
    sync_debug: bool = False
    compile: bool = False
    attnres_buffer: str = "float32"
    attnres_keep_inputs: bool = False
    stop_after_minutes: float | None = None

    def __post_init__(self):
        def bad(flag, msg):
            raise ValueError(f"--{flag.replace('_', '-')} {msg}, got {getattr(self, flag)!r}")

        if self.microbatches is None and isinstance(self.pp, int):
            self.microbatches = self.pp
        if self.preset not in TRAIN_PRESETS:
            bad("preset", f"must be one of {TRAIN_PRESETS}")
        for name, low in (("steps", 1), ("batch_size", 1), ("seq_len", 2), ("ep", 1), ("cp", 1), ("pp", 1),
                          ("microbatches", 1), ("mtp", 0), ("ckpt_every", 0), ("keep_checkpoints", 0),
                          ("log_every", 1)):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= low):
                bad(name, f"must be an int >= {low}")
        # The loader's bound (its generator seed mixes in the epoch); torch.manual_seed takes up to 2**64 - 1.
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed <= MAX_SEED):
            bad("seed", f"must be an int in [0, {MAX_SEED}]")
        if self.mtp >= self.seq_len:
            bad("mtp", f"must be < --seq-len {self.seq_len} (depth k predicts the token k + 1 ahead: a depth of "
                       f"--seq-len or more has no target in a sequence)")
        if self.dp is not None and not (isinstance(self.dp, int) and not isinstance(self.dp, bool) and self.dp >= 1):
            bad("dp", "must be an int >= 1")
        # Far above any learning rate that trains (the book's runs use 1e-2 at most), and below the values whose
        # update overflows float32 inside the optimizer (--lr 1e308) instead of reaching the divergence check.
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and 0 < self.lr < 1):
            bad("lr", "must be a positive finite number < 1")
        if not (isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            bad("weight_decay", "must be a finite number >= 0")
        if not (isinstance(self.max_grad_norm, (int, float)) and not isinstance(self.max_grad_norm, bool)
                and math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            bad("max_grad_norm", "must be a finite number >= 0 (0: no clipping)")
        if not (isinstance(self.warmup, (int, float)) and 0 <= self.warmup < 1):
            bad("warmup", "must be in [0, 1)")
        if self.ep_mode not in MODES:
            bad("ep_mode", f"must be one of {MODES}")
        if self.pp_schedule not in PP_SCHEDULES:
            bad("pp_schedule", f"must be one of {PP_SCHEDULES}")
        if self.pp > 1 and self.pp_schedule != "gpipe" and self.microbatches < self.pp:
            bad("microbatches", f"must be >= --pp {self.pp} for --pp-schedule {self.pp_schedule} (each stage needs a "
                                f"micro-batch in flight; gpipe takes any count)")
        if self.pp > 1 and self.mtp:
            bad("mtp", "does not combine with --pp > 1 (the MTP modules read the embedding, which lives on stage 0)")
        if self.pp > 1 and self.doc_mask:
            bad("doc_mask", "does not combine with --pp > 1 (a schedule's micro-batches are equal tensor chunks; "
                            "each would need its own cu_seqlens)")
        if self.mtp and self.cp > 1:
            bad("mtp", "does not combine with --cp > 1 (a position's later tokens may live on the next rank)")
        if self.ckpt_dir is not None and os.path.exists(self.ckpt_dir) and not os.path.isdir(self.ckpt_dir):
            bad("ckpt_dir", "must be a folder (or not exist yet), not a file")
        if self.ckpt_dir is not None and re.match(r"^step_\d{8}$", os.path.basename(os.path.normpath(self.ckpt_dir))):
            bad("ckpt_dir", "must be the folder that holds the step_NNNNNNNN checkpoints, not one of them")
        if self.log_jsonl is not None and os.path.isdir(self.log_jsonl):
            bad("log_jsonl", "must be a file path, not a folder")
        # ``train`` makes both before its first step too; checked here as well so that a path below a file or
        # in a read-only folder is a flag error before any process group or model exists.
        for name in ("ckpt_dir", "log_jsonl"):
            reason = _unwritable(getattr(self, name))
            if reason:
                bad(name, reason)
        if self.ckpt_every and not self.ckpt_dir:
            bad("ckpt_every", "needs --ckpt-dir")
        if self.keep_checkpoints and not self.ckpt_dir:
            bad("keep_checkpoints", "needs --ckpt-dir")
        if self.resume and not self.ckpt_dir:
            bad("resume", "needs --ckpt-dir")
        if self.activations is not None:
            try:
                self.activation_rules()
            except ValueError as e:
                raise ValueError(f"--activations {e}") from None
        if not isinstance(self.compile, bool):
            bad("compile", "must be a bool")
        if self.attnres_buffer not in ATTNRES_BUFFERS:
            bad("attnres_buffer", f"must be one of {ATTNRES_BUFFERS}")
        if not isinstance(self.attnres_keep_inputs, bool):
            bad("attnres_keep_inputs", "must be a bool")
        if self.stop_after_minutes is not None:
            m = self.stop_after_minutes
            if not (isinstance(m, (int, float)) and not isinstance(m, bool) and math.isfinite(m) and m > 0):
                bad("stop_after_minutes", "must be a finite number of minutes > 0")
            if not self.ckpt_dir:
                bad("stop_after_minutes", "needs --ckpt-dir (the stopped run saves a checkpoint to resume from)")
        if self.kill_at_step is not None and not (
                isinstance(self.kill_at_step, int) and 1 <= self.kill_at_step <= self.steps):
            bad("kill_at_step", f"must be an int in [1, --steps={self.steps}]")


    def activation_rules(self) -> dict[str, str]:
        """``activations`` as ``k3lab.memory.apply_policies`` rules {pattern: policy} ({} when None).

        Raises:
            ValueError: an entry not PATTERN=POLICY, an unknown policy, or one pattern given two policies.
        """
        return parse_rules(self.activations or "")


def _unwritable(path: str | None) -> str | None:
    """Why ``path`` (a file or folder to create or write; missing parent folders are made) cannot be
    written, or None: its nearest existing ancestor is a file, or a folder this process may not write."""
    if not path:
        return None
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "is not writable"
    why = blocked_parent(path)
    return f"cannot be created: {why}" if why else None


HELP = {
    "preset": "model size: k3-tiny (CPU, seconds per step) or k3-1b (one GPU); the vocabulary is the data's",
    "steps": "total optimizer steps; the cosine learning-rate schedule spans them (keep it when resuming)",
    "batch_size": "global batch in sequences, split equally over the dp x ep data rows (cp ranks share a row's)",
    "seq_len": "tokens per sequence (T)",
    "lr": "peak learning rate of Per-Head Muon and AdamW, in (0, 1) (cosine decay to 10%% after a warmup)",
    "dp": "data-parallel ranks, FSDP2 shards over them (default: world size / (pp * ep * cp))",
    "ep": "expert-parallel ranks; routed experts are split over them (must divide the expert count)",
    "cp": "context-parallel ranks: a row's packed tokens (batch / (dp x ep) x seq-len) are split into cp equal "
          "contiguous pieces of at least 3 tokens (KCP for KDA, an all-gather of the MLA latents)",
    "pp": "pipeline-parallel ranks (outermost mesh axis): the model's sublayers cut into balanced stages, Block "
          "AttnRes's completed blocks carried between them",
    "microbatches": "micro-batches per step (gradient accumulation; with --pp the schedule's): must divide the "
                    "sequences of a data row (default: --pp)",
    "pp_schedule": "pipeline schedule (torch.distributed.pipelining): 1f1b, interleaved-1f1b (two stages per "
                   "rank) or gpipe",
    "mtp": "multi-token-prediction depth: D MTP modules after the stack, their loss weighted by 0.3 (0: none); "
           "below --seq-len",
    "ep_mode": "expert-parallel exchange: moonep (static, balanced, K3 App. E) or alltoall (dynamic baseline)",
    "ckpt_dir": "folder for checkpoints (step_NNNNNNNN/, written atomically); none: no checkpoints; without "
                "--resume it must hold no complete checkpoints",
    "ckpt_every": "save every N steps and at the end (0: only at the end); needs --ckpt-dir",
    "keep_checkpoints": "after each save keep only the newest N complete checkpoints (0: keep all); needs --ckpt-dir",
    "resume": "continue from the latest complete checkpoint in --ckpt-dir (a fresh start when there is none)",
    "log_jsonl": "append per-step metrics (loss, gradient norm before clipping, tokens/s, MFU, maxvio per MoE layer, "
                 "peak memory) to this file",
    "seed": "seed of the model initialisation and the data order, in [0, 2**32 - 1]",
    "data_dir": "folder holding shards/ and tokenizer.json, as python -m k3lab.data build leaves them (default: "
                "$K3LAB_DATA_DIR, else the checkout's data/)",
    "doc_mask": "keep packed documents apart: KDA restarts and MLA masks at every <|endoftext|> (the MLA mask is "
                "[B*T, B*T]: short rows only)",
    "kill_at_step": "fault injection for resume tests: every rank SIGKILLs itself after this step",
    "weight_decay": "decoupled weight decay of both optimizer groups (K3: 0.1)",
    "warmup": "fraction of --steps spent in linear warmup (K3: 0.01)",
    "max_grad_norm": "clip the global gradient norm to this before each optimizer step (0: no clipping)",
    "log_every": "read the loss and metrics back every N steps, the step's one host sync (GPU: 10 or more)",
    "activations": "activation-manager rules PATTERN=POLICY[,...] on K3Model module names, policies keep, "
                   "recompute, offload, fp8 (e.g. 'sublayers.*=recompute')",
    "sync_debug": "CUDA: steps between log steps run under torch.cuda.set_sync_debug_mode('error')",
    "compile": "torch.compile each sublayer and MTP module (regional, torchtitan's per-block compile) after "
               "parallelising; the KDA operator, expert GEMMs, expert-parallel exchange and Block AttnRes stay eager",
    "attnres_buffer": "storage dtype of Block AttnRes's block buffer: float32 (the residual stream's) or bfloat16 "
                      "(half the bytes of its mixing passes, block sums rounded to bf16)",
    "attnres_keep_inputs": "keep each sublayer's input for backward instead of rebuilding it from the block buffer "
                           "(one [B, T, d] tensor per sublayer more memory, one mixing pass less)",
    "stop_after_minutes": "wall-clock budget of this invocation (a job's time limit): at the first --log-every step "
                          "past it (rank 0's clock) save a checkpoint and exit 0; rerun with --resume to continue; "
                          "leave room for one --log-every window and a save; needs --ckpt-dir",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m k3lab.train`` argument parser (one flag per ``TrainConfig`` field)."""
    from k3lab.train import __doc__ as doc  # noqa: PLC0415

    parts = doc.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m k3lab.train", description=parts[0],
                                epilog=parts[1] + "\n\n" + parts[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "progress":
            p.add_argument("--no-progress", dest="progress", action="store_false",
                           help="no progress bar (the JSONL log and the summary table stay)")
            continue
        if f.name in SWITCHES:
            p.add_argument(flag, action="store_true", help=HELP[f.name])
            continue
        kind = {"preset": str, "ep_mode": str, "pp_schedule": str, "ckpt_dir": str, "log_jsonl": str, "data_dir": str,
                "activations": str, "attnres_buffer": str,
                "lr": float, "weight_decay": float, "warmup": float, "max_grad_norm": float,
                "stop_after_minutes": float}.get(f.name, int)
        choices = {"preset": TRAIN_PRESETS, "ep_mode": MODES, "pp_schedule": PP_SCHEDULES,
                   "attnres_buffer": ATTNRES_BUFFERS}.get(f.name)
        default = f.default
        p.add_argument(flag, type=kind, default=default, choices=choices,
                       help=HELP[f.name] + ("" if default is None else f" (default {default})"))
    return p


# How long a rank other than 0 waits before it exits on a usage error (seconds).
QUIET_EXIT_DELAY_S = 10.0


def leave_quietly() -> None:
    """Exit with status 2 without printing, after ``QUIET_EXIT_DELAY_S``: for the ranks of a torchrun world other
    than 0 on an error every rank meets. torchrun stops all ranks at the first that exits, so a rank that failed
    at once could stop rank 0 before it printed the reason; rank 0 exiting first stops this one's wait."""
    time.sleep(QUIET_EXIT_DELAY_S)
    raise SystemExit(2)


def parse_args(argv: list[str] | None = None, quiet: bool = False) -> TrainConfig:
    """``TrainConfig`` from the command line; a bad value exits with argparse's usage and the reason
    (``quiet``: without printing them, for the ranks of a torchrun world other than 0).

    Raises:
        SystemExit: status 2 on a bad flag (argparse's convention).
    """
    parser = build_parser()
    if quiet:
        def error(message):
            leave_quietly()

        parser.error = error
    ns = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(ns))
    except ValueError as e:
        parser.error(str(e))
