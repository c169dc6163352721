"""KCP on the FlashKDA kernels (``kcp_flash_kda``): 2 and 3 gloo ranks against one-process
``flash_kda`` on the whole sequence, outputs, final states and every gradient rank by rank, every
rank role of the layout (a document starting mid-rank, one wholly inside a rank, a rank inside one
document, a rank that both folds in and sends a map); bytes per layer independent of T.

The Triton kernels run under TRITON_INTERPRET=1 on CPU (float32, tiny sizes, T_local not a multiple
of the 64-token chunk). The spawned ranks (and the references, computed on rank 0) always run on CPU.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is defined: before k3lab.kernels is imported.
    os.environ["TRITON_INTERPRET"] = "1"


from k3lab.kcp import kcp_flash_kda, make_context  # noqa: E402
from k3lab.kcp.workers import (  # noqa: E402
    FLASH_REPLICATED, FLASH_SHARDED, FlashCase, errors_vs_reference, flash_check_worker,
)
from k3lab.dist import launch  # noqa: E402
from k3lab.kernels.kda import flash_kda  # noqa: E402
from k3lab.testing import assert_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# R = 2: one document over both ranks (45 tokens each), GVA (HV = 2 value heads per q/k head).
# R = 3, T = 186 (62 per rank): [0, 20) inside rank 0; [20, 140) from mid-rank 0 over the whole of
# rank 1 into rank 2; [140, 186) starting mid-rank 2. Both folds.
# R = 3, T = 150 (50 per rank): [0, 70) into rank 1; [70, 120) from mid-rank 1 into rank 2 (rank 1
# folds in and sends a map); [120, 150); no initial state.
CASES = {
    2: [FlashCase(T=90, seed=1)],
    3: [FlashCase(T=186, cu_seqlens=(0, 20, 140, 186), HV=1, seed=2, folds=("sequential", "scan")),
        FlashCase(T=150, cu_seqlens=(0, 70, 120, 150), HV=1, seed=3, with_h0=False)],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.interpreted_ranks
def test_kcp_flash_matches_flash_kda(world_size, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cases = CASES[world_size]
    results = launch(flash_check_worker, world_size, cases, timeout_s=200)
    refs = [results[i % world_size]["refs"][i] for i in range(len(cases))]
    i, kcp_bytes = 0, set()
    for case, ref in zip(cases, refs):
        for fold in case.folds:
            ranks = [res["runs"][i] for res in results]
            i += 1
            errs = errors_vs_reference(ref, ranks, FLASH_SHARDED, FLASH_REPLICATED)
            # Every rank's own slice of every gradient, not only their sum.
            assert len(errs) == world_size * 6 + 1 + 2 + case.with_h0
            worst = max(errs, key=errs.get)
            print(f"R={world_size} T={case.T} {fold}: worst {worst} {errs[worst]:.2e}")
            bad = {name: e for name, e in errs.items() if not e <= 1e-5}
            assert not bad, f"{world_size} ranks, {case}, fold={fold}: {bad}"
            totals = {sum(n for _, n in r["comm"]) for r in ranks}
            assert len(totals) == 1
            kcp_bytes.add(totals.pop())
    # One all-gather each way per layer: maps [R, HV, K, K+V] forward, state gradients [R, HV, K, V]
    # backward, float32, whatever T (R = 3 runs two lengths).
    c = cases[0]
    assert kcp_bytes == {world_size * c.HV * c.K * (c.K + 2 * c.V) * 4}, kcp_bytes


def _inputs(T, H, HV, K, V, N, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    xs = [r(1, T, H, K), r(1, T, H, K), r(1, T, HV, V), r(1, T, HV, K) - 4, r(1, T, HV), 0.2 * r(HV),
          0.3 * r(HV * K), r(N, HV, K, V)]
    return [x.to(DEVICE) for x in xs]


@pytest.mark.timeout(300)
def test_one_process_is_flash_kda():
    """R = 1: kcp_flash_kda is flash_kda with the context's documents as cu_seqlens, bit for bit."""
    T, cu = 40, (0, 13, 40)
    ctx = make_context(T, cu)
    ours = [x.requires_grad_() for x in _inputs(T, 1, 1, 16, 16, 2, seed=4)]
    ref = [x.detach().clone().requires_grad_() for x in ours]
    o, s = kcp_flash_kda(*ours[:7], ctx, initial_state=ours[7], output_final_state=True)
    o_ref, s_ref = flash_kda(*ref[:7], initial_state=ref[7], output_final_state=True,
                             cu_seqlens=torch.tensor(cu, device=DEVICE))
    gen = torch.Generator().manual_seed(5)
    do, ds = torch.randn(o.shape, generator=gen).to(DEVICE), torch.randn(s.shape, generator=gen).to(DEVICE)
    ((o * do).sum() + (s * ds).sum()).backward()
    ((o_ref * do).sum() + (s_ref * ds).sum()).backward()
    assert_close("o", o_ref, o, 0.0)
    assert_close("final", s_ref, s, 0.0)
    for name, a, b in zip(("q", "k", "v", "z", "beta", "A_log", "dt_bias", "h0"), ref, ours):
        assert_close(f"d{name}", a.grad, b.grad, 0.0)


@pytest.mark.timeout(300)
def test_outputs_can_be_changed_in_place():
    """Regression: with float32 inputs, o.mul_(2) on flash_kda's or kcp_flash_kda's output
    raised "Output 0 of ... is a view" (the output was a view made inside the Function; bf16 inputs, cast
    by a copy, did not). Both now allow it, and the gradients follow the change (R = 1, bit for bit)."""
    T, cu = 40, (0, 13, 40)
    ctx = make_context(T, cu)
    ours = [x.requires_grad_() for x in _inputs(T, 1, 1, 16, 16, 2, seed=6)]
    ref = [x.detach().clone().requires_grad_() for x in ours]
    o, _ = kcp_flash_kda(*ours[:7], ctx, initial_state=ours[7])
    o_ref, _ = flash_kda(*ref[:7], initial_state=ref[7], cu_seqlens=torch.tensor(cu, device=DEVICE))
    o.mul_(2)
    o_ref.mul_(2)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    (o * do).sum().backward()
    (o_ref * do).sum().backward()
    assert_close("o", o_ref, o, 0.0)
    for name, a, b in zip(("q", "k", "v", "z", "beta", "A_log", "dt_bias", "h0"), ref, ours):
        assert_close(f"d{name}", a.grad, b.grad, 0.0)
    plain = [x.detach().clone().requires_grad_() for x in ref]
    o_plain, _ = flash_kda(*plain[:7], initial_state=plain[7], cu_seqlens=torch.tensor(cu, device=DEVICE))
    (o_plain * do).sum().backward()
    assert_close("dv follows the in-place change", 2 * plain[2].grad, ref[2].grad, 1e-6)


def test_flags_and_state_types_are_checked():
    """Regressions: kcp_flash_kda took output_final_state=1 and an integer initial_state
    (converted silently), where flash_kda refuses both."""
    T = 32
    ctx = make_context(T)
    xs = _inputs(T, 1, 1, 16, 16, 1, seed=8)
    with pytest.raises(ValueError, match="output_final_state must be a bool"):
        kcp_flash_kda(*xs[:7], ctx, output_final_state=1)
    with pytest.raises(ValueError, match="initial_state must be a floating-point tensor"):
        kcp_flash_kda(*xs[:7], ctx, initial_state=xs[7].long())


def test_second_derivative_is_refused():
    """As for flash_kda: a create_graph=True gradient differentiated again lost kcp_flash_kda's
    second-order term without a word. It must raise instead."""
    T = 16
    q, k, v, z, beta, A_log, dt_bias, _ = _inputs(T, 1, 1, 16, 16, 1, seed=7)
    q.requires_grad_()
    o, _ = kcp_flash_kda(q, k, v, z, beta, A_log, dt_bias, make_context(T))
    (dq,) = torch.autograd.grad((o**2).sum() + (q**3).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice KCPFlashFunction"):
        dq.sum().backward()


def test_rejects_bad_input_like_flash_kda():
    """kcp_flash_kda raises flash_kda's errors (same messages) and its own for the context."""
    T, H, K = 16, 1, 16
    ctx = make_context(T)
    q, k, v, z, beta, A_log, dt_bias, h0 = _inputs(T, H, H, K, K, 1, seed=6)
    nan_q = q.clone()
    nan_q[0, 3, 0, 2] = float("nan")
    for bad in (dict(A_log=A_log[None]), dict(dt_bias=dt_bias[:-1]), dict(lower_bound=0.0), dict(lower_bound="-5"),
                dict(q=nan_q),
                dict(beta_logits=beta[..., :0]), dict(v=v.double())):
        args = dict(q=q, k=k, v=v, z=z, beta_logits=beta, A_log=A_log, dt_bias=dt_bias) | bad
        with pytest.raises(ValueError) as ref:
            flash_kda(**args)
        with pytest.raises(ValueError) as ours:
            kcp_flash_kda(**args, ctx=ctx)
        assert str(ours.value) == str(ref.value)
    with pytest.raises(ValueError, match="ctx"):
        kcp_flash_kda(q, k, v, z, beta, A_log, dt_bias, None)
    with pytest.raises(ValueError, match="T_local"):
        kcp_flash_kda(q[:, :8], k[:, :8], v[:, :8], z[:, :8], beta[:, :8], A_log, dt_bias, ctx)
    with pytest.raises(ValueError, match="initial_state"):
        kcp_flash_kda(q, k, v, z, beta, A_log, dt_bias, ctx, initial_state=h0[:, :, :4])
    with pytest.raises(ValueError, match="fold"):
        kcp_flash_kda(q, k, v, z, beta, A_log, dt_bias, ctx, fold="tree")
    # a layout-only context (no group) failed inside torch's all_gather
    half = make_context(2 * T, rank=0, world_size=2)
    with pytest.raises(ValueError, match="layout only"):
        kcp_flash_kda(q, k, v, z, beta, A_log, dt_bias, half)


def test_context_roles():
    """The layout facts the flash path branches on, for the R = 3, T = 186 case above."""
    ctxs = [make_context(186, (0, 20, 140, 186), rank=r, world_size=3) for r in range(3)]
    assert [c.first_continues for c in ctxs] == [False, True, True]
    assert [c.last_continues for c in ctxs] == [True, True, False]
    assert [c.end_rank for c in ctxs] == [2, 2, 2]
    assert ctxs[0].resets == (True, False, True)
    assert ctxs[0].first_ends == (True, False, True)
