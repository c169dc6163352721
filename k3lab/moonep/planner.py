"""The MoonEP planner: from the router's token counts, a plan in which every EP rank processes exactly S*K
token-expert pairs and hosts at most E/R redundant experts (K3 report, App. E, Theorems 1-2).

E experts over R ranks, L = E/R homed on each: expert e lives on rank e // L. Each rank routes S tokens
to K experts, so the R ranks together hold R*S*K pairs and the balanced load is C = S*K per rank.

The constructive fill (App. E): while some rank is under-loaded, take the most over-loaded rank d (the
donor) and the least-loaded rank u (the receiver), and move exactly C - load(u) of d's pairs to u, the
donor's experts with the most pairs left first (so few distinct experts move). A receiver is filled
exactly, once, and never donates; so at most R-1 fills, and every rank's remote pairs come from one
home rank: at most L = E/R redundant experts on any rank, and never two replicas of one expert on one
rank. The bound is nearly tight: with rank 0's experts idle and the others even, some rank needs
ceil(E(R-1)/R^2) of them.

Every step is a fixed number of tensor ops on the counts' device (R-1 fill steps, each a no-op once the
load is even): no ``.item()``, no ``.tolist()``, no data-dependent shapes, so it can run inside a CUDA
graph. On a GPU the same fill, and the plan's derived fields, run as one Triton kernel launch
(``k3lab.kernels.moonep``, the default where its tile fits) instead of about 37 launches a fill step, and
``layout``'s per-pair and per-row steps as one more. ``naive.plan_reference`` is the same fill in
plain Python, the reference both are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Plan:
    """Where every expert's pairs are processed. L = E/R, C = S*K.

    Attributes:
        keep (Tensor): [E] int64, pairs of expert e processed on its home rank e // L.
        give (Tensor): [R, L] int64, pairs of expert ``donor[v]*L + j`` processed on rank v
            (zero when ``donor[v] == v``).
        donor (Tensor): [R] int64, the home rank whose experts fill rank v's redundant slots (v itself
            when v receives nothing).
        assign (Tensor): [E, R] int64, pairs of expert e processed on rank v; rows sum to the expert's
            global load, columns to C.
        slot_experts (Tensor): [R, 2L] int64, the expert of each slot of rank v's buffer: its L local
            experts ``v*L + j``, then its L redundant slots ``donor[v]*L + j``.
        slot_counts (Tensor): [R, 2L] int64, rows of each slot (``cat(keep.view(R, L), give)``).
        offsets (Tensor): [R, 2L] int32, cumulative ends of the slots (cu_seqlens without the leading 0,
            ``torch.nn.functional.grouped_mm``'s ``offs``); ``offsets[:, -1] == C``.
        S, K (int): tokens per rank, top-k; C = S*K rows in every rank's buffer.
    """

    keep: torch.Tensor
    give: torch.Tensor
    donor: torch.Tensor
    assign: torch.Tensor
    slot_experts: torch.Tensor
    slot_counts: torch.Tensor
    offsets: torch.Tensor
    S: int
    K: int

    @property
    def R(self) -> int:
        return self.give.shape[0]

    @property
    def E(self) -> int:
        return self.keep.shape[0]

    @property
    def capacity(self) -> int:
        return self.S * self.K

    def redundant(self) -> torch.Tensor:
        """[R] int64: redundant experts each rank actually hosts (redundant slots with pairs)."""
        return (self.give > 0).sum(1)


def check_counts(counts: torch.Tensor, S: int, K: int) -> tuple[int, int, int]:
    """Shape and dtype checks shared by the planners (values are not read: that would sync).

    Returns:
        (R, E, L).

    Raises:
        ValueError: ``counts`` is not a [R, E] integer tensor with E a multiple of R, or S, K are not
            positive ints.
    """
    if not isinstance(counts, torch.Tensor) or counts.ndim != 2 or counts.dtype not in (torch.int32, torch.int64):
        got = f"{tuple(counts.shape)} {counts.dtype}" if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"counts must be a [R, E] int64 (or int32) tensor, got {got}")
    for name, v in (("S", S), ("K", K)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    R, E = counts.shape
    if R == 0 or E == 0 or E % R:
        raise ValueError(f"E = {E} experts must be a positive multiple of R = {R} ranks (E/R homed on each)")
    return R, E, E // R


def finish_plan(keep: torch.Tensor, give: torch.Tensor, donor: torch.Tensor, S: int, K: int) -> Plan:
    """The derived fields of a ``Plan`` from its (keep, give, donor); shared with the reference."""
    R, L = give.shape
    dev = give.device
    ranks = torch.arange(R, device=dev)
    local = ranks[:, None] * L + torch.arange(L, device=dev)
    slot_experts = torch.cat([local, donor[:, None] * L + torch.arange(L, device=dev)], 1)
    slot_counts = torch.cat([keep.view(R, L), give], 1)
    # assign[e, v]: the home column from keep, the redundant columns from give; a rank with no donor adds
    # zeros onto its own experts' home column.
    assign = torch.zeros(R * L, R, dtype=torch.int64, device=dev)
    assign.index_put_((slot_experts.reshape(-1), ranks.repeat_interleave(2 * L)), slot_counts.reshape(-1),
                      accumulate=True)
    offsets = slot_counts.cumsum(1).to(torch.int32)
    return Plan(keep=keep, give=give, donor=donor, assign=assign, slot_experts=slot_experts,
                slot_counts=slot_counts, offsets=offsets, S=S, K=K)


BACKENDS = ("torch", "triton")


def plan(counts: torch.Tensor, S: int, K: int, backend: str | None = None) -> Plan:
    """The MoonEP plan for one micro-batch (K3 report, App. E, constructive proof of Theorem 1).

    Two backends run the same fill and give the same plan, field for field: ``"torch"``, R - 1 steps of
    small tensor ops on ``counts``' device (any R, E), and ``"triton"``, the whole plan in one kernel
    launch (``k3lab.kernels.moonep``), for CUDA counts (or CPU counts under TRITON_INTERPRET=1) whose
    tile fits one program: next_pow2(L) <= 128 and next_pow2(R) * next_pow2(L) <= 2048, L = E/R (every
    E <= 1024 with L <= 128, e.g. E = 896 from R = 7 on; at most E = 2048).

    Args:
        counts (Tensor): [R, E] int64 (or int32), ``counts[r, e]`` = pairs on rank r routed to expert e;
            every entry >= 0 and every row summing to S*K (not checked: that would read the counts back to the
            host; other counts give a meaningless plan, ``plan_reference`` checks them).
        S (int): tokens per rank.
        K (int): experts per token.
        backend (str | None): ``"torch"``, ``"triton"``, or None: ``"triton"`` for CUDA counts within the
            kernel's tile limits, ``"torch"`` otherwise.

    Returns:
        Plan: every rank processes exactly S*K pairs, at most E/R of them redundant experts, all from one
        home rank; tensors on ``counts``' device. No host synchronisation on either backend.

    Raises:
        ValueError: ``counts`` is not [R, E] integer with E a multiple of R, or S, K not positive ints; an
            unknown backend; ``backend="triton"`` for R, E outside the tile limits, or for CPU counts
            without TRITON_INTERPRET=1.

    Example:
        >>> p = plan(torch.tensor([[4, 0, 0, 0], [4, 0, 0, 0]]), S=2, K=2)   # R=2, E=4: all to expert 0
        >>> p.offsets.tolist()        # rank 0 keeps 4 of expert 0, rank 1 takes the other 4
        [[4, 4, 4, 4], [0, 0, 4, 4]]
    """
    R, E, L = check_counts(counts, S, K)
    if choose_backend(counts, backend) == "triton":
        from k3lab.kernels.moonep import plan_fill  # noqa: PLC0415 (a CPU process never loads Triton)

        return Plan(*plan_fill(counts, S, K), S=S, K=K)
    C = S * K
    dev = counts.device
    counts = counts.long()
    # 1. global load per expert and per home rank.
    keep = counts.sum(0)
    load = keep.view(R, L).sum(1)
    give = torch.zeros(R, L, dtype=torch.int64, device=dev)
    donor = torch.arange(R, device=dev)
    ranks = torch.arange(R, device=dev)
    # 2. at most R-1 fills: each fill brings one receiver to exactly C for good, and the last one leaves
    #    the donor at C too. A step with no under-loaded rank left moves nothing (need = 0).
    for _ in range(R - 1):
        # 3. the least-loaded receiver u and the most over-loaded donor d (first index on ties).
        u = load.argmin()
        d = load.argmax()
        # index_select, not load[u]: indexing by a 0-d tensor may read it back to the host.
        need = (C - load.index_select(0, u.view(1))).clamp(min=0)
        # 4. the donor's experts, most pairs left first (stable: lower expert index on ties). A donor was
        #    never a receiver (receivers sit at C), so its load is its own experts' pairs left: enough.
        left = keep.view(R, L).index_select(0, d.view(1))[0]
        vals, order = left.sort(descending=True, stable=True)
        # 5. take greedily up to `need` in that order: expert i gets min(vals_i, need - sum before i).
        take_sorted = (need - (vals.cumsum(0) - vals)).clamp(min=0).minimum(vals)
        take = torch.zeros_like(left).scatter(0, order, take_sorted)
        # 6. move them: the donor keeps fewer, the receiver's redundant slots hold them.
        keep.view(R, L).index_add_(0, d.view(1), -take.view(1, L))
        give.index_add_(0, u.view(1), take.view(1, L))
        donor = torch.where((ranks == u) & (need > 0), d, donor)
        load = load + need * ((ranks == u).long() - (ranks == d).long())
    # 7. slots, offsets and the expert -> rank table.
    return finish_plan(keep, give, donor, S, K)


def choose_backend(counts: torch.Tensor, backend: str | None, fill: bool = True) -> str:
    """The planner's (``fill``) or the layout's backend for ``counts`` [R, E] (shape already checked):
    ``backend`` when given and possible, else "triton" for CUDA counts (within the fill kernel's tile limits,
    for the planner; the layout kernel has none) and "torch" otherwise.

    Raises:
        ValueError: an unknown backend; "triton" outside the tile limits or on CPU counts without the
            Triton interpreter.
    """
    if backend not in (*BACKENDS, None):
        raise ValueError(f"{'plan' if fill else 'layout'}: backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "torch" or (backend is None and not counts.is_cuda):
        return "torch"
    if not counts.is_cuda:
        from k3lab.kernels import interpreting  # noqa: PLC0415

        if not interpreting():
            raise ValueError(f"{'plan' if fill else 'layout'}: backend='triton' needs counts on a CUDA device, "
                             f"or TRITON_INTERPRET=1 (k3lab.setup()) on the CPU; got counts on {counts.device}")
    if not fill:
        return "triton"
    from k3lab.kernels.moonep import MAX_BLOCK_L, MAX_TILE, fill_fits  # noqa: PLC0415

    R, E = counts.shape
    if backend is None:
        return "triton" if fill_fits(R, E) else "torch"
    if not fill_fits(R, E):
        raise ValueError(f"plan: backend='triton' needs next_pow2(L) <= {MAX_BLOCK_L} and next_pow2(R) * "
                         f"next_pow2(L) <= {MAX_TILE} (L = E/R), got R = {R}, E = {E}, L = {E // R}; "
                         "use backend='torch' or None")
    return "triton"


@dataclass(frozen=True)
class Layout:
    """One rank's view of a plan: where its own pairs go and where its buffer's rows come from. C = S*K.

    Attributes:
        dest_rank (Tensor): [S*K] int64, the rank that processes pair p (p = token * K + k).
        dest_row (Tensor): [S*K] int64, pair p's row in that rank's [C, d] buffer.
        src_rank (Tensor): [C] int64, the rank whose pair fills row i of this rank's buffer.
        offsets (Tensor): [2L] int32, this rank's slot ends (``plan.offsets[rank]``).
        slot_experts (Tensor): [2L] int64, this rank's slot experts (``plan.slot_experts[rank]``).
    """

    dest_rank: torch.Tensor
    dest_row: torch.Tensor
    src_rank: torch.Tensor
    offsets: torch.Tensor
    slot_experts: torch.Tensor


def pair_positions(topk_idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Step 1 of ``layout``, which needs no plan: each pair's position in this rank's pairs sorted by expert
    (a stable sort keeps pair order within an expert). pos[p] - (pairs of experts < e) is pair p's index
    among this rank's pairs of its expert e.

    Args:
        topk_idx (Tensor): [S, K] int64 expert ids (any strides).
        out (Tensor | None): [S*K] int64 on ``topk_idx``'s device to write into.

    Returns:
        [S*K] int64 (``out`` when given).

    Raises:
        ValueError: ``topk_idx`` is not a 2-D int64 tensor, or ``out`` is not an [S*K] int64 tensor on its
            device.
    """
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.ndim != 2 or topk_idx.dtype != torch.int64:
        got = (f"{list(topk_idx.shape)} {topk_idx.dtype}" if isinstance(topk_idx, torch.Tensor)
               else type(topk_idx).__name__)
        raise ValueError(f"pair_positions: topk_idx must be an [S, K] int64 tensor, got {got}")
    N = topk_idx.numel()
    if out is not None and not (isinstance(out, torch.Tensor) and tuple(out.shape) == (N,)
                                and out.dtype == torch.int64 and out.device == topk_idx.device):
        got = (f"{list(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise ValueError(f"pair_positions: out must be an [S*K={N}] int64 tensor on topk_idx's device "
                         f"{topk_idx.device}, got {got}")
    e = topk_idx.reshape(-1)
    order = torch.argsort(e, stable=True)
    out = torch.empty_like(order) if out is None else out
    return out.scatter_(0, order, torch.arange(N, device=e.device))


def count_prefixes(counts: torch.Tensor, rank: int,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of ``layout``'s plan-free work beside ``pair_positions``: two prefix sums of the counts.

    ``base[e]`` = pairs of expert e on ranks before ``rank`` - pairs of experts below e on ``rank``, so that
    pair p of expert e is number ``base[e] + pos[p]`` among all R ranks' pairs of e (``pos`` =
    ``pair_positions``); ``counts_cum[r, e]`` = pairs of e on ranks 0..r, where the source ranks' pieces end.

    Args:
        counts (Tensor): [R, E] int64 (or int32), the counts the plan is made from.
        rank (int): this rank, in [0, R).
        out (tuple | None): (counts_cum [R, E], base [E]) int64 tensors on ``counts``' device to write into.

    Returns:
        (counts_cum [R, E] int64, base [E] int64) = (``counts.cumsum(0)``, ``counts.cumsum(0)[rank] -
        counts[rank].cumsum(0)``), on ``counts``' device (``out`` when given).

    Raises:
        ValueError: counts not a 2-D int64 or int32 tensor; rank not an int in [0, R); out not a pair of
            [R, E] and [E] int64 tensors on counts' device.
    """
    if not isinstance(counts, torch.Tensor) or counts.ndim != 2 or counts.dtype not in (torch.int32, torch.int64):
        got = f"{list(counts.shape)} {counts.dtype}" if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"count_prefixes: counts must be an [R, E] int64 (or int32) tensor, got {got}")
    R, E = counts.shape
    if not (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < R):
        raise ValueError(f"count_prefixes: rank must be an int in [0, R={R}), got {rank!r}")
    if out is not None:
        ok = isinstance(out, (tuple, list)) and len(out) == 2 and all(
            isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == torch.int64
            and t.device == counts.device for t, shape in zip(out, ((R, E), (E,))))
        if not ok:
            got = (", ".join(f"{list(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
                             else type(t).__name__ for t in out) if isinstance(out, (tuple, list))
                   else type(out).__name__)
            raise ValueError(f"count_prefixes: out must be ([R={R}, E={E}], [E={E}]) int64 tensors on counts' device "
                             f"{counts.device}, got ({got})")
    counts_cum, base = (None, None) if out is None else out
    counts_cum = torch.cumsum(counts, 0, dtype=torch.int64, out=counts_cum)
    mine = torch.cumsum(counts[rank], 0, dtype=torch.int64)
    base = torch.sub(counts_cum[rank], mine, out=base)
    return counts_cum, base


def check_layout_args(who: str, counts: torch.Tensor, topk_idx: torch.Tensor, rank: int, R: int, E: int, S: int,
                      K: int, pos: torch.Tensor | None = None, counts_cum: torch.Tensor | None = None,
                      base: torch.Tensor | None = None) -> None:
    """Shape, dtype and device checks of ``layout``'s arguments against a plan of R, E, S, K (values are not
    read: that would sync), shared with ``plan_and_layout``, which runs them before it forks a stream.

    Raises:
        ValueError: rank not an int in [0, R); counts not [R, E] int64 or int32; topk_idx not [S, K] int64 on
            counts' device; pos, when given, not [S*K] int64 on counts' device; counts_cum, when given, not
            [R, E] int64 there; base, when given, not [E] int64 there. ``who`` starts the message.
    """
    if not (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < R):
        raise ValueError(f"{who}: rank must be an int in [0, R={R}), got {rank!r}")
    # Shapes only (values would need a host sync): a batch or counts of another plan give rows that collide.
    if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != (R, E) or counts.dtype not in (torch.int32,
                                                                                                   torch.int64):
        got = f"{list(counts.shape)} {counts.dtype}" if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"{who}: counts must be the plan's [R={R}, E={E}] int64 (or int32), got {got}")
    if not isinstance(topk_idx, torch.Tensor):
        raise ValueError(f"{who}: topk_idx must be the plan's [S={S}, K={K}] int64, got {type(topk_idx).__name__}")
    if tuple(topk_idx.shape) != (S, K) or topk_idx.dtype != torch.int64:
        raise ValueError(f"{who}: topk_idx must be the plan's [S={S}, K={K}] int64, got "
                         f"{list(topk_idx.shape)} {topk_idx.dtype}")
    if topk_idx.device != counts.device:
        raise ValueError(f"{who}: topk_idx must be on counts' device {counts.device}, got {topk_idx.device}")
    if pos is not None and not (isinstance(pos, torch.Tensor) and tuple(pos.shape) == (S * K,)
                                and pos.dtype == torch.int64 and pos.device == counts.device):
        got = f"{list(pos.shape)} {pos.dtype} on {pos.device}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise ValueError(f"{who}: pos must be pair_positions(topk_idx), an [S*K={S * K}] int64 tensor on counts' "
                         f"device {counts.device}, got {got}")
    for name, t, shape, what in (("counts_cum", counts_cum, (R, E), f"[R={R}, E={E}]"),
                                 ("base", base, (E,), f"[E={E}]")):
        if t is not None and not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape
                                  and t.dtype == torch.int64 and t.device == counts.device):
            got = f"{list(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{who}: {name} must be count_prefixes(counts, rank)'s {what} int64 tensor on counts' "
                             f"device {counts.device}, got {got}")


_SIDE_STREAMS: dict = {}


def plan_and_layout(counts: torch.Tensor, topk_idx: torch.Tensor, rank: int, S: int, K: int,
                    backend: str | None = None) -> tuple[Plan, Layout]:
    """``plan(counts, S, K)`` and this rank's ``layout``: the same integers, with every step of the layout that
    needs no plan on a second CUDA stream while the plan's fill runs: ``pair_positions`` (a sort of the S*K
    pairs), ``count_prefixes`` (two prefix sums of the counts, their int64 cast) and a contiguous copy of a
    strided ``topk_idx``. The fill is R - 1 dependent steps in one program on one SM, the side work spreads
    over the card, so the two overlap; after the join only the layout's plan-dependent step is left (on the
    Triton backend one kernel, ``layout_rows``). Under CUDA graph capture the fork and join are captured
    with them. On a CPU, ``plan`` then ``layout``, one after the other.

    Args and raises: those of ``plan`` and ``layout``, all checked before the fork.
    """
    R, E, _ = check_counts(counts, S, K)
    check_layout_args("plan_and_layout", counts, topk_idx, rank, R, E, S, K)
    if not counts.is_cuda:
        p = plan(counts, S, K, backend)
        return p, layout(p, counts, topk_idx, rank, backend)
    choose_backend(counts, backend)
    dev = counts.device
    main = torch.cuda.current_stream(dev)
    side = _SIDE_STREAMS.get(dev)
    if side is None:
        side = _SIDE_STREAMS[dev] = torch.cuda.Stream(dev)
    # Allocated on the main stream, which frees them: the side stream only writes them before the join.
    pos = torch.empty(S * K, dtype=torch.int64, device=dev)
    counts_cum = torch.empty(R, E, dtype=torch.int64, device=dev)
    base = torch.empty(E, dtype=torch.int64, device=dev)
    ids = topk_idx if topk_idx.is_contiguous() else torch.empty(S, K, dtype=torch.int64, device=dev)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        if ids is not topk_idx:
            ids.copy_(topk_idx)
        pair_positions(ids, pos)
        count_prefixes(counts, rank, out=(counts_cum, base))
    p = plan(counts, S, K, backend)
    main.wait_stream(side)
    return p, layout(p, counts, ids, rank, backend, pos=pos, counts_cum=counts_cum, base=base)


def layout(p: Plan, counts: torch.Tensor, topk_idx: torch.Tensor, rank: int, backend: str | None = None,
           pos: torch.Tensor | None = None, counts_cum: torch.Tensor | None = None,
           base: torch.Tensor | None = None) -> Layout:
    """Destinations of rank ``rank``'s pairs and the sources of its buffer rows, from the plan.

    Expert e's pairs are numbered globally, rank by rank in source order and in pair order inside a rank
    (g = pairs of e on earlier ranks + position among this rank's pairs of e), and cut into consecutive
    pieces, one per processing rank in rank order (``plan.assign[e]``). Every rank computes the same
    numbering from the same counts, so no indices are exchanged.

    Args:
        p (Plan): from ``plan(counts, S, K)``.
        counts (Tensor): [R, E] int64 (or int32), the counts the plan was made from.
        topk_idx (Tensor): [S, K] int64 expert ids of this rank's tokens, in [0, E). They are not read back
            (no host sync): a pair whose id lies outside gets ``dest_rank`` and ``dest_row`` -1, and no memory
            outside the plan is read for it (``k3lab.moonep.ep``'s entry checks the ids with a clear error).
        rank (int): this rank.
        backend (str | None): ``"torch"`` (a few dozen small tensor ops), ``"triton"`` (the plan-free sort and
            prefix sums in torch, then steps 2-5 in one launch, ``k3lab.kernels.moonep.layout_rows``, which
            forms the plan's prefix sums itself; CUDA counts, or CPU counts under TRITON_INTERPRET=1), or None:
            ``"triton"`` for CUDA counts. The same integers either way.
        pos (Tensor | None): [S*K] int64, ``pair_positions(topk_idx)`` when already computed
            (``plan_and_layout``).
        counts_cum, base (Tensor | None): [R, E] and [E] int64, ``count_prefixes(counts, rank)`` when already
            computed (``plan_and_layout``); each is computed here when not given. With ``pos`` and both of
            these, the Triton backend runs one kernel.

    Returns:
        Layout, on ``counts``' device; no host synchronisation.

    Raises:
        ValueError: rank not an int in [0, R); counts not [R, E] int64 or int32, or topk_idx not [S, K] int64
            (the plan's) on counts' device; pos not [S*K] int64 there, counts_cum not [R, E] int64 there, base
            not [E] int64 there; an unknown backend, or ``"triton"`` on CPU counts without the interpreter.
    """
    R, E, L, C = p.R, p.E, p.E // p.R, p.capacity
    check_layout_args("layout", counts, topk_idx, rank, R, E, p.S, p.K, pos, counts_cum, base)
    dev = counts.device
    triton_backend = choose_backend(counts, backend, fill=False) == "triton"
    e = topk_idx.reshape(-1)
    # 1. position of each pair among this rank's pairs of the same expert (stable sort keeps pair order), and
    #    the counts' prefix sums: g = base[e] + pos is the pair's global number within expert e.
    if pos is None:
        pos = pair_positions(topk_idx)
    if counts_cum is None or base is None:
        fresh_cum, fresh_base = count_prefixes(counts, rank)
        counts_cum = fresh_cum if counts_cum is None else counts_cum
        base = fresh_base if base is None else base
    if triton_backend:
        from k3lab.kernels.moonep import layout_rows  # noqa: PLC0415 (a CPU process never loads Triton)

        # 2-5 in one launch.
        dest_rank, dest_row, src_rank = layout_rows(
            e.contiguous(), pos.contiguous(), base.contiguous(), p.assign, p.slot_counts, p.offsets,
            p.slot_experts, counts_cum.contiguous(), rank)
        return Layout(dest_rank=dest_rank, dest_row=dest_row, src_rank=src_rank, offsets=p.offsets[rank],
                      slot_experts=p.slot_experts[rank])
    # An id outside [0, E) reads expert 0's entries and is marked -1 at the end.
    bad = (e < 0) | (e >= E)
    e = e.masked_fill(bad, 0)
    # 2. its global number within expert e.
    g = base[e] + pos
    # 3. the processing rank: the piece of assign[e] that holds g.
    cum = p.assign.cumsum(1)
    # A bad id's g may pass every piece of expert 0 (its pos counts the pairs of all experts): R is clamped.
    dest_rank = (cum[e] <= g[:, None]).sum(1).clamp(max=R - 1)
    within = g - (cum - p.assign)[e, dest_rank]
    # 4. its slot there: the home slot on e's home rank, else the redundant slot of the same index.
    slot = torch.where(dest_rank == e // L, e % L, L + e % L)
    starts = (p.slot_counts.cumsum(1) - p.slot_counts)
    dest_row = starts[dest_rank, slot] + within
    # 5. this rank's buffer: row i's slot, expert and global number, then the source rank holding it.
    rows = torch.arange(C, device=dev)
    my_off = p.offsets[rank].long()
    row_slot = torch.searchsorted(my_off, rows, right=True).clamp(max=2 * L - 1)
    row_expert = p.slot_experts[rank][row_slot]
    row_g = (cum - p.assign)[row_expert, rank] + rows - starts[rank][row_slot]
    src_rank = (counts_cum.T[row_expert] <= row_g[:, None]).sum(1).clamp(max=R - 1)
    dest_rank, dest_row = dest_rank.masked_fill(bad, -1), dest_row.masked_fill(bad, -1)
    return Layout(dest_rank=dest_rank, dest_row=dest_row, src_rank=src_rank, offsets=p.offsets[rank],
                  slot_experts=p.slot_experts[rank])
