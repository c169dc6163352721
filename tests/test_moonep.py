"""MoonEP: planner properties (hypothesis) against the App. E reference over random and adversarial loads,
the one-kernel Triton fill equal to both (on CPU under TRITON_INTERPRET=1, small sizes), the layout by a
simulated all-to-all, no host sync while planning, input errors, EP = 1 bitwise against the dense MoE, and
2- and 4-rank gloo runs (MoonEP and the all-to-all baseline) against one process."""
from __future__ import annotations

import datetime
import math
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3lab.dist import launch
from k3lab.moonep import dense_moe, layout, moonep_experts, plan, plan_reference
from k3lab.moonep.ep import _run_ffn
from k3lab.moonep.workers import (ROUTINGS, Case, check_worker, gather_ranks, make_inputs, make_routing, reference,
                                  tightness_counts, uneven_worker)
from k3lab.testing import DEVICE, assert_close

LOADS = ("multinomial", "one_expert", "one_rank_idle", "zipf", "identical", "one_rank_hot")


def make_counts(kind: str, R: int, L: int, S: int, K: int, seed: int) -> torch.Tensor:
    """[R, E] int64 counts whose rows sum to S*K (pairs need not be distinct experts per token)."""
    E, C = R * L, S * K
    gen = torch.Generator().manual_seed(seed)
    if kind == "one_expert":
        w = torch.zeros(E).index_fill_(0, torch.tensor([seed % E]), 1.0)
    elif kind == "one_rank_idle":
        w = torch.ones(E)
        w[:L] = 0 if R > 1 else 1
    elif kind == "zipf":
        w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
    elif kind == "identical":
        w = torch.zeros(E).index_fill_(0, torch.randperm(E, generator=gen)[:min(K, E)], 1.0)
    elif kind == "one_rank_hot":
        w = torch.full((E,), 1e-3)
        w[(seed % R) * L:(seed % R + 1) * L] = 1.0
    else:
        w = torch.rand(E, generator=gen, dtype=torch.float64) ** 3 + 1e-3
    rows = [torch.multinomial(w.float().expand(1, E), C, replacement=True, generator=gen)[0] for _ in range(R)]
    return torch.stack([torch.zeros(E, dtype=torch.int64).scatter_add_(0, r, torch.ones_like(r)) for r in rows])


PLAN_FIELDS = ("keep", "give", "donor", "assign", "slot_experts", "slot_counts", "offsets")


def assert_same_plan(got, want, tag=""):
    """Every field equal (integers: equal, not close), compared on the CPU."""
    for name in PLAN_FIELDS:
        a, b = getattr(got, name).cpu(), getattr(want, name).cpu()
        assert a.dtype == b.dtype and torch.equal(a, b), f"{tag} plan.{name}:\n{a}\n!=\n{b}"


def check_plan(p, counts, S, K):
    """The properties every plan must have; returns the max redundant experts per rank."""
    R, E = counts.shape
    L, C = E // R, S * K
    assert (p.keep >= 0).all() and (p.give >= 0).all()
    # Exact balance: every rank processes S*K pairs; offsets are cu_seqlens within capacity.
    assert torch.equal(p.slot_counts.sum(1), torch.full((R,), C))
    assert torch.equal(p.offsets[:, -1], torch.full((R,), C, dtype=torch.int32))
    assert (p.offsets.diff(dim=1) >= 0).all() and (p.offsets >= 0).all()
    # Every pair processed once, nowhere else.
    assert torch.equal(p.assign.sum(1), counts.sum(0)) and torch.equal(p.assign.sum(0), torch.full((R,), C))
    home = torch.arange(E) // L
    for v in range(R):
        remote = [e for e in range(E) if p.assign[e, v] > 0 and home[e] != v]
        # Remote pairs from one home rank (the donor), so at most E/R redundant experts.
        assert len({int(home[e]) for e in remote}) <= 1 and len(remote) <= L
        if remote:
            assert int(p.donor[v]) == int(home[remote[0]])
        # A replica of one expert never twice on one rank (and never on its own home).
        used = p.slot_experts[v][p.slot_counts[v] > 0].tolist()
        assert len(used) == len(set(used))
    assert int((p.donor != torch.arange(R)).sum()) <= R - 1
    return int(p.redundant().max())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(R=st.sampled_from([1, 2, 3, 4, 5, 8, 16]), L=st.integers(1, 6), S=st.integers(1, 24), K=st.integers(1, 4),
       kind=st.sampled_from(LOADS), seed=st.integers(0, 2**16))
def test_planner_properties_and_reference(R, L, S, K, kind, seed):
    """Exact S*K balance, the E/R bound, one donor per rank, no double replica; equal to App. E's reference."""
    counts = make_counts(kind, R, L, S, K, seed)
    p = plan(counts, S, K)
    assert_same_plan(p, plan_reference(counts, S, K))
    check_plan(p, counts, S, K)


@settings(max_examples=40, deadline=None)
@given(R=st.integers(2, 8), L=st.integers(1, 6), t=st.integers(1, 4), K=st.integers(1, 3))
def test_tightness_case(R, L, t, K):
    """Rank 0's experts idle, the other (R-1)L experts n = K R t pairs each: rank 0 needs C/n =
    ceil(E(R-1)/R^2) experts at least, and the plan uses no more than E/R on any rank."""
    E = R * L
    counts, S = tightness_counts(E, R, K, t)
    assert (counts.sum(1) == S * K).all() and (counts[:, :L] == 0).all()
    p = plan(counts, S, K)
    most = check_plan(p, counts, S, K)
    assert math.ceil(E * (R - 1) / R**2) <= int(p.redundant()[0]) <= most <= E // R


@settings(max_examples=60, deadline=None)
@given(R=st.sampled_from([1, 2, 3, 4]), L=st.integers(1, 3), S=st.integers(1, 12), K=st.integers(1, 3),
       kind=st.sampled_from(ROUTINGS + ("random",)), seed=st.integers(0, 2**16))
def test_layout_by_simulated_all_to_all(R, L, S, K, kind, seed):
    """Every pair lands on a distinct row of its destination's buffer, inside a slot of its own expert,
    and that row names the pair's rank as its source: the layout each rank computes alone agrees. The
    Triton layout equals the torch one."""
    E = R * L
    K = min(K, E)
    gen = torch.Generator().manual_seed(seed)
    if kind == "random" or (kind == "idle_rank" and E - L < K):
        idx = torch.randint(0, E, (R, S, K), generator=gen)
    else:
        idx = make_routing(kind, R, S, K, E, gen)
    check_round_trip(idx, R, S, K, E)
    assert_same_layouts(idx, R, S, K, E)


LAYOUT_FIELDS = ("dest_rank", "dest_row", "src_rank", "offsets", "slot_experts")


def assert_same_layouts(idx, R, S, K, E):
    """Every rank's Triton layout equals its torch layout, field for field (integers: equal)."""
    counts = torch.stack([torch.bincount(idx[r].reshape(-1), minlength=E) for r in range(R)])
    p, p_dev = plan(counts, S, K), plan(counts.to(DEVICE), S, K)
    for r in range(R):
        want = layout(p, counts, idx[r], r, backend="torch")
        got = layout(p_dev, counts.to(DEVICE), idx[r].to(DEVICE), r, backend="triton")
        for name in LAYOUT_FIELDS:
            a, b = getattr(got, name).cpu(), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {r} layout.{name}:\n{a}\n!=\n{b}"


@pytest.mark.parametrize("kind, R, E, S, K", [("zipf", 64, 896, 40, 8), ("one_expert", 8, 896, 48, 8),
                                              ("idle_rank", 16, 256, 100, 4)])
def test_triton_layout_at_benchmark_widths(kind, R, E, S, K):
    """E = 896 over 64 and 8 ranks (pairs across several blocks, 2L and R loops of 28-224), every pair to
    one expert, an idle rank."""
    assert_same_layouts(make_routing(kind, R, S, K, E, torch.Generator().manual_seed(R)), R, S, K, E)


def test_dense_moe_checks_its_arguments_as_the_ep_entry_does():
    """float64 weights with float32 x came back float64; a topk_idx of other N failed in a bare broadcast."""
    g = torch.Generator().manual_seed(3)
    E, d, h, N, K = 4, 8, 8, 6, 2
    ws = [torch.randn(E, d, h, generator=g), torch.randn(E, d, h, generator=g), torch.randn(E, h, d, generator=g)]
    x = torch.randn(N, d, generator=g)
    idx = torch.randint(0, E, (N, K), generator=g)
    w = torch.rand(N, K, generator=g)
    y = dense_moe(x, idx, w.double(), *ws)
    assert y.dtype == torch.float32
    assert torch.equal(y, dense_moe(x, idx, w, *ws))
    with pytest.raises(ValueError, match=r"topk_idx must be \[S=6, K\] int64"):
        dense_moe(x, idx[:4], w[:4], *ws)
    with pytest.raises(ValueError, match=r"topk_weight must be \[S=6, K=2\] float"):
        dense_moe(x, idx, w[:, :1], *ws)


def test_the_reference_planner_names_negative_counts():
    """Rows summing to S*K with a negative entry were refused with only the (valid) row sums shown."""
    with pytest.raises(ValueError, match=r"row sums \[16, 16\] and negative counts at \[rank, expert\] \[\(0, 1\)\]"):
        plan_reference(torch.tensor([[20, -4, 0, 0], [10, 2, 2, 2]]), 8, 2)


def test_layout_marks_pairs_with_ids_outside_the_experts():
    """The ids are not read back (no host sync), so ``layout`` cannot raise on them: a pair whose id is
    negative or >= E gets dest_rank and dest_row -1 and reads nothing out of bounds (a negative id must not
    wrap to the last expert), the other pairs get rows of the buffer, and both backends agree."""
    R, E, S, K = 4, 8, 6, 2
    idx = make_routing("zipf", R, S, K, E, torch.Generator().manual_seed(5))
    counts = torch.stack([torch.bincount(idx[r].reshape(-1), minlength=E) for r in range(R)])
    p = plan(counts.to(DEVICE), S, K)
    bad = idx[1].clone()
    bad[0, 0], bad[2, 1], bad[5, 0] = -1, E, 10 ** 6
    marked = torch.zeros(S * K, dtype=torch.bool)
    marked[[0, 5, 10]] = True
    got = {b: layout(p, counts.to(DEVICE), bad.to(DEVICE), 1, backend=b) for b in ("torch", "triton")}
    for name in ("dest_rank", "dest_row", "src_rank"):
        assert torch.equal(getattr(got["torch"], name).cpu(), getattr(got["triton"], name).cpu()), name
    lay = got["torch"]
    assert lay.dest_rank.cpu()[marked].eq(-1).all() and lay.dest_row.cpu()[marked].eq(-1).all()
    assert lay.dest_rank.cpu()[~marked].ge(0).all() and lay.dest_rank.cpu()[~marked].lt(R).all()
    assert lay.dest_row.cpu()[~marked].ge(0).all() and lay.dest_row.cpu()[~marked].lt(S * K).all()
    # A bad id sorts after every expert, so its position among the pairs passed all of expert 0's pieces: the
    # torch backend raised a bare IndexError (R = 2, E = 4, an id 4 on rank 0).
    counts = torch.tensor([[4, 4, 4, 4], [10, 2, 2, 2]])
    idx = torch.tensor([[4, 1], [0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3], [3, 0]])
    p = plan(counts.to(DEVICE), 8, 2)
    got = {b: layout(p, counts.to(DEVICE), idx.to(DEVICE), 0, backend=b) for b in ("torch", "triton")}
    for name in ("dest_rank", "dest_row", "src_rank"):
        assert torch.equal(getattr(got["torch"], name).cpu(), getattr(got["triton"], name).cpu()), name
    assert got["torch"].dest_rank[0].item() == -1 and got["torch"].dest_row[0].item() == -1


def check_round_trip(idx, R, S, K, E):
    """The plan of ``idx`` [R, S, K] and every rank's layout, checked by a simulated all-to-all (see above)."""
    counts = torch.stack([torch.bincount(idx[r].reshape(-1), minlength=E) for r in range(R)])
    p = plan(counts, S, K)
    check_plan(p, counts, S, K)
    lays = [layout(p, counts, idx[r], r) for r in range(R)]
    C = S * K
    owner = torch.full((R, C), -1)
    for r, lay in enumerate(lays):
        assert owner[lay.dest_rank, lay.dest_row].eq(-1).all()
        owner[lay.dest_rank, lay.dest_row] = r * C + torch.arange(C)
        assert (lay.dest_row < C).all() and (lay.dest_row >= 0).all()
    assert (owner >= 0).all(), "a buffer row received no pair"
    for v, lay in enumerate(lays):
        slot = torch.searchsorted(lay.offsets.long(), torch.arange(C), right=True)
        src, pair = owner[v] // C, owner[v] % C
        assert torch.equal(lay.src_rank, src)
        assert torch.equal(lay.slot_experts[slot], idx.view(R, C)[src, pair])


@pytest.mark.parametrize("R, E, S, K, kind", [(32, 256, 16, 8, "hot_236"), (16, 256, 144, 8, "identical_after_10"),
                                              (16, 256, 144, 8, "one_expert")])
def test_reported_ep_configurations_round_trip(R, E, S, K, kind):
    """EPLB#22: 256 experts over 32 ranks with expert 236 hot (two replicas landed on one rank there);
    DeepEP#427: 16 ranks, 2304 tokens, every token after the first 10 with the same scores (its dispatch counts
    failed), and all of them to one expert. Exact S*K per rank, no replica twice on a rank, every pair back."""
    gen = torch.Generator().manual_seed(R + S)
    scores = torch.rand(R * S, E, generator=gen)
    if kind == "hot_236":
        scores[:, 236] += 1.0
    elif kind == "identical_after_10":
        scores[10:] = scores[10]
    idx = scores.topk(K, dim=-1).indices.view(R, S, K)
    if kind == "one_expert":
        idx = torch.zeros_like(idx)
    check_round_trip(idx, R, S, K, E)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(R=st.sampled_from([1, 2, 3, 5, 8]), L=st.integers(1, 6), S=st.integers(1, 24), K=st.integers(1, 4),
       kind=st.sampled_from(LOADS), seed=st.integers(0, 2**16), int32=st.booleans())
def test_triton_fill_equals_torch_and_reference(R, L, S, K, kind, seed, int32):
    """The one-kernel fill gives the torch planner's plan and App. E's reference, field for field, on random
    and adversarial loads, odd R and L (padded tiles), int64 and int32 counts."""
    counts = make_counts(kind, R, L, S, K, seed)
    got = plan((counts.int() if int32 else counts).to(DEVICE), S, K, backend="triton")
    assert_same_plan(got, plan(counts, S, K, backend="torch"), "triton vs torch")
    assert_same_plan(got, plan_reference(counts, S, K), "triton vs reference")
    check_plan(got, counts, S, K)


def _one_expert_everywhere(R, L, S, K):
    return torch.zeros(R, R * L, dtype=torch.int64).index_fill_(1, torch.tensor([R * L - 1]), S * K)


def _idle_rank(R, L, S, K):
    """Rank 0's experts idle, every other expert even (the tightness case, R - 1 fills)."""
    counts = torch.zeros(R, R * L, dtype=torch.int64)
    counts[:, L:] = S * K // (L * (R - 1))
    return counts


def _ties(R, L, S, K):
    """Every expert of every rank at the same count except rank 1's, all tied at a higher one: the greedy
    take must break each tie by the lower expert index, as the torch planner's stable sort does."""
    counts = torch.full((R, R * L), S * K // (R * L), dtype=torch.int64)
    counts[:, L:2 * L] += S * K // (R * L)
    counts[:, 2 * L:3 * L] -= S * K // (R * L)
    return counts


@pytest.mark.parametrize("case, R, L, S, K", [
    (_one_expert_everywhere, 4, 3, 6, 2),
    (_one_expert_everywhere, 7, 1, 5, 1),
    (_idle_rank, 5, 4, 16, 3),
    (_idle_rank, 16, 2, 30, 1),
    (_ties, 4, 5, 20, 4),
    (_ties, 6, 6, 36, 3),
    (lambda R, L, S, K: make_counts("zipf", R, L, S, K, 1), 1, 9, 4, 2),
    (lambda R, L, S, K: make_counts("multinomial", R, L, S, K, 2), 16, 1, 9, 2),
    (lambda R, L, S, K: make_counts("zipf", R, L, S, K, 3), 64, 14, 256, 8),
    (lambda R, L, S, K: make_counts("one_rank_hot", R, L, S, K, 4), 8, 112, 256, 8),
    (_idle_rank, 4, 3, 9 * 7456540, 1),
    (_one_expert_everywhere, 4, 3, 2**30, 1),
], ids=["one-expert", "one-expert-R=E", "idle-rank", "idle-rank-R16", "ties", "ties-6x6", "R=1", "R=E",
        "E896-R64", "E896-R8", "int32-state-edge", "int64-state"])
def test_triton_fill_on_adversarial_loads(case, R, L, S, K):
    """All pairs on one expert, an idle rank, ties, R = 1, R = E, the benchmark's E = 896 at R = 64 and 8
    (every rank's experts in one tile row, padded to 16 and 128), and loads at the edge of the int32 state
    (R * S*K * next_pow2(L) just under 2^30) and past it (int64): the same plan as the torch planner and the
    reference, every rank at exactly S*K, at most L redundant experts."""
    counts = case(R, L, S, K)
    assert torch.equal(counts.sum(1), torch.full((R,), S * K))
    got = plan(counts.to(DEVICE), S, K, backend="triton")
    assert_same_plan(got, plan(counts, S, K, backend="torch"), "triton vs torch")
    assert_same_plan(got, plan_reference(counts, S, K), "triton vs reference")
    assert check_plan(got, counts, S, K) <= L


def test_fill_state_is_int32_only_where_every_value_fits():
    """The adversarial cases above run both state types: R * S*K * next_pow2(L) just under 2^30 is int32,
    past it int64."""
    from k3lab.kernels.moonep.fill import state_dtype

    assert str(state_dtype(4, 3, 9 * 7456540)["DT"]) == "int32"
    assert str(state_dtype(4, 3, 2**30)["DT"]) == "int64"  # one expert's load: R * S*K = 2^32
    assert str(state_dtype(64, 14, 8192 * 16)["DT"]) == "int32"  # the benchmark's E = 896, R = 64, K = 16


@pytest.mark.parametrize("num_warps", [1, 8])
def test_triton_fill_at_other_launch_widths(num_warps):
    """The rows of counts summed per iteration follow the launch width; R = 7 leaves a partial last group."""
    from k3lab.kernels.moonep import plan_fill
    from k3lab.moonep.planner import Plan

    counts = make_counts("zipf", 7, 3, 12, 2, 5)
    got = Plan(*plan_fill(counts.to(DEVICE), 12, 2, num_warps=num_warps), S=12, K=2)
    assert_same_plan(got, plan_reference(counts, 12, 2))


def test_plan_backend_choice_and_refusals(monkeypatch):
    """None picks Triton only for CUDA counts within the tile; an explicit "triton" outside the tile, or on
    CPU counts without the interpreter, and an unknown backend are ValueErrors naming what was expected."""
    from k3lab.moonep.planner import choose_backend

    assert choose_backend(torch.zeros(2, 4, dtype=torch.int64), None) == "torch"
    assert choose_backend(torch.zeros(2, 4, dtype=torch.int64), "triton") == "triton"
    if torch.cuda.is_available():
        assert choose_backend(torch.zeros(64, 896, dtype=torch.int64, device="cuda"), None) == "triton"
        assert choose_backend(torch.zeros(1, 896, dtype=torch.int64, device="cuda"), None) == "torch"
    with pytest.raises(ValueError, match=r"next_pow2\(L\) <= 128 .* got R = 1, E = 256, L = 256"):
        plan(torch.full((1, 256), 1, dtype=torch.int64), 64, 4, backend="triton")
    with pytest.raises(ValueError, match=r"<= 2048 \(L = E/R\), got R = 64, E = 4096, L = 64"):
        plan(torch.zeros(64, 4096, dtype=torch.int64), 1, 1, backend="triton")
    with pytest.raises(ValueError, match=r"backend must be one of \('torch', 'triton'\) or None, got 'cuda'"):
        plan(torch.zeros(2, 4, dtype=torch.int64), 1, 1, backend="cuda")
    import k3lab.kernels

    monkeypatch.setattr(k3lab.kernels, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="needs counts on a CUDA device, or TRITON_INTERPRET=1"):
        plan(torch.zeros(2, 4, dtype=torch.int64), 1, 1, backend="triton")


def test_planner_and_layout_never_sync(monkeypatch):
    """No .item()/.tolist()/.cpu()/bool()/int() on a tensor while planning and laying out (CPU check of the
    static-shape claim; on a GPU the same path runs under torch.cuda.set_sync_debug_mode("error"))."""
    R, L, S, K = 4, 3, 16, 2
    gen = torch.Generator().manual_seed(0)
    idx = make_routing("zipf", R, S, K, R * L, gen)
    counts = torch.stack([torch.bincount(idx[r].reshape(-1), minlength=R * L) for r in range(R)])

    def sync(*args, **kwargs):
        raise AssertionError("host synchronisation on the planner path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    p = plan(counts, S, K)
    lays = [layout(p, counts, idx[r], r) for r in range(R)]
    monkeypatch.undo()
    assert int(p.offsets[:, -1].min()) == S * K and len(lays) == R


def test_plan_worked_example():
    """R = 2, E = 4, S = K = 2, every pair to expert 0: rank 0 keeps 4 of expert 0, rank 1 takes the
    other 4 into its first redundant slot (expert 0's replica)."""
    p = plan(torch.tensor([[4, 0, 0, 0], [4, 0, 0, 0]]), 2, 2)
    assert p.offsets.tolist() == [[4, 4, 4, 4], [0, 0, 4, 4]]
    assert p.slot_experts.tolist() == [[0, 1, 0, 1], [2, 3, 0, 1]]
    assert p.donor.tolist() == [0, 0] and p.redundant().tolist() == [0, 1]


@pytest.mark.parametrize("counts,S,K,match", [
    (torch.zeros(2, 3, dtype=torch.int64), 1, 1, "multiple of R"),
    (torch.zeros(2, 0, dtype=torch.int64), 1, 1, "positive multiple of R"),
    (torch.zeros(4, dtype=torch.int64), 1, 1, r"\[R, E\]"),
    (torch.zeros(2, 4), 1, 1, r"\[R, E\] int64"),
    (torch.zeros(2, 4, dtype=torch.int64), 0, 1, "S must be"),
], ids=["E%R", "E=0", "1-D", "float", "S=0"])
def test_plan_rejects_bad_counts(counts, S, K, match):
    with pytest.raises(ValueError, match=match):
        plan(counts, S, K)


def test_plan_reference_rejects_unbalanced_rows():
    with pytest.raises(ValueError, match="summing to S\\*K = 4"):
        plan_reference(torch.tensor([[4, 0], [3, 0]]), 2, 2)


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo group in this process (EP = 1), torn down after the module's tests."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def _ep1(case: Case, R: int, group, mode: str) -> dict:
    """EP = 1 on the global batch that ``R`` ranks split: out and every gradient."""
    full = make_inputs(case, R)
    x = full["x"].clone().requires_grad_()
    tw = full["topk_weight"].clone().requires_grad_()
    experts = torch.nn.Module()
    for n in ("w_gate", "w_up", "w_down"):
        setattr(experts, n, torch.nn.Parameter(full[n].clone()))
    out = moonep_experts(x, full["topk_idx"], tw, experts, group, mode=mode,
                         pad_mask=full["pad"] if case.padded else None)
    (out * full["w_o"]).sum().backward()
    return dict(out=out.detach(), grad_x=x.grad, grad_topk_weight=tw.grad,
                grads={n: getattr(experts, n).grad for n in ("w_gate", "w_up", "w_down")})


@pytest.mark.parametrize("mode", ["moonep", "alltoall"])
def test_ep1_is_the_dense_moe_bitwise(one_rank_group, mode):
    """EP = 1: output and every gradient equal ``dense_moe`` bit for bit (skewed routing, padding)."""
    case = Case(S=20, routing="zipf", padded=True, seed=3)
    got, ref = _ep1(case, 1, one_rank_group, mode), reference(case, 1)
    for key in ("out", "grad_x", "grad_topk_weight"):
        assert torch.equal(got[key], ref[key]), key
    for n in ref["grads"]:
        assert torch.equal(got["grads"][n], ref["grads"][n]), n


def test_entry_rejects_bad_inputs(one_rank_group):
    """Ids outside [0, E) (unless padding), unknown modes and mismatched shapes are ValueErrors."""
    g = torch.Generator().manual_seed(0)
    experts = torch.nn.Module()
    experts.w_gate, experts.w_up = torch.randn(4, 8, 4, generator=g), torch.randn(4, 8, 4, generator=g)
    experts.w_down = torch.randn(4, 4, 8, generator=g)
    x, w = torch.randn(5, 8, generator=g), torch.rand(5, 2, generator=g)
    ok = torch.randint(0, 4, (5, 2), generator=g)
    for bad_id in (-1, 4):
        idx = ok.clone()
        idx[3, 1] = bad_id
        with pytest.raises(ValueError, match=rf"\[0, E=4\).*\[{bad_id}\] at tokens \[3\]"):
            moonep_experts(x, idx, w, experts, one_rank_group)
        pad = torch.zeros(5, dtype=torch.bool)
        pad[3] = True
        out = moonep_experts(x, idx, w, experts, one_rank_group, pad_mask=pad)
        assert torch.equal(out[3], torch.zeros(8))
    with pytest.raises(ValueError, match="mode must be one of"):
        moonep_experts(x, ok, w, experts, one_rank_group, mode="deepep")
    with pytest.raises(ValueError, match=r"topk_idx must be \[S=5, K\] int64"):
        moonep_experts(x, ok.int(), w, experts, one_rank_group)
    with pytest.raises(ValueError, match=r"topk_weight must be \[S=5, K=2\] float"):
        moonep_experts(x, ok, w[:, :1], experts, one_rank_group)
    with pytest.raises(ValueError, match=r"topk_weight must be \[S=5, K=2\] float, got \[5, 2\] torch.int64"):
        moonep_experts(x, ok, ok, experts, one_rank_group)
    with pytest.raises(ValueError, match=r"x must be \[S, d=8\]"):
        moonep_experts(x[:, :7], ok, w, experts, one_rank_group)


@pytest.mark.parametrize("mode", ["moonep", "alltoall"])
def test_an_empty_batch_gives_an_empty_output_in_both_modes(one_rank_group, mode):
    """S = 0 on every rank: MoonEP's planner refused it ("S must be a positive int") and the baseline failed
    reshaping [0, K, -1]. The output is [0, d], differentiable in x."""
    g = torch.Generator().manual_seed(0)
    experts = torch.nn.Module()
    experts.w_gate, experts.w_up = torch.randn(4, 8, 4, generator=g), torch.randn(4, 8, 4, generator=g)
    experts.w_down = torch.randn(4, 4, 8, generator=g)
    x = torch.randn(0, 8, requires_grad=True)
    out = moonep_experts(x, torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), experts, one_rank_group,
                         mode=mode)
    assert out.shape == (0, 8) and out.dtype == x.dtype
    out.sum().backward()
    assert x.grad.shape == (0, 8)


def test_entry_names_mismatched_expert_weights_and_dtypes(one_rank_group):
    """Weights of disagreeing shapes failed deep in the fetch (split_with_sizes), a float64 x with float32
    experts inside a matmul, K = 0 in the planner as "K must be a positive int"."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 8, generator=g), torch.rand(5, 2, generator=g)
    idx = torch.randint(0, 4, (5, 2), generator=g)

    def experts(L_up=4, h_down=4, dtype=torch.float32):
        e = torch.nn.Module()
        e.w_gate = torch.randn(4, 8, 4, generator=g, dtype=dtype)
        e.w_up = torch.randn(L_up, 8, 4, generator=g, dtype=dtype)
        e.w_down = torch.randn(4, h_down, 8, generator=g, dtype=dtype)
        return e

    for bad in (experts(L_up=3), experts(h_down=5)):
        with pytest.raises(ValueError, match=r"experts must hold w_gate, w_up \[n, d, h\] and w_down \[n, h, d\] \(n experts\)"):
            moonep_experts(x, idx, w, bad, one_rank_group)
    with pytest.raises(ValueError, match="x and the expert weights must share one dtype, got x torch.float64"):
        moonep_experts(x.double(), idx, w, experts(), one_rank_group)
    with pytest.raises(ValueError, match=r"topk_idx must be \[S=5, K\] int64 with K >= 1, got \[5, 0\]"):
        moonep_experts(x, idx[:, :0], w[:, :0], experts(), one_rank_group)


def test_layout_refuses_a_batch_or_counts_of_another_plan():
    """layout read topk_idx and counts of any shape: a [3, 2] batch against a plan of S=2 sent the extra pairs
    to rank 1 rows that collide; counts [3, 6] against a plan of R=2, E=4 named wrong source ranks."""
    counts = torch.tensor([[4, 0, 0, 0], [4, 0, 0, 0]])
    p = plan(counts, S=2, K=2)
    idx = torch.zeros(2, 2, dtype=torch.int64)
    assert layout(p, counts, idx, 0).dest_row.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"topk_idx must be the plan's \[S=2, K=2\] int64, got \[3, 2\]"):
        layout(p, counts, torch.zeros(3, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"topk_idx must be the plan's \[S=2, K=2\] int64, got \[2, 2\] torch.float32"):
        layout(p, counts, idx.float(), 0)
    with pytest.raises(ValueError, match=r"counts must be the plan's \[R=2, E=4\] int64 \(or int32\), got \[3, 6\]"):
        layout(p, torch.zeros(3, 6, dtype=torch.int64), idx, 0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layout_refuses_counts_that_are_not_integers(backend):
    """layout took float or bool counts the planner refuses: bool counts (read as 0/1) gave an IndexError on
    the torch backend and rows far outside the buffer on the Triton one; int32 counts stay accepted."""
    counts = torch.tensor([[3, 1, 0, 0], [0, 2, 1, 1]])
    p = plan(counts, S=2, K=2)
    idx = torch.tensor([[0, 1], [0, 0]])
    want = layout(p, counts, idx, 0, backend="torch")
    got = layout(p, counts.int(), idx, 0, backend=backend)
    assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("dest_rank", "dest_row", "src_rank"))
    for bad in (counts.bool(), counts.float(), counts.tolist()):
        with pytest.raises(ValueError, match=r"layout: counts must be the plan's \[R=2, E=4\] int64 \(or int32\)"):
            layout(p, bad, idx, 0, backend=backend)
    with pytest.raises(ValueError, match=r"layout: topk_idx must be the plan's \[S=2, K=2\] int64, got list"):
        layout(p, counts, idx.tolist(), 0, backend=backend)


CASES = [Case(routing=r, mode=m, padded=(r == "uniform"), seed=i)
         for i, r in enumerate(ROUTINGS) for m in ("moonep", "alltoall")]


@pytest.mark.parametrize("R", [2, 4])
def test_ranks_equal_one_process(one_rank_group, R):
    """R gloo ranks, every routing, both modes: outputs and gradients (x, weights, every expert) equal the
    dense MoE on one process and EP = 1 (float32, 1e-5); MoonEP ranks each process exactly S*K pairs with
    at most E/R redundant experts, the baseline's loads sum to R*S*K. With R = 4 also on a dp=2 x ep=2
    mesh: MoonEP over the ep subgroups (group ranks, not world ranks) equals one process per group."""
    ep_cases = [Case(routing="zipf", seed=7), Case(routing="one_expert", mode="alltoall", seed=8)] if R == 4 else []
    out = launch(check_worker, R, CASES, ep_cases, 2, timeout_s=150)
    results = [o["world"] for o in out]
    for i, case in enumerate(CASES):
        per_rank = [res[i] for res in results]
        got, ref, ep1 = gather_ranks(per_rank), reference(case, R), _ep1(case, R, one_rank_group, case.mode)
        tag = f"R={R} {case.routing} {case.mode}"
        for key in ("out", "grad_x", "grad_topk_weight"):
            assert_close(f"{tag} {key}", ref[key], got[key], 1e-5)
        for n in ref["grads"]:
            assert_close(f"{tag} grad {n}", ref["grads"][n], got["grads"][n], 1e-5)
            assert_close(f"{tag} grad {n} vs EP=1", ep1["grads"][n], got["grads"][n], 1e-5)
        rows = [res["rows"] for res in per_rank]
        if case.mode == "moonep":
            assert rows == [case.S * case.K] * R, (tag, rows)
            assert max(per_rank[0]["redundant"]) <= case.E // R
        else:
            assert sum(rows) == R * case.S * case.K, (tag, rows)
    # The skew is real: the baseline's busiest rank carries well over S*K under "one_expert".
    one = CASES.index(Case(routing="one_expert", mode="alltoall", seed=ROUTINGS.index("one_expert")))
    assert max(res[one]["rows"] for res in results) == R * Case().S * Case().K
    # dp=2 x ep=2 mesh: each ep group (world ranks {0, 1} and {2, 3}) runs its own batch over its group.
    for i, case in enumerate(ep_cases):
        for dp in range(2):
            per_rank = [o["ep"][i] for o in out[2 * dp:2 * dp + 2]]
            assert all(res["dp"] == dp for res in per_rank)
            got, ref = gather_ranks(per_rank), reference(Case(**per_rank[0]["case"]), 2)
            for key in ("out", "grad_x", "grad_topk_weight"):
                assert_close(f"mesh dp={dp} {case.mode} {key}", ref[key], got[key], 1e-5)
            for n in ref["grads"]:
                assert_close(f"mesh dp={dp} {case.mode} grad {n}", ref["grads"][n], got["grads"][n], 1e-5)


def test_ranks_of_unequal_batches():
    """4 gloo ranks holding 6, 0, 3 and 5 tokens. The baseline equals the dense MoE on the 14 tokens (float32,
    1e-5), the empty rank included. MoonEP on these sizes raised an IndexError on one rank while the others
    waited in a collective (an empty rank returned early and left them waiting): now every rank raises the
    same ValueError naming the sizes. An id outside [0, E) on the last rank alone fails on every rank too."""
    sizes, case = [6, 0, 3, 5], Case(mode="alltoall", seed=3)
    out = launch(uneven_worker, 4, sizes, case, timeout_s=150)
    full = make_inputs(Case(**{**case.__dict__, "S": max(sizes)}), 4)
    n = sum(sizes)
    x = full["x"][:n].clone().requires_grad_()
    tw = full["topk_weight"][:n].clone().requires_grad_()
    ws = {k: full[k].clone().requires_grad_() for k in ("w_gate", "w_up", "w_down")}
    ref = dense_moe(x, full["topk_idx"][:n], tw, ws["w_gate"], ws["w_up"], ws["w_down"], ffn=_run_ffn)
    (ref * full["w_o"][:n]).sum().backward()
    got = gather_ranks(out)
    assert_close("uneven out", ref.detach(), got["out"], 1e-5)
    assert_close("uneven grad_x", x.grad, got["grad_x"], 1e-5)
    assert_close("uneven grad_topk_weight", tw.grad, got["grad_topk_weight"], 1e-5)
    for k, w in ws.items():
        assert_close(f"uneven grad {k}", w.grad, got["grads"][k], 1e-5)
    for r, res in enumerate(out):
        assert res["moonep_sizes"] is not None and "(S, K) = [(6, 3), (0, 3), (3, 3), (5, 3)] by rank" in \
            res["moonep_sizes"], (r, res["moonep_sizes"])
        want = r"\[0, E=8\).*\[8\] at tokens \[4\] on rank 3" if r == 3 else r"ranks \[3\] hold ids outside it"
        assert res["bad_id"] is not None and re.search(want, res["bad_id"]), (r, res["bad_id"])


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_entry_runs_k3lab_moe_grouped_experts(one_rank_group, activation):
    """The contract with k3lab.moe: its GroupedExperts (and activation) plug in as ``experts``; EP = 1
    equals GroupedExperts run on the pairs grouped by k3lab.moe's own group_by_expert."""
    from k3lab.moe.experts import GroupedExperts, group_by_expert

    torch.manual_seed(0)
    S, K, E, d, h = 24, 2, 6, 16, 8
    experts = GroupedExperts(E, d, h, activation=activation, init_std=0.3)
    x = torch.randn(S, d)
    idx = make_routing("zipf", 1, S, K, E, torch.Generator().manual_seed(1))[0]
    w = torch.rand(S, K)
    order, offsets, _ = group_by_expert(idx, E)
    y = torch.zeros(S * K, d).index_copy(0, order, experts(x[order // K], offsets))
    want = (y.view(S, K, d) * w[..., None]).sum(1)
    assert torch.equal(moonep_experts(x, idx, w, experts, one_rank_group), want)
    assert torch.equal(moonep_experts(x, idx, w, experts, one_rank_group, mode="alltoall"), want)


@pytest.mark.parametrize("rank", [-1, 2, 1.0, True])
def test_layout_rejects_a_rank_outside_the_group(rank):
    counts = torch.tensor([[3, 1], [2, 2]])
    p = plan(counts, S=4, K=1)
    with pytest.raises(ValueError, match=r"layout: rank must be an int in \[0, R=2\)"):
        layout(p, counts, torch.tensor([[0], [1], [0], [0]]), rank)


COMPILE_FILL = """
from sm90_compile import compile_sm90
from k3lab.kernels.moonep import fill
for (R, E), C in zip(((64, 896), (8, 896), (7, 21), (16, 2048), (64, 896)), (2**17, 2**17, 2**17, 2**17, 2**20)):
    const = dict(fill.launch_config(R, E // R), **fill.state_dtype(R, E // R, C))
    num_warps = const.pop("num_warps")
    io = dict(counts="*i64", keep="*i64", give="*i64", donor="*i64", assign="*i64", slot_experts="*i64",
              slot_counts="*i64", offsets="*i32", R="i32", L="i32", C="i32")
    print(compile_sm90(fill.moonep_fill_kernel, io, const, num_warps=num_warps))
"""


COMPILE_LAYOUT = """
from sm90_compile import compile_sm90
from k3lab.kernels.moonep import layout
ptrs = ("e_ids", "pos", "base", "assign", "slot_counts", "slot_experts", "counts_cum", "dest_rank", "dest_row",
        "src_rank")
io = {n: "*i64" for n in ptrs} | dict(offsets="*i32", N="i32", C="i32", R="i32", L="i32", rank="i32",
                                      n_pair_blocks="i32")
print(compile_sm90(layout.moonep_layout_kernel, io, dict(BLOCK=layout.BLOCK), num_warps=4))
"""


def test_layout_kernel_compiles_for_sm90_without_spills(compile_sm90_lines):
    lines = compile_sm90_lines(COMPILE_LAYOUT)
    assert len(lines) == 1 and "STACK:0" in lines[0], lines


def test_fill_kernel_compiles_for_sm90_without_spills(compile_sm90_lines):
    """The interpreter accepts code the GPU compiler refuses: compile the fill for sm_90 (Triton's front end
    and the wheel's ptxas, no GPU needed) at the benchmark's shapes and the tile limit, each at the
    launcher's width (int32 state; the last shape again with int64 state), in a process without
    TRITON_INTERPRET; no register spills (STACK:0)."""
    lines = compile_sm90_lines(COMPILE_FILL)
    assert len(lines) == 5 and all("STACK:0" in line for line in lines), lines


@pytest.mark.parametrize("kind", ["zipf", "one_expert"])
def test_plan_and_layout_equals_plan_then_layout(kind):
    """``plan_and_layout`` (on a GPU the layout's sort on a second stream beside the fill) gives the same
    integers as ``plan`` then ``layout``, on every rank; ``pair_positions`` is the stable rank of each pair."""
    from k3lab.moonep.planner import pair_positions, plan_and_layout

    R, L, S, K = 4, 3, 16, 2
    gen = torch.Generator().manual_seed(3)
    idx = make_routing(kind, R, S, K, R * L, gen)
    counts = torch.stack([torch.bincount(idx[r].reshape(-1), minlength=R * L) for r in range(R)])
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        c, ix = counts.to(dev), idx.to(dev)
        p = plan(c, S, K)
        for r in range(R):
            p2, lay2 = plan_and_layout(c, ix[r], r, S, K)
            lay = layout(p, c, ix[r], r)
            assert torch.equal(p2.assign, p.assign) and torch.equal(p2.offsets, p.offsets)
            for f in ("dest_rank", "dest_row", "src_rank", "offsets", "slot_experts"):
                assert torch.equal(getattr(lay2, f), getattr(lay, f)), (dev, r, f)
    e = idx[0].reshape(-1)
    pos = pair_positions(idx[0])
    expected = torch.empty_like(e)
    expected[sorted(range(e.numel()), key=lambda i: (int(e[i]), i))] = torch.arange(e.numel())
    assert torch.equal(pos, expected)


def test_plan_and_layout_and_pair_positions_name_bad_inputs():
    """plan_and_layout and pair_positions checked nothing of their own: counts that are not a tensor raised
    AttributeError, topk_idx on another device than counts a bare RuntimeError (on a GPU after forking the
    side stream), and pair_positions took float or 1-D ids, wrote part of an oversized ``out`` silently and
    gave torch's scatter errors for an ``out`` of the wrong size or dtype. Now each is a ValueError naming the
    argument and what was expected, checked before any stream fork; a non-contiguous topk_idx still works."""
    from k3lab.moonep.planner import pair_positions, plan_and_layout

    counts = torch.tensor([[3, 1, 0, 0], [0, 2, 1, 1]])
    idx = torch.tensor([[0, 1], [0, 0]])
    with pytest.raises(ValueError, match=r"counts must be a \[R, E\] int64 \(or int32\) tensor, got list"):
        plan_and_layout(counts.tolist(), idx, 0, 2, 2)
    for bad, got in ((idx.float(), r"\[2, 2\] torch.float32"), (idx.reshape(-1), r"\[4\] torch.int64"),
                     (torch.zeros(3, 2, dtype=torch.int64), r"\[3, 2\] torch.int64")):
        with pytest.raises(ValueError, match=r"plan_and_layout: topk_idx must be the plan's \[S=2, K=2\] int64, "
                                             r"got " + got):
            plan_and_layout(counts, bad, 0, 2, 2)
    with pytest.raises(ValueError, match=r"plan_and_layout: topk_idx must be the plan's \[S=4, K=1\] int64"):
        plan_and_layout(counts, idx, 0, 4, 1)
    with pytest.raises(ValueError, match=r"plan_and_layout: rank must be an int in \[0, R=2\), got 2"):
        plan_and_layout(counts, idx, 2, 2, 2)
    # "meta" stands in for another device on a CPU-only machine.
    with pytest.raises(ValueError, match="plan_and_layout: topk_idx must be on counts' device cpu, got meta"):
        plan_and_layout(counts, idx.to("meta"), 0, 2, 2)
    with pytest.raises(ValueError, match="layout: topk_idx must be on counts' device cpu, got meta"):
        layout(plan(counts, 2, 2), counts, idx.to("meta"), 0)
    strided = torch.tensor([[0, 0], [1, 0]]).T
    assert not strided.is_contiguous()
    assert torch.equal(plan_and_layout(counts, strided, 0, 2, 2)[1].dest_row,
                       layout(plan(counts, 2, 2), counts, idx, 0).dest_row)

    for bad, got in ((idx.float(), r"\[2, 2\] torch.float32"), (idx.reshape(-1), r"\[4\] torch.int64"),
                     (idx.tolist(), "list")):
        with pytest.raises(ValueError, match=r"pair_positions: topk_idx must be an \[S, K\] int64 tensor, got " + got):
            pair_positions(bad)
    for out, got in ((torch.empty(3, dtype=torch.int64), r"\[3\] torch.int64 on cpu"),
                     (torch.full((6,), -1), r"\[6\] torch.int64 on cpu"),
                     (torch.empty(4, dtype=torch.int32), r"\[4\] torch.int32 on cpu"),
                     (torch.empty(4, dtype=torch.int64, device="meta"), r"\[4\] torch.int64 on meta")):
        with pytest.raises(ValueError, match=r"pair_positions: out must be an \[S\*K=4\] int64 tensor on "
                                             r"topk_idx's device cpu, got " + got):
            pair_positions(idx, out)
    out = torch.full((4,), -1)
    assert pair_positions(strided, out) is out and out.tolist() == [0, 3, 1, 2]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layout_checks_pos_and_reads_a_strided_one(backend):
    """layout's ``pos`` went to the Triton kernel as it came: a strided one (``pair_positions`` into a view)
    gave garbage rows, and one of the wrong size a broadcast error on the torch backend."""
    from k3lab.moonep.planner import pair_positions

    counts = torch.tensor([[3, 1, 0, 0], [0, 2, 1, 1]])
    idx = torch.tensor([[0, 1], [0, 0]])
    p = plan(counts, 2, 2)
    want = layout(p, counts, idx, 0, backend="torch")
    pos = pair_positions(idx, torch.full((8,), 7)[::2])
    got = layout(p, counts, idx, 0, backend=backend, pos=pos)
    assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("dest_rank", "dest_row", "src_rank"))
    with pytest.raises(ValueError, match=r"layout: pos must be pair_positions\(topk_idx\), an \[S\*K=4\] int64 "
                                         r"tensor on counts' device cpu, got \[3\] torch.int64 on cpu"):
        layout(p, counts, idx, 0, backend=backend, pos=pos[:3])


def routing_of(counts: torch.Tensor, S: int, K: int, seed: int) -> torch.Tensor:
    """[R, S, K] int64 expert ids whose per-rank bincounts are ``counts`` [R, E] (rows summing to S*K), in a
    random order: any counts, adversarial ones included, get a routing the layout can take."""
    gen = torch.Generator().manual_seed(seed)
    R, E = counts.shape
    rows = [torch.arange(E).repeat_interleave(counts[r]) for r in range(R)]
    return torch.stack([row[torch.randperm(S * K, generator=gen)].view(S, K) for row in rows])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind, R, L, S, K, seed", [
    ("multinomial", 4, 3, 16, 2, 0), ("multinomial", 5, 2, 9, 3, 1), ("one_expert", 4, 3, 12, 2, 2),
    ("one_rank_idle", 3, 4, 10, 2, 3), ("identical", 4, 2, 8, 2, 4), ("one_rank_hot", 6, 2, 7, 3, 5),
    ("zipf", 8, 3, 6, 4, 6), ("one_expert", 1, 3, 5, 2, 7)])
def test_layout_with_precomputed_plan_free_pieces_equals_layout(backend, kind, R, L, S, K, seed):
    """What ``plan_and_layout`` hands ``layout`` from its side stream (``pair_positions`` and ``count_prefixes``,
    written into given tensors, the ids of a strided topk_idx copied) gives the same integers as ``plan`` then
    ``layout`` computing everything itself, on every rank, on random and adversarial counts (every pair on
    one expert, an idle home rank, one hot home rank), int64 and int32 counts; ``count_prefixes`` equals its
    definition in plain Python."""
    from k3lab.moonep.planner import count_prefixes, pair_positions, plan_and_layout

    counts = make_counts(kind, R, L, S, K, seed)
    idx = routing_of(counts, S, K, seed)
    E = R * L
    p = plan(counts, S, K)
    for c in (counts, counts.int()):
        for r in range(R):
            want = layout(p, counts, idx[r], r, backend="torch")
            strided = idx[r].T.contiguous().T
            ids = torch.empty(S, K, dtype=torch.int64).copy_(strided)
            pos = pair_positions(ids, torch.full((S * K,), -1))
            out = (torch.full((R, E), -1), torch.full((E,), -1))
            counts_cum, base = count_prefixes(c, r, out=out)
            assert counts_cum is out[0] and base is out[1]
            got = layout(p, c, ids, r, backend=backend, pos=pos, counts_cum=counts_cum, base=base)
            for f in LAYOUT_FIELDS:
                assert torch.equal(getattr(got, f), getattr(want, f)), (kind, c.dtype, r, f)
            # Each piece alone, the others computed inside.
            for given in (dict(pos=pos), dict(counts_cum=counts_cum), dict(base=base)):
                alone = layout(p, c, ids, r, backend=backend, **given)
                assert torch.equal(alone.dest_row, want.dest_row) and torch.equal(alone.src_rank, want.src_rank)
            p2, lay2 = plan_and_layout(c, strided, r, S, K, backend=backend)
            assert_same_plan(p2, p)
            assert all(torch.equal(getattr(lay2, f), getattr(want, f)) for f in LAYOUT_FIELDS)
            cl = counts.tolist()
            assert counts_cum.tolist() == [[sum(cl[q][e] for q in range(i + 1)) for e in range(E)] for i in range(R)]
            assert base.tolist() == [sum(cl[q][e] for q in range(r + 1)) - sum(cl[r][: e + 1]) for e in range(E)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layout_and_count_prefixes_name_bad_precomputed_pieces(backend):
    """Precomputed counts_cum and base of the wrong shape, dtype or device, or not tensors, are ValueErrors
    naming the argument and what was expected, as a bad ``pos``; so are count_prefixes' bad arguments."""
    from k3lab.moonep.planner import count_prefixes

    counts = torch.tensor([[3, 1, 0, 0], [0, 2, 1, 1]])
    idx = torch.tensor([[0, 1], [0, 0]])
    p = plan(counts, 2, 2)
    cum, base = count_prefixes(counts, 0)
    for name, bad, got in (
            ("counts_cum", cum[:1], r"\[1, 4\] torch.int64 on cpu"), ("counts_cum", cum.int(), r"\[2, 4\] torch.int32"),
            ("counts_cum", cum.T, r"\[4, 2\] torch.int64"),
            ("counts_cum", cum.to("meta"), r"\[2, 4\] torch.int64 on meta"),
            ("counts_cum", cum.tolist(), "list"), ("base", base[:3], r"\[3\] torch.int64 on cpu"),
            ("base", base.float(), r"\[4\] torch.float32"), ("base", cum, r"\[2, 4\] torch.int64"),
            ("base", base.to("meta"), r"\[4\] torch.int64 on meta")):
        what = r"\[R=2, E=4\]" if name == "counts_cum" else r"\[E=4\]"
        with pytest.raises(ValueError, match=rf"layout: {name} must be count_prefixes\(counts, rank\)'s {what} int64 "
                                             rf"tensor on counts' device cpu, got {got}"):
            layout(p, counts, idx, 0, backend=backend, **{name: bad})
    with pytest.raises(ValueError, match=r"count_prefixes: counts must be an \[R, E\] int64 \(or int32\) tensor, "
                                         r"got \[2, 4\] torch.float32"):
        count_prefixes(counts.float(), 0)
    with pytest.raises(ValueError, match=r"count_prefixes: rank must be an int in \[0, R=2\), got 2"):
        count_prefixes(counts, 2)
    for out, got in (((cum, base[:3]), r"\[2, 4\] torch.int64 on cpu, \[3\] torch.int64 on cpu"),
                     ((cum.int(), base), r"\[2, 4\] torch.int32 on cpu, \[4\] torch.int64 on cpu"),
                     ((cum,), r"\[2, 4\] torch.int64 on cpu"), (cum, "Tensor")):
        with pytest.raises(ValueError, match=r"count_prefixes: out must be \(\[R=2, E=4\], \[E=4\]\) int64 tensors "
                                             r"on counts' device cpu, got \(" + got + r"\)"):
            count_prefixes(counts, 0, out=out)


def test_dense_moe_of_no_tokens_is_empty():
    """N = 0 failed reshaping [0, K, -1] ("the unspecified dimension size -1 can be any value"); the reference
    gives [0, d] as moonep_experts does."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(4, 8, 4, generator=g), torch.randn(4, 8, 4, generator=g), torch.randn(4, 4, 8, generator=g)]
    out = dense_moe(torch.randn(0, 8), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), *ws)
    assert out.shape == (0, 8)
