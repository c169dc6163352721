"""FlashKDA's packed sequences and states: varlen batches (every sub-tile tail, strided offsets,
NaN-poisoned buffers), the chunk tables, the state kernels' V tiles and prefetch, the output written by
the state kernel, and KCP ranks running the kernels.

Float32 kernels (TRITON_INTERPRET=1 on CPU, set by tests/conftest.py) against ``k3lab.kda.naive_fused_kda``
in float64; the bf16 GPU check is ``python -m k3lab.bench.flash_kda --check-only``.
"""
import pytest
import torch

from k3lab.kernels.kda import chunk_bwd, chunk_fwd, flash_kda
from k3lab.kernels.kda.utils import chunk_index
from k3lab.testing import DEVICE, FLASH_KDA_TOL_GRAD, assert_close


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prefetch", [False, True], ids=["loads_when_used", "prefetch"])
def test_state_kernels_with_and_without_prefetch(monkeypatch, prefetch, kda_check, kda_inputs):
    """The state kernels' two schedules (``state_prefetch``: a chunk's U and decay loaded when used, or
    one chunk ahead) on packed sequences of 7, 130 and 64 tokens: tails, a three-chunk walk each way,
    and the chunk after a sequence's last (masked). Weak gates (z ~ -7: a chunk keeps 0.5-0.8 of its
    state; the default inputs' chunks keep < 1e-39), or a wrong decay row in the backward's prefetch
    went unseen (1.2e-2 in d initial_state)."""
    from k3lab.kernels.kda import chunk_bwd, chunk_fwd

    for mod in (chunk_fwd, chunk_bwd):
        monkeypatch.setattr(mod, "state_prefetch", lambda BV, stores: prefetch)
    inputs = kda_inputs(1, 201, 1, 1, 16, 16, N=3, seed=21)
    inputs[3] -= 7.0
    kda_check(inputs, cu_seqlens=torch.tensor([0, 7, 137, 201]))


@pytest.mark.timeout(300)
def test_varlen(kda_check, kda_inputs):
    """Packed sequences of 7, 66 and 3 tokens: chunks never cross a sequence boundary."""
    cu = torch.tensor([0, 7, 73, 76])
    kda_check(kda_inputs(1, 76, 1, 1, 16, 16, N=3, seed=3), cu_seqlens=cu)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_varlen_offsets_as_a_strided_view(dtype, kda_inputs):
    """cu_seqlens every other element of a buffer: an int32 view reached the kernels as it was, which
    read the buffer's neighbouring entries as offsets (wrong sequences; out of bounds, memory
    corruption, with other values). Must equal the same call with a contiguous copy, bit for bit."""
    cu = torch.tensor([0, 7, 20], dtype=dtype, device=DEVICE).repeat_interleave(2)[::2]
    assert not cu.is_contiguous()
    inputs = kda_inputs(1, 20, 1, 1, 16, 16, N=2, seed=12)
    q, k, v, z, beta, A_log, dt_bias, h0 = (x.float().to(DEVICE) for x in inputs)
    with torch.no_grad():
        outs = [flash_kda(q, k, v, z, beta, A_log, dt_bias, initial_state=h0, output_final_state=True, cu_seqlens=c)
                for c in (cu, cu.contiguous())]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.timeout(300)
def test_chunk_tables_values_and_cache():
    from k3lab.kernels.kda.utils import chunk_index

    cu, ci, co = chunk_index([100, 64, 3], torch.device("cpu"))
    assert cu.tolist() == [0, 100, 164, 167]
    assert ci.tolist() == [[0, 0], [0, 1], [1, 0], [2, 0]]
    assert co.tolist() == [0, 2, 3, 4]
    again = chunk_index([100, 64, 3], "cpu")
    assert all(a is b for a, b in zip(again, (cu, ci, co)))
    assert chunk_index([100, 64, 4], "cpu")[0].tolist() == [0, 100, 164, 168]


@pytest.mark.timeout(300)
def test_varlen_gva_group_of_4_without_dt_bias(kda_inputs, kda_reference):
    """H = 1, HV = 4 (the norm kernel's GVA sum over 4 heads), K = 24, packed sequences of 5 and 65
    tokens (a tail chunk of 1), dt_bias=None (the gate without bias, no ddt_bias)."""
    cu = torch.tensor([0, 5, 70])
    q, k, v, z, beta, A_log, _, h0 = kda_inputs(1, 70, 1, 4, 24, 16, N=2, seed=23)
    ours = [x.float().to(DEVICE).requires_grad_() for x in (q, k, v, z, beta, A_log, h0)]
    ref = [x.clone().requires_grad_() for x in (q, k, v, z, beta, A_log, h0)]
    o, s = flash_kda(*ours[:6], None, initial_state=ours[6], output_final_state=True, cu_seqlens=cu.to(DEVICE))
    o_ref, s_ref = kda_reference(*ref[:6], None, initial_state=ref[6], cu_seqlens=cu)
    assert_close("o", o_ref, o.cpu(), 1e-4)
    assert_close("final_state", s_ref, s.cpu(), 1e-4)
    gen = torch.Generator().manual_seed(1)
    do, ds = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (o_ref, s_ref))
    ((o.double().cpu() * do).sum() + (s.double().cpu() * ds).sum()).backward()
    ((o_ref * do).sum() + (s_ref * ds).sum()).backward()
    for name, a, b in zip(("q", "k", "v", "z", "beta_logits", "A_log", "initial_state"), ref, ours):
        assert_close(f"d{name}", a.grad, b.grad.cpu(), 1e-4)


@pytest.mark.timeout(240)
@pytest.mark.interpreted_ranks
def test_kcp_flash_partial_k_tile(monkeypatch):
    """KCP over 2 gloo ranks with K = 48, V = 40: the state kernel's lead columns (values [0 | U], V' =
    K + V = 88) with the state in two halves of 32 rows, and the K-tiled backward on each rank."""
    from k3lab.kcp.workers import (
        FLASH_REPLICATED, FLASH_SHARDED, FlashCase, errors_vs_reference, flash_check_worker,
    )
    from k3lab.dist import launch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = FlashCase(T=90, HV=1, K=48, V=40, seed=28)
    results = launch(flash_check_worker, 2, [case], timeout_s=200)
    errs = errors_vs_reference(results[0]["refs"][0], [res["runs"][0] for res in results], FLASH_SHARDED,
                               FLASH_REPLICATED)
    bad = {name: e for name, e in errs.items() if not e <= 1e-5}
    assert not bad, bad


def poison_empty(monkeypatch):
    """Every torch.empty / empty_like / new_empty in the call is NaN-filled (ints a huge negative), so a
    buffer the kernels read before writing shows up as NaN instead of as the zeros a fresh CPU page holds."""
    def fill(t):
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_(-(2**30)) if t.dtype in (torch.int32, torch.int64) else t

    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(empty_like(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: fill(new_empty(self, *a, **kw)))


@pytest.mark.timeout(300)
def test_varlen_every_subtile_tail_poisoned_buffers(monkeypatch, kda_inputs, kda_run_both, assert_all_close):
    """Packed sequences of 1, 16, 17, 31, 63 and 65 tokens (chunks ending inside, at and just past a 16-row
    sub-tile; the sub-tiles past a short chunk's end return early), H = HV = 1,
    K = 72 (intra backward K tiles 64 + 8, gate K tiles 32 + 32 + 8), V = 8, NaN-poisoned empty buffers.
    Every sequence's slice is checked on its own: a one-token sequence's error is invisible in the total."""
    poison_empty(monkeypatch)
    lengths = [1, 16, 17, 31, 63, 65]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = kda_inputs(1, int(cu[-1]), 1, 1, 72, 8, N=len(lengths), seed=101)
    ours, ref = kda_run_both(inputs, cu_seqlens=cu)
    assert_all_close(ours, ref)
    for name in ("o", "dq", "dk", "dv", "dz", "dbeta_logits"):
        for n, (t0, t1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            assert_close(f"{name}[seq {n}, len {t1 - t0}]", ref[name][:, t0:t1], ours[name][:, t0:t1],
                         FLASH_KDA_TOL_GRAD)
    for name in ("final_state", "dinitial_state"):
        for n in range(len(lengths)):
            assert_close(f"{name}[seq {n}]", ref[name][n], ours[name][n], FLASH_KDA_TOL_GRAD)


@pytest.mark.timeout(300)
def test_batch_of_three_shorter_than_a_subtile(kda_inputs, kda_run_both, assert_all_close):
    """B = 3, T = 5 (every batch row one partial sub-tile), K = 72, V = 8."""
    ours, ref = kda_run_both(kda_inputs(3, 5, 1, 1, 72, 8, seed=102))
    assert_all_close(ours, ref)


@pytest.mark.timeout(240)
@pytest.mark.interpreted_ranks
def test_kcp_documents_crossing_the_rank_boundary(monkeypatch):
    """kcp_flash_kda on 2 gloo ranks (20 tokens each) against one-process flash_kda: documents [0, 1),
    [1, 19) ending just before the boundary, [19, 21) with one token on each rank, [21, 40); H = 2,
    HV = 4, K = 40, V = 8."""
    from k3lab.dist import launch
    from k3lab.kcp.workers import (
        FLASH_REPLICATED, FLASH_SHARDED, FlashCase, errors_vs_reference, flash_check_worker,
    )

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = FlashCase(T=40, cu_seqlens=(0, 1, 19, 21, 40), H=2, HV=4, K=40, V=8, seed=108)
    results = launch(flash_check_worker, 2, [case], timeout_s=200)
    for i, fold in enumerate(case.folds):
        errs = errors_vs_reference(results[0]["refs"][0], [res["runs"][i] for res in results], FLASH_SHARDED,
                                   FLASH_REPLICATED)
        print(fold, f"worst {max(errs.values()):.1e}")
        bad = {name: e for name, e in errs.items() if not e <= 1e-5}
        assert not bad, (fold, bad)


def v_tiles_of_16(monkeypatch):
    """The state kernels' V tile of 16 (several V-tile programs per value head; a GPU picks it at small
    grids, the CPU launch never does)."""
    from k3lab.kernels.kda import chunk_bwd, chunk_fwd

    for mod in (chunk_fwd, chunk_bwd):
        monkeypatch.setattr(mod, "state_tile", lambda N, HV, V, device: 16)


@pytest.mark.timeout(120)
def test_fused_output_grad_and_no_grad_forwards_agree(monkeypatch, kda_inputs, kda_run_both, assert_all_close):
    """K = 32, V = 48 (three V tiles of 16), H = 1, HV = 2, T = 70: the forward under autograd, under
    torch.no_grad() and under torch.inference_mode() gives the same o and final state bit for bit, both
    match float64, and so do the gradients."""
    v_tiles_of_16(monkeypatch)
    inputs = kda_inputs(1, 70, 1, 2, 32, 48, seed=109)
    ours, ref = kda_run_both(inputs)
    assert_all_close(ours, ref)
    xs = [x.float().to(DEVICE) for x in inputs]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            o, s = flash_kda(*xs[:7], initial_state=xs[7], output_final_state=True)
        assert torch.equal(o.cpu(), ours["o"]) and torch.equal(s.cpu(), ours["final_state"]), mode.__name__


@pytest.mark.timeout(120)
def test_fused_output_varlen_v_tiles_poisoned(monkeypatch, kda_inputs, kda_reference):
    """Packed sequences of 1, 15, 16, 17, 63, 64 and 65 tokens (one V-tile program walks each sequence's
    chunks, tails included), H = 1, HV = 2, K = 32, V = 40 (V tiles 16 + 16 + 8), NaN-poisoned empty
    buffers (o is one: every element must be written exactly by its tile), lower_bound = -0.5 so a
    chunk's entering state reaches all its rows of o. Forward only: each sequence's o and final state,
    and a second call equal bit for bit."""
    v_tiles_of_16(monkeypatch)
    poison_empty(monkeypatch)
    lengths = [1, 15, 16, 17, 63, 64, 65]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = kda_inputs(1, int(cu[-1]), 1, 2, 32, 40, N=len(lengths), seed=110)
    o_ref, s_ref = kda_reference(*inputs[:7], initial_state=inputs[7], cu_seqlens=cu, lower_bound=-0.5)
    xs = [x.float().to(DEVICE) for x in inputs]
    outs = []
    for _ in range(2):
        with torch.no_grad():
            outs.append(flash_kda(*xs[:7], initial_state=xs[7], output_final_state=True, cu_seqlens=cu.to(DEVICE),
                                  lower_bound=-0.5))
    (o, s), (o2, s2) = outs
    assert torch.equal(o, o2) and torch.equal(s, s2)
    print(f"o: {assert_close('o', o_ref, o.cpu(), FLASH_KDA_TOL_GRAD):.1e}")
    for n, (t0, t1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert_close(f"o[seq {n}, len {t1 - t0}]", o_ref[:, t0:t1], o[:, t0:t1].cpu(), FLASH_KDA_TOL_GRAD)
        assert_close(f"final_state[seq {n}]", s_ref[n], s[n].cpu(), FLASH_KDA_TOL_GRAD)
