"""Distributed plumbing shared by KCP, MoonEP and the trainer: starting ranks, the device mesh and the few
collectives k3lab wraps.

- ``launch(fn, R, *args)``: R fresh processes, each in a gloo (CPU) or NCCL (one GPU per rank) group with
  a timeout; returns ``[fn(rank, R, group, *args) for each rank]``. The function must live in an
  importable module (a package ``workers.py``): spawn cannot pickle a notebook cell's function.
- ``make_mesh(pp=, dp=, cp=, ep=)``: one ``DeviceMesh`` whose named axes give every group
  (``mesh["ep"].get_group()``), so groups are passed explicitly, never kept in globals.
- ``all_gather_stacked`` / ``reduce_scatter_sum``: the all-gather of one fixed-size piece per rank and its
  transpose, on flat buffers (gloo wants them so).

Dimension letters: R ranks in a group, E experts, S tokens per rank, K top-k, d width.
"""
from __future__ import annotations

import datetime
import math
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Mesh axes, outermost first: pipeline stages are farthest apart, expert-parallel ranks nearest (the
# all-to-all of every MoE layer stays inside a node when ep fits in one).
AXES = ("pp", "dp", "cp", "ep")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, outdir, backend, pg_timeout_s, args):
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        result = fn(rank, world_size, dist.group.WORLD, *args)
        path = os.path.join(outdir, f"rank{rank}.pt")
        torch.save(result, path + ".part")
        os.replace(path + ".part", path)
        # No rank tears its group down while another still talks to it (rank 0 hosts the store).
        dist.barrier()
    except BaseException:  # SystemExit too: a worker's sys.exit left no result and no record
        # The rank that fails first is the cause; others then fail in a collective ("Connection closed by
        # peer"), and spawn reports whichever exit it notices first. The time lets launch name the first.
        # Written whole or not at all: launch reads the records while it stops the other ranks.
        path = os.path.join(outdir, f"rank{rank}.err")
        with open(path + ".part", "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        os.replace(path + ".part", path)
        raise
    finally:
        dist.destroy_process_group()
    # Skip interpreter finalisation: gloo's worker threads can abort the process there ("terminate called
    # without an active exception") after the result is safely written, failing a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn: Callable, world_size: int, *args, timeout_s: float = 180.0, backend: str = "gloo",
           pg_timeout_s: float = 60.0, env: dict[str, str] | None = None) -> list:
    """Run ``fn(rank, world_size, group, *args)`` on ``world_size`` fresh processes; their results in rank order.

    Each process starts with ``env`` added to this process's environment (set before it imports anything,
    ``fn``'s module included), sets one intra-op thread, takes GPU ``rank`` when
    ``backend`` is "nccl", and joins a ``backend`` group over TCP on localhost whose collectives fail after
    ``pg_timeout_s``; ``group`` is that world group. Results travel back through ``torch.save`` files,
    so they must be picklable (tensors, dicts, lists, dataclasses).

    Args:
        fn (Callable): a module-level function (spawn pickles it by name).
        world_size (int): R >= 1.
        timeout_s (float): the whole run is killed after this many seconds.
        backend (str): "gloo" (CPU) or "nccl".
        env (dict[str, str] | None): environment variables every rank starts with.
        pg_timeout_s (float): > 0.

    The calling script must guard its own work with ``if __name__ == "__main__":``: spawn starts each rank by
    importing the script's main module again.

    Raises:
        ValueError: world_size not an int >= 1, a timeout not a finite number > 0, a backend other than "gloo"
            or "nccl" (or "nccl" without a CUDA device).
        TimeoutError: not all ranks finished within ``timeout_s`` (they are killed).
        torch.multiprocessing.ProcessRaisedException: a rank raised: the first rank to fail, with its traceback
            (the others usually fail after it, in a collective it left).
        torch.multiprocessing.ProcessExitedException: a rank ended without a traceback (a signal such as
            SIGKILL or SIGSEGV, or os._exit): that rank, its exit code or signal, and the first error
            recorded after it.
        RuntimeError: a rank exited without a result and without an error (``sys.exit`` in ``fn``).
    """
    if not (isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    for name, v in (("timeout_s", timeout_s), ("pg_timeout_s", pg_timeout_s)):
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {v!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' on the CPU")
    port = _free_port()
    with tempfile.TemporaryDirectory() as outdir:
        # Spawned ranks inherit this environment: set here, env is in place before a rank unpickles fn (whose
        # imports may read it, as Triton reads TRITON_INTERPRET).
        with mock.patch.dict(os.environ, {k: str(v) for k, v in (env or {}).items()}):
            procs = mp.start_processes(
                _entry, args=(fn, world_size, port, outdir, backend, pg_timeout_s, args),
                nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not procs.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for p in procs.processes:
                        if p.is_alive():
                            p.kill()
                    raise TimeoutError(f"{world_size} ranks running {getattr(fn, '__name__', fn)} did not finish "
                                       f"within {timeout_s} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            silent = _silent_exits(procs.processes, outdir, e.error_index)
            first = _first_failure(outdir)
            if silent:
                # A rank killed by a signal (or leaving through os._exit) records nothing, and the ranks waiting
                # on it then record "Connection closed by peer": the silent exit is the cause.
                rank, code = silent[0]
                sig = (signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}") \
                    if code < 0 else None
                how = f"was killed by {sig}" if sig else f"exited with code {code}"
                then = f"\nThe first error recorded after it (rank {first[0]}):\n{first[1]}" if first else ""
                raise mp.ProcessExitedException(
                    f"process {rank} {how} without a traceback (killed by a signal, or os._exit){then}", rank,
                    procs.processes[rank].pid, code, sig) from e
            # An exit code (a SystemExit) says less than a recorded traceback: report that one.
            if first is None or (first[0] == e.error_index and isinstance(e, mp.ProcessRaisedException)):
                raise
            rank, trace = first
            after = "" if rank == e.error_index else f"; process {e.error_index} failed after it"
            raise mp.ProcessRaisedException(
                f"\n\n-- Process {rank} terminated with the following error (the first rank to fail{after}):"
                f"\n{trace}", rank, procs.processes[rank].pid) from e
        missing = [r for r in range(world_size) if not os.path.exists(os.path.join(outdir, f"rank{r}.pt"))]
        if missing:
            first = _first_failure(outdir)
            raise RuntimeError(f"ranks {missing} of {world_size} running {getattr(fn, '__name__', fn)} exited without a "
                               f"result" + (f"; rank {first[0]} first:\n{first[1]}" if first else
                                            " and without an error (sys.exit in the worker?)"))
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _silent_exits(processes, outdir: str, detected: int) -> list[tuple[int, int]]:
    """(rank, exit code; -N for signal N) of the ranks that ended with neither a result nor a recorded error,
    ``detected`` (the exit spawn noticed first) before the others. Other ranks ended by SIGTERM are left out:
    spawn stops the survivors with it once one rank has failed."""
    out = []
    for rank, p in enumerate(processes):
        p.join(timeout=5.0)  # spawn has stopped the others: their records and exit codes are final
        code = p.exitcode
        recorded = any(os.path.exists(os.path.join(outdir, f"rank{rank}{ext}")) for ext in (".pt", ".err"))
        if code is None or recorded or (code == -signal.SIGTERM and rank != detected):
            continue
        out.append((rank, code))
    return sorted(out, key=lambda x: x[0] != detected)


def _first_failure(outdir: str) -> tuple[int, str] | None:
    """(rank, traceback) of the rank whose ``_entry`` recorded the earliest failure in ``outdir``, or None."""
    found = []
    for name in os.listdir(outdir):
        if name.startswith("rank") and name.endswith(".err"):
            with open(os.path.join(outdir, name)) as f:
                stamp, _, trace = f.read().partition("\n")
            found.append((float(stamp), int(name[4:-4]), trace))
    return min(found)[1:] if found else None


def make_mesh(*, pp: int = 1, dp: int = 1, cp: int = 1, ep: int = 1, device_type: str = "cpu"):
    """The world as a ``DeviceMesh`` with named axes ("pp", "dp", "cp", "ep"), outermost first.

    Every axis is present, size 1 included, so code can always ask ``mesh["ep"].get_group()``. Rank
    ``r`` sits at ``(pp, dp, cp, ep)`` coordinates in row-major order: ep ranks are consecutive.

    Args:
        pp, dp, cp, ep (int): axis sizes >= 1 whose product is the world size.
        device_type (str): "cpu" (gloo) or "cuda".

    Returns:
        torch.distributed.device_mesh.DeviceMesh: shape (pp, dp, cp, ep), ``mesh_dim_names == AXES``.

    Raises:
        ValueError: a size is not an int >= 1, device_type not "cpu" or "cuda", or the product differs from
            the initialised world size.
        RuntimeError: the default process group is not initialised.
    """
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    sizes = dict(pp=pp, dp=dp, cp=cp, ep=ep)
    bad = {k: v for k, v in sizes.items() if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1)}
    if bad:
        raise ValueError(f"mesh axis sizes must be ints >= 1, got {bad}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs an initialised default process group (see k3lab.dist.launch)")
    world = dist.get_world_size()
    shape = tuple(sizes[a] for a in AXES)
    if pp * dp * cp * ep != world:
        raise ValueError(f"mesh {dict(zip(AXES, shape))} has {pp * dp * cp * ep} ranks, the world has {world}")
    return init_device_mesh(device_type, shape, mesh_dim_names=AXES)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: in-place ops on it change the DTensor); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_gather_stacked(x: torch.Tensor, world_size: int, group, async_op: bool = False):
    """[*] -> [R, *]: every rank's ``x`` (same shape and dtype on all ranks), stacked in rank order.

    Shapes are not exchanged (that would cost a second collective on every call): ranks whose ``x``
    differ in size abort in gloo (SIGABRT) and may hang or read stale memory in NCCL. A caller that
    cannot vouch for equal shapes exchanges them first, as ``moonep_experts(check_ids=True)`` does.

    With ``async_op``: (the [R, *] buffer, the collective's handle), the result valid only after
    ``handle.wait()``, so work that does not read it can be issued first.
    """
    # torch >= 2.13 names it all_gather_single; 2.11 (the GPU image) has only all_gather_into_tensor.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = x.new_empty(world_size * x.numel())
    work = fn(out, x.contiguous().view(-1), group=group, async_op=async_op)
    out = out.view(world_size, *x.shape)
    return (out, work) if async_op else out


def reduce_scatter_sum(x: torch.Tensor, group) -> torch.Tensor:
    """[R, *] -> [*]: rank j gets the sum over ranks of ``x[j]`` (the transpose of ``all_gather_stacked``)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out = x.new_empty(x[0].numel())
    fn(out, x.contiguous().view(-1), op=dist.ReduceOp.SUM, group=group)
    return out.view(x.shape[1:])


def all_to_all_equal(x: torch.Tensor, group) -> torch.Tensor:
    """[R, *] -> [R, *]: block j of ``x`` goes to rank j; block i of the result came from rank i.

    Equal split sizes, so no sizes are exchanged and nothing is read on the host. Its own transpose:
    the backward of an all-to-all is the same all-to-all of the gradients.
    """
    out = torch.empty_like(x)
    dist.all_to_all_single(out.view(-1), x.contiguous().view(-1), group=group)
    return out


def all_to_all_rows(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group) -> torch.Tensor:
    """[sum(in_splits), *] -> [sum(out_splits), *]: rows in_splits[j] go to rank j, out_splits[i] come from i.

    Uneven splits are host integers: the caller has already synchronised to know them.
    """
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def mesh_worker(rank: int, world_size: int, group, sizes: dict[str, int]) -> dict:
    """What ``make_mesh(**sizes)`` and the wrapped collectives give on this rank (for tests and the book).

    Returns {"coords": this rank's coordinate per axis, "groups": the world ranks of this rank's group per
    axis, "gathered": ``all_gather_stacked`` of [rank, rank] over the ep group, "scattered":
    ``reduce_scatter_sum`` over the world of a [R, 2] tensor with entry (j, :) = rank * R + j,
    "a2a_equal": ``all_to_all_equal`` over the world of x[j] = 100 rank + j, "a2a_rows": ``all_to_all_rows``
    over the world where rank i sends j + 1 rows of value 100 i + j to rank j}.
    """
    mesh = make_mesh(**sizes)
    coords = dict(zip(AXES, mesh.get_coordinate()))
    groups = {a: dist.get_process_group_ranks(mesh[a].get_group()) for a in AXES}
    ep_group = mesh["ep"].get_group()
    gathered = all_gather_stacked(torch.tensor([rank, rank]), sizes.get("ep", 1), ep_group)
    R = world_size
    scattered = reduce_scatter_sum(torch.arange(R * 2).view(R, 2) // 2 + rank * R, group)
    a2a_equal = all_to_all_equal(100 * rank + torch.arange(R), group)
    rows = torch.cat([torch.full((j + 1, 3), 100.0 * rank + j) for j in range(R)])
    a2a_rows = all_to_all_rows(rows, [j + 1 for j in range(R)], [rank + 1] * R, group)
    return dict(coords=coords, groups=groups, gathered=gathered, scattered=scattered, a2a_equal=a2a_equal,
                a2a_rows=a2a_rows)


def environ_worker(rank: int, world_size: int, group, names: list[str]) -> dict:
    """{name: this rank's ``os.environ.get(name)``} for each of ``names`` (for tests of ``launch``'s env)."""
    return {n: os.environ.get(n) for n in names}


def exit_worker(rank: int, world_size: int, group, code) -> None:
    """``sys.exit(code)`` on every rank (for tests: a worker that leaves without a result)."""
    sys.exit(code)


def signal_worker(rank: int, world_size: int, group, who: int, sig: int) -> int:
    """Rank ``who`` sends itself ``sig`` while the others wait for it in a barrier (for tests: a rank that
    dies without a traceback)."""
    if rank == who:
        os.kill(os.getpid(), sig)
        time.sleep(30)
    dist.barrier(group=group)
    return rank
