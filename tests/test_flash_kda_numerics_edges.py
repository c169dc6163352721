"""FlashKDA's numerics and edges: hard inputs (identical keys, strongly coupled sub-tiles, gates at
zero, at the lower bound and saturated), the UT inverse against float64, overflow and NaN named,
and bad arguments refused with the same errors as ``k3lab.kda``.

Float32 kernels (TRITON_INTERPRET=1 on CPU, set by tests/conftest.py) against ``k3lab.kda.naive_fused_kda``
in float64; the bf16 GPU check is ``python -m k3lab.bench.flash_kda --check-only``.
"""
import os
import traceback
import warnings

import pytest
import torch
import triton
import triton.language as tl

from k3lab.kda import chunk_kda, lower_bounded_gate, naive_fused_kda
from k3lab.kernels.kda import flash_kda
from k3lab.kernels.kda.chunk_fwd import inverse_precisions, kda_intra_fwd, unit_lower_inverse
from k3lab.kernels.kda.utils import chunk_index
from k3lab.testing import DEVICE, FLASH_KDA_ARGS, FLASH_KDA_TOL_GRAD, assert_close, rel_rms_error


def test_identical_consecutive_keys(kda_check, kda_inputs):
    """All keys equal: (I + StrictTril(...)) is as ill-conditioned as KDA inputs get."""
    inputs = kda_inputs(1, 40, 1, 1, 16, 16, seed=4)
    inputs[1][:] = inputs[1][:, :1]
    kda_check(inputs)


@pytest.mark.timeout(300)
def test_gate_exactly_zero(kda_check, kda_inputs):
    """g = 0 exactly ("gate = 1", no decay): with exp(A_log) = e^5 and z + dt_bias = -1,
    sigmoid(-148) underflows to 0 in float32, so the fused gate lower_bound * sigmoid(.) is -0.0
    (the float64 reference sees ~1e-64). Every key channel then keeps its state undecayed, and the
    gate's own gradients (dz, dA_log, ddt_bias) vanish: sigmoid'(-148) ~ 1e-64."""
    inputs = kda_inputs(1, 40, 1, 1, 16, 16, seed=5)
    inputs[5][:] = 5.0
    inputs[6][:] = 0.0
    inputs[3][:] = -1.0
    assert (lower_bounded_gate(inputs[3].float(), inputs[5].float(), inputs[6].float()) == 0).all()
    kda_check(inputs, vanishing=("z", "A_log", "dt_bias"))


@pytest.mark.timeout(300)
def test_strong_decay_lower_bound_limit(kda_check, kda_inputs):
    """lower_bound = -10 (the kernel's limit) with gates near it (sigmoid(3) = 0.95, g ~ -9.5):
    exp(G_i - r) spans e^76 over half a sub-tile, still finite in float32/bf16; the state forgets
    almost everything every token. The gate gradients are then ~1e-5 of the O(1) terms that cancel
    into them (at a chunk's last token, whose gate scales the whole carried state), so float32
    round-off puts them ~1e-3 from float64: they get 2e-3."""
    inputs = kda_inputs(1, 20, 1, 1, 16, 16, seed=6)
    inputs[3] = 3.0 + 0.1 * inputs[3]
    inputs[5][:] = 0.0
    inputs[6][:] = 0.0
    kda_check(inputs, lower_bound=-10.0, gate_tol=2e-3)


def _bad_cases(kda_inputs):
    """(description, kwargs overrides) for inputs both flash_kda and chunk_kda must reject."""
    B, T, H, K = 1, 8, 2, 16
    q, k, v, z, beta, A_log, dt_bias, h0 = (x.float() for x in kda_inputs(B, T, H, H, K, K, seed=8))
    base = dict(q=q, k=k, v=v, z=z, beta_logits=beta)
    nan_q = q.clone()
    nan_q[0, 3, 1, 2] = float("nan")
    return [
        ("k shape", dict(base, k=k[:, :, :1])),
        ("GVA", dict(base, v=torch.randn(B, T, 3, K), z=torch.randn(B, T, 3, K), beta_logits=torch.randn(B, T, 3))),
        ("beta shape", dict(base, beta_logits=beta[..., :1])),
        ("NaN", dict(base, q=nan_q)),
        ("duplicate offsets", dict(base, cu_seqlens=torch.tensor([0, 4, 4, 8]))),
        ("offsets end", dict(base, cu_seqlens=torch.tensor([0, 4, 7]))),
        ("initial_state", dict(base, initial_state=h0[:, :, :3])),
    ], (A_log, dt_bias)


@pytest.mark.parametrize("i", range(7), ids=["k shape", "GVA", "beta shape", "NaN", "duplicate offsets",
                                              "offsets end", "initial_state"])
def test_bad_inputs_same_errors_as_k3lab_kda(i, kda_inputs):
    cases, gate_params = _bad_cases(kda_inputs)
    _, kwargs = cases[i]
    kwargs = {name: x.to(DEVICE) for name, x in kwargs.items()}
    A_log, dt_bias = (x.to(DEVICE) for x in gate_params)
    with pytest.raises(ValueError) as ours:
        flash_kda(A_log=A_log, dt_bias=dt_bias, **kwargs)
    # chunk_kda takes the log-decay g and the strengths beta in their places: give it a valid g of z's shape.
    ref_kwargs = {{"z": "g", "beta_logits": "beta"}.get(n, n): x for n, x in kwargs.items()}
    ref_kwargs["g"] = -ref_kwargs["g"].abs()
    with pytest.raises(ValueError) as ref:
        chunk_kda(**ref_kwargs)
    # The same check and message, each naming its own op's arguments; the reference too.
    assert str(ours.value) == str(ref.value).replace("g must", "z must").replace("beta must", "beta_logits must")
    if i != 3:  # value checks are flash_kda's own
        with pytest.raises(ValueError) as naive:
            naive_fused_kda(A_log=A_log.cpu(), dt_bias=dt_bias.cpu(), **{n: x.cpu() for n, x in kwargs.items()})
        assert str(naive.value) == str(ours.value)


def test_bad_gate_parameters(kda_inputs):
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in kda_inputs(1, 8, 1, 1, 16, 16))
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


def test_gate_parameters_on_another_device_or_bad_scale(kda_inputs):
    """A_log/dt_bias on another device failed inside Triton (RuntimeError); a NaN scale gave NaN."""
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in kda_inputs(1, 8, 1, 1, 16, 16))
    with pytest.raises(ValueError, match="A_log"):
        flash_kda(q, k, v, z, beta, A_log.to("meta"), dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        flash_kda(q, k, v, z, beta, A_log, dt_bias.to("meta"))
    with pytest.raises(ValueError, match="scale"):
        flash_kda(q, k, v, z, beta, A_log, dt_bias, scale=float("nan"))
    with pytest.raises(ValueError, match="beta"):
        flash_kda(q, k, v, z, beta.long(), A_log, dt_bias)


def test_silently_accepted_arguments_are_refused(kda_inputs):
    """Regressions, all accepted without a word before: a scale <= 0, a tensor as
    output_final_state (truthy), an integer A_log or dt_bias (no gradient), a 0-d tensor lower_bound."""
    q, k, v, z, beta, A_log, dt_bias, h0 = (x.float() for x in kda_inputs(1, 8, 1, 1, 16, 16))
    cases = [(dict(scale=-0.25), "scale must be a finite positive float, got -0.25"),
             (dict(scale=0), "scale must be a finite positive float, got 0"),
             (dict(output_final_state=h0), "output_final_state must be a bool, got Tensor"),
             (dict(A_log=A_log.long()), "A_log must be a floating-point tensor, got dtype torch.int64"),
             (dict(dt_bias=dt_bias.long()), "dt_bias must be a floating-point tensor, got dtype torch.int64"),
             (dict(lower_bound=torch.tensor(-5.0)), r"lower_bound must be a float in \[-10.0, 0\), got tensor"),
             (dict(scale=torch.tensor(0.25, requires_grad=True)), "scale must be a number: flash_kda does not "
                                                                  "differentiate it")]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, z=z, beta_logits=beta, A_log=A_log, dt_bias=dt_bias) | change
        with pytest.raises(ValueError, match=message):
            flash_kda(**args)


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


# The interpreter runs the kernels in numpy, which warns where they overflow as intended here.
INTERPRETER_OVERFLOW = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")


def flash_inputs(kda_inputs, seed=40, T=20):
    """float32 inputs on DEVICE (B = 1, T tokens, H = HV = 1, K = V = 16) and their float64 originals."""
    inputs = kda_inputs(1, T, 1, 1, 16, 16, seed=seed)
    return [x.float().to(DEVICE) for x in inputs], inputs


@pytest.mark.timeout(300)
def test_keys_scaled_by_1e3_match_the_reference(kda_inputs, kda_reference):
    """flash_kda normalises q and k itself: keys 1e3 times too large give the float64 result."""
    ours, ref = flash_inputs(kda_inputs)
    ours[1], ref[1] = ours[1] * 1e3, ref[1] * 1e3
    o, s = flash_kda(*ours[:7], initial_state=ours[7], output_final_state=True)
    o_ref, s_ref = kda_reference(*ref[:7], initial_state=ref[7])
    assert_close("o", o_ref, o.cpu(), 1e-4)
    assert_close("final_state", s_ref, s.cpu(), 1e-4)


@INTERPRETER_OVERFLOW
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["q", "k"])
def test_q_k_beyond_the_float32_norm_raise(name, kda_inputs):
    """max |k| = 3e20: ||k||^2 overflowed float32 in the kernels' norm and k came out as 0, a finite
    and wrong output (0.09 where the reference has 0.14). check_values=False still skips the check."""
    ours, _ = flash_inputs(kda_inputs)
    i = FLASH_KDA_ARGS.index(name)
    ours[i] = ours[i] * 1e20
    with pytest.raises(ValueError, match=rf"^{name} is too large for flash_kda's L2 norm: max \|{name}\| = .*K=16"):
        flash_kda(*ours[:7], initial_state=ours[7])
    flash_kda(*ours[:7], initial_state=ours[7], check_values=False)


@INTERPRETER_OVERFLOW
@pytest.mark.timeout(300)
def test_initial_state_beyond_float32_raises(kda_inputs):
    """A float64 initial_state of 1e300: check_finite passed it, the kernels' float32 copy was inf."""
    ours, _ = flash_inputs(kda_inputs)
    huge = torch.full(ours[7].shape, 1e300, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match=r"^initial_state is out of range: max \|initial_state\| = 1e\+300 exceeds "
                                         r"float32's largest value"):
        flash_kda(*ours[:7], initial_state=huge)


@INTERPRETER_OVERFLOW
@pytest.mark.timeout(300)
def test_output_overflow_names_initial_state(kda_inputs):
    """A float32 state of 3e38 with the gate at ~0 (z = -100: no decay): o overflows float32 -> ValueError,
    never an inf/NaN returned."""
    ours, _ = flash_inputs(kda_inputs)
    ours[3] = torch.full_like(ours[3], -100.0)
    ours[6] = torch.zeros_like(ours[6])
    huge = torch.full_like(ours[7], 3e38)
    with pytest.raises(ValueError, match=r"^initial_state is too large: .*overflowed float32.*k3lab.kda.chunk_kda"):
        flash_kda(*ours[:7], initial_state=huge)


@INTERPRETER_OVERFLOW
def test_float16_output_overflow_names_float16():
    """float16 inputs whose output passes 6.55e4 (v = 6e4 summed over a few tokens): the message said float32's
    range (3.4e38) had run out, against max |v| = 6e4; it is float16's, as chunk_kda reports."""
    q = k = torch.ones(1, 8, 1, 16, dtype=torch.float16, device=DEVICE)
    v = torch.full((1, 8, 1, 16), 6e4, dtype=torch.float16, device=DEVICE)
    z = torch.zeros(1, 8, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"^v is too large: .*overflowed float16 \(largest finite 6.55e\+04\)"):
        flash_kda(q, k, v, z, torch.full((1, 8, 1), 10.0, device=DEVICE), torch.zeros(1, device=DEVICE),
                  torch.zeros(16, device=DEVICE), scale=100.0)


@INTERPRETER_OVERFLOW
@pytest.mark.timeout(300)
def test_nan_input_still_named(kda_inputs):
    """The value checks now read their flags after the kernels (one sync): a NaN input is still named."""
    ours, _ = flash_inputs(kda_inputs)
    ours[2] = ours[2].index_fill(1, torch.tensor([3], device=DEVICE), float("nan"))
    with pytest.raises(ValueError, match=r"^v contains NaN or inf$"):
        flash_kda(*ours[:7], initial_state=ours[7])


def coupled_inputs(kda_inputs):
    """One chunk where every key is the same, beta = sigmoid(20) and the gate z - 8 gives a log-decay of
    ~-1e-3 per token at lower_bound = -5: the diagonal blocks' N has all entries just below 1, and its
    powers reach C(14, 7) = 3432, so the product form's float32 roundings are ~1e-4 of T."""
    inputs = kda_inputs(1, 64, 1, 1, 16, 16, seed=3)
    inputs[1][:] = inputs[1][:, :1]
    inputs[3] = inputs[3] - 8.0
    inputs[4][:] = 20.0
    return inputs


@pytest.mark.timeout(120)
def test_ut_inverse_of_strongly_coupled_subtiles(kda_inputs):
    """The kernel's whole T = (I + L)^-1 (Tinv after the forward) against float64's inverse of the same L.
    The power form alone is 9.3e-4 off; forward substitution, and the power form plus one Newton step,
    3.1e-7; recursive doubling 3.0e-7."""
    q, k, v, z, beta, A_log, dt_bias, _ = coupled_inputs(kda_inputs)
    T, K = q.shape[1], q.shape[3]
    kn = k[0, :, 0] / (k[0, :, 0].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    G = lower_bounded_gate(z, A_log, dt_bias, -5.0)[0, :, 0].cumsum(0)
    L = (beta[0, :, 0].sigmoid()[:, None] * (kn * G.exp()) @ (kn * (-G).exp()).T).tril(-1)
    expected = torch.linalg.inv(torch.eye(T, dtype=torch.float64) + L)
    cu, chunk_indices, _ = chunk_index([T], DEVICE)
    flat = [x[0].to(DEVICE, torch.float32).contiguous() for x in (q, k, v, z, beta)]
    Tinv = kda_intra_fwd(*flat, A_log.float().to(DEVICE), dt_bias.float().to(DEVICE), K**-0.5, -5.0, cu,
                         chunk_indices, torch.float32)[1]
    got = Tinv[:, 0, :T].double().cpu().tril()
    err = (got - expected).abs().max().item()
    print(f"max |T - T64| = {err:.1e} (max |T64| {expected.abs().max():.1f})")
    assert err < 1e-5, f"max |T - T64| = {err:.1e}"


@pytest.mark.timeout(120)
def test_outputs_and_gradients_of_strongly_coupled_subtiles(kda_inputs, kda_run_both):
    """The same chunk end to end: o, final state and every gradient within the float32
    tolerance (dbeta_logits = sigmoid'(20) ~ 2e-9 of its terms is 0 in float32, as in torch's autograd: skipped).
    The power form alone gives dv 3.3e-4, dk 1.5e-4, final state 9.8e-5; with a Newton step (as with
    forward substitution) all <= 1.8e-6; by recursive doubling all <= 1.2e-6."""
    ours, ref = kda_run_both(coupled_inputs(kda_inputs))
    for name in ref:
        if name != "dbeta_logits":
            print(f"{name}: {assert_close(name, ref[name], ours[name], FLASH_KDA_TOL_GRAD):.1e}")


@pytest.mark.timeout(300)
def test_strong_decay_then_open_gates_in_one_chunk(kda_check, kda_inputs):
    """48 tokens at a log-decay near -10 (G reaches about -480 in the chunk), then 16 nearly open ones
    (-4.5e-4 each): float32 resolves G only to 3e-5 there, so a float32 running sum rounded each small
    gate and missed by up to 1.5e-4 (o 5.7e-5, final state 9.8e-5, gradients up to 1.4e-4). With float32 intermediates G is summed in float64 and rounded once: o and the state are
    1.2e-5 / 1.4e-5 off."""

    inputs = kda_inputs(1, 64, 1, 1, 16, 16, seed=0)
    closed = (torch.arange(64) < 48)[None, :, None, None]
    inputs[3] = torch.where(closed, 2.0, -2.0).double().expand(1, 64, 1, 16).clone()
    inputs[5] = torch.full_like(inputs[5], 1.6)
    inputs[6] = torch.zeros_like(inputs[6])
    kda_check(inputs, lower_bound=-10.0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lower_bound, gate_tol", [
    (-10.0, {"dz": 1e-2, "dA_log": 0.2, "ddt_bias": 1e-2}),
    (-7.0, {"dz": 4e-4, "dA_log": 6e-3, "ddt_bias": 4e-4}),
])
def test_gate_saturated_at_a_strong_bound(lower_bound, gate_tol, kda_inputs, kda_run_both, assert_all_close):
    """z + 8 with A_log = 0: every log-decay sits next to lower_bound (at -10: -9.997, e^-150 over a
    sub-tile). o, the state and the q, k, v, beta and initial-state gradients stay at float32 accuracy,
    and the backward's kernels compute no inf/NaN anywhere (numpy reports overflow/invalid in the
    interpreter's dots; the forward's masked upper triangle does, the backward, whose factors are all
    <= 1, must not). The gate's own gradients are ~e^-10 of the O(1) terms whose differences the chunkwise
    form takes (cumulative G, reverse cumsum of dG), so their error grows like e^|lb|: at -10 measured dz
    4.8e-3, ddt_bias 5.1e-3, dA_log 8.6e-2, better than the PyTorch chunk_kda in float32 (2.2e-2,
    9.1e-2, 2.0); at -7 dz 1.6e-4,
    dA_log 2.6e-3, already past the 1e-4 float32 tolerance. torch's float32 autograd through the naive
    recurrence gets ~3e-5 / 2e-4 at both."""
    inputs = kda_inputs(1, 40, 1, 2, 40, 16, seed=105)
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
        ours, ref = kda_run_both(inputs, lower_bound=lower_bound)
    assert not bwd_warnings, bwd_warnings
    assert_all_close(ours, ref, skip=gate_tol)
    for name, tol in gate_tol.items():
        print(f"{name}: {assert_close(name, ref[name], ours[name], tol):.1e}")


@pytest.mark.timeout(300)
def test_saturated_gates(kda_check, kda_inputs):
    """a (z + bias) near +12, where the gate's sigmoid is 1 - 6e-6: its derivative taken as s (1 - s) lost
    1 - s to cancellation in float32 (dz 5.4e-3, dA_log 7.8e-3 relative); as
    t / (1 + t)^2 with t = e^-|x| every gradient is at float32 accuracy (dz 9e-6)."""

    inputs = kda_inputs(1, 40, 1, 1, 16, 16, seed=3)
    inputs[3] = 0.3 * inputs[3] + 12.0
    inputs[5] = torch.zeros_like(inputs[5])
    kda_check(inputs)


@pytest.mark.timeout(300)
def test_saturated_beta_and_repeated_keys(kda_inputs, kda_run_both, assert_all_close):
    """beta logits +-30 and every pair of consecutive keys equal: all gradients but dbeta_logits at float32
    accuracy; dbeta_logits = sigmoid'(+-30) ~ 1e-13 times the upstream term, which torch's float32 autograd (s (1 - s)
    with s = 1) gives as 0 (0.95 relative); ours (``sigmoid_grad``) 9.7e-4, held to at most torch's."""
    inputs = kda_inputs(1, 40, 1, 2, 24, 16, seed=106)
    inputs[4] = 30.0 * inputs[4].sign()
    inputs[1][:, 1::2] = inputs[1][:, 0::2]
    ours, ref = kda_run_both(inputs)
    assert_all_close(ours, ref, skip=("dbeta_logits",))
    _, ref32 = kda_run_both(inputs, ref_dtype=torch.float32)
    mine = rel_rms_error(ref["dbeta_logits"], ours["dbeta_logits"])
    torch32 = rel_rms_error(ref["dbeta_logits"], ref32["dbeta_logits"])
    print(f"dbeta_logits: {mine:.1e} (torch float32 autograd {torch32:.1e})")
    assert mine <= 1.5 * torch32 + FLASH_KDA_TOL_GRAD


@pytest.mark.timeout(300)
def test_explicit_scale_bias_per_head_weak_lower_bound(kda_inputs, kda_run_both, assert_all_close):
    """scale = 0.37 given, dt_bias passed as [HV, K] (its gradient keeps that shape), lower_bound = -0.1,
    K = 96 (intra K tiles 64 + 32), V = 8, T = 70."""
    B, T, H, HV, K, V = 1, 70, 1, 1, 96, 8
    inputs = kda_inputs(B, T, H, HV, K, V, seed=107)
    inputs[6] = inputs[6].view(HV, K)
    ours, ref = kda_run_both(inputs, scale=0.37, lower_bound=-0.1)
    assert ours["ddt_bias"].shape == (HV, K)
    assert_all_close(ours, ref)
