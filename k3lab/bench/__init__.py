"""Benchmarks run on a GPU as ``python -m k3lab.bench.<name>``; each writes
data/results/<name>_<card>.json (``result_path``)."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a bad value stops the command before any work, naming the option)."""
    return _int_at_least(text, 1, "a positive int")


def nonnegative_int(text: str) -> int:
    """argparse type: an int >= 0 (0 typically meaning "skip")."""
    return _int_at_least(text, 0, "an int >= 0")


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0 (a bad value stops the command before any work, naming the option)."""
    import math

    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {x}")
    return x


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {n}")
    return n


def shape_bth(text: str) -> tuple[int, int, int]:
    """argparse type: a shape written BxTxH (positive ints), e.g. 4x8192x16."""
    bad = argparse.ArgumentTypeError(f"expected BxTxH with positive ints, e.g. 4x8192x16, got {text!r}")
    parts = text.split("x")
    if len(parts) != 3:
        raise bad
    try:
        return tuple(positive_int(p) for p in parts)
    except argparse.ArgumentTypeError:
        raise bad from None


def run_info(device) -> dict:
    """What every benchmark JSON starts with: device, commit, date (UTC) and versions.

    The commit comes from ``$K3LAB_COMMIT`` when set (a GPU node may get the working tree without
    its ``.git``), else from ``git rev-parse HEAD``, else None.
    """
    import datetime
    import os
    import platform
    import subprocess

    import torch

    commit = os.environ.get("K3LAB_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                    cwd=os.path.dirname(__file__)).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = None
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "versions": versions}


def parse_device(p, text: str, cpu_hint: str = "run with --device cpu"):
    """``--device``'s value as a ``torch.device``, checked before any work.

    Args:
        p (argparse.ArgumentParser): the command's parser (its error names the option, exit status 2).
        text (str): "cpu", "cuda" or "cuda:N".
        cpu_hint (str): what the message for a CUDA device on a machine without one suggests.

    Raises:
        SystemExit: ``text`` is not "cpu", "cuda" or "cuda:N" (status 2, from ``p.error``; other torch devices
            such as "meta" or "cpu:1" too, which the benchmarks cannot run on), CUDA is asked for and absent,
            or N is not a visible card.
    """
    import torch  # noqa: PLC0415

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index is not None):
        p.error(f"argument --device: expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"no CUDA device: {cpu_hint}")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        p.error(f"argument --device: {text} names no card ({torch.cuda.device_count()} visible: "
                f"cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


def gpu_device(p, args, work: str = "the full shapes are GPU work"):
    """``args.device`` parsed (``parse_device``) for a benchmark whose real shapes are GPU work: on a CPU only
    with ``args.small`` (its tiny check of the script).

    Raises:
        SystemExit: as ``parse_device``; "cpu" without ``--small`` (the message says why: ``work``).
    """
    device = parse_device(p, args.device, cpu_hint="run with --device cpu --small to check the script")
    if device.type != "cuda" and not args.small:
        raise SystemExit(f"--device cpu needs --small ({work})")
    return device


def timed_flags(p, bench: str, rep: int, small: str = "tiny sizes; for checking the script on a CPU") -> None:
    """Add the flags a timed GPU benchmark with a CPU check shares to parser ``p``: --device (cuda, or cpu with
    --small), --small (help text ``small``), --rep (median of N timed runs; ``rep`` by default, 2 with --small) and
    --out (default ``data/results/<bench>_<card>.json``)."""
    p.add_argument("--device", default="cuda", help="cuda or cuda:N (the benchmark), or cpu (only with --small)")
    p.add_argument("--small", action="store_true", help=small)
    p.add_argument("--rep", type=positive_int, default=None,
                   help=f"timed repetitions per measurement (median; default {rep}, 2 with --small)")
    p.add_argument("--out", default=None, help="JSON path ('' = write nothing); default "
                   f"data/results/{bench}_<card>.json after the device, below the current folder (with --small: "
                   "nothing)")


def add_attnres_flags(p) -> None:
    """The trainer's Block AttnRes options as flags of a benchmark's parser (``--attnres-buffer``,
    ``--attnres-keep-inputs``), passed on to its ``TrainConfig``."""
    from k3lab.train.config import ATTNRES_BUFFERS  # noqa: PLC0415

    p.add_argument("--attnres-buffer", choices=ATTNRES_BUFFERS, default="float32",
                   help="Block AttnRes's buffer dtype (the trainer's --attnres-buffer)")
    p.add_argument("--attnres-keep-inputs", action="store_true",
                   help="keep the sublayers' inputs for backward (the trainer's --attnres-keep-inputs)")


def check_out(out: str | None) -> None:
    """Stop before any work when ``--out`` cannot be written: the JSON is written at the end of a run that may
    take minutes of GPU time. Missing parent folders are fine (they are created).

    Raises:
        SystemExit: status 2 (a usage error, as argparse's), the reason on stderr: ``out`` is an existing
            directory, or its nearest existing parent is a file or not writable.
    """
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from k3lab.files import blocked_parent  # noqa: PLC0415

    if not out:
        return
    why = "is a folder: give the JSON's file path" if os.path.isdir(out) else blocked_parent(out)
    if why:
        print(f"error: --out {out}: {why}", file=sys.stderr)
        raise SystemExit(2)


def write_result(bench: str, result: dict, out: str | None, small: bool = False) -> str | None:
    """Write ``result`` as JSON where ``out`` says ('' writes nothing; None: ``result_path`` of its device,
    except for a ``small`` check run, whose tiny shapes must never replace a committed result) and say so.

    Returns:
        the path written, or None.
    """
    from k3lab.files import write_json  # noqa: PLC0415

    path = (None if small else result_path(bench, result["device"])) if out is None else out
    if path:
        write_json(path, result, indent=1)
        print(f"wrote {path}")
    return path or None


def result_path(bench: str, device_name: str) -> str:
    """``data/results/<bench>_<card>.json``: one file per benchmark and device (card h100, h200, or
    the device name's last word in lower case)."""
    low = device_name.lower()
    card = next((c for c in ("h200", "h100", "b200", "a100") if c in low), low.split()[-1] if low else "cpu")
    return f"data/results/{bench}_{card}.json"


class RoutingReplay:
    """Pins every MoE router of a model to the experts of its first call, for comparisons that must not
    depend on near ties: at initialisation a router's biased scores nearly tie, and a difference in the last
    bit (bf16 rounding, CUDA's reordered float sums) sends some tokens to other experts, which moves gradients
    by tens of percent.

    Inside the ``with`` block, the first call of each ``k3lab.moe.Router`` records its topk_idx [N, K]; every
    later call (another run, a recompute replay in backward) routes to those experts with its own scores
    (weights renormalised as the router does). Hooks are removed on exit.

    Raises:
        ValueError: a later call with another number of tokens N than the recorded one.
    """

    def __init__(self, model):
        from k3lab.moe.router import Router  # noqa: PLC0415

        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.chosen: dict[int, object] = {}
        self._handles = []

    def _hook(self, router, args, routing):
        from k3lab.moe.router import Routing  # noqa: PLC0415

        idx = self.chosen.get(id(router))
        if idx is None:
            self.chosen[id(router)] = routing.topk_idx
            return None
        if idx.shape[0] != routing.scores.shape[0]:
            raise ValueError(f"RoutingReplay: recorded {idx.shape[0]} tokens, this call routes "
                             f"{routing.scores.shape[0]}")
        w = routing.scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True) if router.renormalize else w
        return Routing(routing.scores, idx, w * router.routed_scaling, routing.cutoff)

    def __enter__(self):
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
