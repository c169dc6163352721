"""KDALayer: the formula against a by-hand composition, cached decoding == full sequence (float64),
varlen packing, the short-conv state, validation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3lab.kda import KDACache, KDALayer, naive_recurrent_kda
from k3lab.kda.layer import causal_short_conv, reference_kda_op
from k3lab.testing import assert_close

TOL = 1e-12


def make_layer(gate="lower_bounded", H=2, HV=4, K=8, V=6, d=24, seed=0, chunk_size=16):
    torch.manual_seed(seed)
    layer = KDALayer(d, H, K, num_v_heads=HV, v_head_dim=V, gate=gate, chunk_size=chunk_size).double()
    # Random (not init-valued) norm weights and biases so every parameter matters.
    with torch.no_grad():
        layer.o_norm.weight.uniform_(0.5, 1.5)
        layer.A_log.normal_(0, 0.5)
    return layer


def x_of(B, T, d=24, seed=1):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def by_hand(layer: KDALayer, x: torch.Tensor) -> torch.Tensor:
    """The layer's equations written out (K3_NOTES, "Layer"), with the naive recurrence."""
    H, K, HV, V, W = layer.H, layer.K, layer.HV, layer.V, layer.conv_size

    def conv(u, w):  # causal depthwise: left-pad W-1 zeros
        return F.conv1d(F.pad(u.transpose(1, 2), (W - 1, 0)), w[:, None], groups=u.shape[-1]).transpose(1, 2)

    def l2(u):
        return u / torch.sqrt((u * u).sum(-1, keepdim=True) + 1e-6)

    q = l2(F.silu(conv(x @ layer.q_proj.weight.T, layer.q_conv)).unflatten(-1, (H, K)))
    k = l2(F.silu(conv(x @ layer.k_proj.weight.T, layer.k_conv)).unflatten(-1, (H, K)))
    v = F.silu(conv(x @ layer.v_proj.weight.T, layer.v_conv)).unflatten(-1, (HV, V))
    beta = torch.sigmoid(x @ layer.b_proj.weight.T)
    z = (x @ layer.f_proj.weight.T).unflatten(-1, (HV, K)) + layer.dt_bias.view(HV, K)
    if layer.gate == "lower_bounded":
        g = layer.lower_bound * torch.sigmoid(layer.A_log.exp()[:, None] * z)
    else:
        g = -layer.A_log.exp()[:, None] * F.softplus(z)
    o, _ = naive_recurrent_kda(q, k, v, g, beta)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight
    gate_out = torch.sigmoid(x @ layer.g_proj.weight.T).unflatten(-1, (HV, V))
    return (gate_out * o).flatten(-2) @ layer.o_proj.weight.T


@pytest.mark.parametrize("gate", ["lower_bounded", "kimi_linear"])
def test_matches_the_equations(gate):
    layer = make_layer(gate)
    x = x_of(2, 37)
    y, _ = layer(x)
    assert y.shape == x.shape and y.dtype == torch.float64
    assert_close("y", by_hand(layer, x), y, TOL)


@pytest.mark.parametrize("gate", ["lower_bounded", "kimi_linear"])
def test_token_by_token_decoding_equals_full_sequence(gate):
    layer = make_layer(gate, seed=2)
    x = x_of(2, 21, seed=3)
    y, cache = layer(x)
    ys, c = [], None
    for t in range(x.shape[1]):
        yt, c = layer(x[:, t : t + 1], cache=c)
        ys.append(yt)
    assert_close("y", y, torch.cat(ys, dim=1), TOL)
    for name in ("conv_q", "conv_k", "conv_v", "state"):
        assert_close(name, getattr(cache, name), getattr(c, name), TOL)


def test_prefill_in_uneven_pieces():
    """Pieces of 1, 2, 3, 17, 5 tokens: conv states shorter than the kernel are carried correctly."""
    layer = make_layer(seed=4)
    x = x_of(1, 28, seed=5)
    y, _ = layer(x)
    ys, c, t0 = [], None, 0
    for n in (1, 2, 3, 17, 5):
        yt, c = layer(x[:, t0 : t0 + n], cache=c)
        ys.append(yt)
        t0 += n
    assert_close("y", y, torch.cat(ys, dim=1), TOL)


def test_conv_state_zero_padded_for_short_sequences():
    layer = make_layer(seed=6)
    x = x_of(1, 2, seed=7)
    _, cache = layer(x)
    assert cache.conv_q.shape == (1, layer.conv_size - 1, layer.H * layer.K)
    assert torch.equal(cache.conv_q[0, 0], torch.zeros(layer.H * layer.K, dtype=torch.float64))
    assert_close("conv_q[-2:]", layer.q_proj(x)[0], cache.conv_q[0, 1:], TOL)
    assert cache.state.shape == (1, layer.HV, layer.K, layer.V)


def test_varlen_equals_separate_sequences_with_caches():
    """Packed sequences (some shorter than the kernel and the chunk) == each run alone, incl. caches,
    and a second packed call continuing from the packed cache."""
    layer = make_layer(seed=8)
    lengths = [1, 3, 20, 2]
    cu = torch.tensor([0, 1, 4, 24, 26])
    x = x_of(1, 26, seed=9)
    y, cache = layer(x, cu_seqlens=cu)
    x2 = x_of(1, 10, seed=10)
    cu2 = torch.tensor([0, 2, 3, 9, 10])
    y2, _ = layer(x2, cache=cache, cu_seqlens=cu2)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        yn, cn = layer(x[:, a:b])
        assert_close(f"y[{n}]", yn, y[:, a:b], TOL)
        assert_close(f"state[{n}]", cn.state[0], cache.state[n], TOL)
        assert_close(f"conv_v[{n}]", cn.conv_v[0], cache.conv_v[n], TOL)
        a2, b2 = cu2[n].item(), cu2[n + 1].item()
        yn2, _ = layer(x2[:, a2:b2], cache=cn)
        assert_close(f"y2[{n}]", yn2, y2[:, a2:b2], TOL)
    assert lengths == cu.diff().tolist()


def test_causal_short_conv_reference():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 9, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    state = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    y, new_state = causal_short_conv(x, w, state)
    full = torch.cat([state, x], dim=1)
    ref = torch.stack([(full[:, t : t + 4] * w.T).sum(1) for t in range(9)], dim=1)
    assert_close("y", ref, y, TOL)
    assert torch.equal(new_state, x[:, -3:])
    with pytest.raises(ValueError, match="conv_state"):
        causal_short_conv(x, w, state[:, :2])


def test_gradients_reach_every_parameter():
    layer = make_layer(seed=12)
    y, _ = layer(x_of(2, 20, seed=13), use_cache=False)
    y.pow(2).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name


def test_k3_init():
    layer = KDALayer(32, 2, 16)
    assert torch.equal(layer.A_log, torch.zeros(2))
    g = layer.log_decay(torch.randn(1, 50, 32))
    assert g.dtype == torch.float32 and (g > -5).all() and (g <= 0).all()
    _, cache = layer(torch.randn(1, 3, 32), use_cache=False)
    assert cache is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_v_heads=3), "num_v_heads"),
    (dict(gate="mamba"), "gate"),
    (dict(head_dim=0), "head_dim"),
    (dict(conv_size=0), "conv_size"),
    (dict(lower_bound=0.5), "lower_bound"),
    (dict(d_model=True), "d_model must be a positive int"),
], ids=["hv", "gate", "head_dim", "conv_size", "lower_bound", "bool_d_model"])
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KDALayer(**{**dict(d_model=16, num_heads=2, head_dim=8), **kwargs})


def test_bad_forward_inputs():
    layer = make_layer(seed=14)
    with pytest.raises(ValueError, match="x must be"):
        layer(x_of(1, 4, d=23))
    # T = 0 reached the operator ("B, T, H, K, HV and V must be positive"); use_cache=0 was reported as
    # the operator's output_final_state.
    with pytest.raises(ValueError, match=r"x must be \[B, T, d_model=24\] with B, T >= 1, got \[1, 0, 24\]"):
        layer(x_of(1, 0))
    with pytest.raises(ValueError, match="use_cache must be a bool, got int"):
        layer(x_of(1, 4), use_cache=0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x_of(2, 4), cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x_of(1, 4), cu_seqlens=torch.tensor([0, 2, 2, 4]))
    _, cache = layer(x_of(2, 4))
    # The caller's names (cache.<field>), not the convolution's conv_state or the operator's initial_state.
    with pytest.raises(ValueError, match=r"cache.conv_q must be \[N, conv_size-1, H\*K\] = \[3, 3, 16\] for N=3 "
                                         r"sequences, got \[2, 3, 16\]"):
        layer(x_of(3, 1), cache=cache)
    bad = KDACache(cache.conv_q, cache.conv_k, cache.conv_v, cache.state[:, :1])
    with pytest.raises(ValueError, match=r"cache.state must be \[N, HV, K, V\] = \[2, 4, 8, 6\] for N=2 sequences, "
                                         r"got \[2, 1, 8, 6\]"):
        layer(x_of(2, 1), cache=bad)
    bad = KDACache(cache.conv_q, cache.conv_k, cache.conv_v.int(), cache.state)
    with pytest.raises(ValueError, match="cache.conv_v must be a floating-point tensor, got dtype torch.int32"):
        layer(x_of(2, 1), cache=bad)


def test_integer_convolution_inputs_and_reference_op_inputs_are_refused():
    """An integer conv_state or weight was taken (truncating the convolution), a list conv_state raised
    AttributeError; the reference operator raised TypeError from torch.finfo on an integer q."""
    x = torch.randn(1, 5, 3)
    for kw, match in ((dict(conv_state=[[0]]), "conv_state must be a floating-point"),
                      (dict(conv_state=torch.zeros(1, 3, 3, dtype=torch.long)), "conv_state must be a floating-point"),
                      (dict(weight=torch.ones(3, 4, dtype=torch.long)), "weight must be a floating-point")):
        with pytest.raises(ValueError, match=match):
            causal_short_conv(x, **dict(dict(weight=torch.randn(3, 4)), **kw))
    q, k, v, z = (torch.randn(1, 5, 2, 4) for _ in range(4))
    with pytest.raises(ValueError, match="q must be a floating-point tensor, got dtype torch.int64"):
        reference_kda_op(q.long(), k, v, z, torch.randn(1, 5, 2), torch.randn(2), torch.randn(8))
    with pytest.raises(ValueError, match="beta_logits must be a torch.Tensor, got list"):
        reference_kda_op(q, k, v, z, [1.0], torch.randn(2), torch.randn(8))


def poisoned(cache: KDACache, field: str, value: float) -> KDACache:
    fields = dict(conv_q=cache.conv_q, conv_k=cache.conv_k, conv_v=cache.conv_v, state=cache.state)
    fields[field] = fields[field].clone()
    fields[field].view(-1)[3] = value
    return KDACache(**fields)


@pytest.mark.parametrize("field", ["conv_q", "conv_k", "conv_v", "state"])
def test_non_finite_cache_named_by_field(field):
    """A NaN in the cache surfaced as the operator's "q contains NaN or inf" (or "initial_state ...")."""
    layer = make_layer(seed=15)
    _, cache = layer(x_of(2, 4))
    with pytest.raises(ValueError, match=rf"^cache\.{field} contains NaN or inf$"):
        layer(x_of(2, 1, seed=2), cache=poisoned(cache, field, float("nan")))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_non_finite_x_named_x(dtype):
    """A NaN in x was reported as the operator's q (computed from x)."""
    layer = make_layer(seed=16).to(dtype)
    x = x_of(1, 6).to(dtype)
    with pytest.raises(ValueError, match=r"^x contains NaN or inf$"):
        layer(x.index_fill(1, torch.tensor([2]), float("nan")))


@pytest.mark.parametrize("gate, param, value, name", [
    ("lower_bounded", "q_proj.weight", float("nan"), "q_proj.weight"),
    ("kimi_linear", "A_log", 100.0, r"A_log \(its exp\)")], ids=["nan_weight", "A_log_overflow"])
def test_a_non_finite_parameter_is_named_not_x(gate, param, value, name):
    """A diverged weight (or an A_log whose exp overflows float32: Kimi Linear's gate -exp(A_log) softplus(.)
    turns -inf) surfaced as "x is too large" with x finite and small, sending the user to the inputs."""
    layer = make_layer(gate=gate, seed=18).float()
    with torch.no_grad():
        layer.get_parameter(param).fill_(value)
    with pytest.raises(ValueError, match=rf"^{name} contains NaN or inf$"):
        layer(x_of(1, 6).float())


def test_huge_cache_state_named():
    """A float64 cache.state of 1e300 in a float32 layer overflowed the operator's float32 state to NaN."""
    layer = make_layer(seed=17).float()
    _, cache = layer(x_of(1, 4).float())
    huge = KDACache(cache.conv_q, cache.conv_k, cache.conv_v, torch.full(cache.state.shape, 1e300, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^cache\.state is out of range .*initial_state is too large"):
        layer(x_of(1, 2).float(), cache=huge)


@pytest.mark.parametrize("chunk_size", [24, 16.0], ids=["not_multiple_of_16", "float"])
def test_chunk_size_checked_at_construction(chunk_size):
    """chunk_size=24 was accepted by the constructor and failed at the first forward."""
    with pytest.raises(ValueError, match="chunk_size"):
        KDALayer(d_model=16, num_heads=2, head_dim=8, chunk_size=chunk_size)


def test_forward_input_dtype_and_cache_type():
    """An integer x or one whose dtype differs from the weights failed in a matmul (RuntimeError); a
    cache that is not a KDACache (e.g. an empty dict) was silently ignored."""
    layer = make_layer(seed=15)
    x = x_of(1, 4)
    with pytest.raises(ValueError, match="x must be"):
        layer(x.round().long())
    with pytest.raises(ValueError, match="x must be"):
        layer(x.float())
    with pytest.raises(ValueError, match="cache"):
        layer(x, cache={})
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, cu_seqlens=[0, 2, 4])


@pytest.mark.parametrize("norm_eps", [-1.0, 0.0, float("nan"), float("inf"), "1e-5"])
def test_bad_norm_eps(norm_eps):
    # 0 turned a zero input row into 0/0 = NaN in the output norm.
    with pytest.raises(ValueError, match=r"norm_eps must be a finite number > 0"):
        KDALayer(d_model=16, num_heads=2, head_dim=8, norm_eps=norm_eps)


def test_reference_op_refuses_unknown_gate():
    """Regression: gate='foo' silently ran the kimi_linear gate."""
    from k3lab.kda.layer import reference_kda_op

    q, k, v, z = (torch.randn(1, 4, 1, 8) for _ in range(4))
    with pytest.raises(ValueError, match="gate must be one of"):
        reference_kda_op(q, k, v, z, torch.randn(1, 4, 1), torch.zeros(1), None, gate="foo")


def test_bf16_input_under_autocast():
    """The layer's check allows another input dtype under autocast, but b_proj ran with autocast off on
    the bf16 x against float32 weights: RuntimeError (same dtype expected). Now it runs, and agrees with
    the float32 forward of the same x to bf16's precision."""
    torch.manual_seed(16)
    layer = KDALayer(d_model=32, num_heads=2, head_dim=8)
    x = torch.randn(1, 9, 32)
    ref, _ = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = layer(x.bfloat16())
    assert torch.isfinite(y).all()
    assert_close("bf16 autocast vs float32", ref, y.float(), 5e-2)


def test_low_rank_output_gate():
    """gate_rank=r: Kimi Linear's gate W_g2 W_g1 x + b; with b = 0 it is the full-rank layer whose W_g is
    the product."""
    torch.manual_seed(0)
    full = KDALayer(24, 2, 8, num_v_heads=4, v_head_dim=6, chunk_size=16).double()
    low = KDALayer(24, 2, 8, num_v_heads=4, v_head_dim=6, chunk_size=16, gate_rank=5).double()
    low.load_state_dict({k: v for k, v in full.state_dict().items() if not k.startswith("g_proj")}, strict=False)
    assert low.g_proj[0].weight.shape == (5, 24) and low.g_proj[1].weight.shape == (24, 5)
    with torch.no_grad():
        low.g_proj[1].bias.zero_()
        full.g_proj.weight.copy_(low.g_proj[1].weight @ low.g_proj[0].weight)
    x = x_of(2, 9)
    assert_close("low-rank gate", full(x)[0], low(x)[0], TOL)
    with pytest.raises(ValueError, match="gate_rank"):
        KDALayer(24, 2, 8, gate_rank=0)


@pytest.mark.parametrize("scale", [1e19, 1e30])
def test_huge_inputs_give_the_scale_free_result_not_zeros(scale):
    # q, k are L2-normalised and the head output RMS-normed, so the layer is nearly scale-free; in float32
    # their squares overflow past ~1e19 and used to normalise them to zero (a finite, wrong output).
    torch.manual_seed(0)
    layer = KDALayer(64, 2, 32)
    x = torch.randn(1, 10, 64)
    ref, _ = layer.double()(x.double() * scale)
    out, _ = layer.float()(x * scale)
    assert torch.isfinite(out).all()
    assert_close(f"x * {scale:g}", ref, out, 1e-3)
