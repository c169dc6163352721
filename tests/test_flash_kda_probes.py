"""FlashKDA probes aimed at the backward's layout (intra backward per
16-row sub-tile x K tile of 64, the gate backward per K tile of 32, the q/k norm backward per token block,
the rows' inverse norms written by dq/dk and read later, state gradients in the intermediate dtype) and
the forward whose output the state kernel writes.

They are regression tests for what the other FlashKDA tests do not
reach: every tail length of a chunk's sub-tiles in one varlen batch with K = 72 (a partial second K tile)
and the backward's empty buffers poisoned with NaN, per-sequence errors, T < 16 with B = 3, gradients of
a subset of the inputs, strided inputs and expanded output gradients, the gate next to lower_bound = -10
(no overflow in the backward's products), saturated beta logits, an explicit scale with dt_bias as [HV, K],
and KCP with documents crossing the rank boundary; for the forward, grad/no_grad/inference_mode equality
and varlen with several V tiles per value head into NaN-poisoned outputs.

Float32 kernels (TRITON_INTERPRET=1 on CPU) against the float64 naive recurrence.
"""
import os
import traceback
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is defined: before k3lab.kernels is imported.
    os.environ["TRITON_INTERPRET"] = "1"

from test_flash_kda import DEVICE, INTERPRETED_RANKS, NAMES, make_inputs  # noqa: E402

from k3lab.kda import lower_bounded_gate, naive_recurrent_kda  # noqa: E402
from k3lab.kernels.kda import flash_kda  # noqa: E402
from k3lab.testing import assert_close, rel_rms_error  # noqa: E402

TOL = 1e-4 if DEVICE == "cpu" else 1e-2


def reference(q, k, v, z, beta, A_log, dt_bias, scale=None, initial_state=None, output_final_state=True,
              cu_seqlens=None, lower_bound=-5.0):
    """test_flash_kda's reference with flash_kda's signature (explicit scale; the final state always)."""
    qn = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    kn = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    g = lower_bounded_gate(z, A_log, dt_bias, lower_bound)
    return naive_recurrent_kda(qn, kn, v, g, beta.sigmoid(), scale=scale, initial_state=initial_state,
                               output_final_state=True, cu_seqlens=cu_seqlens)


def run_both(inputs, want=NAMES, cu_seqlens=None, lower_bound=-5.0, scale=None, ref_dtype=torch.float64):
    """flash_kda (float32) and the reference (``ref_dtype``) on the same inputs (None entries skipped), the
    loss <o, do> + <final state, ds> backpropagated through both. Returns (ours, ref): each a dict of o,
    final state and the gradients of the inputs named in ``want``."""
    gen = torch.Generator().manual_seed(1)
    do = ds = None
    out = []
    for fn, dtype, device in ((flash_kda, torch.float32, DEVICE), (reference, ref_dtype, "cpu")):
        xs = [None if x is None else x.detach().to(device, dtype, copy=True).requires_grad_(n in want)
              for n, x in zip(NAMES, inputs)]
        cu = None if cu_seqlens is None else cu_seqlens.to(device)
        o, s = fn(*xs[:7], scale=scale, initial_state=xs[7], output_final_state=True, cu_seqlens=cu,
                  lower_bound=lower_bound)
        if do is None:
            do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
            ds = torch.randn(s.shape, generator=gen, dtype=torch.float64)
        ((o.double().cpu() * do).sum() + (s.double().cpu() * ds).sum()).backward()
        res = {"o": o.detach().cpu(), "final_state": s.detach().cpu()}
        res.update({f"d{n}": x.grad.cpu() for n, x in zip(NAMES, xs) if n in want and x is not None})
        out.append(res)
    return out


def assert_all_close(ours, ref, tol=TOL, skip=()):
    for name in ref:
        if name not in skip:
            print(f"{name}: {assert_close(name, ref[name], ours[name], tol):.1e}")


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
def test_varlen_every_subtile_tail_poisoned_buffers(monkeypatch):
    """Packed sequences of 1, 16, 17, 31, 63 and 65 tokens (chunks ending inside, at and just past a 16-row
    sub-tile; the sub-tiles past a short chunk's end return early), H = HV = 1,
    K = 72 (intra backward K tiles 64 + 8, gate K tiles 32 + 32 + 8), V = 8, NaN-poisoned empty buffers.
    Every sequence's slice is checked on its own: a one-token sequence's error is invisible in the total."""
    poison_empty(monkeypatch)
    lengths = [1, 16, 17, 31, 63, 65]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = make_inputs(1, int(cu[-1]), 1, 1, 72, 8, N=len(lengths), seed=101)
    ours, ref = run_both(inputs, cu_seqlens=cu)
    assert_all_close(ours, ref)
    for name in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        for n, (t0, t1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            assert_close(f"{name}[seq {n}, len {t1 - t0}]", ref[name][:, t0:t1], ours[name][:, t0:t1], TOL)
    for name in ("final_state", "dinitial_state"):
        for n in range(len(lengths)):
            assert_close(f"{name}[seq {n}]", ref[name][n], ours[name][n], TOL)


@pytest.mark.timeout(300)
def test_batch_of_three_shorter_than_a_subtile():
    """B = 3, T = 5 (every batch row one partial sub-tile), K = 72, V = 8."""
    ours, ref = run_both(make_inputs(3, 5, 1, 1, 72, 8, seed=102))
    assert_all_close(ours, ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("want", [("q", "g"), ("k", "beta"), ("initial_state",), ("A_log", "dt_bias")],
                         ids=["q-g", "k-beta", "h0", "A_log-dt_bias"])
def test_gradients_of_a_subset(want):
    """requires_grad on some inputs only: exactly those get gradients, and they match."""
    inputs = make_inputs(1, 40, 1, 2, 40, 16, seed=103)
    ours, ref = run_both(inputs, want=want)
    assert sorted(ours) == sorted(ref) == sorted(["o", "final_state", *(f"d{n}" for n in want)])
    assert_all_close(ours, ref)


@pytest.mark.timeout(300)
def test_strided_inputs_and_expanded_output_gradients():
    """q and k split from one fused projection, v, z and beta non-contiguous, H = 2, HV = 4, and the loss
    o.sum() + final_state.sum(): autograd hands the backward stride-0 (expanded) gradients."""
    B, T, H, HV, K, V = 1, 24, 2, 4, 24, 16
    inputs = make_inputs(B, T, H, HV, K, V, seed=104)
    grads = []
    for dtype, device in ((torch.float32, DEVICE), (torch.float64, "cpu")):
        xs = [x.detach().to(device, dtype, copy=True).requires_grad_() for x in inputs]
        q, k = torch.cat(xs[:2], -1).split(K, -1)
        v = xs[2].transpose(1, 2).contiguous().transpose(1, 2)
        z = xs[3].transpose(2, 3).contiguous().transpose(2, 3)
        beta = torch.stack([xs[4], xs[4]], -1)[..., 0]
        assert not any(t.is_contiguous() for t in (q, k, v, z, beta))
        fn = flash_kda if dtype == torch.float32 else reference
        o, s = fn(q, k, v, z, beta, *xs[5:7], initial_state=xs[7], output_final_state=True)
        (o.double().sum() + s.double().sum()).backward()
        grads.append([x.grad.cpu() for x in xs])
    for name, a, b in zip(NAMES, grads[1], grads[0]):
        print(f"d{name}: {assert_close(f'd{name}', a, b, TOL):.1e}")


@pytest.mark.timeout(300)
def test_strong_decay_then_open_gates_in_one_chunk():
    """48 tokens at a log-decay near -10 (G reaches about -480 in the chunk), then 16 nearly open ones
    (-4.5e-4 each): float32 resolves G only to 3e-5 there, so a float32 running sum rounded each small
    gate and missed by up to 1.5e-4 (o 5.7e-5, final state 9.8e-5, gradients up to 1.4e-4). With float32 intermediates G is summed in float64 and rounded once: o and the state are
    1.2e-5 / 1.4e-5 off."""
    from test_flash_kda import check

    inputs = make_inputs(1, 64, 1, 1, 16, 16, seed=0)
    closed = (torch.arange(64) < 48)[None, :, None, None]
    inputs[3] = torch.where(closed, 2.0, -2.0).double().expand(1, 64, 1, 16).clone()
    inputs[5] = torch.full_like(inputs[5], 1.6)
    inputs[6] = torch.zeros_like(inputs[6])
    check(inputs, lower_bound=-10.0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lower_bound, gate_tol", [
    (-10.0, {"dg": 1e-2, "dA_log": 0.2, "ddt_bias": 1e-2}),
    (-7.0, {"dg": 4e-4, "dA_log": 6e-3, "ddt_bias": 4e-4}),
])
def test_gate_saturated_at_a_strong_bound(lower_bound, gate_tol):
    """z + 8 with A_log = 0: every log-decay sits next to lower_bound (at -10: -9.997, e^-150 over a
    sub-tile). o, the state and the q, k, v, beta and initial-state gradients stay at float32 accuracy,
    and the backward's kernels compute no inf/NaN anywhere (numpy reports overflow/invalid in the
    interpreter's dots; the forward's masked upper triangle does, the backward, whose factors are all
    <= 1, must not). The gate's own gradients are ~e^-10 of the O(1) terms whose differences the chunkwise
    form takes (cumulative G, reverse cumsum of dG), so their error grows like e^|lb|: at -10 measured dg
    4.8e-3, ddt_bias 5.1e-3, dA_log 8.6e-2, better than the PyTorch chunk_kda in float32 (2.2e-2,
    9.1e-2, 2.0); at -7 dg 1.6e-4,
    dA_log 2.6e-3, already past the 1e-4 float32 tolerance. torch's float32 autograd through the naive
    recurrence gets ~3e-5 / 2e-4 at both."""
    inputs = make_inputs(1, 40, 1, 2, 40, 16, seed=105)
    inputs[3] = inputs[3] + 8.0
    inputs[5] = torch.zeros_like(inputs[5])
    bwd_warnings = []

    def record(message, category, *args, **kwargs):
        if not issubclass(category, RuntimeWarning):
            return
        frames = [f.filename for f in traceback.extract_stack() if os.sep + "kda" + os.sep in f.filename]
        if frames and frames[-1].endswith("chunk_bwd.py"):
            bwd_warnings.append(str(message))

    with warnings.catch_warnings():
        warnings.simplefilter("always", RuntimeWarning)
        warnings.showwarning = record
        ours, ref = run_both(inputs, lower_bound=lower_bound)
    assert not bwd_warnings, bwd_warnings
    assert_all_close(ours, ref, skip=gate_tol)
    for name, tol in gate_tol.items():
        print(f"{name}: {assert_close(name, ref[name], ours[name], tol):.1e}")


@pytest.mark.timeout(300)
def test_saturated_gates():
    """a (z + bias) near +12, where the gate's sigmoid is 1 - 6e-6: its derivative taken as s (1 - s) lost
    1 - s to cancellation in float32 (dz 5.4e-3, dA_log 7.8e-3 relative); as
    t / (1 + t)^2 with t = e^-|x| every gradient is at float32 accuracy (dz 9e-6)."""
    from test_flash_kda import check

    inputs = make_inputs(1, 40, 1, 1, 16, 16, seed=3)
    inputs[3] = 0.3 * inputs[3] + 12.0
    inputs[5] = torch.zeros_like(inputs[5])
    check(inputs)


@pytest.mark.timeout(300)
def test_saturated_beta_and_repeated_keys():
    """beta logits +-30 and every pair of consecutive keys equal: all gradients but dbeta at float32
    accuracy; dbeta = sigmoid'(+-30) ~ 1e-13 times the upstream term, which torch's float32 autograd (s (1 - s)
    with s = 1) gives as 0 (0.95 relative); ours (``sigmoid_grad``) 9.7e-4, held to at most torch's."""
    inputs = make_inputs(1, 40, 1, 2, 24, 16, seed=106)
    inputs[4] = 30.0 * inputs[4].sign()
    inputs[1][:, 1::2] = inputs[1][:, 0::2]
    ours, ref = run_both(inputs)
    assert_all_close(ours, ref, skip=("dbeta",))
    _, ref32 = run_both(inputs, ref_dtype=torch.float32)
    mine, torch32 = rel_rms_error(ref["dbeta"], ours["dbeta"]), rel_rms_error(ref["dbeta"], ref32["dbeta"])
    print(f"dbeta: {mine:.1e} (torch float32 autograd {torch32:.1e})")
    assert mine <= 1.5 * torch32 + TOL


@pytest.mark.timeout(300)
def test_explicit_scale_bias_per_head_weak_lower_bound():
    """scale = 0.37 given, dt_bias passed as [HV, K] (its gradient keeps that shape), lower_bound = -0.1,
    K = 96 (intra K tiles 64 + 32), V = 8, T = 70."""
    B, T, H, HV, K, V = 1, 70, 1, 1, 96, 8
    inputs = make_inputs(B, T, H, HV, K, V, seed=107)
    inputs[6] = inputs[6].view(HV, K)
    ours, ref = run_both(inputs, scale=0.37, lower_bound=-0.1)
    assert ours["ddt_bias"].shape == (HV, K)
    assert_all_close(ours, ref)


@pytest.mark.timeout(240)
@INTERPRETED_RANKS
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


# Probes of the forward with the output written by the state kernel (one program per sequence,
# value head and V tile writes that tile's columns of o while its state is in registers). Every probe
# passed (float32 vs float64, o and final states <= 9e-7, gradients <= 3.1e-6): grad vs no_grad forwards,
# with and without initial/final state, varlen of 1..130 tokens at V tiles of 16, V = 16/24/40/48/80
# against K = 8..64 with HV = 2H and 4H, strided inputs, many one-token sequences, KCP on 2 and 3 ranks
# with several documents per rank (against flash_kda and float64). Kept: the two that reach what the other
# files do not.


def v_tiles_of_16(monkeypatch):
    """The state kernels' V tile of 16 (several V-tile programs per value head; a GPU picks it at small
    grids, the CPU launch never does)."""
    from k3lab.kernels.kda import chunk_bwd, chunk_fwd

    for mod in (chunk_fwd, chunk_bwd):
        monkeypatch.setattr(mod, "state_tile", lambda N, HV, V, device: 16)


@pytest.mark.timeout(120)
def test_fused_output_grad_and_no_grad_forwards_agree(monkeypatch):
    """K = 32, V = 48 (three V tiles of 16), H = 1, HV = 2, T = 70: the forward under autograd, under
    torch.no_grad() and under torch.inference_mode() gives the same o and final state bit for bit, both
    match float64, and so do the gradients."""
    v_tiles_of_16(monkeypatch)
    inputs = make_inputs(1, 70, 1, 2, 32, 48, seed=109)
    ours, ref = run_both(inputs)
    assert_all_close(ours, ref)
    xs = [x.float().to(DEVICE) for x in inputs]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            o, s = flash_kda(*xs[:7], initial_state=xs[7], output_final_state=True)
        assert torch.equal(o.cpu(), ours["o"]) and torch.equal(s.cpu(), ours["final_state"]), mode.__name__


@pytest.mark.timeout(120)
def test_fused_output_varlen_v_tiles_poisoned(monkeypatch):
    """Packed sequences of 1, 15, 16, 17, 63, 64 and 65 tokens (one V-tile program walks each sequence's
    chunks, tails included), H = 1, HV = 2, K = 32, V = 40 (V tiles 16 + 16 + 8), NaN-poisoned empty
    buffers (o is one: every element must be written exactly by its tile), lower_bound = -0.5 so a
    chunk's entering state reaches all its rows of o. Forward only: each sequence's o and final state,
    and a second call equal bit for bit."""
    v_tiles_of_16(monkeypatch)
    poison_empty(monkeypatch)
    lengths = [1, 15, 16, 17, 63, 64, 65]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = make_inputs(1, int(cu[-1]), 1, 2, 32, 40, N=len(lengths), seed=110)
    o_ref, s_ref = reference(*inputs[:7], initial_state=inputs[7], cu_seqlens=cu, lower_bound=-0.5)
    xs = [x.float().to(DEVICE) for x in inputs]
    outs = []
    for _ in range(2):
        with torch.no_grad():
            outs.append(flash_kda(*xs[:7], initial_state=xs[7], output_final_state=True, cu_seqlens=cu.to(DEVICE),
                                  lower_bound=-0.5))
    (o, s), (o2, s2) = outs
    assert torch.equal(o, o2) and torch.equal(s, s2)
    print(f"o: {assert_close('o', o_ref, o.cpu(), TOL):.1e}")
    for n, (t0, t1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert_close(f"o[seq {n}, len {t1 - t0}]", o_ref[:, t0:t1], o[:, t0:t1].cpu(), TOL)
        assert_close(f"final_state[seq {n}]", s_ref[n], s[n].cpu(), TOL)
