"""k3lab.moe: SiTU-GLU, the router, grouped experts, the MoE layer, Quantile Balancing and its baselines."""
from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from k3lab.dist import launch
from k3lab.moe import (GatedFFN, MoE, MoEConfig, Router, balance_loss, expert_ffn, group_by_expert, maxvio,
                       naive_expert_ffn, quantile_bias, route, situ_glu, update_biases)
from k3lab.moe.activation import glu, glu_packed
from k3lab.moe.experts import combine_rows, dispatch_rows, inverse_permutation
from k3lab.moe.balance import aux_loss, histogram_bias, histogram_counts, histogram_quantile, histogram_range
from k3lab.moe.workers import histogram_worker
from k3lab.testing import assert_close, forbid_host_sync


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _config(**kw):
    base = dict(d_model=16, n_experts=8, top_k=2, expert_hidden=16, latent_dim=8, n_shared=1, init_std=0.3)
    return MoEConfig(**{**base, **kw})


def _skewed_logits(m, E, gen, skew=2.0):
    return torch.randn(m, E, generator=gen) * skew + torch.linspace(-2, 2, E)


# ---------------------------------------------------------------- SiTU-GLU

def test_situ_glu_formula_bound_and_not_silu():
    g = _gen()
    a = torch.randn(4096, dtype=torch.float64, generator=g) * 40
    u = torch.randn(4096, dtype=torch.float64, generator=g) * 80
    out = situ_glu(a, u)
    ref = 4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(u / 25)
    assert_close("situ_glu", ref, out, 1e-15)
    assert out.abs().max() < 100
    # SwiGLU on the same inputs is unbounded; a SiLU substitute fails this by orders of magnitude.
    swiglu = F.silu(a) * u
    assert (swiglu - out).abs().max() > 1000
    # At |u| >> 25 the up branch saturates at 25 (SiLU-GLU would pass u through).
    big = situ_glu(torch.tensor([10.0], dtype=torch.float64), torch.tensor([1000.0], dtype=torch.float64))
    assert abs(big.item() - 4 * math.tanh(2.5) / (1 + math.exp(-10)) * 25 * math.tanh(40)) < 1e-12


def test_packed_glu_is_glu_on_its_halves_and_names_a_bad_input():
    au = torch.randn(3, 10, dtype=torch.float64, generator=_gen(2))
    for activation in ("situ", "swiglu"):
        assert torch.equal(glu_packed(au, activation), glu(au[:, :5], au[:, 5:], activation))
    with pytest.raises(ValueError, match=r"au must be \[\.\.\., 2h\].*\[3, 9\]"):
        glu_packed(au[:, :9], "situ")
    with pytest.raises(ValueError, match="activation must be one of"):
        glu_packed(au, "silu")


def test_situ_glu_gradcheck_and_swiglu_limit():
    g = _gen(1)
    a = (torch.randn(12, dtype=torch.float64, generator=g) * 30).requires_grad_()
    u = (torch.randn(12, dtype=torch.float64, generator=g) * 60).requires_grad_()
    assert torch.autograd.gradcheck(situ_glu, (a, u))
    x = torch.randn(100, dtype=torch.float64, generator=g)
    y = torch.randn(100, dtype=torch.float64, generator=g)
    far = situ_glu(x, y, beta1=1e4, beta2=1e4)
    assert_close("situ_glu -> swiglu as betas grow", F.silu(x) * y, far, 1e-6)
    with pytest.raises(ValueError, match="beta1"):
        situ_glu(x, y, beta1=0.0)
    with pytest.raises(ValueError, match="same shape"):
        situ_glu(x, y[:3])


def _situ64(a, u):
    return 4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(u / 25)


def _silu_glu64(a, u):
    return F.silu(a) * u


def _moe_by_hand(m, x, idx, act):
    """Float64 MoE output written out token by token with ``act`` as the gated unit: router scores at the
    given choice ``idx`` renormalised, routed experts at the latent (or full) width, latent RMSNorm and
    up-projection after the weighted sum, shared experts on the full-width token."""
    w = {n: p.detach().double() for n, p in m.named_parameters()}
    x = x.double()
    s = torch.sigmoid(x @ w["router.weight"].t()).gather(1, idx)
    p = s / s.sum(-1, keepdim=True)
    z = x if m.down is None else x @ w["down.weight"].t()
    routed = torch.zeros_like(z)
    for i in range(x.shape[0]):
        for k, e in enumerate(idx[i].tolist()):
            h = act(z[i] @ w["experts.w_gate"][e], z[i] @ w["experts.w_up"][e])
            routed[i] += p[i, k] * (h @ w["experts.w_down"][e])
    if m.up is not None:
        normed = routed / torch.sqrt(routed.pow(2).mean(-1, keepdim=True) + m.config.norm_eps)
        routed = (normed * w["latent_norm.weight"]) @ w["up.weight"].t()
    a, u = (x @ w["shared.gate_up.weight"].t()).chunk(2, dim=-1)
    return routed + act(a, u) @ w["shared.down.weight"].t()


@pytest.mark.parametrize("latent", [8, None], ids=["latent", "full"])
def test_the_layer_runs_situ_glu_in_routed_and_shared_experts_not_silu(latent):
    """SiTU-GLU was silently replaced by SiLU inside a fused kernel and behind a config flag. The layer's
    output (grouped GEMM path, float32) equals the float64 formula written out with SiTU-GLU at
    pre-activations far past both bounds (|u| >> 25), and is far from the same formula with SiLU-GLU."""
    torch.manual_seed(25)
    m = MoE(_config(latent_dim=latent, balance="none", init_std=2.0))
    x = 8 * torch.randn(12, 16, generator=_gen(25))
    y = m(x)
    idx = m.last_routing.topk_idx
    z = x.double() if m.down is None else x.double() @ m.down.weight.detach().double().t()
    u = torch.einsum("nd,ndh->nh", z, m.experts.w_up.detach().double()[idx[:, 0]])
    assert u.abs().max() > 100, "the test needs up pre-activations far past SiTU's bound of 25"
    assert_close("layer vs SiTU-GLU by hand", _moe_by_hand(m, x, idx, _situ64), y, 1e-5)
    silu = _moe_by_hand(m, x, idx, _silu_glu64)
    assert (silu - y.double()).norm() > 0.5 * silu.norm()


# ---------------------------------------------------------------- router

def test_weights_are_the_unbiased_scores_even_at_tiny_scores_and_large_bias():
    """flashinfer#3875: logits ~ -18, bias ~ 12: (s + b) - b in float32 rounds s to 0."""
    E, K = 8, 2
    logits = torch.full((3, E), -18.0) + torch.arange(E) * 0.1
    bias = torch.zeros(E)
    bias[[1, 4]] = 12.0
    r = route(logits, bias, K)
    assert (r.topk_idx.sort(-1).values == torch.tensor([1, 4])).all()
    s64 = torch.sigmoid(logits.double()).gather(1, r.topk_idx)
    assert_close("renormalised unbiased weights", s64 / s64.sum(-1, keepdim=True), r.topk_weight.double(), 1e-6)
    assert (r.topk_weight > 0.4).all()
    # With the selection fixed, changing the bias changes no weight.
    r2 = route(logits, bias * 3, K)
    assert torch.equal(r.topk_idx, r2.topk_idx) and torch.equal(r.topk_weight, r2.topk_weight)


def test_router_gradient_is_autograd_of_the_renormalised_scores_and_never_reaches_the_bias():
    g = _gen(2)
    E, K = 6, 3
    logits = torch.randn(5, E, dtype=torch.float64, generator=g).requires_grad_()
    bias = torch.randn(E, generator=g).requires_grad_()
    w = torch.randn(5, K, dtype=torch.float64, generator=g)
    r = route(logits, bias, K, routed_scaling=2.5)
    (r.topk_weight.double() * w).sum().backward()
    assert bias.grad is None
    ref_logits = logits.detach().clone().requires_grad_()
    sel = torch.sigmoid(ref_logits).gather(1, r.topk_idx)
    (2.5 * sel / sel.sum(-1, keepdim=True) * w).sum().backward()
    assert_close("router grad", ref_logits.grad, logits.grad, 1e-6)


def test_weights_stay_finite_and_exact_where_every_selected_score_underflows():
    """Logits below about -88 give s = sigmoid(logit) = 0 in float32: the plain ratio s / sum(s) was 0 / 0 = NaN,
    forward and backward. The renormalised weights and their gradient equal the float64 ones."""
    E, K = 6, 2
    logits = (torch.tensor([[-95.0, -97.0, -99.0, -96.5, -120.0, -101.0],
                            [-200.0, -201.5, -203.0, -199.0, -250.0, -210.0],
                            [-89.0, -90.0, 0.5, -91.0, -92.0, -93.0]]) + 0.0).requires_grad_()
    w = torch.randn(3, K, generator=_gen(11), dtype=torch.float64)
    r = route(logits, torch.zeros(E), K)
    (r.topk_weight.double() * w).sum().backward()
    ref = logits.detach().double().requires_grad_()
    sel = torch.sigmoid(ref).gather(1, r.topk_idx)
    p = sel / sel.sum(-1, keepdim=True)
    (p * w).sum().backward()
    assert torch.isfinite(r.topk_weight).all() and torch.isfinite(logits.grad).all()
    assert_close("weights at underflowing scores", p, r.topk_weight.double(), 1e-6)
    assert_close("their gradient", ref.grad, logits.grad.double(), 1e-5)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_bias_is_refused_not_left_to_win_every_top_k(value):
    bias = torch.zeros(8)
    bias[5] = value
    with pytest.raises(ValueError, match="bias holds NaN or inf"):
        route(torch.randn(4, 8, generator=_gen(12)), bias, 2)


@pytest.mark.parametrize("bad, match", [
    (dict(top_k=9), "exceeds"), (dict(top_k=0), "top_k"), (dict(latent_dim=0), "latent_dim"),
    (dict(n_experts=0), "n_experts"), (dict(activation="silu"), "activation"), (dict(balance="aux2"), "balance"),
    (dict(n_shared=True), r"n_shared must be an int >= 0, got True"),
    (dict(renormalize="no"), r"renormalize must be a bool, got 'no'"),
    (dict(latent_dim=32), r"latent_dim 32 is wider than d_model 16"),
])
def test_bad_configs_name_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        MoE(_config(**bad))


_X = torch.randn(3, 4, generator=_gen(14))


@pytest.mark.parametrize("call, match", [
    (lambda: GatedFFN(16, 0), r"GatedFFN: hidden must be a positive int, got 0"),
    (lambda: GatedFFN(16, -4), r"GatedFFN: hidden must be a positive int, got -4"),
    (lambda: GatedFFN(0, 16), r"GatedFFN: d must be a positive int, got 0"),
    (lambda: situ_glu(_X, _X, beta1=True), r"beta1 must be a positive finite number, got True"),
    (lambda: situ_glu(_X, _X.double()), r"same shape and dtype.*torch.float32.*torch.float64"),
    (lambda: route(_X, torch.zeros(4), 2, routed_scaling=-1.0), r"routed_scaling must be a finite number > 0, got -1.0"),
    (lambda: route(_X, torch.zeros(4), 2, routed_scaling=True), r"routed_scaling must be a finite number > 0, got True"),
    (lambda: Router(4, 4, 2, routed_scaling=float("nan")), r"Router: routed_scaling must be a finite number > 0"),
    (lambda: Router(-1, 4, 2), r"Router: d must be a positive int, got -1"),
    (lambda: Router(8, 4, 2)(torch.randn(3, 7)), r"Router: x must be \[N, d=8\], got shape \[3, 7\]"),
    (lambda: Router(8, 4, 2)(torch.randn(3, 8, dtype=torch.float64)), r"Router: x is torch.float64"),
], ids=["ffn_hidden_0", "ffn_hidden_neg", "ffn_d_0", "situ_bool_beta", "situ_dtypes", "route_neg_scaling",
        "route_bool_scaling", "router_nan_scaling", "router_d_neg", "router_x_width", "router_x_dtype"])
def test_bad_arguments_of_the_parts_name_the_argument(call, match):
    """GatedFFN(hidden=0) built an empty FFN and a negative hidden failed inside torch; situ_glu took True
    for 1 and mixed dtypes; route flipped the weights' sign for a negative routed_scaling; Router(d=-1) and a
    Router fed x of another width or dtype failed inside torch ("mat1 and mat2 shapes cannot be multiplied")."""
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call, match", [
    (lambda: situ_glu([1.0], [1.0]), r"situ_glu: a must be a floating-point tensor, got list"),
    (lambda: situ_glu(_X, [1.0]), r"situ_glu: u must be a floating-point tensor, got list"),
    (lambda: situ_glu(_X.long(), _X.long()), r"situ_glu: a must be a floating-point tensor, got torch.int64"),
    (lambda: route(_X.long(), torch.zeros(4), 2), r"route: logits must be a floating-point tensor .*got torch.int64"),
    (lambda: route(_X.tolist(), torch.zeros(4), 2), r"route: logits must be a floating-point tensor .*got list"),
], ids=["situ_list", "situ_u_list", "situ_int", "route_int", "route_list"])
def test_non_float_inputs_of_situ_glu_and_route_are_type_errors(call, match):
    """A list failed with AttributeError ('list' object has no attribute 'shape'); int64 tensors ran, and
    situ_glu returned float32 for them."""
    with pytest.raises(TypeError, match=match):
        call()


@pytest.mark.parametrize("latent", [8, None], ids=["latent", "full"])
def test_expert_widths_the_grouped_gemms_cannot_take_name_the_config_field(latent):
    """Widths off the 16-byte grid failed in expert_ffn with its own d and h, naming no config field. float64
    runs the loop over experts, which takes any width, so the layer builds and runs there."""
    width = "latent_dim" if latent else "d_model"
    kw = dict(latent_dim=7) if latent else dict(d_model=14, latent_dim=None)
    x = torch.randn(2, 3, kw.get("d_model", 16), generator=_gen(15))
    with pytest.raises(ValueError, match=rf"MoEConfig.{width} must be a multiple of 4 to run the layer in "
                                         rf"torch.float32 .*got {kw.get('d_model', 7)}"):
        MoE(_config(**kw))(x)
    with pytest.raises(ValueError, match=r"MoEConfig.expert_hidden must be a multiple of 4 .*got 13"):
        MoE(_config(expert_hidden=13, latent_dim=latent))(torch.randn(2, 3, 16, generator=_gen(15)))
    m = MoE(_config(expert_hidden=12, latent_dim=latent))  # float32 takes 12; bf16 needs 8
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            ValueError, match=r"MoEConfig.expert_hidden must be a multiple of 8 to run the layer in torch.bfloat16"):
        m(torch.randn(2, 3, 16, generator=_gen(15)))
    assert torch.isfinite(MoE(_config(expert_hidden=13, **kw)).double()(x.double())).all()


@pytest.mark.parametrize("bad,match", [
    (dict(balance="aux2"), "MoEConfig.balance"), (dict(estimator="median"), "MoEConfig.estimator"),
    (dict(bins=1), "MoEConfig.bins"), (dict(top_k=8, balance="qb"), "top_k < n_experts"),
])
def test_bad_balancer_settings_fail_at_the_config(bad, match):
    with pytest.raises(ValueError, match=match):
        _config(**bad)
    assert MoE(_config(top_k=8, balance="none")).config.top_k == 8


def test_nan_router_logits_and_bad_shapes_raise():
    m = MoE(_config())
    x = torch.randn(2, 3, 16)
    x[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        m(x)
    with pytest.raises(ValueError, match="d=16"):
        m(torch.randn(2, 3, 15))
    with pytest.raises(ValueError, match="mask"):
        m(torch.randn(2, 3, 16), mask=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="d=16"):
        m(torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.uint8])
def test_a_non_bool_mask_is_refused_not_read_as_token_counts(dtype):
    m = MoE(_config())
    m.train()
    with pytest.raises(ValueError, match="mask must be a bool"):
        m(torch.randn(2, 3, 16), mask=torch.full((2, 3), 2, dtype=dtype))
    assert int(m.balance.counts.sum()) == 0


# ---------------------------------------------------------------- grouped experts

def test_grouped_gemm_equals_the_loop_forward_and_backward_with_empty_experts_and_padding():
    g = _gen(3)
    E, d, h, N, pad = 5, 8, 12, 40, 3
    idx = torch.randint(0, E, (N, 1), generator=g)
    idx[idx == 2] = 3  # expert 2 gets nothing
    _, offsets, counts = group_by_expert(idx, E)
    assert counts[2] == 0 and offsets[-1] == N
    x = torch.randn(N + pad, d, generator=g)
    ws = [torch.randn(E, d, h, generator=g) / 3, torch.randn(E, d, h, generator=g) / 3,
          torch.randn(E, h, d, generator=g) / 3]
    dy = torch.randn(N + pad, d, generator=g)
    leaves32 = [t.clone().requires_grad_() for t in [x] + ws]
    y = expert_ffn(leaves32[0], offsets, *leaves32[1:])
    (y * dy).sum().backward()
    leaves64 = [t.double().requires_grad_() for t in [x] + ws]
    y64 = naive_expert_ffn(leaves64[0], offsets, *leaves64[1:])
    (y64 * dy.double()).sum().backward()
    assert torch.equal(y[N:], torch.zeros(pad, d)) and torch.equal(leaves32[0].grad[N:], torch.zeros(pad, d))
    assert_close("grouped y", y64, y, 1e-6)
    for name, a, b in zip(("x", "w_gate", "w_up", "w_down"), leaves64, leaves32):
        assert_close(f"grouped d{name}", a.grad, b.grad, 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        expert_ffn(x.double(), offsets, *[w.double() for w in ws])


@pytest.mark.parametrize("d, h, match", [(12, 6, r"expert_ffn: h=6 must be a multiple of 4 for torch.float32"),
                                          (6, 12, r"expert_ffn: d=6 must be a multiple of 4"),
                                          (6, 6, r"expert_ffn: d=6 and h=6 must be a multiple of 4")])
def test_expert_ffn_names_the_width_off_the_grid(d, h, match):
    """d=12, h=6 was reported as "d=12 and h=6 must be multiples of 4": only h was off."""
    E, N = 2, 5
    offsets = torch.tensor([2, N], dtype=torch.int32)
    ws = [torch.randn(E, d, h), torch.randn(E, d, h), torch.randn(E, h, d)]
    with pytest.raises(ValueError, match=match):
        expert_ffn(torch.randn(N, d), offsets, *ws)


@pytest.mark.parametrize("max_rows", [1, 3, 4, 7, 100])
def test_groups_cut_into_pieces_give_the_loops_result(max_rows):
    """expert_ffn(max_group_rows=) runs long groups as pieces of the same expert (their weight gradients
    summed per expert): forward and every gradient equal the per-expert loop, with empty groups and
    padding rows; the number of pieces is static."""
    from k3lab.moe.experts import split_groups

    gen = _gen(21)
    offsets, N, d, h = torch.tensor([3, 3, 20, 22, 22, 30]), 32, 8, 16
    ends, expert = split_groups(offsets, N, max_rows)
    assert ends.shape == expert.shape == (6 + N // max_rows,)
    sizes = ends.diff(prepend=ends.new_zeros(1))
    real = ends - sizes < offsets[-1]  # pieces of real rows (the rest: padding, or empty)
    assert sizes.min() >= 0 and sizes[real].max() <= max_rows
    # Each expert's pieces cover exactly its rows.
    per_expert = torch.zeros(6, dtype=torch.long).index_add_(0, expert, sizes)
    assert per_expert[:5].tolist() == offsets.diff(prepend=offsets.new_zeros(1))[:5].tolist()
    x = torch.randn(N, d, generator=gen)
    ws = [torch.randn(6, d, h, generator=gen), torch.randn(6, d, h, generator=gen), torch.randn(6, h, d, generator=gen)]
    dy = torch.randn(N, d, generator=gen)
    grads = {}
    for name, fn, kw in (("loop", naive_expert_ffn, {}), ("cut", expert_ffn, dict(max_group_rows=max_rows))):
        xx, w = x.clone().requires_grad_(), [t.clone().requires_grad_() for t in ws]
        y = fn(xx, offsets, *w, **kw)
        y.backward(dy)
        grads[name] = [y, xx.grad, *(t.grad for t in w)]
    for label, got, ref in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), grads["cut"], grads["loop"]):
        assert_close(label, got, ref, 1e-5)
    with pytest.raises(ValueError, match="max_rows must be an int >= 1"):
        expert_ffn(x, offsets, *ws, max_group_rows=0)


def test_unpadded_rows_skip_the_zeroing_and_give_the_same_result():
    g = _gen(11)
    E, d, h, N = 4, 8, 16, 30
    _, offsets, _ = group_by_expert(torch.randint(0, E, (N, 1), generator=g), E)
    x = torch.randn(N, d, generator=g)
    ws = [torch.randn(E, d, h, generator=g) / 3, torch.randn(E, d, h, generator=g) / 3,
          torch.randn(E, h, d, generator=g) / 3]
    dy = torch.randn(N, d, generator=g)
    grads = []
    for padded in (True, False):
        leaves = [t.clone().requires_grad_() for t in [x] + ws]
        y = expert_ffn(leaves[0], offsets, *leaves[1:], padded=padded)
        (y * dy).sum().backward()
        grads.append([y.detach()] + [t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_expert_ffn_takes_a_strided_x():
    """A transposed or column-sliced x (row stride not a multiple of 16 bytes) failed inside grouped_mm with
    "strides should be multiple of 16 bytes"; it gives the contiguous x's output and gradient."""
    g = _gen(4)
    E, d, h, N = 3, 8, 12, 10
    offsets = torch.tensor([3, 7, 10], dtype=torch.int32)
    ws = [torch.randn(E, d, h, generator=g), torch.randn(E, d, h, generator=g), torch.randn(E, h, d, generator=g)]
    for base in (torch.randn(d, N, generator=g).t(), torch.randn(N, d + 1, generator=g)[:, :d]):
        x = base.detach().requires_grad_()
        x_ref = base.detach().contiguous().requires_grad_()
        y, y_ref = expert_ffn(x, offsets, *ws), expert_ffn(x_ref, offsets, *ws)
        assert torch.equal(y, y_ref)
        y.sum().backward()
        y_ref.sum().backward()
        assert torch.equal(x.grad, x_ref.grad)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("N", [10, 1, 0])
def test_expert_ffn_takes_any_layout_of_the_output_gradient_and_of_x(N, padded):
    """grouped_mm's backward reads the output gradient with the 16-byte row-stride rule of its inputs: the
    expanded gradient of ``y.sum()`` (strides (0, 0)) failed with "Invalid strides/sizes" when unpadded, a
    transposed one with "strides should be multiple of 16 bytes" either way; so did an x whose one row or no rows
    have another stride (``is_contiguous`` is True there). Each gives the row-major tensors' output and gradients."""
    g = _gen(5)
    E, d, h = 3, 8, 12
    offsets = torch.tensor([min(3, N), min(7, N), N], dtype=torch.int32)
    ws = [torch.randn(E, d, h, generator=g), torch.randn(E, d, h, generator=g), torch.randn(E, h, d, generator=g)]
    x_odd = torch.randn(d, N, generator=g).t()  # N = 1: strides (1, 1); N = 0: (1, 8)
    dys = {"expanded": torch.ones(()).expand(N, d), "transposed": torch.randn(d, N, generator=g).t()}
    for kind, dy in dys.items():
        leaves = [t.detach().clone().requires_grad_() for t in [x_odd] + ws]
        y = expert_ffn(leaves[0], offsets, *leaves[1:], padded=padded)
        y.backward(dy)
        ref = [t.detach().clone(memory_format=torch.contiguous_format).requires_grad_() for t in [x_odd] + ws]
        y_ref = expert_ffn(ref[0], offsets, *ref[1:], padded=padded)
        y_ref.backward(dy.clone(memory_format=torch.contiguous_format))
        assert torch.equal(y, y_ref), kind
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, ref)), kind


def test_dispatch_and_combine_equal_index_select_and_index_add_and_differentiate_twice():
    N, K, d, E = 11, 3, 5, 4
    idx = torch.randint(0, E, (N, K), generator=_gen(7))
    idx[:4] = 2  # a crowded expert: many rows of one group
    order, _, _ = group_by_expert(idx, E)
    inv = inverse_permutation(order)
    assert torch.equal(order[inv], torch.arange(N * K))
    x = torch.randn(N, d, dtype=torch.float64, generator=_gen(8), requires_grad=True)
    y = torch.randn(N * K, d, dtype=torch.float64, generator=_gen(9), requires_grad=True)
    w = torch.rand(N, K, dtype=torch.float64, generator=_gen(10), requires_grad=True)
    token = order // K
    assert torch.equal(dispatch_rows(x, order, inv, K), x[token])
    plain = torch.zeros(N, d, dtype=torch.float64).index_add_(0, token, y * w.reshape(-1)[order, None])
    assert_close("combine", plain, combine_rows(y, order, inv, w), 1e-15)
    gx, = torch.autograd.grad((dispatch_rows(x, order, inv, K) * y).sum(), x)
    gx_plain, = torch.autograd.grad((x[token] * y).sum(), x)
    assert_close("dispatch dx", gx_plain, gx, 1e-15)
    assert torch.autograd.gradcheck(lambda a: dispatch_rows(a, order, inv, K), (x,))
    assert torch.autograd.gradcheck(lambda a, b: combine_rows(a, order, inv, b), (y, w))
    assert torch.autograd.gradgradcheck(lambda a, b: combine_rows(a, order, inv, b), (y, w))
    assert torch.autograd.gradgradcheck(lambda a: dispatch_rows(a, order, inv, K) ** 2, (x,))
    # Traced by dynamo (the MoE's sublayer under compile_blocks), the same gradients: torch 2.11 gave zeros
    # when the forward's last op was a same-dtype .to() (the routed experts and the router learned nothing).
    compiled = torch.compile(lambda a, b: combine_rows(a, order, inv, b), dynamic=False, backend="eager")
    want = torch.autograd.grad(combine_rows(y, order, inv, w).pow(2).sum(), (y, w))
    got = torch.autograd.grad(compiled(y, w).pow(2).sum(), (y, w))
    for name, a_, b_ in zip(("dy", "dweight"), want, got):
        assert_close(f"compiled combine {name}", a_, b_, 1e-12)


def test_dispatch_and_combine_name_a_bad_argument():
    order = torch.arange(6)
    x, y, w = torch.randn(3, 4), torch.randn(6, 4), torch.rand(3, 2)
    with pytest.raises(ValueError, match=r"dispatch_rows: x must be \[N, d\], got \[3\]"):
        dispatch_rows(x[:, 0], order, order, 2)
    with pytest.raises(ValueError, match="dispatch_rows: K must be a positive int, got 0"):
        dispatch_rows(x, order, order, 0)
    with pytest.raises(ValueError, match=r"dispatch_rows: inv must be int64 \[N\*K=6\], got \[6\] torch.int32"):
        dispatch_rows(x, order, order.int(), 2)
    with pytest.raises(ValueError, match=r"combine_rows: y must be \[N\*K=6, d\] for weight \[N=3, K=2\], got \[5, 4\]"):
        combine_rows(y[:5], order, order, w)
    with pytest.raises(ValueError, match=r"combine_rows: order must be int64 \[N\*K=6\], got \[5\]"):
        combine_rows(y, order[:5], order, w)
    with pytest.raises(ValueError, match=r"combine_rows: weight must be \[N, K\], got \[6\]"):
        combine_rows(y, order, order, w.flatten())


@pytest.mark.parametrize("call, match", [
    (lambda: group_by_expert(torch.zeros(3, 2, dtype=torch.int32), 4),
     r"group_by_expert: topk_idx must be int64 \[N, K\], got \[3, 2\] torch.int32"),
    (lambda: group_by_expert(torch.zeros(6, dtype=torch.int64), 4),
     r"group_by_expert: topk_idx must be int64 \[N, K\], got \[6\] torch.int64"),
    (lambda: group_by_expert([[0, 1]], 4), r"group_by_expert: topk_idx must be int64 \[N, K\], got list"),
    (lambda: group_by_expert(torch.zeros(3, 2, dtype=torch.int64), 0),
     r"group_by_expert: E must be a positive int, got 0"),
    (lambda: group_by_expert(torch.zeros(3, 2, dtype=torch.int64), True),
     r"group_by_expert: E must be a positive int, got True"),
    (lambda: inverse_permutation(torch.arange(6, dtype=torch.int32)),
     r"inverse_permutation: order must be int64 \[P\], got \[6\] torch.int32"),
    (lambda: inverse_permutation(torch.arange(6).view(3, 2)),
     r"inverse_permutation: order must be int64 \[P\], got \[3, 2\] torch.int64"),
], ids=["idx_int32", "idx_1d", "idx_list", "E_0", "E_bool", "order_int32", "order_2d"])
def test_grouping_and_its_inverse_name_a_bad_argument(call, match):
    """An int32 topk_idx or order failed inside torch ("scatter(): Expected self.dtype to be equal to src.dtype"),
    a 2-D order with an IndexError, E = 0 with "index 0 is out of bounds"."""
    with pytest.raises(ValueError, match=match):
        call()


def test_dispatch_of_zero_width_rows_differentiates():
    """x [N, 0]: the backward's view(-1, K, 0) of an empty tensor failed ("the unspecified dimension size -1 can
    be any value")."""
    order = torch.tensor([1, 3, 0, 2])
    x = torch.randn(2, 0, requires_grad=True)
    dispatch_rows(x, order, inverse_permutation(order), 2).sum().backward()
    assert x.grad.shape == (2, 0)


@pytest.mark.parametrize("latent", [8, None], ids=["latent", "full"])
def test_moe_layer_equals_the_float64_loop_reference(latent):
    torch.manual_seed(4)
    m = MoE(_config(latent_dim=latent, balance="none"))
    ref = MoE(_config(latent_dim=latent, balance="none")).double()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(3, 7, 16, generator=_gen(4))
    dy = torch.randn(3, 7, 16, generator=_gen(5))
    x32, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    y32, y64 = m(x32), ref.reference(x64)
    assert torch.equal(m.last_routing.topk_idx, ref.last_routing.topk_idx)
    (y32 * dy).sum().backward()
    (y64 * dy.double()).sum().backward()
    print(f"MoE latent={latent}: y rel err {assert_close('y', y64, y32, 1e-5):.2e}")
    assert_close("dx", x64.grad, x32.grad, 1e-5)
    p64 = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        assert_close(f"d{name}", p64[name].grad, p.grad, 1e-5)
    assert m.router.bias.grad is None and not m.router.bias.requires_grad


def test_flops_per_token_counts_active_experts_at_their_width():
    c = MoEConfig(d_model=7168, n_experts=64, top_k=8, expert_hidden=3072, latent_dim=3584, n_shared=2)
    full = MoEConfig(d_model=7168, n_experts=64, top_k=8, expert_hidden=3072, latent_dim=None, n_shared=2)
    routed_latent = 6 * 3584 * 3072 * 8
    assert c.flops_per_token() == 2 * 7168 * 64 + 6 * 7168 * 3072 * 2 + 4 * 7168 * 3584 + routed_latent
    assert 1.45 < full.flops_per_token() / c.flops_per_token() < 1.5
    k3 = MoEConfig.k3()
    assert (k3.n_experts, k3.top_k, k3.latent_dim, k3.n_shared) == (896, 16, 3584, 2)


def test_only_the_projection_into_the_residual_is_depth_scaled():
    """K3's LatentMoE has one depth-scaled projection on its routed path, W_up into the residual (std
    init_std / sqrt(2 L)); the experts' w_down writes into the latent and keeps init_std. A full-width MoE's
    w_down is the projection into the residual; the shared experts' down projection is one in both."""
    L, std = 8, 0.02
    out = std / math.sqrt(2 * L)
    c = _config(d_model=96, latent_dim=48, expert_hidden=64, n_experts=4, n_shared=1, init_std=std, n_layers=L)
    torch.manual_seed(24)
    latent, full = MoE(c), MoE(replace(c, latent_dim=None))
    want = [("latent up", latent.up.weight, out), ("latent shared down", latent.shared.down.weight, out),
            ("latent experts w_down", latent.experts.w_down, std), ("latent down", latent.down.weight, std),
            ("latent experts w_gate", latent.experts.w_gate, std), ("latent router", latent.router.weight, std),
            ("full experts w_down", full.experts.w_down, out), ("full shared down", full.shared.down.weight, out),
            ("full experts w_up", full.experts.w_up, std)]
    for name, p, s in want:
        got = p.detach().double().std().item()
        assert abs(got / s - 1) < 0.06, f"{name}: std {got:.5f}, want {s:.5f}"


@pytest.mark.parametrize("latent", [8, None], ids=["latent", "full"])
def test_flops_per_token_equals_torchs_count_of_a_forward(latent):
    """FLOPs per token that ignored MoE sparsity or the latent width over-counted 1.8-2x (and an MFU came out
    above 100%). ``flops_per_token`` equals the matmul FLOPs torch's FlopCounterMode measures on a forward of
    the layer (the loop reference: its matmuls are the grouped GEMM's), two shared experts included."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(26)
    m = MoE(_config(latent_dim=latent, balance="none", n_shared=2))
    x = torch.randn(40, 16, generator=_gen(26))
    with FlopCounterMode(display=False) as counter:
        m.reference(x)
    assert counter.get_total_flops() == 40 * m.config.flops_per_token()


# ---------------------------------------------------------------- Quantile Balancing

WORKED_SCORES = [[0.70, 0.55, 0.30], [0.95, 0.25, 0.90], [0.95, 0.10, 0.40],
                 [0.70, 0.55, 0.60], [0.90, 0.55, 0.30], [0.90, 0.05, 0.25]]


def test_qb_worked_example():
    """Chapter 05's worked example: 6 tokens, 3 experts, top-1, so q = 2 tokens each; every token
    prefers expert 0 until one Quantile Balancing update."""
    s = torch.tensor(WORKED_SCORES, dtype=torch.float64)
    logits = torch.logit(s).float()
    r = route(logits, torch.zeros(3), K=1)
    assert r.topk_idx[:, 0].tolist() == [0] * 6
    # alpha_i: midway between each token's best and second-best score.
    torch.testing.assert_close(r.cutoff, torch.tensor([0.625, 0.925, 0.675, 0.65, 0.725, 0.575]))
    # r_ij = alpha_i - s_ij; b_hat_j = midway between the 2nd and 3rd smallest: -0.225, 0.1375, 0.1625.
    b = quantile_bias(r.scores, r.cutoff, K=1)
    torch.testing.assert_close(b, torch.tensor([-0.25, 0.1125, 0.1375]), atol=1e-6, rtol=0)
    r2 = route(logits, b, K=1)
    assert r2.topk_idx[:, 0].tolist() == [1, 2, 0, 2, 1, 0]
    assert torch.bincount(r2.topk_idx[:, 0], minlength=3).tolist() == [2, 2, 2]


@pytest.mark.parametrize("m, E, K", [(256, 8, 1), (512, 16, 2), (512, 16, 4)])
def test_qb_reaches_exact_balance_on_a_fixed_batch(m, E, K):
    logits = _skewed_logits(m, E, _gen(m + K))
    b = torch.zeros(E)
    history = []
    for _ in range(400):
        r = route(logits, b, K)
        load = torch.bincount(r.topk_idx.flatten(), minlength=E)
        history.append(maxvio(load))
        if history[-1] == 0:
            break
        b = quantile_bias(r.scores, r.cutoff, K)
    print(f"m={m} E={E} K={K}: maxvio {history[0]:.2f} -> {history[-1]:.3f} in {len(history) - 1} updates")
    assert history[-1] == 0 and load.tolist() == [m * K // E] * E
    assert history[1] < 0.5 * history[0]


def test_qb_on_one_token_reads_its_r_and_agrees_with_the_histogram():
    """A step with one counted token (q = floor(K/E) clamped to 1) has no (q+1)-th r: the exact estimator
    raised inside kthvalue. Its b_hat is that token's r_j, within one bin of the histogram's reading."""
    E, K, bins = 8, 2, 1000
    logits = torch.randn(1, E, generator=_gen(13))
    bias = torch.zeros(E)
    r = route(logits, bias, K)
    b = quantile_bias(r.scores, r.cutoff, K)
    r64 = (r.cutoff.double()[:, None] - r.scores.double())[0]
    assert_close("one-token exact bias", r64 - r64.mean(), b.double(), 1e-6)
    lo, hi = histogram_range(bias)
    est = histogram_bias(histogram_counts(r.scores, r.cutoff, lo, hi, bins), lo, hi, K)
    assert (est - b).abs().max() <= 2 * (hi - lo) / bins
    m = MoE(_config(estimator="exact")).train()
    m(torch.randn(1, 16, generator=_gen(14)))
    load = update_biases(m)[0]
    assert int(load.sum()) == K and torch.isfinite(m.router.bias).all() and m.router.bias.abs().sum() > 0


def test_quantile_bias_names_a_missing_cutoff():
    """The cutoff of a route with K = E is None: quantile_bias failed with "'NoneType' object has no attribute
    'shape'" instead of its documented ValueError."""
    r = route(torch.randn(5, 4, generator=_gen(6)), torch.zeros(4), 4)
    with pytest.raises(ValueError, match=r"quantile_bias: cutoff must be an \[m\] tensor.*K < E"):
        quantile_bias(r.scores, r.cutoff, 2)


def test_route_and_balancing_name_a_bias_or_step_of_the_wrong_kind():
    """A list bias failed with AttributeError ('list' object has no attribute 'shape'); a NaN sign_lr was
    taken by Balancing (MoEConfig checks it) and reached the bias at the next update."""
    from k3lab.moe.balance import Balancing

    with pytest.raises(ValueError, match=r"route: bias must be a tensor \[E=4\], got list"):
        route(torch.randn(3, 4), [0.0] * 4, 2)
    for bad in (float("nan"), -1.0, True):
        with pytest.raises(ValueError, match="sign_lr must be a finite number >= 0"):
            Balancing("sign", 4, 2, sign_lr=bad)
    # The latent RMSNorm's eps = 0 gave NaN on a zero token, as it did in the other norms.
    with pytest.raises(ValueError, match="MoEConfig.norm_eps must be a finite number > 0.0, got 0.0"):
        MoEConfig(d_model=32, n_experts=4, top_k=2, expert_hidden=16, latent_dim=16, norm_eps=0.0)


def test_maxvio_of_counts_a_list_and_bad_loads():
    """A list failed with AttributeError ('list' object has no attribute 'double')."""
    assert maxvio([3, 1, 2, 2]) == pytest.approx(3 / 2 - 1)
    assert maxvio(torch.tensor([5, 5], dtype=torch.int64)) == 0.0 and maxvio(torch.zeros(4)) == 0.0
    # A bool tensor (a mask passed by mistake) was read as counts of 0 and 1.
    for bad in ([], [[1, 2]], [1, -1], [1.0, float("nan")], torch.tensor([True, False])):
        with pytest.raises(ValueError, match="maxvio: load must be"):
            maxvio(bad)


@pytest.mark.parametrize("which", ["scores", "cutoff"])
def test_quantile_bias_refuses_nan_scores_or_cutoffs(which):
    """NaN scores were skipped by the quantiles (a finite bias from part of the data), a NaN cutoff gave an
    all-NaN bias that would have gone into routing."""
    r = route(torch.randn(8, 4, generator=_gen(8)), torch.zeros(4), 2)
    scores, cutoff = r.scores.clone(), r.cutoff.clone()
    (scores if which == "scores" else cutoff)[1] = float("nan")
    with pytest.raises(ValueError, match=f"quantile_bias: {which} must be finite, got 1 NaN or infinite"
                       if which == "cutoff" else f"quantile_bias: {which} must be finite, got 4 NaN"):
        quantile_bias(scores, cutoff, 2)


def test_recentring_the_bias_changes_no_choice():
    logits = _skewed_logits(300, 12, _gen(6))
    b = torch.randn(12, generator=_gen(7)) * 0.1
    a, c = route(logits, b, 3), route(logits, b - b.mean() + 0.25, 3)
    assert torch.equal(a.topk_idx.sort(-1).values, c.topk_idx.sort(-1).values)


def test_histogram_estimate_is_within_one_bin_of_the_exact_interval():
    m, E, K, bins = 2000, 16, 2, 1000
    logits = _skewed_logits(m, E, _gen(8))
    bias = torch.randn(E, generator=_gen(9)) * 0.05
    r = route(logits, bias, K)
    lo, hi = histogram_range(bias)
    hist = histogram_counts(r.scores, r.cutoff, lo, hi, bins)
    assert hist.sum(1).tolist() == [m] * E and hist.dtype == torch.int64
    b_hat = histogram_quantile(hist, lo, hi, K)
    rr = (r.cutoff[:, None] - r.scores).sort(0).values
    q = m * K // E
    # Every bias in [q-th, (q+1)-th smallest r] gives expert j exactly q tokens.
    b_lo, b_hi, w = rr[q - 1], rr[q], (hi - lo) / bins
    assert ((b_hat >= b_lo - w) & (b_hat <= b_hi + w)).all()
    exact, est = quantile_bias(r.scores, r.cutoff, K), histogram_bias(hist, lo, hi, K)
    print(f"histogram vs exact bias: max diff {(exact - est).abs().max():.2e}, bin width {w:.2e}")
    assert (exact - est).abs().max() < (b_hi - b_lo).max() + 2 * w


@pytest.mark.parametrize("fn", [histogram_bias, histogram_quantile])
def test_a_histogram_not_integer_e_by_b_is_named(fn):
    """A 1-D histogram failed with "not enough values to unpack"; a float one was read as counts."""
    lo, hi = torch.tensor(-1.0), torch.tensor(1.0)
    for shape in ((10,), (2, 4, 5), (4, 0)):
        want = r"histogram_quantile: hist must be \[E, B\].*" + re.escape(str(list(shape)))
        with pytest.raises(ValueError, match=want):
            fn(torch.ones(shape, dtype=torch.long), lo, hi, 2)
    for bad, got in ((torch.ones(4, 10), "torch.float32"), (torch.ones(4, 10, dtype=torch.bool), "torch.bool"),
                     ([[1, 2]], "list")):
        with pytest.raises(TypeError, match=f"histogram_quantile: hist must be an integer tensor of counts .*got {got}"):
            fn(bad, lo, hi, 2)


@pytest.mark.parametrize("estimator", ["histogram", "exact"])
def test_a_nan_token_with_value_checks_off_reaches_the_output_not_outside_the_histogram(estimator):
    """With the router's value check off (a trainer that checks its batch once), a NaN token's r = alpha - s
    is NaN and its histogram bin index was INT64_MIN: the training forward failed with "index out of bounds"
    (a device-side assert on a GPU) instead of passing the NaN on to the loss the trainer watches."""
    m = MoE(_config(estimator=estimator))
    m.train()
    m.router.check_values = False
    x = torch.randn(2, 3, 16, generator=_gen(5))
    x[1, 2, 0] = float("nan")
    y = m(x)
    assert torch.isnan(y[1, 2]).all() and torch.isfinite(y[:1]).all()
    assert int(m.balance.counts.sum()) == 6 * 2
    if estimator == "histogram":
        assert m.balance.hist.sum(1).tolist() == [6] * 8


@pytest.mark.parametrize("world_size", [2, 4])
def test_distributed_histogram_equals_the_pooled_one(world_size):
    results = launch(histogram_worker, world_size, world_size, timeout_s=120)
    pooled = histogram_worker(0, 1, None, world_size)
    for load, bias in results:
        assert torch.equal(load, pooled[0])
        assert torch.equal(bias, pooled[1])


# ---------------------------------------------------------------- counting rules

def test_eval_forwards_count_nothing_and_train_eval_choose_the_same_experts():
    m = MoE(_config())
    x = torch.randn(4, 6, 16, generator=_gen(10))
    m.eval()
    with torch.no_grad():
        m(x)
    eval_idx = m.last_routing.topk_idx.clone()
    assert m.balance.counts.sum() == 0 and m.balance.hist.sum() == 0
    m.train()
    m(x)
    assert torch.equal(m.last_routing.topk_idx, eval_idx)
    assert m.balance.counts.sum() == 4 * 6 * 2


@pytest.mark.parametrize("balance", ["qb", "sign", "aux"])
def test_eval_forwards_between_a_training_forward_and_the_update_change_nothing(balance):
    """An eval forward run between the statistics' reset and the bias update (under no_grad, and with grad
    on as a plain ``model.eval()`` evaluation runs it) added its tokens to the counts and histogram, leaking
    eval routing into the next step. The update and the aux loss equal those of a twin that never evaluated."""
    torch.manual_seed(27)
    a, b = MoE(_config(balance=balance, sign_lr=0.01)), MoE(_config(balance=balance, sign_lr=0.01))
    b.load_state_dict(a.state_dict())
    x, x_eval = torch.randn(2, 9, 16, generator=_gen(27)), torch.randn(3, 7, 16, generator=_gen(28)) * 3
    for m in (a, b):
        m.train()
        m(x)
    a.eval()
    a(x_eval)
    with torch.no_grad():
        a(x_eval)
    a.train()
    if balance == "aux":
        assert torch.equal(balance_loss(a), balance_loss(b))
    load_a, load_b = update_biases(a)[0], update_biases(b)[0]
    assert int(load_a.sum()) == 2 * 9 * 2 and torch.equal(load_a, load_b)
    assert torch.equal(a.router.bias, b.router.bias)
    assert balance == "aux" or a.router.bias.abs().sum() > 0


@pytest.mark.parametrize("balance", ["qb", "aux"])
def test_a_layer_copies_after_a_forward(balance):
    """copy.deepcopy and pickle after a training forward (an EMA or evaluation snapshot): the copy starts
    without the forward's routing and pending aux loss (they hold its graph), gives the same output, and the
    original keeps both."""
    import copy
    import io

    m = MoE(_config(balance=balance, aux_coef=0.1))
    x = torch.randn(3, 5, 16, generator=_gen(12))
    y = m(x)
    twin = copy.deepcopy(m)
    assert twin.last_routing is None and twin.balance.aux is None
    assert m.last_routing is not None and (balance != "aux" or m.balance.aux.requires_grad)
    assert torch.equal(twin.balance.counts, m.balance.counts)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (twin, loaded):
        other.eval(), m.eval()
        assert torch.equal(other(x), m(x))
        m.train()
    assert y.requires_grad


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_counts_each_token_once(reentrant):
    m = MoE(_config())
    x = torch.randn(3, 5, 16, generator=_gen(11), requires_grad=True)
    y = checkpoint(m, x, use_reentrant=reentrant)
    routing = m.last_routing
    y.sum().backward()
    # The replay is not a new forward: its routing, holding the replayed graph, is not kept.
    assert m.last_routing is routing
    assert m.balance.counts.sum() == 3 * 5 * 2
    assert m.balance.hist.sum() == 3 * 5 * 8
    assert x.grad is not None


def test_aux_loss_under_non_reentrant_recompute_gives_the_plain_gradients():
    """The replay skipped the auxiliary loss, so checkpoint saw fewer tensors than the forward had saved
    ("A different number of tensors was saved ... 57 vs 52")."""
    import copy

    m = MoE(_config(balance="aux")).train()
    x = torch.randn(20, 16, generator=_gen(12))
    other = copy.deepcopy(m)
    (m(x).square().mean() + balance_loss(m)).backward()
    y = checkpoint(other, x, use_reentrant=False)
    (y.square().mean() + balance_loss(other)).backward()
    for (name, a), b in zip(m.named_parameters(), other.parameters()):
        assert_close(name, b.grad, a.grad, 1e-6)
    assert torch.equal(m.balance.counts, other.balance.counts)


def test_a_forward_that_raises_counts_nothing_and_exact_qb_refuses_a_group_before_reducing():
    """The counts were recorded before the expert-width check, so a failed forward's tokens moved the next
    bias; the exact estimator all-reduced the counts in place, then refused the group."""
    m = MoE(MoEConfig(d_model=6, n_experts=4, top_k=2, expert_hidden=6, estimator="exact")).train()
    with pytest.raises(ValueError, match="multiple of"):
        m(torch.randn(3, 6, generator=_gen(13)))
    assert m.balance.counts.sum() == 0 and not m.balance._kept
    m = MoE(_config(estimator="exact")).train()
    m(torch.randn(3, 16, generator=_gen(14)))
    before = m.balance.counts.clone()
    with pytest.raises(ValueError, match="exact Quantile Balancing estimator runs in one process"):
        m.balance.update(m.router.bias, group=object())
    assert torch.equal(m.balance.counts, before)


def test_padding_is_not_counted_and_bias_stays_float32_in_bf16():
    m = MoE(_config()).to(torch.bfloat16)
    assert m.router.bias.dtype == torch.float32 and m.experts.w_gate.dtype == torch.bfloat16
    x = torch.randn(2, 8, 16, generator=_gen(12)).bfloat16()
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    m(x, mask=mask)
    assert m.balance.counts.dtype == torch.int64 and m.balance.counts.sum() == 13 * 2
    assert m.balance.hist.sum() == 13 * 8
    load = update_biases(m)[0]
    assert load.sum() == 26 and m.router.bias.dtype == torch.float32 and m.router.bias.abs().sum() > 0


@pytest.mark.parametrize("latent", [8, None], ids=["latent", "full"])
def test_an_input_dtype_other_than_the_parameters_is_refused_outside_autocast(latent, check_dtype_guard):
    """A bf16 x on a float32 layer failed in the router's matmul with torch's "same dtype" error; under
    autocast it is the training path and runs (the experts' weights cast to bf16)."""
    m = MoE(_config(latent_dim=latent))
    check_dtype_guard("MoE", "x", m, torch.randn(2, 8, 16, generator=_gen(13)))


def test_an_integer_input_is_refused_as_not_floating_point():
    """An int64 x got the dtype-mismatch message, whose remedy was module.to(torch.int64)."""
    with pytest.raises(ValueError, match=r"MoE: x must be a floating-point tensor .*got torch.int64") as e:
        MoE(_config())(torch.ones(2, 3, 16, dtype=torch.int64))
    assert "module.to" not in str(e.value)


@pytest.mark.parametrize("latent", [8, None], ids=["latent", "full"])
def test_float32_input_under_bf16_autocast_matches_float64(latent):
    """Under autocast a full-width layer gets the float32 norm output (a latent layer's down projection
    makes it bf16): the experts cast their weights to bf16 but not the tokens, and grouped_mm refused the
    pair. Now tokens and weights are cast together; output and gradients match float64."""
    torch.manual_seed(21)  # weights whose bf16 router logits pick the float64 experts (checked below)
    m = MoE(_config(latent_dim=latent))
    x = torch.randn(3, 7, 16, generator=_gen(21), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    idx = m.last_routing.topk_idx
    m64 = MoE(_config(latent_dim=latent)).double()
    m64.load_state_dict(m.state_dict())
    x64 = x.detach().double().requires_grad_()
    y64 = m64(x64)
    assert torch.equal(m64.last_routing.topk_idx, idx)  # the same experts, so the outputs are comparable
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert_close("autocast MoE vs float64", y64, y, 3e-2)
    g = torch.randn(y64.shape, generator=_gen(22), dtype=torch.float64)
    (y.double() * g).sum().backward()
    (y64 * g).sum().backward()
    assert_close("its input gradient", x64.grad, x.grad, 3e-2)
    assert_close("w_gate gradient", m64.experts.w_gate.grad, m.experts.w_gate.grad, 3e-2)


def test_every_layer_is_updated_disabled_ones_skipped_none_is_a_noop():
    layers = torch.nn.ModuleList([MoE(_config(balance=b)) for b in ("qb", "none", "sign", "qb")])
    x = torch.randn(2, 9, 16, generator=_gen(13))
    for layer in layers:
        layer(x)
    loads = update_biases(layers)
    assert len(loads) == 4 and all(load.sum() == 36 for load in loads)
    assert layers[0].router.bias.abs().sum() > 0 and layers[3].router.bias.abs().sum() > 0
    assert layers[1].router.bias.abs().sum() == 0
    assert all(layer.balance.counts.sum() == 0 for layer in layers)
    assert update_biases(torch.nn.Linear(3, 3)) == []


def test_quantile_balancing_update_reads_nothing_back_and_keeps_the_bias_without_tokens():
    # The trainer's step runs under a sync check on the GPU: the histogram update decides on the device.
    m = MoE(_config())
    m(torch.randn(2, 9, 16, generator=_gen(14)))
    with forbid_host_sync(torch.device("cpu")):
        update_biases(m)
    moved = m.router.bias.clone()
    assert moved.abs().sum() > 0
    with forbid_host_sync(torch.device("cpu")):
        load = update_biases(m)[0]
    assert load.sum() == 0 and torch.equal(m.router.bias, moved)


def test_sign_update_compares_like_with_like():
    """torchtitan#1506: comparing an expected frequency with raw counts moved every expert one way."""
    m = MoE(_config(balance="sign", sign_lr=0.01, n_experts=4, top_k=1))
    m.balance.counts.copy_(torch.tensor([5, 5, 1, 9]))
    update_biases(m)
    torch.testing.assert_close(m.router.bias, torch.tensor([0.0, 0.0, 0.01, -0.01]))


def test_aux_loss_gradient_reaches_the_router_as_autograd_of_the_total_loss():
    m = MoE(_config(balance="aux", aux_coef=0.1, latent_dim=None)).double()
    x = torch.randn(2, 10, 16, dtype=torch.float64, generator=_gen(14))
    y = m(x)
    total = y.pow(2).mean() + balance_loss(m)
    total.backward()
    got = m.router.weight.grad.clone()
    m.zero_grad()
    y = m(x)
    r = m.last_routing
    manual = y.pow(2).mean() + 0.1 * aux_loss(r.scores, r.topk_idx)
    manual.backward()
    assert_close("router grad with aux", m.router.weight.grad, got, 1e-12)
    uniform = aux_loss(torch.full((8, 4), 0.5), torch.tensor([[0], [1], [2], [3]] * 2))
    assert abs(uniform.item() - 1.0) < 1e-6


@pytest.mark.parametrize("latent", [8, None], ids=["latent", "full"])
def test_aux_loss_router_gradient_is_the_same_with_experts_over_two_ranks(latent):
    """The aux-loss gradient never reached the router and its scale changed with the parallel degrees. With
    the experts spread over 2 gloo ranks (each with its own tokens, the replicated gradients averaged as data
    parallelism does) every gradient equals one process's autograd of the ranks' mean of L + a L_aux, the
    router's included (a = 0.1, large enough that dropping L_aux misses by far more than the tolerance)."""
    from k3lab.moe.workers import aux_ep_worker

    R = 2
    c = _config(latent_dim=latent, balance="aux", aux_coef=0.1, n_experts=4)
    torch.manual_seed(29)
    m = MoE(c)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    x, g = torch.randn(R, 10, 16, generator=_gen(29)), torch.randn(R, 10, 16, generator=_gen(30))
    ranks = launch(aux_ep_worker, R, c, state, x, g, timeout_s=120)
    m.train()
    total = 0.0
    for r in range(R):
        total = total + ((m(x[r]) * g[r]).mean() + balance_loss(m)) / R
    total.backward()
    for name, p in m.named_parameters():
        if name.startswith("experts."):
            got = torch.cat([ranks[r][name] for r in range(R)])
        else:
            got = ranks[0][name]
            assert torch.equal(got, ranks[1][name]), name
        assert_close(f"grad {name}", p.grad, got, 1e-5)
    # The aux term's share of the router gradient is far above that tolerance.
    ref = m.router.weight.grad.clone()
    m.zero_grad()
    for r in range(R):
        ((m(x[r]) * g[r]).mean() / R).backward()
    assert (ref - m.router.weight.grad).norm() > 0.05 * ref.norm()


def test_aux_loss_equals_its_formula_in_float64():
    """NeMo Automodel#1408 / Megatron-LM#5047: the aux loss came out 10^5 off. Its value is E * sum_j f_j P_j
    with f_j the share of pairs sent to j and P_j the mean normalised score, counted tokens only; balance_loss
    is aux_coef times it."""
    E, K, N = 8, 2, 30
    scores = torch.rand(N, E, generator=_gen(16), dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=_gen(17 + i))[:K] for i in range(N)])
    keep = torch.rand(N, generator=_gen(18)) < 0.7
    f = torch.zeros(E, dtype=torch.float64)
    for i in range(N):
        if keep[i]:
            f[idx[i]] += 1
    f /= f.sum()
    P = (scores / scores.sum(-1, keepdim=True))[keep].mean(0)
    assert_close("aux loss", E * (f * P).sum(), aux_loss(scores, idx, keep), 1e-12)
    m = MoE(_config(balance="aux", aux_coef=0.1, latent_dim=None)).double()
    m(torch.randn(N, 16, generator=_gen(19), dtype=torch.float64))
    r = m.last_routing
    assert_close("balance_loss", 0.1 * aux_loss(r.scores, r.topk_idx), balance_loss(m), 1e-12)


def test_latent_layout_router_and_shared_read_full_width_norm_after_the_weighted_sum():
    """Megatron-LM#5225 and others: down-projection before dispatch, RMSNorm and up-projection after the
    weighted top-k sum, router and shared experts on the full-width token."""
    # Seeded: the latent norm's eps makes the cancellation inexact for small routed sums, so the weights must
    # not depend on which tests ran before.
    torch.manual_seed(15)
    c = _config(latent_dim=8, d_model=16, balance="none")
    m = MoE(c)
    assert m.router.weight.shape == (8, 16) and m.shared.gate_up.weight.shape[1] == 16
    assert m.experts.w_gate.shape == (8, 8, 16) and m.down.weight.shape == (8, 16) and m.up.weight.shape == (16, 8)
    x = torch.randn(2, 5, 16, generator=_gen(15))
    # The latent RMSNorm comes after the weighted sum, so a common scale on the weights cancels...
    scaled = MoE(replace(c, routed_scaling=7.0))
    scaled.load_state_dict(m.state_dict())
    assert_close("latent output ignores the routed scale", m(x), scaled(x), 1e-5)
    # ...while a full-width MoE passes it through.
    full = MoE(replace(c, latent_dim=None))
    full_scaled = MoE(replace(c, latent_dim=None, routed_scaling=7.0))
    full_scaled.load_state_dict(full.state_dict())
    shared = full.shared(x)
    assert_close("full width scales", 7 * (full(x) - shared), full_scaled(x) - shared, 1e-5)


@pytest.mark.parametrize("field, value", [("routed_scaling", float("inf")), ("routed_scaling", 0.0), ("sign_lr", float("nan")),
                                          ("aux_coef", -1.0), ("init_std", 0.0), ("norm_eps", -1e-6)])
def test_config_rejects_numbers_out_of_range(field, value):
    with pytest.raises(ValueError, match=f"MoEConfig.{field} must be a finite number"):
        _config(**{field: value})
