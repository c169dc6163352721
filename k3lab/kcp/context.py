"""`KCPContext`: the process group, the rank layout and the document layout of one KCP call.

Nothing here is global: every KCP function takes a context, built once per batch by
``make_context`` (the group outlives batches; the document layout does not).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from k3lab.kda.checks import check_cu_seqlens


@dataclass
class CommLog:
    """Bytes moved by KCP's collectives, one record per call, counted from the tensor sizes.

    A record is ``(name, nbytes)`` with ``nbytes`` the size of the full collective buffer: the
    gathered output of an all-gather, the input of a reduce-scatter (both ``R x`` the piece a rank
    contributes).
    """

    records: list[tuple[str, int]] = field(default_factory=list)

    def add(self, name: str, nbytes: int) -> None:
        self.records.append((name, int(nbytes)))

    def total(self, prefix: str = "") -> int:
        """Sum of the bytes of records whose name starts with ``prefix``."""
        return sum(n for name, n in self.records if name.startswith(prefix))

    def clear(self) -> None:
        self.records.clear()


@dataclass(frozen=True)
class KCPContext:
    """Where this rank sits in the sequence and in the process group.

    The global sequence of T tokens is packed documents (``seq_bounds``, the global cu_seqlens) and
    is split into R equal contiguous rank segments (``rank_bounds``); rank r holds tokens
    [rank_bounds[r], rank_bounds[r+1]). A rank's local tokens are "pieces": the parts of documents
    that fall inside its segment.

    Attributes:
        group (ProcessGroup | None): the context-parallel group; None for one process.
        rank (int): this process's rank in ``group``.
        world_size (int): R.
        seq_bounds (tuple[int, ...]): global document offsets, N+1 entries, 0 ... T.
        rank_bounds (tuple[int, ...]): rank offsets, R+1 entries, 0 ... T.
        comm (CommLog): bytes moved by this context's collectives.
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    seq_bounds: tuple[int, ...]
    rank_bounds: tuple[int, ...]
    comm: CommLog = field(default_factory=CommLog, compare=False)

    @property
    def T(self) -> int:
        return self.rank_bounds[-1]

    @property
    def N(self) -> int:
        return len(self.seq_bounds) - 1

    @property
    def start(self) -> int:
        return self.rank_bounds[self.rank]

    @property
    def stop(self) -> int:
        return self.rank_bounds[self.rank + 1]

    @property
    def T_local(self) -> int:
        return self.stop - self.start

    def _check_index(self, name: str, i, stop: int) -> int:
        if not (_is_int(i) and 0 <= i < stop):
            raise ValueError(f"{name} must be an int in [0, {stop}), got {i!r}")
        return int(i)

    def doc_of(self, t: int) -> int:
        """Index of the document holding global token t.

        Raises:
            ValueError: t not an int in [0, T).
        """
        t = self._check_index("t", t, self.seq_bounds[-1])
        return next(n for n in range(self.N) if self.seq_bounds[n] <= t < self.seq_bounds[n + 1])

    def rank_of(self, t: int) -> int:
        """The rank holding global token t.

        Raises:
            ValueError: t not an int in [0, T).
        """
        t = self._check_index("t", t, self.rank_bounds[-1])
        return next(r for r in range(self.world_size) if self.rank_bounds[r] <= t < self.rank_bounds[r + 1])

    def pieces(self, rank: int | None = None) -> list[tuple[int, int, int]]:
        """``(doc, global start, global stop)`` of each piece of ``rank`` (default: this rank).

        Raises:
            ValueError: rank not None or an int in [0, world_size).
        """
        r = self.rank if rank is None else self._check_index("rank", rank, self.world_size)
        lo, hi = self.rank_bounds[r], self.rank_bounds[r + 1]
        out = []
        for n in range(self.N):
            a, b = max(self.seq_bounds[n], lo), min(self.seq_bounds[n + 1], hi)
            if a < b:
                out.append((n, a, b))
        return out

    @cached_property
    def local_cu_seqlens(self) -> list[int]:
        """Offsets of this rank's pieces relative to its first token, N_local+1 entries."""
        return [0] + [b - self.start for _, _, b in self.pieces()]

    @cached_property
    def local_docs(self) -> list[int]:
        """Global document index of each local piece."""
        return [n for n, _, _ in self.pieces()]

    @cached_property
    def resets(self) -> tuple[bool, ...]:
        """Per rank: does its last piece start its document (so its map composes with nothing earlier)?"""
        return tuple(self.pieces(r)[-1][1] == self.seq_bounds[self.pieces(r)[-1][0]] for r in range(self.world_size))

    @property
    def first_continues(self) -> bool:
        """Does this rank's first piece continue a document begun on an earlier rank?"""
        doc = self.local_docs[0]
        return self.seq_bounds[doc] < self.start

    @property
    def fold_from(self) -> int:
        """The rank where this rank's first document starts (== rank when it starts here)."""
        return self.rank_of(self.seq_bounds[self.local_docs[0]])

    @cached_property
    def ends_here(self) -> list[bool]:
        """Per local piece: does its document end on this rank?"""
        return [b == self.seq_bounds[n + 1] for n, _, b in self.pieces()]

    @property
    def last_continues(self) -> bool:
        """Does this rank's last piece continue its document on the next rank?"""
        return not self.ends_here[-1]

    @property
    def end_rank(self) -> int:
        """The rank where this rank's last document ends (== rank when it ends here)."""
        return self.rank_of(self.seq_bounds[self.local_docs[-1] + 1] - 1)

    @cached_property
    def first_ends(self) -> tuple[bool, ...]:
        """Per rank: does its first piece end its document there? (The backward fold's ``resets``:
        such a rank's gradient composes with nothing later.)"""
        out = []
        for r in range(self.world_size):
            n, _, b = self.pieces(r)[0]
            out.append(b == self.seq_bounds[n + 1])
        return tuple(out)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_context(ctx) -> None:
    """Raise ValueError unless ``ctx`` is a KCPContext that can run collectives: one process, or a
    group whose size and rank are the context's (a context built from ``rank``/``world_size``
    without a group describes a layout only)."""
    if not isinstance(ctx, KCPContext):
        raise ValueError(f"ctx must be a KCPContext (k3lab.kcp.make_context), got {type(ctx).__name__}")
    if ctx.world_size == 1:
        return
    if ctx.group is None:
        raise ValueError(f"ctx describes a layout only (world_size={ctx.world_size} without a process group):"
                         " pass the group to make_context")
    if (dist.get_world_size(ctx.group), dist.get_rank(ctx.group)) != (ctx.world_size, ctx.rank):
        raise ValueError(f"ctx describes a layout only: rank {ctx.rank} of {ctx.world_size}, but its group has"
                         f" rank {dist.get_rank(ctx.group)} of {dist.get_world_size(ctx.group)}")


def make_context(
    T: int,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> KCPContext:
    """Build the context for one batch of T global tokens split evenly over the group.

    Args:
        T (int): global number of tokens (a multiple of the group size).
        cu_seqlens (Tensor | list[int] | None): global document offsets [N+1]; None: one document.
            Every rank of the group must pass the same T and offsets: they are not compared across
            ranks (a collective per batch), and ranks that disagree compute states for different
            documents without an error.
        group (ProcessGroup | None): the context-parallel group. None with neither ``rank`` nor
            ``world_size`` given: the default group when torch.distributed is initialised, else one
            process. ``rank``/``world_size`` without a group describe a layout only (no collectives
            can run), which is how the notebook draws layouts.
        rank, world_size (int | None): override the group's values (layout only).

    Returns:
        KCPContext.

    Raises:
        ValueError: T not an int that is a positive multiple of the world size, bad ``cu_seqlens`` (see
            ``check_cu_seqlens``), world_size not an int >= 1, rank not an int in [0, world_size).
    """
    if group is None and rank is None and world_size is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if world_size is None:
        world_size = dist.get_world_size(group) if group is not None else 1
    if rank is None:
        rank = dist.get_rank(group) if group is not None else 0
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    if not _is_int(T) or T <= 0 or T % world_size != 0:
        raise ValueError(f"T must be an int, a positive multiple of the world size {world_size}, got T={T!r}")
    if cu_seqlens is None:
        bounds = (0, T)
    else:
        cu = torch.as_tensor(cu_seqlens)
        check_cu_seqlens(cu, T)
        bounds = tuple(int(x) for x in cu.tolist())
    step = T // world_size
    return KCPContext(group, rank, world_size, bounds, tuple(range(0, T + 1, step)))
