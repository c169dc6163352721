"""KCP (KDA context parallelism): the affine maps, the fold and the scan, the layout, the conv halo,
and 2- and 4-rank gloo runs against one process (outputs and every gradient, rank by rank)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3lab.kcp import kcp_kda, kcp_short_conv, make_context, naive_kcp_kda, short_conv_reference
from k3lab.kcp.affine import compose, fold_scan, fold_sequential, scan_maps, segment_map
from k3lab.kcp.layout import draw_layout, folded_ranks, sent_map
from k3lab.dist import launch
from k3lab.kcp.workers import Case, check_worker, errors_vs_reference, reference
from k3lab.kda import chunk_kda
from k3lab.testing import assert_close

# R = 4, T = 128 (32 per rank); R = 2 (64 per rank):
#   [0, 10) inside rank 0; [10, 80) from mid-rank 0 across rank 1 (wholly inside it) into rank 2
#   (3 ranks for R = 4); [80, 96) inside rank 2, ending on a rank boundary; [96, 100) starting on
#   one; [100, 128) starting mid-rank 3.
VARLEN = (0, 10, 80, 96, 100, 128)


def _rand_map(gen, *shape, K, V, dtype=torch.float64):
    M = torch.eye(K, dtype=dtype) + 0.3 * torch.randn(*shape, K, K, generator=gen, dtype=dtype)
    return torch.cat([M, torch.randn(*shape, K, V, generator=gen, dtype=dtype)], -1)


@pytest.mark.parametrize("L,slab,decay", [(150, None, 0.05), (150, 32, 0.05), (7, None, 0.05), (64, 16, 0.05),
                                          (150, 32, 0.3), (80, None, 8.0)], ids=lambda x: str(x))
def test_segment_map_is_the_identity_state_trick(L, slab, decay):
    """[M | S~] from chunk maps + tree reduction == chunk_kda's final state from [I | 0] with values [0 | v]
    (decay 8 per token leaves K3's bound, so the generic scores are used)."""
    gen = torch.Generator().manual_seed(L)
    HV, K, V, dt = 3, 8, 6, torch.float64
    k = F.normalize(torch.randn(1, L, HV, K, generator=gen, dtype=dt), dim=-1)
    v = torch.randn(1, L, HV, V, generator=gen, dtype=dt)
    g = -decay * torch.rand(1, L, HV, K, generator=gen, dtype=dt)
    beta = torch.rand(1, L, HV, generator=gen, dtype=dt)
    start = torch.cat([torch.eye(K, dtype=dt).expand(1, HV, K, K), torch.zeros(1, HV, K, V, dtype=dt)], -1)
    vals = torch.cat([torch.zeros(1, L, HV, K, dtype=dt), v], -1)
    _, ref = chunk_kda(torch.randn_like(k), k, vals, g, beta, initial_state=start, output_final_state=True,
                       chunk_size=16)
    m = segment_map(*(x[0].transpose(0, 1) for x in (k, v, g)), beta[0].T, chunk_size=16, slab_tokens=slab)
    assert_close("M", ref[0, ..., :K], m[..., :K], 1e-12)
    assert_close("S~", ref[0, ..., K:], m[..., K:], 1e-12)


def test_compose_is_associative_and_fold_matches_scan():
    gen = torch.Generator().manual_seed(0)
    a, b, c = _rand_map(gen, 3, 2, K=5, V=4)
    assert_close("assoc", compose(compose(a, b), c), compose(a, compose(b, c)), 1e-12)
    for R in (1, 2, 3, 5, 8, 13):
        maps = _rand_map(gen, R, 2, K=5, V=4)
        h0 = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
        resets = torch.rand(R, generator=gen) < 0.3
        resets[0] = True
        prefix = scan_maps(maps, resets)
        for stop in range(1, R + 1):
            first = max(j for j in range(stop) if resets[j])
            seq = fold_sequential(maps, first, stop, h0)
            assert_close(f"R{R} stop{stop}", seq, fold_scan(maps, resets, first, stop, h0), 1e-12)
            assert_close(f"R{R} stop{stop} zero", fold_sequential(maps, first, stop),
                         prefix[stop - 1][..., 5:], 1e-12)


def test_context_layout():
    ctx = make_context(128, VARLEN, rank=2, world_size=4)
    assert ctx.pieces() == [(1, 64, 80), (2, 80, 96)]
    assert ctx.local_cu_seqlens == [0, 16, 32]
    assert ctx.first_continues and ctx.fold_from == 0
    assert ctx.resets == (True, False, True, True)
    assert ctx.ends_here == [True, True]
    r3 = make_context(128, VARLEN, rank=3, world_size=4)
    assert not r3.first_continues and r3.fold_from == 3 and r3.local_docs == [3, 4]
    with pytest.raises(ValueError, match="multiple of the world size"):
        make_context(130, None, rank=0, world_size=4)
    with pytest.raises(ValueError, match="strictly increasing"):
        make_context(128, (0, 10, 10, 128), rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank must be"):
        make_context(128, None, rank=4, world_size=4)


def test_layout_labels_and_drawing():
    """sent_map / folded_ranks on VARLEN over 4 ranks (the book's worked layout), and one drawing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = [make_context(128, VARLEN, rank=r, world_size=4) for r in range(4)]
    assert [sent_map(c) for c in ctxs] == ["[0|S_end]", "[M|S̃] width K+V", "[0|0] unused", "[0|0] unused"]
    assert [folded_ranks(c) for c in ctxs] == [([], [1, 2]), ([0], [2]), ([0, 1], []), ([], [])]
    fig, ax = plt.subplots()
    draw_layout(128, VARLEN, 4, ax)
    # 7 document pieces; 3 forward + 3 backward fold arrows
    assert len(ax.patches) == 7 + 6
    plt.close(fig)
    with pytest.raises(ValueError, match="multiple of the world size"):
        draw_layout(130, None, 4, ax)


def test_one_process_matches_chunk_kda_and_rejects_bad_input():
    """R = 1: kcp_kda and kcp_short_conv are chunk_kda and the per-document conv."""
    gen = torch.Generator().manual_seed(3)
    T, H, K = 40, 2, 8
    ctx = make_context(T, (0, 13, 40))
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    k = F.normalize(k, dim=-1)
    v, g = torch.randn(1, T, H, K, generator=gen), -torch.rand(1, T, H, K, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    ref, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 13, 40]), chunk_size=16)
    out, _ = kcp_kda(q, k, v, g, beta, ctx, chunk_size=16)
    assert_close("o", ref, out, 1e-6)
    x, w = torch.randn(1, T, 6, generator=gen), torch.randn(6, 4, generator=gen)
    assert_close("conv", short_conv_reference(x, w, [0, 13, 40]), kcp_short_conv(x, w, ctx), 1e-6)
    with pytest.raises(ValueError, match="fold"):
        kcp_kda(q, k, v, g, beta, ctx, fold="tree")
    with pytest.raises(ValueError, match="T_local"):
        kcp_kda(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], ctx)
    with pytest.raises(ValueError, match="initial_state"):
        kcp_kda(q, k, v, g, beta, ctx, initial_state=torch.zeros(1, H, K, K))
    with pytest.raises(ValueError, match="slab_tokens"):
        kcp_kda(q, k, v, g, beta, ctx, chunk_size=16, slab_tokens=24)
    with pytest.raises(ValueError, match="weight"):
        kcp_short_conv(x, torch.randn(5, 4), ctx)
    # Regressions: an integer x cast the taps to int (all-zero output); q=None raised
    # AttributeError, chunk_size=0 ZeroDivisionError; offsets past T gave the reference a longer output.
    with pytest.raises(ValueError, match="x must be a floating-point tensor"):
        kcp_short_conv(x.round().long(), w, ctx)
    with pytest.raises(ValueError, match="q must be a tensor"):
        kcp_kda(None, k, v, g, beta, ctx)
    with pytest.raises(ValueError, match="chunk_size"):
        kcp_kda(q, k, v, g, beta, ctx, chunk_size=0, slab_tokens=64)
    with pytest.raises(ValueError, match="cu_seqlens"):
        short_conv_reference(x, w, [0, 10, 50])
    with pytest.raises(ValueError, match="ctx must be a KCPContext"):
        naive_kcp_kda(q, k, v, g, beta, None)
    with pytest.raises(ValueError, match="output_final_state must be a bool"):
        naive_kcp_kda(q, k, v, g, beta, ctx, output_final_state="yes")


def _cases():
    # The varlen case under both folds and the gather-everything reference; then one document at
    # two lengths (bytes must not change with T), with the slabbed local KDA.
    return [Case(T=128, cu_seqlens=VARLEN, H=1, HV=2, seed=1),
            Case(T=128, with_h0=True, seed=2, slab_tokens=32, folds=("sequential",)),
            Case(T=256, with_h0=False, seed=3, slab_tokens=32, folds=("sequential",))]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_kcp_matches_one_process(world_size):
    cases = _cases()
    results = launch(check_worker, world_size, cases, timeout_s=200)
    i = 0
    kcp_bytes = {}
    for case in cases:
        ref = reference(case)
        for fold in case.folds:
            ranks = [per_rank[i] for per_rank in results]
            i += 1
            errs = errors_vs_reference(ref, ranks)
            # Every rank's own slice of every gradient, not only their sum.
            assert len(errs) == 1 + world_size * 6 + 3 + case.with_h0
            bad = {name: e for name, e in errs.items() if not e <= 1e-5}
            assert not bad, f"{world_size} ranks, {case}, fold={fold}: {bad}"
            if fold != "naive":
                totals = {sum(n for _, n in r["comm"]) for r in ranks}
                assert len(totals) == 1
                kcp_bytes[(case.T, case.cu_seqlens, fold)] = totals.pop()
    # Bytes per layer (forward + backward, maps and conv halos) do not depend on T: R * HV * K * (K+V)
    # * 4 for the maps each way, R * (W-1) * D * 4 per conv halo each way.
    assert kcp_bytes[(128, None, "sequential")] == kcp_bytes[(256, None, "sequential")]
    c = cases[1]
    maps = world_size * c.HV * c.K * (c.K + c.V) * 4
    halos = world_size * (c.W - 1) * (2 * c.H * c.K + c.HV * c.V) * 4
    assert kcp_bytes[(256, None, "sequential")] == 2 * (maps + halos)


def test_bounded_scores_match_decayed_scores():
    """K3's gate (g > -5 per token): the matmul-only scores equal the generic ones."""
    from k3lab.kcp.affine import bounded_scores
    from k3lab.kda.chunk import decayed_scores

    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(2, 3, 64, 32, generator=gen), torch.randn(2, 3, 64, 32, generator=gen)
    G = (-5 * torch.rand(2, 3, 64, 32, generator=gen)).cumsum(-2)
    for inclusive in (True, False):
        assert_close(f"inclusive={inclusive}", decayed_scores(a, b, G, inclusive),
                     bounded_scores(a, b, G, inclusive), 1e-5)


def test_entry_points_reject_wrong_argument_types():
    """A ctx that is not a KCPContext or an initial_state that is not a tensor failed with an
    AttributeError; a [D, 0] conv weight with a RuntimeError from a broadcast."""
    T, H, K = 16, 2, 8
    ctx = make_context(T)
    q = torch.randn(1, T, H, K, dtype=torch.float64)
    k = F.normalize(torch.randn(1, T, H, K, dtype=torch.float64), dim=-1)
    v, g, beta = torch.randn(1, T, H, K, dtype=torch.float64), -torch.rand(1, T, H, K, dtype=torch.float64), \
        torch.rand(1, T, H, dtype=torch.float64)
    with pytest.raises(ValueError, match="ctx"):
        kcp_kda(q, k, v, g, beta, None)
    with pytest.raises(ValueError, match="initial_state"):
        kcp_kda(q, k, v, g, beta, ctx, initial_state=[[0.0]])
    # Regressions: these were taken (the state silently converted, the flag read as truthy) or
    # failed deep inside with a TypeError.
    with pytest.raises(ValueError, match="initial_state must be a floating-point tensor"):
        kcp_kda(q, k, v, g, beta, ctx, initial_state=torch.zeros(1, H, K, K, dtype=torch.long))
    with pytest.raises(ValueError, match="output_final_state must be a bool"):
        kcp_kda(q, k, v, g, beta, ctx, output_final_state=1)
    for slab in (16.0, "16", True):
        with pytest.raises(ValueError, match="slab_tokens must be an int"):
            kcp_kda(q, k, v, g, beta, ctx, chunk_size=16, slab_tokens=slab)
    with pytest.raises(ValueError, match="local_op must be None or a function"):
        kcp_kda(q, k, v, g, beta, ctx, local_op=3)
    for T_bad in (16.0, "16", True):
        with pytest.raises(ValueError, match="T must be an int"):
            make_context(T_bad)
    with pytest.raises(ValueError, match="ctx"):
        kcp_short_conv(torch.randn(1, T, 6), torch.randn(6, 4), None)
    with pytest.raises(ValueError, match="weight"):
        kcp_short_conv(torch.randn(1, T, 6), torch.randn(6, 0), ctx)


def test_context_lookups_name_an_index_out_of_range():
    """doc_of(100) and rank_of(-1) raised a bare StopIteration, pieces(5) an IndexError."""
    ctx = make_context(16, (0, 5, 16), rank=0, world_size=2)
    assert (ctx.doc_of(7), ctx.rank_of(9), ctx.pieces(1)) == (1, 1, [(1, 8, 16)])
    for call, match in ((lambda: ctx.doc_of(100), r"t must be an int in \[0, 16\), got 100"),
                        (lambda: ctx.rank_of(-1), r"t must be an int in \[0, 16\), got -1"),
                        (lambda: ctx.pieces(5), r"rank must be an int in \[0, 2\), got 5")):
        with pytest.raises(ValueError, match=match):
            call()


def test_second_derivative_is_refused():
    """The backward recomputes with autograd passes of its own, so a create_graph=True gradient held none
    of KDA's second-order terms: a penalty on dx gave dA 0.229 where the one-process layer gives 0.448.
    Differentiating it again must raise, as for kcp_flash_kda."""
    T = 16
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, T, 1, 8, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(1, T, 1, 8, dtype=torch.float64)
    beta = torch.rand(1, T, 1, dtype=torch.float64)
    q.requires_grad_()
    g.requires_grad_()
    o, _ = kcp_kda(q, k, v, g, beta, make_context(T), chunk_size=4)
    (dq,) = torch.autograd.grad((o**2).sum() + (q**3).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice KCPFunction"):
        torch.autograd.grad(dq.square().sum() + 0 * g.sum(), g)


def test_bad_world_size_and_layout_only_contexts_are_refused():
    """make_context(world_size=0) said "rank must be in [0, 0)" and world_size=True passed as 1. A
    layout-only context (rank/world_size without a group) handed to kcp_kda or kcp_short_conv failed
    inside torch ("Default process group has not been initialized"), or, under a default group of
    another size, ran its collectives on that group."""
    for ws in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="world_size must be an int >= 1"):
            make_context(32, rank=0, world_size=ws)
    with pytest.raises(ValueError, match="rank must be an int"):
        make_context(32, rank=True, world_size=2)
    T, H, K = 16, 1, 8
    ctx = make_context(2 * T, rank=0, world_size=2)
    q = torch.randn(1, T, H, K, dtype=torch.float64)
    k = F.normalize(torch.randn(1, T, H, K, dtype=torch.float64), dim=-1)
    v, g = torch.randn(1, T, H, K, dtype=torch.float64), -torch.rand(1, T, H, K, dtype=torch.float64)
    beta = torch.rand(1, T, H, dtype=torch.float64)
    with pytest.raises(ValueError, match="layout only"):
        kcp_kda(q, k, v, g, beta, ctx)
    with pytest.raises(ValueError, match="layout only"):
        kcp_short_conv(torch.randn(1, T, 6), torch.randn(6, 4), ctx)


def test_bench_kcp_help_names_the_module(capsys):
    """--help printed `usage: kcp.py`; it must show how the bench is run."""
    from k3lab.bench import kcp as bench

    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m k3lab.bench.kcp "), out[:80]
