"""k3lab.kda: chunkwise KDA vs the naive recurrence (float64) on the hard inputs of K3_NOTES, gradients,
the gate formulas, input validation, and the shared case files.

Reference everywhere: ``naive_recurrent_kda`` (one token at a time) on the same inputs.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k3lab.kda import KDALayer, chunk_kda, kimi_linear_gate, lower_bounded_gate, naive_recurrent_kda
from k3lab.testing import assert_close

F64_TOL = 1e-11


def make_inputs(T, H=1, HV=None, K=16, V=None, B=1, N=None, seed=0, dtype=torch.float64, gate="lower_bounded",
                init_state=True):
    """Fresh random KDA inputs: L2-normalised keys, sigmoid beta, gate-made g, random initial state."""
    HV, V = HV or H, V or K
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = randn(B, T, H, K)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, HV, V)
    z = 2 * randn(B, T, HV, K)
    if gate == "lower_bounded":
        g = lower_bounded_gate(z, torch.zeros(HV, dtype=torch.float64))
    elif gate == "kimi_strong":
        # Per-token decays down to ~e^-30: products underflow; only exp(non-positive) may appear.
        g = kimi_linear_gate(z, torch.full((HV,), 2.0, dtype=torch.float64))
    elif gate == "zero":
        g = torch.zeros(B, T, HV, K, dtype=torch.float64)
    else:
        raise ValueError(gate)
    beta = torch.sigmoid(randn(B, T, HV))
    S0 = randn(N or B, HV, K, V) if init_state else None
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), g=cast(g), beta=cast(beta), initial_state=cast(S0))


def compare(inputs, tol=F64_TOL, cu_seqlens=None, chunk_size=64, state_tol=None):
    o_ref, s_ref = naive_recurrent_kda(**inputs, output_final_state=True, cu_seqlens=cu_seqlens)
    o, s = chunk_kda(**inputs, output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    assert o.dtype == inputs["q"].dtype
    err = assert_close("o", o_ref, o, tol)
    assert_close("final_state", s_ref, s, state_tol or tol)
    return err


# --- chunk vs naive, float64 -------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 500, 1000], ids=lambda T: f"T{T}")
def test_lengths(T):
    # Long sequences stay small in H/K to keep CI fast.
    compare(make_inputs(T, H=2 if T <= 500 else 1, K=16 if T >= 500 else 32, V=12, seed=T))


@pytest.mark.parametrize("K", [64, 100, 128], ids=lambda K: f"K{K}")
def test_head_dims(K):
    compare(make_inputs(70, H=1, K=K, V=K, seed=K))


@pytest.mark.parametrize("H, HV", [(1, 4), (2, 4), (2, 6)], ids=["H1_HV4", "H2_HV4", "H2_HV6"])
def test_gva(H, HV):
    compare(make_inputs(80, H=H, HV=HV, K=16, V=8, B=2, seed=HV))


@pytest.mark.parametrize("chunk_size", [1, 2, 4, 8, 16, 32, 128], ids=lambda c: f"C{c}")
def test_chunk_sizes(chunk_size):
    compare(make_inputs(100, H=1, K=16, seed=chunk_size), chunk_size=chunk_size)


@pytest.mark.parametrize(
    "lengths",
    [[1, 7, 64, 65, 3], [200], [5, 130, 1, 64], [1]],
    ids=["mixed_short", "single", "long_and_tiny", "one_token"],
)
def test_varlen(lengths):
    """Packed sequences (several shorter than a chunk) each start from their own initial state."""
    cu = torch.tensor(np.cumsum([0] + lengths))
    inputs = make_inputs(sum(lengths), H=2, HV=4, K=16, V=8, N=len(lengths), seed=len(lengths))
    compare(inputs, cu_seqlens=cu)
    # And the packed result equals running each sequence alone.
    o, s = chunk_kda(**inputs, cu_seqlens=cu, output_final_state=True)
    for n, (t0, t1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = {key: x[:, t0:t1] for key, x in inputs.items() if key != "initial_state"}
        o1, s1 = chunk_kda(**one, initial_state=inputs["initial_state"][n : n + 1], output_final_state=True)
        assert_close(f"seq{n}.o", o1, o[:, t0:t1], F64_TOL)
        assert_close(f"seq{n}.state", s1, s[n : n + 1], F64_TOL)


@pytest.mark.parametrize("gate", ["zero", "kimi_strong"], ids=["g_equals_0", "strong_decay"])
def test_extreme_gates(gate):
    """g = 0 exactly (alpha = 1: no forgetting) and decays far below 1/Gamma's range."""
    inputs = make_inputs(130, H=1, HV=2, K=16, seed=7, gate=gate)
    if gate == "kimi_strong":
        assert inputs["g"].min() < -20
    compare(inputs)


@pytest.mark.parametrize("reset", [-1e4, -1e6, -1e30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hard_reset_gate(reset, dtype):
    """One token's gate far below the rest (a hard reset) among small decays: the in-chunk cumsum then
    swamped the small gates after it (float32 o 5e-4 off at -1e4, 3e-2 at -1e6; float64 0.10 off at
    -1e30). Gates are floored at -60 before the cumsum (e^-60 clears the state either way)."""
    inputs = make_inputs(64, H=1, K=16, seed=17, gate="zero")
    gen = torch.Generator().manual_seed(18)
    inputs["g"] = -0.01 * torch.rand(inputs["g"].shape, generator=gen, dtype=torch.float64)
    inputs["g"][:, 20] = reset
    o_ref, s_ref = naive_recurrent_kda(**inputs, output_final_state=True)
    o, s = chunk_kda(**{key: x.to(dtype) for key, x in inputs.items()}, output_final_state=True)
    tol = 2e-5 if dtype == torch.float32 else F64_TOL
    assert_close("o", o_ref, o, tol)
    assert_close("final_state", s_ref, s, tol)


@pytest.mark.parametrize("beta_value", [None, 1.0], ids=["beta_random", "beta_1"])
def test_identical_consecutive_keys(beta_value):
    """20 identical keys in a row (a rank-1 block: the textbook ill-conditioned UT inverse)."""
    inputs = make_inputs(100, H=1, K=16, seed=11)
    inputs["k"][:, 30:50] = inputs["k"][:, 30:31]
    if beta_value is not None:
        inputs["beta"][:, 30:50] = beta_value
    compare(inputs, tol=1e-10)


def test_unnormalised_fp16_keys():
    """Un-normalised fp16 keys (||k||^2 up to ~1.9, so beta ||k||^2 < 2 keeps the recurrence stable).
    Chunk computes in float32 and returns fp16 outputs: compared against the float64 reference on the
    same fp16 values, the error must be at fp16 output rounding (rel RMS <= 2e-3; state <= 1e-4)."""
    inputs = make_inputs(150, H=2, HV=2, K=64, V=32, seed=13)
    gen = torch.Generator().manual_seed(14)
    inputs["k"] = inputs["k"] * (0.6 + 0.8 * torch.rand(1, 150, 2, 1, generator=gen, dtype=torch.float64))
    assert inputs["k"].norm(dim=-1).max() > 1.2
    half = {key: x.half() for key, x in inputs.items()}
    ref64 = {key: x.double() for key, x in half.items()}
    o_ref, s_ref = naive_recurrent_kda(**ref64, output_final_state=True)
    o, s = chunk_kda(**half, output_final_state=True)
    assert o.dtype == torch.float16 and s.dtype == torch.float32
    assert_close("o", o_ref, o, 2e-3)
    assert_close("final_state", s_ref, s, 1e-4)


def test_float32_inputs():
    inputs = make_inputs(200, H=2, HV=4, K=32, V=16, seed=15)
    ref = naive_recurrent_kda(**inputs, output_final_state=True)
    out = chunk_kda(**{key: x.float() for key, x in inputs.items()}, output_final_state=True)
    assert_close("o", ref[0], out[0], 1e-5)
    assert_close("final_state", ref[1], out[1], 1e-5)


def test_no_initial_state_no_final_state():
    inputs = make_inputs(40, H=1, K=8, seed=16, init_state=False)
    o, s = chunk_kda(**inputs)
    assert s is None
    assert_close("o", naive_recurrent_kda(**inputs)[0], o, F64_TOL)


def test_state_carries_across_calls():
    """Splitting a sequence and passing the final state on gives the unsplit result."""
    inputs = make_inputs(150, H=1, HV=2, K=16, seed=17)
    o, s = chunk_kda(**inputs, output_final_state=True)
    first = {key: x[:, :37] for key, x in inputs.items() if key != "initial_state"}
    rest = {key: x[:, 37:] for key, x in inputs.items() if key != "initial_state"}
    o1, s1 = chunk_kda(**first, initial_state=inputs["initial_state"], output_final_state=True)
    o2, s2 = chunk_kda(**rest, initial_state=s1, output_final_state=True)
    assert_close("o", o, torch.cat([o1, o2], dim=1), F64_TOL)
    assert_close("final_state", s, s2, F64_TOL)


def test_custom_scale():
    inputs = make_inputs(50, H=1, K=16, seed=18)
    ref = naive_recurrent_kda(**inputs, scale=0.3)[0]
    assert_close("o", ref, chunk_kda(**inputs, scale=0.3)[0], F64_TOL)
    # scale multiplies q only: o is linear in the scale.
    assert_close("o_linear", 2 * ref, naive_recurrent_kda(**inputs, scale=0.6)[0], F64_TOL)


def test_naive_matches_the_matrix_recurrence():
    """The reference itself vs S_t = (I - b k k^T) Diag(alpha) S + b k v^T, o = S^T (scale q), by hand."""
    inputs = make_inputs(12, H=1, K=5, V=3, seed=19)
    q, k, v, g, beta, S = (inputs[n][0, :, 0] if n != "initial_state" else inputs[n][0, 0]
                           for n in ("q", "k", "v", "g", "beta", "initial_state"))
    outs = []
    for t in range(12):
        kt = k[t][:, None]
        S = (torch.eye(5, dtype=S.dtype) - beta[t] * kt @ kt.T) @ torch.diag(g[t].exp()) @ S + beta[t] * kt @ v[t][None]
        outs.append(S.T @ (q[t] * 5**-0.5))
    o, s = naive_recurrent_kda(**inputs, output_final_state=True)
    assert_close("o", torch.stack(outs), o[0, :, 0], 1e-13)
    assert_close("S", S, s[0, 0], 1e-13)


# --- gradients -----------------------------------------------------------------------------------------

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.mark.parametrize("chunk_size, cu", [(4, None), (16, None), (4, [0, 3, 10])], ids=["C4", "C16", "C4_varlen"])
def test_gradcheck_chunk(chunk_size, cu):
    """torch.autograd.gradcheck of chunk_kda in float64 (tail chunk, several chunks, GVA, varlen)."""
    cu = None if cu is None else torch.tensor(cu)
    N = 1 if cu is None else len(cu) - 1
    inputs = make_inputs(10, H=1, HV=2, K=4, V=3, N=N, seed=20)
    # Keep g away from 0 so finite differences never cross the g <= 0 check.
    inputs["g"] = inputs["g"].clamp(max=-0.05)
    args = [inputs[n].clone().requires_grad_() for n in GRAD_NAMES]

    def fn(q, k, v, g, beta, s0):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                         chunk_size=chunk_size)
        return o, s

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_grads_match_naive(varlen):
    """d(loss)/d(q, k, v, g, beta, initial_state) through chunk == through the recurrence."""
    cu = torch.tensor([0, 20, 90, 100]) if varlen else None
    inputs = make_inputs(100, H=2, HV=4, K=16, V=8, N=3 if varlen else 2, B=1 if varlen else 2, seed=21)
    gen = torch.Generator().manual_seed(22)
    do = torch.randn(*inputs["v"].shape, generator=gen, dtype=torch.float64)
    ds = torch.randn(*inputs["initial_state"].shape, generator=gen, dtype=torch.float64)
    grads = []
    for fn in (naive_recurrent_kda, chunk_kda):
        leaves = {n: inputs[n].clone().requires_grad_() for n in GRAD_NAMES}
        o, s = fn(**leaves, output_final_state=True, cu_seqlens=cu)
        ((o * do).sum() + (s * ds).sum()).backward()
        grads.append({n: x.grad for n, x in leaves.items()})
    for n in GRAD_NAMES:
        assert_close(f"d{n}", grads[0][n], grads[1][n], 1e-10)


# --- gates ---------------------------------------------------------------------------------------------

def test_lower_bounded_gate_formula_and_range():
    gen = torch.Generator().manual_seed(23)
    z = 2 * torch.randn(2, 5, 3, 4, generator=gen, dtype=torch.float64)
    A_log = 0.3 * torch.randn(3, generator=gen, dtype=torch.float64)
    dt_bias = torch.randn(12, generator=gen, dtype=torch.float64)
    g = lower_bounded_gate(z, A_log, dt_bias, lower_bound=-5.0)
    expected = -5.0 / (1 + torch.exp(-A_log.exp()[:, None] * (z + dt_bias.view(3, 4))))
    assert_close("g", expected, g, 1e-14)
    assert (g > -5).all() and (g <= 0).all()
    # K3's init (A_log = 0, no bias): g = -5 sigmoid(z); z = 0 gives -2.5.
    g0 = lower_bounded_gate(torch.zeros(1, 1, 3, 4), torch.zeros(3))
    assert torch.allclose(g0, torch.full_like(g0, -2.5))
    # [HV, K] dt_bias works like the flat one; half inputs are computed in float32, returned as half.
    assert torch.equal(lower_bounded_gate(z, A_log, dt_bias.view(3, 4)), g)
    gh = lower_bounded_gate(z.half(), A_log.half())
    assert gh.dtype == torch.float16
    assert_close("g_half", lower_bounded_gate(z.half().double(), A_log.half().double()), gh, 1e-3)
    # Saturation: every alpha lies in [e^g_min, 1].
    sat = lower_bounded_gate(torch.tensor([-1e4, 1e4]).view(1, 2, 1, 1), torch.zeros(1), lower_bound=-3.0)
    assert sat.flatten().tolist() == [0.0, -3.0]


def test_kimi_linear_gate_formula_and_range():
    gen = torch.Generator().manual_seed(24)
    z = 5 * torch.randn(2, 5, 3, 4, generator=gen, dtype=torch.float64)
    A_log = torch.randn(3, generator=gen, dtype=torch.float64)
    dt_bias = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    g = kimi_linear_gate(z, A_log, dt_bias)
    expected = -A_log.exp()[:, None] * torch.log1p(torch.exp(z + dt_bias))
    assert_close("g", expected, g, 1e-12)
    assert (g <= 0).all()
    # Unbounded below: a large pre-activation gives a decay far beyond K3's e^-5 floor.
    assert kimi_linear_gate(torch.full((1, 1, 1, 1), 50.0), torch.zeros(1)).item() == pytest.approx(-50.0)


@pytest.mark.parametrize("gate", [lower_bounded_gate, kimi_linear_gate])
def test_gates_refuse_integer_pre_activations(gate):
    """Regression: an int64 z gave an int64, truncated log-decay (-4 for -4.91)."""
    with pytest.raises(ValueError, match="z must be a floating-point tensor, got dtype torch.int64"):
        gate(torch.ones(1, 2, 1, 3, dtype=torch.long), torch.zeros(1), torch.zeros(3))


@pytest.mark.parametrize("lower_bound", [0.0, float("-inf"), float("nan"), "a", True])
def test_lower_bound_must_be_finite_negative(lower_bound):
    with pytest.raises(ValueError, match="lower_bound must be a finite negative number"):
        lower_bounded_gate(torch.zeros(1, 1, 1, 1), torch.zeros(1), lower_bound=lower_bound)
    with pytest.raises(ValueError, match="lower_bound must be a finite negative number"):
        KDALayer(32, 2, 16, lower_bound=lower_bound)


@pytest.mark.parametrize("gate", [lower_bounded_gate, kimi_linear_gate])
def test_gate_params_are_not_broadcast(gate):
    """Regression: z [1, 3, 1, 4] with A_log [3] (HV = 1) broadcast to a [1, 3, 3, 4] gate."""
    z = torch.randn(1, 3, 1, 4)
    with pytest.raises(ValueError, match=r"A_log must be a \[HV\] = \[1\] tensor, got \[3\]"):
        gate(z, torch.zeros(3))
    with pytest.raises(ValueError, match=r"dt_bias must be \[HV \* K\] = \[4\] or \[HV, K\] = \[1, 4\], got \[5\]"):
        gate(z, torch.zeros(1), torch.zeros(5))
    with pytest.raises(ValueError, match=r"z must be a \[B, T, HV, K\] tensor, got \[3, 4\]"):
        gate(z[0, :, 0], torch.zeros(1))


# --- validation ------------------------------------------------------------------------------------------

def _bad(name):
    """Valid inputs of B=1, T=6, H=2, HV=4, K=4, V=3, then one argument broken as ``name`` says."""
    x = make_inputs(6, H=2, HV=4, K=4, V=3, seed=25)
    extra = {}
    if name == "k_shape":
        x["k"] = x["k"][..., :3]
    elif name == "v_shape":
        x["v"] = x["v"][:, :5]
    elif name == "g_shape":
        x["g"] = x["g"][:, :, :2]
    elif name == "beta_shape":
        x["beta"] = x["beta"][..., None]
    elif name == "q_rank":
        x["q"] = x["q"][0]
    elif name == "hv_not_multiple":
        x["v"], x["g"], x["beta"] = x["v"][:, :, :3], x["g"][:, :, :3], x["beta"][:, :, :3]
        x["initial_state"] = x["initial_state"][:, :3]
    elif name == "g_positive":
        x["g"][0, 2, 1, 0] = 0.1
    elif name.startswith("nan_"):
        x[name[4:]].view(-1)[3] = float("nan")
    elif name == "inf_v":
        x["v"].view(-1)[3] = float("inf")
    elif name == "state_shape":
        x["initial_state"] = x["initial_state"][:, :, :, :2]
    elif name == "batch_with_cu_seqlens":
        x = make_inputs(6, B=2, H=2, HV=4, K=4, V=3, seed=25, init_state=False)
        extra["cu_seqlens"] = torch.tensor([0, 3, 6])
    elif name.startswith("cu_"):
        x["initial_state"] = None
        extra["cu_seqlens"] = {
            "cu_unsorted": torch.tensor([0, 4, 2, 6]),
            "cu_duplicate": torch.tensor([0, 3, 3, 6]),
            "cu_empty": torch.tensor([], dtype=torch.int64),
            "cu_single": torch.tensor([0]),
            "cu_not_ending_at_T": torch.tensor([0, 3, 5]),
            "cu_not_starting_at_0": torch.tensor([1, 3, 6]),
            "cu_float": torch.tensor([0.0, 3.0, 6.0]),
        }[name]
    elif name == "chunk_size":
        extra["chunk_size"] = 24
    elif name == "chunk_size_0":
        extra["chunk_size"] = 0
    return x, extra


BAD = {
    "k_shape": "k", "v_shape": "v", "g_shape": "g", "beta_shape": "beta", "q_rank": "q",
    "hv_not_multiple": "HV", "g_positive": "g", "nan_q": "q", "nan_k": "k", "nan_v": "v", "nan_g": "g",
    "nan_beta": "beta", "nan_initial_state": "initial_state", "inf_v": "v", "state_shape": "initial_state",
    "batch_with_cu_seqlens": "cu_seqlens", "cu_unsorted": "cu_seqlens", "cu_duplicate": "cu_seqlens",
    "cu_empty": "cu_seqlens", "cu_single": "cu_seqlens", "cu_not_ending_at_T": "cu_seqlens",
    "cu_not_starting_at_0": "cu_seqlens", "cu_float": "cu_seqlens",
}


@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda], ids=["naive", "chunk"])
@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_inputs_raise_value_error_naming_the_argument(fn, case):
    x, extra = _bad(case)
    with pytest.raises(ValueError, match=BAD[case]):
        fn(**x, **extra)


@pytest.mark.parametrize("case", ["chunk_size", "chunk_size_0"])
def test_bad_chunk_size(case):
    x, extra = _bad(case)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(**x, **extra)


# --- validation: dtypes, empty dims, non-tensor/other-device arguments, scale, chunk_size type ------------

def _bad_more(name):
    """Valid inputs (B=1, T=6, H=2, HV=4, K=4, V=3), then one argument broken as ``name`` says."""
    x, extra = make_inputs(6, H=2, HV=4, K=4, V=3, seed=26), {}
    if name == "int_q":
        x["q"] = x["q"].round().long()
    elif name == "int_all":
        x = {k: (t.round().long() if k != "initial_state" else None) for k, t in x.items()}
    elif name == "bool_beta":
        x["beta"] = x["beta"] > 0.5
    elif name == "B0":
        x = {k: t[:0] for k, t in x.items()}
    elif name == "H0":
        x = make_inputs(6, H=2, HV=4, K=4, V=3, seed=26, init_state=False)
        x["q"], x["k"] = x["q"][:, :, :0], x["k"][:, :, :0]
    elif name == "cu_list":
        x["initial_state"] = None
        extra["cu_seqlens"] = [0, 2, 6]
    elif name == "state_list":
        x["initial_state"] = x["initial_state"].tolist()
    elif name == "state_other_device":
        x["initial_state"] = x["initial_state"].to("meta")
    elif name in ("scale_nan", "scale_inf"):
        extra["scale"] = float(name[6:])
    elif name in ("scale_negative", "scale_zero"):
        extra["scale"] = -0.5 if name == "scale_negative" else 0.0
    elif name == "final_state_not_bool":
        extra["output_final_state"] = x["initial_state"]
    elif name == "final_state_numpy_bool":
        extra["output_final_state"] = np.bool_(True)
    elif name == "all_meta":
        x = {k: t.to("meta") for k, t in x.items()}
    elif name == "int_state":
        x["initial_state"] = x["initial_state"].round().long()
    return x, extra


# all_meta and int_state: regressions (NotImplementedError "Cannot copy out of meta tensor"
# from the value checks; an integer state silently cast); so are a scale <= 0 and a tensor passed as
# output_final_state (both accepted silently).
BAD_MORE = {"int_q": "q", "int_all": "q", "bool_beta": "beta", "B0": "B", "H0": "H", "cu_list": "cu_seqlens",
            "state_list": "initial_state", "state_other_device": "initial_state", "scale_nan": "scale",
            "scale_inf": "scale", "all_meta": "meta device", "int_state": "initial_state must be a floating-point",
            "scale_negative": "scale must be a finite positive", "scale_zero": "scale must be a finite positive",
            "final_state_not_bool": "output_final_state must be a bool, got Tensor",
            # said "must be a bool, got bool"
            "final_state_numpy_bool": "output_final_state must be a bool, got numpy.bool"}


@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda], ids=["naive", "chunk"])
@pytest.mark.parametrize("case", list(BAD_MORE), ids=list(BAD_MORE))
def test_more_bad_inputs_raise_value_error(fn, case):
    """Integer inputs used to come back as a truncated integer output, B=0/H=0 and non-tensor
    arguments failed deep inside (RuntimeError, ZeroDivisionError, AttributeError), a NaN scale
    returned NaN silently."""
    x, extra = _bad_more(case)
    with pytest.raises(ValueError, match=BAD_MORE[case]):
        fn(**x, **extra)


@pytest.mark.parametrize("chunk_size", [16.0, True, "64"], ids=["float", "bool", "str"])
def test_chunk_size_must_be_an_int(chunk_size):
    x, _ = _bad("chunk_size")
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(**x, chunk_size=chunk_size)


def test_cu_seqlens_on_meta_device_is_rejected():
    """A meta cu_seqlens has no values to read; it failed with NotImplementedError from .tolist()."""
    from k3lab.kda.checks import check_cu_seqlens

    cu = torch.tensor([0, 3, 6], device="meta")
    with pytest.raises(ValueError, match="cu_seqlens must be on a device with values.*got meta"):
        check_cu_seqlens(cu, 6)
    inputs = make_inputs(6, init_state=False)
    with pytest.raises(ValueError, match="cu_seqlens must be on a device"):
        chunk_kda(**inputs, cu_seqlens=cu)


@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda], ids=["naive", "chunk"])
def test_keys_far_from_unit_norm_raise_naming_k(fn):
    """Keys scaled by 1e3 (beta ||k||^2 ~ 1e6: the state grows ~1e6x per token) came back as NaN."""
    inputs = {key: x.float() for key, x in make_inputs(40, H=2, seed=30).items()}
    with pytest.raises(ValueError, match=r"^k is out of range: .*beta_t \* \|\|k_t\|\|\^2 in \[0, 2\], got "):
        fn(**dict(inputs, k=inputs["k"] * 1e3))


@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda], ids=["naive", "chunk"])
def test_beta_out_of_range_raises_naming_beta(fn):
    """Unit keys with beta = 50: the same geometric growth, blamed on beta (outside [0, 1])."""
    inputs = make_inputs(200, seed=31, gate="zero", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^beta is out of range"):
        fn(**dict(inputs, beta=torch.full_like(inputs["beta"], 50.0)))


@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda], ids=["naive", "chunk"])
def test_unstable_but_finite_keys_stay_correct(fn):
    """Keys of norm 2 (beta ||k||^2 up to 4): the state grows, but while it stays finite the float32
    result is the float64 recurrence's to float32 precision (the check does not refuse it)."""
    inputs = make_inputs(30, H=2, HV=4, seed=32)
    inputs["k"] = 2 * inputs["k"]
    o_ref, s_ref = naive_recurrent_kda(**inputs, output_final_state=True)
    o, s = fn(**{key: x.float() for key, x in inputs.items()}, output_final_state=True)
    assert_close("o", o_ref, o.double(), 1e-5)
    assert_close("final_state", s_ref, s.double(), 1e-5)


@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda], ids=["naive", "chunk"])
def test_huge_initial_state_or_values_raise_naming_them(fn):
    """A float64 initial_state of 1e300 with float32 inputs (the state is computed in float32), and
    values whose true output is beyond float32, came back as NaN/inf silently."""
    inputs = {key: x.float() for key, x in make_inputs(20, seed=33, gate="zero").items()}
    huge = torch.full(inputs["initial_state"].shape, 1e300, dtype=torch.float64)
    match = r"^initial_state is too large: .*overflowed float32.*max \|initial_state\| = 1e\+300"
    with pytest.raises(ValueError, match=match):
        fn(**dict(inputs, initial_state=huge))
    # Values of 3e38 read by 4x queries: the float64 recurrence's output reaches 6.1e38.
    big = dict(inputs, v=inputs["v"] / inputs["v"].abs().max() * 3e38, q=4 * inputs["q"])
    assert naive_recurrent_kda(**{key: x.double() for key, x in big.items()})[0].abs().max() > 3.5e38
    with pytest.raises(ValueError, match=r"^v is too large"):
        fn(**big)
    # The same state in float64 is in range: a finite result.
    o, _ = fn(**{key: x.double() for key, x in inputs.items()} | dict(initial_state=huge))
    assert torch.isfinite(o).all()


def test_float16_output_overflow_names_q():
    """float16 inputs: o is computed in float32 and cast back to float16, where it is out of range."""
    inputs = make_inputs(10, seed=34, gate="zero")
    inputs["q"] = inputs["q"] / inputs["q"].abs().max() * 6e4
    inputs["initial_state"] = inputs["initial_state"] * 100
    with pytest.raises(ValueError, match=r"^q is too large: .*overflowed float16"):
        chunk_kda(**{key: x.half() for key, x in inputs.items()})

