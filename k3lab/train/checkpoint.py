"""Atomic ``torch.distributed.checkpoint`` saves of the whole training state, and finding the latest one.

Layout under the checkpoint folder::

    step_00000040/      a complete checkpoint (DCP files + .metadata), made by one rename
    .tmp-step_00000050/ a save in progress, or one killed mid-way: never read, removed by the next save
    .lock               held by the run writing here (``k3lab.train.loop``): a second run is refused

Every rank writes its shards into the temporary folder; after ``dcp.save`` returns on all ranks (its
coordinator has written ``.metadata``) and a barrier, rank 0 renames it to ``step_N``. A rename within one
file system is atomic, so ``latest_checkpoint`` sees either no ``step_N`` or a complete one. The folder
must be on storage all ranks see (one host here).

What is saved: the model (``get_model_state_dict``: FSDP / EP shards as DTensors, so experts are stored
under their global ids and a checkpoint loads at another (dp, ep) layout), the optimizer
(``get_optimizer_state_dict``: Muon momentum, AdamW moments and step counts), the router biases of
Quantile Balancing (buffers of the model state), the step and the loader position.

Pipeline stages (``k3lab.model.K3Stage``) keep the whole model's parameter names, so a rank's parts are
saved as one state dict, the union of theirs; the pseudo-queries every stage holds are one key, written
once (DCP keeps one copy of identical shards). The optimizer state is flattened to one key per parameter
(``flatten_optimizer_state_dict``), so it does not depend on how parameters were grouped on the saving
layout; the groups' parameter-name lists (``"names"``) are the loading layout's own.
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _parts(model, optimizer) -> tuple[list, list]:
    """(modules, optimizers) as lists: one module or a rank's pipeline parts, each with its optimizer."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    opts = None if optimizer is None else (list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
    if opts is not None and len(opts) != len(models):
        raise ValueError(f"one optimizer per model part: got {len(models)} parts and {len(opts)} optimizers")
    return models, opts


def _model_states(models) -> list[dict]:
    return [get_model_state_dict(m) for m in models]


def _optim_states(models, opts) -> list[dict]:
    return [get_optimizer_state_dict(m, o, options=_FLAT) for m, o in zip(models, opts)]


def _is_names(key: str) -> bool:
    return key.startswith("param_groups.") and key.endswith(".names")


def _union(states: list[dict]) -> dict:
    out = {}
    for sd in states:
        for k, v in sd.items():
            out.setdefault(k, v)
    return out


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """``root/step_00000040`` for step 40."""
    return Path(root) / f"step_{step:08d}"


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (None if there is none or no ``root``).

    Complete means a ``step_NNNNNNNN`` folder holding ``.metadata``; temporary folders and anything else
    are ignored.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").is_file()]
    return max(found)[1] if found else None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_checkpoint(root: str | os.PathLike, step: int, model, optimizer, train_state: dict, keep: int = 0) -> Path:
    """Save model, optimizer and ``train_state`` (picklable values, the same on every rank) as ``step_N``.

    Collective: every rank of the default group calls it with the same ``root`` and ``step``.

    Args:
        model (nn.Module | list[nn.Module]): the model, or this rank's pipeline parts.
        optimizer (Optimizer | list[Optimizer]): its optimizer, or one per part.
        keep (int): after the new checkpoint is complete, keep only the newest ``keep`` complete ones
            (0: keep all). An old one is first renamed to a temporary name, so a kill while it is being
            deleted leaves nothing ``latest_checkpoint`` would pick.

    Returns:
        Path of the complete checkpoint.

    Raises:
        OSError: the folder cannot be written.
        RuntimeError: DCP failed otherwise (its message, with the rank that met it).
        ValueError: not one optimizer per part.
    """
    models, opts = _parts(model, optimizer)
    root = Path(root)
    tmp, final = root / f".tmp-step_{step:08d}", step_dir(root, step)
    if _is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    state = {"model": _union(_model_states(models)), "optim": _union(_optim_states(models, opts)),
             "train": dict(train_state)}
    _dcp(dcp.save, state, tmp, "saving")
    _barrier()
    if _is_rank0():
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        # The rename is durable only once the parent directory's entry is on disk.
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if keep:
            _prune(root, keep)
    _barrier()
    return final


def _dcp(fn, state: dict, path: Path, doing: str) -> None:
    """``fn`` (``dcp.save`` or ``dcp.load``) of ``state`` at ``path``. DCP reports a rank's failure as a
    ``CheckpointException``, a BaseException that ``except Exception`` does not catch, holding every
    rank's traceback: it becomes the first failed rank's own error, an OSError kept an OSError, the rest a
    RuntimeError."""
    try:
        # One process without a group (e.g. sampling from a trained run) reads the whole checkpoint itself;
        # DCP warns that it assumes exactly that.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            fn(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except CheckpointException as e:
        rank, (exc, _) = min(e.failures.items(), key=lambda kv: kv[0])
        kind = OSError if isinstance(exc, OSError) else RuntimeError
        raise kind(f"{doing} checkpoint {path} failed on rank {rank}: {type(exc).__name__}: {exc}") from e


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints under ``root`` (rank 0, after a save)."""
    found = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").is_file())
    for n, old in found[:-keep]:
        # Out of latest_checkpoint's sight first; the next save removes what a kill leaves of it.
        gone = root / f".tmp-step_{n:08d}.removing"
        os.replace(old, gone)
        shutil.rmtree(gone, ignore_errors=True)


def _check_complete(path: Path) -> None:
    """Read ``path``'s ``.metadata`` once before DCP does: DCP answers an unreadable one by logging each of
    its fallbacks' tracebacks on the root logger before its own error.

    Raises:
        FileNotFoundError: no ``.metadata``.
        ValueError: a ``.metadata`` that does not unpickle (truncated or damaged bytes).
    """
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata)")
    try:
        dcp.FileSystemReader(str(path)).read_metadata()
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - unpickling damaged bytes raises whatever the bytes lead to
        raise ValueError(f"{path}/.metadata is damaged ({type(e).__name__}: {e})") from e


def read_train_state(path: str | os.PathLike, train_state: dict) -> dict:
    """The train state saved in ``path`` (the keys of ``train_state``, their values as placeholders), read
    without the model or optimizer: what a resume checks before building its model into the checkpoint.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
        ValueError: its ``.metadata`` is damaged.
        RuntimeError: a key is missing (DCP's message, with the rank that met it).
    """
    path = Path(path)
    _check_complete(path)
    state = {"train": dict(train_state)}
    _dcp(dcp.load, state, path, "reading the train state of")
    return state["train"]


def load_checkpoint(path: str | os.PathLike, model, optimizer, train_state: dict) -> dict:
    """Load ``path`` into ``model`` (and ``optimizer``) in place; returns the saved train state.

    ``train_state`` gives the keys (and placeholder values) to read. Collective like ``save_checkpoint``;
    a model built and sharded for any layout reads a checkpoint of any other (DCP reshards), pipeline
    stages included. With ``optimizer`` None only the model is read (e.g. one process sampling text from a
    trained run).

    Args:
        model (nn.Module | list[nn.Module]), optimizer (Optimizer | list[Optimizer] | None): as
            ``save_checkpoint``'s.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
        RuntimeError: the checkpoint lacks a key the model or optimizer has, or holds a tensor of another
            shape (another config): DCP's message, with the rank that met it.
        ValueError: not one optimizer per part, or a damaged ``.metadata``.
    """
    models, opts = _parts(model, optimizer)
    path = Path(path)
    _check_complete(path)
    model_sds = _model_states(models)
    state = {"model": _union(model_sds), "train": dict(train_state)}
    if opts is not None:
        optim_sds = _optim_states(models, opts)
        # Each layout groups parameters its own way: the groups' name lists are not read back.
        state["optim"] = {k: v for k, v in _union(optim_sds).items() if not _is_names(k)}
    _dcp(dcp.load, state, path, "loading")
    for m, sd in zip(models, model_sds):
        set_model_state_dict(m, {k: state["model"][k] for k in sd})
    if opts is not None:
        for m, o, sd in zip(models, opts, optim_sds):
            own = {k: v if _is_names(k) else state["optim"][k] for k, v in sd.items()}
            set_optimizer_state_dict(m, o, own, options=_FLAT)
    return state["train"]
