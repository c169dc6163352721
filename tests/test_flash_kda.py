"""FlashKDA (Triton) vs the float64 naive recurrence, forward, final state and all 8 gradients.

On CPU the kernels run under TRITON_INTERPRET=1 in float32 at tiny sizes (the interpreter costs
~0.5 s per chunk and head); on a GPU the same tests run in float32 too. The bf16 GPU check with the
issue's tolerances is ``python -m k3lab.bench.flash_kda --check-only``.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is defined: before k3lab.kernels is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from k3lab.kda import chunk_kda, lower_bounded_gate, naive_recurrent_kda  # noqa: E402
from k3lab.kernels import numpy_supports_interpreter  # noqa: E402
from k3lab.kernels.kda import flash_kda  # noqa: E402
from k3lab.kernels.kda.chunk_fwd import inverse_precisions, unit_lower_inverse  # noqa: E402
from k3lab.testing import assert_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# KCP tests whose gloo ranks run the kernels under the interpreter even on a GPU machine: an environment
# not built from the project's pins (a newer numpy) cannot run them.
INTERPRETED_RANKS = pytest.mark.skipif(not numpy_supports_interpreter(),
                                       reason="Triton 3.6's interpreter needs numpy<2.4 (the project's pin)")
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
# float32 kernels (tf32 dots on a GPU) vs float64: outputs ~1e-6 on CPU; GPU tf32 needs the slack.
TOL_OUT = 1e-4 if DEVICE == "cpu" else 5e-3
TOL_GRAD = 1e-4 if DEVICE == "cpu" else 1e-2


def reference(q, k, v, z, beta, A_log, dt_bias, initial_state=None, cu_seqlens=None, lower_bound=-5.0):
    """The fused pieces in torch, then the naive recurrence (float64 inputs give a float64 reference)."""
    qn = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    kn = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    g = lower_bounded_gate(z, A_log, dt_bias, lower_bound)
    return naive_recurrent_kda(qn, kn, v, g, beta.sigmoid(), initial_state=initial_state,
                               output_final_state=True, cu_seqlens=cu_seqlens)


def make_inputs(B, T, H, HV, K, V, N=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return [r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), r(B, T, HV, K), r(B, T, HV),
            0.5 * r(HV), 0.5 * r(HV * K), r(N or B, HV, K, V)]


def check(inputs, cu_seqlens=None, lower_bound=-5.0, vanishing=(), gate_tol=TOL_GRAD):
    """Forward (with autograd recording, and without: only the first stores the chunk states), final
    state and every gradient of flash_kda (float32) vs the float64 reference; gradients named in
    ``vanishing`` are ~0 in the reference and must be ~0 (< 1e-30) here too."""
    ours = [x.float().to(DEVICE).requires_grad_() for x in inputs]
    ref = [x.clone().requires_grad_() for x in inputs]
    cu_dev = cu_seqlens.to(DEVICE) if cu_seqlens is not None else None
    run = lambda: flash_kda(*ours[:7], initial_state=ours[7], output_final_state=True,  # noqa: E731
                            cu_seqlens=cu_dev, lower_bound=lower_bound)
    o_ref, s_ref = reference(*ref[:7], initial_state=ref[7], cu_seqlens=cu_seqlens, lower_bound=lower_bound)
    with torch.no_grad():
        o, s = run()
    assert_close("o (no autograd)", o_ref, o.cpu(), TOL_OUT)
    assert_close("final_state (no autograd)", s_ref, s.cpu(), TOL_OUT)
    o, s = run()
    assert_close("o", o_ref, o.cpu(), TOL_OUT)
    assert_close("final_state", s_ref, s.cpu(), TOL_OUT)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    ds = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64)
    ((o.double().cpu() * do).sum() + (s.double().cpu() * ds).sum()).backward()
    ((o_ref * do).sum() + (s_ref * ds).sum()).backward()
    for name, a, b in zip(NAMES, ref, ours):
        if name in vanishing:
            assert a.grad.abs().max() < 1e-30 and b.grad.abs().max() < 1e-30, name
        else:
            tol = gate_tol if name in ("g", "A_log", "dt_bias") else TOL_GRAD
            assert_close(f"d{name}", a.grad, b.grad.cpu(), tol)


@pytest.mark.timeout(300)
def test_gva_batch_tail_chunk():
    """B=2, GVA (2 value heads per q/k head), T = 70: a full chunk plus a 6-token tail."""
    check(make_inputs(2, 70, 1, 2, 16, 16))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prefetch", [False, True], ids=["loads_when_used", "prefetch"])
def test_state_kernels_with_and_without_prefetch(monkeypatch, prefetch):
    """The state kernels' two schedules (``state_prefetch``: a chunk's U and decay loaded when used, or
    one chunk ahead) on packed sequences of 7, 130 and 64 tokens: tails, a three-chunk walk each way,
    and the chunk after a sequence's last (masked). Weak gates (z ~ -7: a chunk keeps 0.5-0.8 of its
    state; the default inputs' chunks keep < 1e-39), or a wrong decay row in the backward's prefetch
    went unseen (1.2e-2 in d initial_state)."""
    from k3lab.kernels.kda import chunk_bwd, chunk_fwd

    for mod in (chunk_fwd, chunk_bwd):
        monkeypatch.setattr(mod, "state_prefetch", lambda BV, stores: prefetch)
    inputs = make_inputs(1, 201, 1, 1, 16, 16, N=3, seed=21)
    inputs[3] -= 7.0
    check(inputs, cu_seqlens=torch.tensor([0, 7, 137, 201]))


@pytest.mark.timeout(300)
def test_short_sequence_T_below_16():
    """T = 5 < 16: one partial sub-tile; K = 32, V = 16 (K != V)."""
    check(make_inputs(1, 5, 1, 1, 32, 16, seed=2))


@pytest.mark.timeout(300)
def test_varlen():
    """Packed sequences of 7, 66 and 3 tokens: chunks never cross a sequence boundary."""
    cu = torch.tensor([0, 7, 73, 76])
    check(make_inputs(1, 76, 1, 1, 16, 16, N=3, seed=3), cu_seqlens=cu)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_varlen_offsets_as_a_strided_view(dtype):
    """cu_seqlens every other element of a buffer: an int32 view reached the kernels as it was, which
    read the buffer's neighbouring entries as offsets (wrong sequences; out of bounds, memory
    corruption, with other values). Must equal the same call with a contiguous copy, bit for bit."""
    cu = torch.tensor([0, 7, 20], dtype=dtype, device=DEVICE).repeat_interleave(2)[::2]
    assert not cu.is_contiguous()
    inputs = make_inputs(1, 20, 1, 1, 16, 16, N=2, seed=12)
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


def test_training_after_inference_mode_at_the_same_shape():
    """The cached chunk tables were built under torch.inference_mode() when the first call at a shape
    came from evaluation: they were inference tensors, and every later training call at that shape
    failed in save_for_backward ("Inference tensors cannot be saved for backward")."""
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in make_inputs(1, 9, 1, 1, 16, 16, seed=14))
    with torch.inference_mode():
        o_eval, _ = flash_kda(q, k, v, z, beta, A_log, dt_bias, cu_seqlens=torch.tensor([0, 2, 9], device=DEVICE))
    q.requires_grad_()
    o, _ = flash_kda(q, k, v, z, beta, A_log, dt_bias, cu_seqlens=torch.tensor([0, 2, 9], device=DEVICE))
    o.sum().backward()
    assert torch.equal(o.detach(), o_eval) and torch.isfinite(q.grad).all()


def test_identical_consecutive_keys():
    """All keys equal: (I + StrictTril(...)) is as ill-conditioned as KDA inputs get."""
    inputs = make_inputs(1, 40, 1, 1, 16, 16, seed=4)
    inputs[1][:] = inputs[1][:, :1]
    check(inputs)


@pytest.mark.timeout(300)
def test_gate_exactly_zero():
    """g = 0 exactly ("gate = 1", no decay): with exp(A_log) = e^5 and z + dt_bias = -1,
    sigmoid(-148) underflows to 0 in float32, so the fused gate lower_bound * sigmoid(.) is -0.0
    (the float64 reference sees ~1e-64). Every key channel then keeps its state undecayed, and the
    gate's own gradients (dz, dA_log, ddt_bias) vanish: sigmoid'(-148) ~ 1e-64."""
    inputs = make_inputs(1, 40, 1, 1, 16, 16, seed=5)
    inputs[5][:] = 5.0
    inputs[6][:] = 0.0
    inputs[3][:] = -1.0
    assert (lower_bounded_gate(inputs[3].float(), inputs[5].float(), inputs[6].float()) == 0).all()
    check(inputs, vanishing=("g", "A_log", "dt_bias"))


@pytest.mark.timeout(300)
def test_strong_decay_lower_bound_limit():
    """lower_bound = -10 (the kernel's limit) with gates near it (sigmoid(3) = 0.95, g ~ -9.5):
    exp(G_i - r) spans e^76 over half a sub-tile, still finite in float32/bf16; the state forgets
    almost everything every token. The gate gradients are then ~1e-5 of the O(1) terms that cancel
    into them (at a chunk's last token, whose gate scales the whole carried state), so float32
    round-off puts them ~1e-3 from float64: they get 2e-3."""
    inputs = make_inputs(1, 20, 1, 1, 16, 16, seed=6)
    inputs[3] = 3.0 + 0.1 * inputs[3]
    inputs[5][:] = 0.0
    inputs[6][:] = 0.0
    check(inputs, lower_bound=-10.0, gate_tol=2e-3)


@pytest.mark.timeout(300)
def test_second_backward_through_a_retained_graph():
    """Two backwards through a retained graph read the same saved intermediates (W, KG, QG, h, V~):
    the same gradients, both matching the float64 reference."""
    inputs = make_inputs(1, 40, 1, 2, 16, 16, seed=5)
    ours = [x.float().to(DEVICE).requires_grad_() for x in inputs]
    ref = [x.clone().requires_grad_() for x in inputs]
    do = torch.randn(1, 40, 2, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    o, _ = flash_kda(*ours[:7], initial_state=ours[7])
    loss = (o.double().cpu() * do).sum()
    first = torch.autograd.grad(loss, ours, retain_graph=True)
    second = torch.autograd.grad(loss, ours)
    o_ref, _ = reference(*ref[:7], initial_state=ref[7])
    expected = torch.autograd.grad((o_ref * do).sum(), ref)
    for name, a, b, c in zip(NAMES, expected, first, second):
        assert_close(f"d{name} (first)", a, b.cpu(), TOL_GRAD)
        assert_close(f"d{name} (second vs first)", b.double().cpu(), c.cpu(), 1e-12)


def test_no_grad_matches_and_no_state():
    """Inference (no autograd: intermediates in the input dtype), no initial or final state."""
    q, k, v, z, beta, A_log, dt_bias, _ = make_inputs(1, 20, 1, 1, 16, 16, seed=7)
    with torch.no_grad():
        o, s = flash_kda(*(x.float().to(DEVICE) for x in (q, k, v, z, beta, A_log, dt_bias)))
    assert s is None
    o_ref, _ = reference(q, k, v, z, beta, A_log, dt_bias)
    assert_close("o", o_ref, o.cpu(), TOL_OUT)


def test_second_derivative_is_refused():
    """The backward is Triton kernels, not differentiable: differentiating a create_graph=True gradient
    silently dropped flash_kda's second-order term (as if it were linear in q). It must raise instead."""
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in make_inputs(1, 8, 1, 1, 16, 16, seed=13))
    q.requires_grad_()
    o, _ = flash_kda(q, k, v, z, beta, A_log, dt_bias)
    (dq,) = torch.autograd.grad((o**2).sum() + (q**3).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice FlashKDAFunction"):
        dq.sum().backward()


def test_second_derivative_is_refused_for_constant_incoming_gradients():
    """Regression: with a loss linear in o, the incoming gradient does not require grad, and
    torch's once_differentiable then returned plain tensors: the second derivative silently lacked
    flash_kda's terms (0.058401 vs the reference's 0.059186). It must raise too."""
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in make_inputs(1, 8, 1, 1, 16, 16, seed=14))
    v.requires_grad_()
    o, _ = flash_kda(q, k, v, z, beta, A_log, dt_bias)
    w = torch.randn_like(o)
    loss = (o * w).sum()
    (dv,) = torch.autograd.grad(loss, v, create_graph=True)
    assert_close("dv with create_graph", torch.autograd.grad((reference(q, k, v, z, beta, A_log, dt_bias)[0] * w)
                                                             .sum(), v)[0], dv.detach(), TOL_GRAD)
    with pytest.raises(RuntimeError, match="differentiate twice FlashKDAFunction"):
        torch.autograd.grad(loss + (dv**2).sum(), v)


def _bad_cases():
    """(description, kwargs overrides) for inputs both flash_kda and chunk_kda must reject."""
    B, T, H, K = 1, 8, 2, 16
    q, k, v, z, beta, A_log, dt_bias, h0 = (x.float() for x in make_inputs(B, T, H, H, K, K, seed=8))
    base = dict(q=q, k=k, v=v, g=z, beta=beta)
    nan_q = q.clone()
    nan_q[0, 3, 1, 2] = float("nan")
    return [
        ("k shape", dict(base, k=k[:, :, :1])),
        ("GVA", dict(base, v=torch.randn(B, T, 3, K), g=torch.randn(B, T, 3, K), beta=torch.randn(B, T, 3))),
        ("beta shape", dict(base, beta=beta[..., :1])),
        ("NaN", dict(base, q=nan_q)),
        ("duplicate offsets", dict(base, cu_seqlens=torch.tensor([0, 4, 4, 8]))),
        ("offsets end", dict(base, cu_seqlens=torch.tensor([0, 4, 7]))),
        ("initial_state", dict(base, initial_state=h0[:, :, :3])),
    ], (A_log, dt_bias)


@pytest.mark.parametrize("i", range(7), ids=["k shape", "GVA", "beta shape", "NaN", "duplicate offsets",
                                              "offsets end", "initial_state"])
def test_bad_inputs_same_errors_as_k3lab_kda(i):
    cases, gate_params = _bad_cases()
    _, kwargs = cases[i]
    kwargs = {name: x.to(DEVICE) for name, x in kwargs.items()}
    A_log, dt_bias = (x.to(DEVICE) for x in gate_params)
    with pytest.raises(ValueError) as ours:
        flash_kda(A_log=A_log, dt_bias=dt_bias, **kwargs)
    # chunk_kda takes the log-decay itself: give it a valid one of the same shape.
    ref_kwargs = dict(kwargs, g=-kwargs["g"].abs())
    with pytest.raises(ValueError) as ref:
        chunk_kda(**ref_kwargs)
    assert str(ours.value) == str(ref.value)


def test_bad_gate_parameters():
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in make_inputs(1, 8, 1, 1, 16, 16))
    with pytest.raises(ValueError, match="A_log"):
        flash_kda(q, k, v, z, beta, A_log[None], dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        flash_kda(q, k, v, z, beta, A_log, dt_bias[:-1])
    with pytest.raises(ValueError, match="lower_bound"):
        flash_kda(q, k, v, z, beta, A_log, dt_bias, lower_bound=0.0)
    with pytest.raises(ValueError, match="lower_bound"):
        flash_kda(q, k, v, z, beta, A_log, dt_bias, lower_bound=-20.0)
    # not a number: a TypeError from the range comparison, naming nothing
    for bad in ("-5", None):
        with pytest.raises(ValueError, match="lower_bound"):
            flash_kda(q, k, v, z, beta, A_log, dt_bias, lower_bound=bad)
    with pytest.raises(ValueError, match="dt_bias contains NaN"):
        flash_kda(q, k, v, z, beta, A_log, torch.full_like(dt_bias, float("nan")))


@pytest.mark.timeout(300)
def test_same_results_as_kdalayer_reference_op():
    """KDALayer runs flash_kda on CUDA and ``reference_kda_op`` elsewhere: same signature, same results."""
    from k3lab.kda.layer import reference_kda_op

    q, k, v, z, beta, A_log, dt_bias, h0 = (x.float() for x in make_inputs(1, 20, 1, 2, 16, 16, seed=9))
    o_ref, s_ref = reference_kda_op(q, k, v, z, beta, A_log, dt_bias, initial_state=h0, output_final_state=True)
    with torch.no_grad():
        o, s = flash_kda(*(x.to(DEVICE) for x in (q, k, v, z, beta, A_log, dt_bias)),
                         initial_state=h0.to(DEVICE), output_final_state=True)
    assert_close("o", o_ref, o.cpu(), TOL_OUT)
    assert_close("final_state", s_ref, s.cpu(), TOL_OUT)


@pytest.mark.timeout(300)
def test_float16_inference_is_finite():
    """float16 without autograd used float16 intermediates: a diagonal sub-tile's factor
    exp(r - G_j) reaches exp(8 |lower_bound|) = e^40 > float16's max, so every output from T ~ 10 on
    was NaN. T = 20 with the default lower bound."""
    q, k, v, z, beta, A_log, dt_bias, _ = make_inputs(1, 20, 1, 1, 16, 16, seed=11)
    o_ref, _ = reference(q, k, v, z, beta, A_log, dt_bias)
    with torch.no_grad():
        o, _ = flash_kda(*(x.half().to(DEVICE) for x in (q, k, v, z, beta)), A_log.float().to(DEVICE),
                         dt_bias.float().to(DEVICE))
    assert o.dtype == torch.float16
    assert_close("o", o_ref, o.cpu(), 5e-3)


@pytest.mark.timeout(300)
def test_bfloat16_forward_and_backward():
    """bfloat16 q, k, v, z, beta: on CPU the bf16 intermediates went through the Triton interpreter,
    which has no bf16 arithmetic, and every output and gradient was garbage (relative error ~1e12)."""
    inputs = make_inputs(1, 20, 1, 1, 16, 16, seed=15)
    ref = [x.clone().requires_grad_() for x in inputs[:7]]
    ours = [x.to(DEVICE, torch.bfloat16 if i < 5 else torch.float32).requires_grad_() for i, x in enumerate(inputs[:7])]
    o, _ = flash_kda(*ours)
    o_ref, _ = reference(*ref)
    assert o.dtype == torch.bfloat16
    assert_close("o", o_ref, o.cpu(), 1e-2)
    # Without autograd a GPU's bf16 forward runs the packed gate and the fused inverse + W/U kernel: G
    # rebuilt to within 6.1e-4, so the same output to bf16's rounding; on CPU (float32 intermediates)
    # the autograd forward's path, bit for bit.
    with torch.no_grad():
        o_inference = flash_kda(*ours)[0]
    assert_close("o without autograd", o_ref, o_inference.cpu(), 1e-2)
    assert DEVICE == "cuda" or torch.equal(o_inference, o)
    do = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (o.double().cpu() * do).sum().backward()
    (o_ref * do).sum().backward()
    for name, a, b in zip(NAMES, ref, ours):
        assert_close(f"d{name}", a.grad, b.grad.cpu(), 2e-2)


def test_gate_parameters_on_another_device_or_bad_scale():
    """A_log/dt_bias on another device failed inside Triton (RuntimeError); a NaN scale gave NaN."""
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in make_inputs(1, 8, 1, 1, 16, 16))
    with pytest.raises(ValueError, match="A_log"):
        flash_kda(q, k, v, z, beta, A_log.to("meta"), dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        flash_kda(q, k, v, z, beta, A_log, dt_bias.to("meta"))
    with pytest.raises(ValueError, match="scale"):
        flash_kda(q, k, v, z, beta, A_log, dt_bias, scale=float("nan"))
    with pytest.raises(ValueError, match="beta"):
        flash_kda(q, k, v, z, beta.long(), A_log, dt_bias)


def test_silently_accepted_arguments_are_refused():
    """Regressions, all accepted without a word before: a scale <= 0, a tensor as
    output_final_state (truthy), an integer A_log or dt_bias (no gradient), a 0-d tensor lower_bound."""
    q, k, v, z, beta, A_log, dt_bias, h0 = (x.float() for x in make_inputs(1, 8, 1, 1, 16, 16))
    cases = [(dict(scale=-0.25), "scale must be a finite positive float, got -0.25"),
             (dict(scale=0), "scale must be a finite positive float, got 0"),
             (dict(output_final_state=h0), "output_final_state must be a bool, got Tensor"),
             (dict(A_log=A_log.long()), "A_log must be a floating-point tensor, got dtype torch.int64"),
             (dict(dt_bias=dt_bias.long()), "dt_bias must be a floating-point tensor, got dtype torch.int64"),
             (dict(lower_bound=torch.tensor(-5.0)), r"lower_bound must be a float in \[-10.0, 0\), got tensor"),
             (dict(scale=torch.tensor(0.25, requires_grad=True)), "scale must be a number: flash_kda does not "
                                                                  "differentiate it")]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, g=z, beta=beta, A_log=A_log, dt_bias=dt_bias) | change
        with pytest.raises(ValueError, match=message):
            flash_kda(**args)


def test_layer_dispatch_takes_numpy_lower_bounds():
    """KDALayer's CUDA operator sent np.float32(-12) to flash_kda (which refuses < -10) instead of the
    reference: its "too low" test knew only int and float. On a CPU the kernels run under the interpreter."""
    import numpy as np

    from k3lab.kda.layer import _kda_op, reference_kda_op

    op = _kda_op(torch.device("cuda"), "lower_bounded", 16)
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in make_inputs(1, 20, 1, 1, 16, 16))
    for lb in (np.float32(-12.0), np.float64(-3.0)):
        o, _ = op(q, k, v, z, beta, A_log, dt_bias, lower_bound=lb)
        o_ref, _ = reference_kda_op(q, k, v, z, beta, A_log, dt_bias, lower_bound=float(lb), chunk_size=16)
        print(f"lower_bound {lb!r}: {assert_close('o', o_ref, o, TOL_OUT):.1e}")


def test_bench_flash_kda_help_names_the_module(capsys):
    """--help printed `usage: flash_kda.py`; it must show how the bench is run."""
    from k3lab.bench import flash_kda as bench

    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m k3lab.bench.flash_kda "), out[:80]


def test_bench_takes_fla_times_from_several_files(tmp_path):
    """--fla-from FILE...: the first file with a time for a shape wins, and each time says which run
    timed fla (a live run's date, or the date its file took the time from); a bad file is named."""
    import json

    from k3lab.bench.flash_kda import fla_times

    def case(B, fwd):
        return {"B": B, "T": 8192, "H": 16, "K": 128, "fla_fwd_ms": fwd, "fla_fwd_bwd_ms": None if fwd is None
                else 4 * fwd, "fla_peak_mib": 1.0}

    copied = {"versions": {"fla_times_from": "10:51"}, "date": "18:37", "cases": [case(1, 0.9), case(2, None)]}
    live = {"versions": {"fla-core": "0.6.0"}, "date": "18:54", "cases": [case(1, 0.5), case(2, 1.2), case(4, 1.8)]}
    paths = []
    for name, data in (("copied", copied), ("live", live)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    times = fla_times(paths)
    assert sorted(times) == [(1, 8192, 16, 128), (2, 8192, 16, 128), (4, 8192, 16, 128)]
    assert times[1, 8192, 16, 128] == {"fla_fwd_ms": 0.9, "fla_fwd_bwd_ms": 3.6, "fla_peak_mib": 1.0,
                                       "fla_times_from": "10:51"}
    assert times[2, 8192, 16, 128]["fla_times_from"] == "18:54" and times[2, 8192, 16, 128]["fla_fwd_ms"] == 1.2
    assert fla_times(paths[::-1])[1, 8192, 16, 128]["fla_fwd_ms"] == 0.5
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        fla_times([tmp_path / "bad.json"])


def tune_with_three_configs(monkeypatch, tuned) -> list:
    """Give each autotuned kernel in ``tuned`` three configs and a stand-in benchmark that runs each twice
    (the interpreter has no timer) and picks the last; returns the list that gets one entry per timing."""
    runs = []

    def bench_twice(kernel_call, quantiles):
        kernel_call()
        kernel_call()
        runs.append(1)
        return [1.0 / len(runs)] * 3

    for fn in tuned:
        monkeypatch.setattr(fn, "configs", [triton.Config({}, num_warps=w) for w in (1, 2, 4)])
        monkeypatch.setattr(fn, "cache", {})
        monkeypatch.setitem(fn.__dict__, "do_bench", bench_twice)
    return runs


def test_autotuning_leaves_in_place_buffers_intact(monkeypatch):
    """On a GPU, Triton's autotuner runs each config of an autotuned kernel before picking one; the
    W/U, dW/dv and intra-backward kernels update buffers in place, so without ``restore_value``
    the tuning runs would add their terms several times. Here every autotuned kernel is tuned over three
    configs (``tune_with_three_configs``): the results must still match the reference."""
    from k3lab.kernels.kda import chunk_bwd, chunk_fwd

    tuned = [fn for mod in (chunk_fwd, chunk_bwd) for fn in vars(mod).values()
             if isinstance(fn, triton.runtime.Autotuner)]
    assert len(tuned) == 7
    runs = tune_with_three_configs(monkeypatch, tuned)
    check(make_inputs(1, 70, 1, 2, 16, 16, seed=11))
    # scores, inverse, W/U, dq/dk, dW/dv, intra bwd: 3 configs each (the scores kernel is tuned for the
    # float32 intermediates the interpreter runs; a fixed launch serves bf16 at K <= 128). On a GPU,
    # float32 intermediates launch dW/dv untuned (``chunk_bwd.kda_dwv_bwd``). The fused inverse + W/U
    # kernel serves 16-bit intermediates only: the next test tunes it.
    assert len(runs) == 3 * (5 if DEVICE == "cuda" else 6)


@pytest.mark.timeout(300)
def test_inverse_fused_into_wu_gives_the_split_kernels_results(monkeypatch):
    """``kda_inverse_wu_fwd_kernel`` (a forward with no backward, 16-bit intermediates on a GPU: T assembled
    in registers, never stored) against ``kda_inverse_fwd_kernel`` + ``kda_wu_fwd_kernel`` on the same L:
    W and U bit for bit, on packed sequences of 20 and 70 tokens (tail chunks) with GVA, the fused kernel
    tuned over three configs (it rewrites W in place, like the W/U kernel)."""
    from k3lab.kernels.kda import chunk_fwd as cf
    from k3lab.kernels.kda.utils import chunk_index

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    inputs = make_inputs(1, 90, 1, 2, 16, 16, N=2, seed=31)
    q, k, v, z, beta = (x[0].to(DEVICE, dtype) for x in inputs[:5])
    A_log, dt_bias = (x.float().to(DEVICE) for x in inputs[5:7])
    cu, chunk_indices, _ = chunk_index([20, 70], DEVICE)
    G, Tinv, Aqk, *split = cf.kda_intra_fwd(q, k, v, z, beta, A_log, dt_bias, 0.25, -5.0, cu, chunk_indices, dtype)
    # kda_intra_fwd picks the fused kernel for 16-bit intermediates when T is not kept.
    kept = cf.kda_intra_fwd(q, k, v, z, beta, A_log, dt_bias, 0.25, -5.0, cu, chunk_indices, dtype, keep_t=False)[1]
    assert (kept is None) == (dtype == torch.bfloat16)
    runs = tune_with_three_configs(monkeypatch, [cf.kda_inverse_wu_fwd_kernel])
    L = torch.empty(90, 2, 64, device=DEVICE)
    fused = cf._launch_intra(q, k, v, beta, G, L, None, torch.empty_like(Aqk), 0.25, cu, chunk_indices, dtype,
                             replay=False)
    assert len(runs) == 3
    for name, a, b in zip(("W", "U", "KG", "QG"), split, fused):
        assert a.abs().max() > 1e-2 and torch.equal(a, b), name


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lower_bound", [-5.0, -10.0])
def test_packed_gate_against_the_float32_gate(lower_bound):
    """The packed gate (int16 codes within 16-row sub-tiles, the sub-tiles' ends E; what a forward with no
    backward runs with 16-bit intermediates) against the float32 G, on packed sequences of 20, 70 and 130
    tokens (tail chunks) with GVA, run here with float32 intermediates so the interpreter takes it: G
    rebuilt from the codes to within half their step, E equal to G at the sub-tiles' last rows, the
    scores kernel's W, KG, QG, Aqk, U and the state kernel's output and final state from it within the
    codes' rounding (a factor exp(+-step / 2) per decay term)."""
    from k3lab.kernels.kda import chunk_fwd as cf
    from k3lab.kernels.kda.utils import chunk_index

    lengths = [20, 70, 130]
    inputs = make_inputs(1, sum(lengths), 1, 2, 16, 16, N=3, seed=41)
    q, k, v, z, beta = (x[0].to(DEVICE, torch.float32) for x in inputs[:5])
    A_log, dt_bias = (x.float().to(DEVICE) for x in inputs[5:7])
    z = 3 * z  # gates from near 0 to near the bound
    cu, chunk_indices, chunk_offsets = chunk_index(lengths, DEVICE)
    NT, (T, HV, K) = chunk_indices.shape[0], z.shape
    G, _, _ = cf.kda_gate_fwd(z, A_log, dt_bias, lower_bound, cu, chunk_indices, exact_sum=False, packed=False)
    X, E, step = cf.kda_gate_fwd(z, A_log, dt_bias, lower_bound, cu, chunk_indices, exact_sum=False, packed=True)
    assert X.dtype == torch.int16 and E.shape == (NT, HV, 4, K)
    # Rebuild G token by token: r = the previous sub-tile's end in the token's chunk (0 for the first).
    pos = torch.cat([torch.arange(n) for n in lengths]).to(DEVICE)
    length = torch.repeat_interleave(torch.tensor(lengths), torch.tensor(lengths)).to(DEVICE)
    c = chunk_offsets[:-1].long().repeat_interleave(torch.tensor(lengths, device=DEVICE)) + pos // 64
    sub = pos % 64 // 16
    r = torch.cat([torch.zeros_like(E[:, :, :1]), E[:, :, :3]], 2)[c, :, sub]
    rebuilt = r + step * (X.float() - 32767)
    assert (rebuilt - G).abs().max() <= 0.5 * step + 1e-5 * G.abs().max()
    ends = (pos % 16 == 15) | (pos == length - 1)
    assert torch.allclose(E[c[ends], :, sub[ends]], G[ends], rtol=1e-5, atol=1e-5)
    Aqk = [torch.empty(T, HV, 64, device=DEVICE) for _ in range(2)]
    L = torch.empty(T, HV, 64, device=DEVICE)
    Tinv = torch.empty(T, HV, 64, device=DEVICE)
    ref = cf._launch_intra(q, k, v, beta, G, L, Tinv, Aqk[0], 0.25, cu, chunk_indices, torch.float32, replay=False)
    packed = cf._launch_intra(q, k, v, beta, X, L, Tinv, Aqk[1], 0.25, cu, chunk_indices, torch.float32,
                              replay=False, E=E, x_scale=step)
    bound = 2 * step
    for name, a, b in zip(("W", "U", "KG", "QG", "Aqk"), (*ref, Aqk[0]), (*packed, Aqk[1])):
        assert_close(name, a, b, bound)
    outs = []
    for (W, U, KG, QG), gate, A in ((ref, G, Aqk[0]), (packed, E, Aqk[1])):
        o = torch.empty(T, HV, 16, device=DEVICE)
        outs += [o, cf.kda_state_fwd(W, U, KG, gate, None, True, cu, chunk_offsets, NT, store_states=False,
                                     output=(QG, A, o))[2]]
    assert_close("o", outs[0], outs[2], bound)
    assert_close("final state", outs[1], outs[3], bound)


@triton.jit
def _invert_four_blocks(N, X, BC: tl.constexpr, PREC: tl.constexpr):
    o = tl.arange(0, BC)
    off = o[:, None] * BC + o[None, :]
    x0, x1, x2, x3 = unit_lower_inverse(tl.load(N + off), tl.load(N + BC * BC + off),
                                        tl.load(N + 2 * BC * BC + off), tl.load(N + 3 * BC * BC + off), BC, PREC)
    tl.store(X + off, x0)
    tl.store(X + BC * BC + off, x1)
    tl.store(X + 2 * BC * BC + off, x2)
    tl.store(X + 3 * BC * BC + off, x3)


def test_ut_inverse_of_a_near_identical_key_block():
    """The diagonal blocks' inverse (I + N)^-1 by recursive doubling, against float64: on a block from
    near-identical keys (beta = 1, no decay), where the power form (I - N)(I + N^2)(I + N^4)(I + N^8)
    it replaced lost 6e-5 in float32 (N^8 reaches 3432), and on a random one. Float32 intermediates'
    products ("ieee") must be at float32's rounding; bf16 intermediates' (three bf16 passes on a GPU)
    must stay far below bf16's rounding of T (3.9e-3): plain TF32 lost 2.2e-3 here on an H200. Triton's
    interpreter computes every tl.dot in float32 whatever its input precision, so the precisions' half of
    this check bites on a GPU only."""
    gen = torch.Generator().manual_seed(0)
    near = torch.ones(4, 16, 16, dtype=torch.float64) - 0.01 * torch.rand(4, 16, 16, generator=gen, dtype=torch.float64)
    for N in (near.tril(-1), (0.5 * torch.randn(4, 16, 16, generator=gen, dtype=torch.float64)).tril(-1)):
        ref = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + N)
        for exact, bound in ((True, 1e-6), (False, 4e-4)):
            X = torch.empty(4, 16, 16, device=DEVICE)
            # The interpreter takes only tf32/tf32x3/ieee (and computes each in float32).
            prec = inverse_precisions(exact)[0] if DEVICE == "cuda" else "ieee"
            _invert_four_blocks[(1,)](N.float().to(DEVICE).contiguous(), X, BC=16, PREC=prec)
            assert_close(f"(I + N)^-1, exact={exact}", ref, X.cpu(), bound)
