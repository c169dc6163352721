"""Atomic ``torch.distributed.checkpoint`` saves of the whole training state, and finding the latest one.

Layout under the checkpoint folder::

    step_00000040/      a complete checkpoint (DCP files + .metadata), made by one rename
    .tmp-step_00000050/ a save in progress, or one killed mid-way: never read, removed by the next save

Every rank writes its shards into the temporary folder; after ``dcp.save`` returns on all ranks (its
coordinator has written ``.metadata``) and a barrier, rank 0 renames it to ``step_N``. A rename within one
file system is atomic, so ``latest_checkpoint`` sees either no ``step_N`` or a complete one. The folder
must be on storage all ranks see (one host here).

What is saved: the model (``get_model_state_dict``: FSDP / EP shards as DTensors, so experts are stored
under their global ids and a checkpoint loads at another (dp, ep) layout), the optimizer
(``get_optimizer_state_dict``: Muon momentum, AdamW moments and step counts), the router biases of
Quantile Balancing (buffers of the model state), the step and the loader position.
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

_STEP_DIR = re.compile(r"^step_(\d{8})$")


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


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    train_state: dict) -> Path:
    """Save model, optimizer and ``train_state`` (picklable values, the same on every rank) as ``step_N``.

    Collective: every rank of the default group calls it with the same ``root`` and ``step``.

    Returns:
        Path of the complete checkpoint.

    Raises:
        OSError: the folder cannot be written.
    """
    root = Path(root)
    tmp, final = root / f".tmp-step_{step:08d}", step_dir(root, step)
    if _is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
             "train": dict(train_state)}
    dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
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
    _barrier()
    return final


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    train_state: dict) -> dict:
    """Load ``path`` into ``model`` (and ``optimizer``) in place; returns the saved train state.

    ``train_state`` gives the keys (and placeholder values) to read. Collective like ``save_checkpoint``;
    a model built and sharded for any layout reads a checkpoint of any other (DCP reshards). With
    ``optimizer`` None only the model is read (e.g. one process sampling text from a trained run).

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
        RuntimeError: the checkpoint lacks a key the model or optimizer has (DCP's message).
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata)")
    state = {"model": get_model_state_dict(model), "train": dict(train_state)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    # One process without a group (e.g. sampling from a trained run) reads the whole checkpoint itself;
    # DCP warns that it assumes exactly that.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return state["train"]
