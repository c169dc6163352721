"""Per-step metrics: JSONL records, a progress bar and the final summary table (rank 0 only).

Record kinds (one JSON object per line, ``"event"`` first):

    start    the layout, model, flops_per_token and its convention, the resumed step (or 0)
    step     step, loss (global mean, nats), grad_norm (the global L2 norm of the raw gradients over every
             rank and pipeline stage, before clipping to ``--max-grad-norm``), lr, step_s and tokens_per_s (global; the mean over the
             ``--log-every`` window the step was read back in), mfu (None without a known peak), maxvio
             (one per MoE layer, the step's routing summed over the data ranks; None on the steps of a
             window before its last, whose loads are not read back), peak_mem_GiB
    stop     --stop-after-minutes ended this invocation: step, steps, minutes, the message with how to resume
    summary  the table's numbers: this invocation's steps, its train_minutes (the sum of its steps' step_s:
             stepping time, without start-up and checkpoint saves) and stopped_at (None: it reached --steps);
             a resumed invocation adds run_* fields over the file's parts of the run (``summarize_log``)

``summarize_log(path)`` summarises a run that took several invocations (--stop-after-minutes, or a kill and
--resume) from its JSONL: the parts since the last fresh start, their training minutes summed (not the wall
time between them), a step replayed after a kill counted in its last part only. A process killed mid-write
leaves its part's last line cut: the next part starts on a new line, and the reader skips such a line with a
warning (only there: a line that is not JSON anywhere else is an error).

MFU follows ``k3lab.model.flops_per_token``: 6 x activated parameters (input embedding excluded, routed
experts K of E at their latent width, LM head included) plus the Gated MLA attention terms at the
training length, not halved for the causal mask; over dense bf16 peak (``k3lab.model.PEAK_FLOPS``) times
the number of GPUs. Peak memory: ``torch.cuda.max_memory_allocated`` on GPU, the process's peak resident
set (``ru_maxrss``) on CPU, rank 0's.
"""
from __future__ import annotations

import json
import math
import resource
import sys
import warnings
from pathlib import Path

import torch

FLOPS_CONVENTION = ("6 x activated params (no input embedding; routed experts K of E at the latent width; "
                    "LM head included, once more per MTP depth) + Gated MLA attention 6*H*(Dn+Dr+Dv)*T per MLA "
                    "layer, not halved for causality (k3lab.model.flops_per_token); MFU over dense bf16 peak x GPUs")


def peak_memory_gib(device: torch.device) -> tuple[float, str]:
    """(GiB, kind): CUDA's peak allocated bytes on ``device``, else this process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "cpu_peak_rss"


def peak_key(device: torch.device) -> str | None:
    """The ``k3lab.model.PEAK_FLOPS`` key of ``device`` ("h100", "h200"), None for a CPU or another GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((k for k in ("h200", "h100") if k in name), None)


class MetricsLog:
    """Writes the records above (``path`` None: none), draws a tqdm bar on stderr (``progress``), prints
    the summary table on stdout. Only rank 0 builds one; the others pass ``enabled=False``.

    ``path`` is opened for append so a resumed run continues its log: the loss curve of a killed run and
    its resumption overlap on the steps replayed since the checkpoint. A last line cut by a kill is ended
    first, so the new records start on their own line.
    """

    def __init__(self, path: str | None, total_steps: int, start_step: int, progress: bool, enabled: bool = True,
                 log_every: int = 1):
        self.enabled, self.log_every = enabled, log_every
        self.records: list[dict] = []
        self.file = None
        self.bar = None
        self.start_step = start_step
        if not enabled:
            return
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)
            if _ends_cut(path):
                self.file.write("\n")
        if progress:
            from tqdm.auto import tqdm  # noqa: PLC0415

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", file=sys.stderr, dynamic_ncols=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if record.get("event") == "step":
            self.records.append(record)
            if self.bar is not None:
                mv = max(record["maxvio"]) if record["maxvio"] else 0.0
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                     maxvio=f"{mv:.2f}", refresh=False)
                self.bar.update(1)
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")

    def summary(self, extra: dict, stopped_at: int | None = None) -> dict:
        """The summary record of this process's steps (the first --log-every window, which compiles and warms
        up, is left out of the throughput), written and printed as a table; ``stopped_at``: the step --stop-after-minutes
        stopped at. A resumed run that logs to a file adds ``run_*``: ``summarize_log`` over its parts."""
        if not self.enabled:
            return {}
        steps = self.records
        last = steps[-1] if steps else {}
        out = dict(event="summary", steps=len(steps), first_step=steps[0]["step"] if steps else None,
                   last_step=last.get("step"), final_loss=last.get("loss"),
                   min_loss=min((r["loss"] for r in steps), default=None), **_throughput([steps], [self.log_every]),
                   stopped_at=stopped_at,
                   final_maxvio_mean=(sum(last["maxvio"]) / len(last["maxvio"])) if last.get("maxvio") else None,
                   peak_mem_GiB=max((r["peak_mem_GiB"] for r in steps), default=None), **extra)
        if self.file is not None and self.start_step > 0:
            try:
                run = summarize_log(self.file.name)
                out.update({f"run_{k}": run[k] for k in ("parts", "steps", "train_minutes", "tokens_per_s", "mfu")})
            except (ValueError, KeyError, TypeError, OSError) as e:
                # An earlier part's lines this summary cannot read (another writer's, a cut line) must not
                # fail a run that has finished its steps: its own summary stands.
                print(f"{self.file.name}: no summary over the run's parts ({type(e).__name__}: {e})", file=sys.stderr)
        if self.bar is not None:
            self.bar.close()
        self.write(out)
        if self.file is not None:
            self.file.close()
        print(format_summary(out), flush=True)
        return out


def after_first_window(part: list[dict], log_every: int) -> list[dict]:
    """The step records of one invocation without its first ``log_every`` window (the steps up to the first
    read-back, a multiple of ``log_every``: they compile and warm up, and each carries that window's rate);
    empty when the invocation ended within that window."""
    if not part:
        return part
    end = -(-part[0]["step"] // log_every) * log_every
    return [r for r in part if r["step"] > end]


def _throughput(parts: list[list[dict]], log_every: list[int]) -> dict:
    """tokens_per_s and mfu (means over every part's steps but its first window of its own ``log_every``, which
    compiles and warms up; over all steps when no part ran past its first; None without steps) and
    train_minutes (the sum of every step's step_s) of the step records of one or more invocations."""
    timed = ([r for part, n in zip(parts, log_every) for r in after_first_window(part, n)]
             or [r for part in parts for r in part])
    mfus = [r["mfu"] for r in timed if r["mfu"] is not None]
    return dict(tokens_per_s=sum(r["tokens_per_s"] for r in timed) / len(timed) if timed else None,
                mfu=sum(mfus) / len(mfus) if mfus else None,
                train_minutes=sum(r["step_s"] for part in parts for r in part) / 60)


def _ends_cut(path: str | Path) -> bool:
    """Whether the file at ``path`` is not empty and its last byte is not a newline (a write cut short)."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            return False
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def _is_start(line: str) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and record.get("event") == "start"


def read_records(path: str | Path) -> list[dict]:
    """The records of a JSONL log, in order. A line that is not complete JSON is skipped, with a warning, where
    it is the last line of a part (the file's last line, or the line before a "start" record): a process
    killed mid-write.

    Raises:
        ValueError: a line that is not complete JSON anywhere else (the message gives its number).
    """
    lines = Path(path).read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
            continue
        except json.JSONDecodeError as e:
            after = next((later for later in lines[i + 1:] if later.strip()), None)
            if after is not None and not _is_start(after):
                raise ValueError(f"{path}: line {i + 1} is not complete JSON and not the last line of a part "
                                 f"(the file's last line, or the line before a start record): {e}") from e
        warnings.warn(f"{path}: line {i + 1} is not complete JSON (a cut last line), skipped", stacklevel=3)
    return records


def run_parts(path: str | Path) -> tuple[list[list[dict]], int | None, list[int]]:
    """The step records of the run a JSONL log ends with, one list per invocation since its last fresh start
    (a "start" record with ``resumed_from`` 0), the last invocation's stop step (None: it was not stopped
    by ``--stop-after-minutes``) and each invocation's ``log_every`` (a resume may change it; 1 where its
    start record has none).

    Raises:
        ValueError: the file holds no "start" record, or a line that is not complete JSON other than a part's
            cut last line (``read_records``).
    """
    records = read_records(path)
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    if not starts:
        raise ValueError(f"{path} holds no start record: not a k3lab.train log")
    first = max((i for i in starts if not records[i].get("resumed_from")), default=starts[0])
    parts, stopped_at, log_every = [], None, []
    for r in records[first:]:
        if r.get("event") == "start":
            parts.append([])
            log_every.append(r.get("log_every") or 1)
            stopped_at = None
        elif r.get("event") == "step":
            parts[-1].append(r)
        elif r.get("event") == "stop":
            stopped_at = r["step"]
    return parts, stopped_at, log_every


def summarize_log(path: str | Path) -> dict:
    """The summary of the run a JSONL log ends with, over all its invocations ("parts").

    The run starts at the file's last "start" record with ``resumed_from`` 0 (a fresh start); each later
    "start" begins another part. Throughput is the mean over every part's steps but each part's first
    --log-every window (each recompiles and warms up); ``train_minutes`` sums the parts' stepping time (their steps' step_s), not
    the wall time between the parts. A step logged by several parts (replayed after a kill since the last
    checkpoint) takes its last part's loss in the curve.

    Returns:
        dict: parts (the invocations that ran steps), steps (distinct steps), first_step, last_step, final_loss, min_loss, tokens_per_s, mfu,
        train_minutes, stopped_at (the last part's stop step, None when it reached --steps), losses
        ({step: loss}).

    Raises:
        ValueError: the file holds no "start" record, or a line that is not complete JSON other than a part's
            cut last line (``read_records``).
    """
    parts, stopped_at, log_every = run_parts(path)
    losses = {r["step"]: r["loss"] for part in parts for r in part}
    order = sorted(losses)
    # An invocation that ran no step (resumed at --steps) is no part of the training.
    return dict(parts=sum(1 for part in parts if part), steps=len(losses), first_step=order[0] if order else None,
                last_step=order[-1] if order else None, final_loss=losses[order[-1]] if order else None,
                min_loss=min(losses.values(), default=None), **_throughput(parts, log_every), stopped_at=stopped_at,
                losses=losses)


def format_summary(s: dict) -> str:
    """The summary record as an aligned two-column table."""
    def fmt(v):
        if isinstance(v, float):
            return "n/a" if math.isnan(v) else f"{v:.4g}"
        return "n/a" if v is None else str(v)

    rows = [(k, fmt(v)) for k, v in s.items() if k not in ("event", "flops_convention")]
    w = max(len(k) for k, _ in rows)
    return "\n".join([f"{'metric':<{w}}  value", "-" * (w + 12)] + [f"{k:<{w}}  {v}" for k, v in rows])
