"""Start ``k3lab.train`` under torchrun as a subprocess and follow its JSONL log (the book, scripts).

    cmd = torchrun_command(2, preset="k3-tiny", ep=2, steps=60, log_jsonl="run.jsonl")
    result = run_and_follow(cmd, "run.jsonl")        # a progress bar fed by the log's step records
    result.returncode, result.steps, result.stdout   # -9 after --kill-at-step, 0 when it finished
    result.stopped_at                                # the step --stop-after-minutes stopped at (None: --steps)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3lab.train.config import SWITCHES, TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def torchrun_command(nproc: int, **flags) -> list[str]:
    """``python -m torch.distributed.run --nproc-per-node nproc -m k3lab.train --flag value ...``.

    ``flags`` are ``TrainConfig`` fields (``progress=False`` gives ``--no-progress``, ``resume=True``
    gives ``--resume``, ``doc_mask=True`` ``--doc-mask``, ``compile=True`` ``--compile``, as every bool field, None values are left out); they are validated by building the ``TrainConfig``.

    Raises:
        ValueError: nproc < 1, an unknown field or a value ``TrainConfig`` refuses.
    """
    if not (isinstance(nproc, int) and nproc >= 1):
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    TrainConfig(**flags)
    args = []
    for k, v in flags.items():
        if k == "progress":
            args += [] if v else ["--no-progress"]
        elif k in SWITCHES:
            args += [f"--{k.replace('_', '-')}"] if v else []
        elif v is not None:
            args += [f"--{k.replace('_', '-')}", str(v)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "k3lab.train", *args]


@dataclass
class RunResult:
    """What ``run_and_follow`` saw: the exit status (negative: killed by that signal; torchrun reports a
    killed worker as 1), the step records this run appended to the log, its stdout / stderr, and the step
    ``--stop-after-minutes`` stopped it at (its "stop" record; None when it did not stop early)."""

    returncode: int
    steps: list[dict] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    stopped_at: int | None = None

    def check(self, last_step: int | None = None) -> "RunResult":
        """Return ``self`` if the run ended as intended: exit status 0, or, given ``last_step`` (a run
        killed with ``--kill-at-step``), its last logged step equal to ``last_step``. Torchrun reports a
        killed worker and a crashed one alike (status 1), so only the log tells a kill from a crash.

        Raises:
            RuntimeError: the run ended otherwise; the message ends with its stderr's last 4000 characters.
        """
        last = self.steps[-1]["step"] if self.steps else None
        if last_step is None and self.returncode != 0:
            why = f"exited with status {self.returncode}"
        elif last_step is not None and last != last_step:
            why = f"stopped with its last logged step {last}, not at the kill step {last_step}"
        else:
            return self
        raise RuntimeError(f"the training run {why}; its stderr ends with:\n{self.stderr[-4000:]}")


def run_and_follow(cmd: list[str], log_jsonl: str | os.PathLike, timeout_s: float = 600.0, progress: bool = True,
                   env: dict[str, str] | None = None) -> RunResult:
    """Run ``cmd`` from the repository root, updating a progress bar from the step records appended to
    ``log_jsonl`` while it runs (one thread per rank: OMP_NUM_THREADS=1 unless ``env`` says otherwise).

    Raises:
        TimeoutError: still running after ``timeout_s`` (the process is killed first).
    """
    log = Path(log_jsonl)
    offset = log.stat().st_size if log.exists() else 0
    run_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    bar = None
    steps: list[dict] = []
    stopped_at = None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env, stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + timeout_s
        while True:
            done = proc.poll() is not None
            new = _read_new(log, offset)
            if new:
                offset += sum(len(line.encode()) + 1 for line in new)
                for rec in map(json.loads, new):
                    if rec.get("event") == "start" and progress and bar is None:
                        from tqdm.auto import tqdm  # noqa: PLC0415

                        bar = tqdm(total=rec["steps"], initial=rec["resumed_from"], desc="train")
                    elif rec.get("event") == "step":
                        steps.append(rec)
                        if bar is not None:
                            bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
                            bar.update(1)
                    elif rec.get("event") == "stop":
                        stopped_at = rec["step"]
            if done:
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise TimeoutError(f"{' '.join(cmd)} did not finish within {timeout_s} s")
            time.sleep(0.2)
        if bar is not None:
            bar.close()
        out.seek(0)
        err.seek(0)
        return RunResult(proc.returncode, steps, out.read(), err.read(), stopped_at)


def _read_new(log: Path, offset: int) -> list[str]:
    """Complete lines appended to ``log`` after byte ``offset`` (a half-written last line waits)."""
    if not log.exists():
        return []
    with open(log, "rb") as f:
        f.seek(offset)
        data = f.read().decode()
    lines = data.split("\n")
    return [line for line in lines[:-1] if line]
