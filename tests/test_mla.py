"""GatedMLA: the materialised layer against the float64 reference, packed documents, the absorbed
form and the latent cache (T >= 2, where a wrong softmax scale shows), validation."""
from __future__ import annotations

import pytest
import torch

from k3lab.mla import GatedMLA, MLACache, absorbed_attention, attention_mask, naive_gated_mla
from k3lab.testing import assert_close

TOL = 1e-12


def make_layer(q_lora=24, seed=0, d=40, H=3, R=16, Dn=8, Dr=4, Dv=6):
    torch.manual_seed(seed)
    layer = GatedMLA(d, H, R, q_lora, qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=Dv).double()
    with torch.no_grad():
        for p in layer.parameters():
            # Random norm gains too, and weights large enough that the softmax is far from uniform.
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if p.ndim == 1 else torch.randn_like(p) * 0.4)
    return layer


def x_of(B, T, d=40, seed=1):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("q_lora", [24, None], ids=["q_lora", "q_full"])
def test_materialised_matches_reference(q_lora):
    layer = make_layer(q_lora)
    x = x_of(2, 13).requires_grad_()
    y, cache = layer(x)
    assert cache is None and y.shape == x.shape and y.dtype == torch.float64
    ref = naive_gated_mla(layer, x)
    assert_close("y", ref, y, TOL)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    (dx_ref,) = torch.autograd.grad(ref, x, g)
    assert_close("dx", dx_ref, dx, 1e-11)


def test_scale_is_one_over_sqrt_qk_head_width():
    with torch.device("meta"):
        full = GatedMLA(7168, 96, 512, 1536, 128, 64, 128)
    assert full.scale == 192 ** -0.5
    assert full.q_b_proj.weight.shape == (96 * 192, 1536) and full.kv_a_proj.weight.shape == (512 + 64, 7168)
    assert full.kv_b_proj.weight.shape == (96 * 256, 512) and full.g_proj.weight.shape == (96 * 128, 7168)


def test_packed_documents_equal_documents_one_by_one():
    layer = make_layer(seed=2)
    lengths = [5, 1, 9, 3]
    x = x_of(1, sum(lengths), seed=3)
    cu = torch.tensor([0, 5, 6, 15, 18])
    y, _ = layer(x, cu_seqlens=cu)
    alone = torch.cat([layer(part)[0] for part in x.split(lengths, dim=1)], dim=1)
    assert_close("packed vs one by one", alone, y, TOL)
    assert_close("packed vs reference", naive_gated_mla(layer, x, cu), y, TOL)
    # Absorbed form with the same block-diagonal mask.
    ya, _ = layer(x, cu_seqlens=cu, absorbed=True)
    assert_close("packed absorbed", y, ya, TOL)


@pytest.mark.parametrize("T", [2, 7, 16])
def test_absorbed_equals_materialised(T):
    layer = make_layer(seed=4)
    x = x_of(2, T, seed=5)
    y, _ = layer(x, absorbed=False)
    ya, _ = layer(x, absorbed=True)
    assert_close("absorbed", y, ya, TOL)


def test_cached_decoding_equals_full_forward():
    """Prefill 4 tokens (materialised), then pieces of 1, 3, 1, 2 decoded from the latent cache
    (absorbed): every piece sees all earlier tokens at T >= 2 too."""
    layer = make_layer(seed=6)
    x = x_of(2, 11, seed=7)
    y, full_cache = layer(x, use_cache=True)
    ys, cache, start = [], None, 0
    for n in (4, 1, 3, 1, 2):
        yt, cache = layer(x[:, start : start + n], cache=cache, use_cache=True)
        ys.append(yt)
        start += n
    assert_close("decoded", y, torch.cat(ys, dim=1), TOL)
    assert cache.length == 11
    assert_close("latent cache", full_cache.latent, cache.latent, TOL)
    assert_close("k_shared cache", full_cache.k_shared, cache.k_shared, TOL)
    # The materialised form from the same cache agrees too.
    y_mat, _ = layer(x[:, 9:], cache=MLACache(cache.latent[:, :9], cache.k_shared[:, :9]), absorbed=False)
    assert_close("cached materialised", y[:, 9:], y_mat, TOL)


def _absorbed_o(layer, x, scale):
    q_nope, q_shared = layer.queries(x)
    latent, k_shared = layer.latents(x)
    T = x.shape[1]
    return absorbed_attention(q_nope, q_shared, latent, k_shared, *layer.up_weights(), scale,
                              attention_mask(T, T))


def test_a_wrong_scale_is_caught_at_T_ge_2_only():
    """The absorbed dot product is R + Dr wide; SDPA's default scale there, 1/sqrt(R + Dr), is the
    published bug. At T = 1 (one key) it is invisible; at T >= 2 the test above would fail."""
    layer = make_layer(seed=8)
    wrong = (layer.R + layer.Dr) ** -0.5
    for T, should_match in ((1, True), (6, False)):
        x = x_of(2, T, seed=9)
        right = _absorbed_o(layer, x, layer.scale)
        bad = _absorbed_o(layer, x, wrong)
        # The materialised attention output, before the gate.
        y = layer(x)[0]
        gate = torch.sigmoid(layer.g_proj(x))
        y_bad = layer.o_proj(gate * bad.flatten(-2))
        assert_close("right scale", y, layer.o_proj(gate * right.flatten(-2)), TOL)
        if should_match:
            assert_close("wrong scale at T=1", y, y_bad, TOL)
        else:
            with pytest.raises(AssertionError):
                assert_close("wrong scale at T>=2", y, y_bad, 1e-3)


def test_output_gate_is_channelwise_before_o_proj():
    """y = W_o[sigmoid(W_g x) * o]: with W_g = 0 every channel is halved before W_o, and the gate is
    full rank ([H Dv, d])."""
    layer = make_layer(seed=10)
    x = x_of(1, 5, seed=11)
    assert layer.g_proj.weight.shape == (layer.H * layer.Dv, layer.d_model)
    o = _absorbed_o(layer, x, layer.scale).flatten(-2)
    with torch.no_grad():
        layer.g_proj.weight.zero_()
        y, _ = layer(x)
    assert_close("half-open gate", layer.o_proj(0.5 * o), y, TOL)


def test_validation():
    layer = make_layer()
    x = x_of(2, 4)
    with pytest.raises(ValueError, match="x must be"):
        layer(x[..., :5])
    with pytest.raises(ValueError, match="T >= 1"):
        layer(x[:, :0])
    with pytest.raises(ValueError, match="B=1"):
        layer(x, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x[:1], cu_seqlens=torch.tensor([0, 2, 2, 4]))
    with pytest.raises(ValueError, match="cache must"):
        layer(x, cache=(1, 2))
    with pytest.raises(ValueError, match="cache must hold"):
        layer(x, cache=MLACache(torch.zeros(1, 3, 16, dtype=torch.float64), torch.zeros(1, 3, 4, dtype=torch.float64)))
    with pytest.raises(ValueError, match="cache"):
        _, c = layer(x[:1], use_cache=True)
        layer(x[:1], cache=c, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        GatedMLA(40, 2, 0)
    with pytest.raises(ValueError, match="norm_eps"):
        GatedMLA(40, 2, 8, norm_eps=float("nan"))


@pytest.mark.parametrize("cu", [[0, 4, 1, 7], [0, 3, 9], [1, 7], [0, 3, 7]], ids=["unsorted", "past-T", "not-0", "list"])
def test_the_reference_and_attention_mask_refuse_bad_cu_seqlens(cu):
    """Offsets out of order were taken by the reference (tokens in two documents, silently) and failed in
    attention_mask with torch's "repeats can not be negative"; a list or offsets past T failed with an
    AttributeError or IndexError."""
    layer = make_layer()
    x = x_of(1, 7)
    cu = cu if cu == [0, 3, 7] else torch.tensor(cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        naive_gated_mla(layer, x, cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention_mask(7, 7, cu_seqlens=cu)


def test_attention_mask_and_absorbed_attention_name_bad_arguments():
    with pytest.raises(ValueError, match="attention_mask: T must be an int >= 0, got -1"):
        attention_mask(-1, 3)
    with pytest.raises(ValueError, match="attention_mask: offset must be an int >= 0"):
        attention_mask(2, 2, offset=-5)
    layer = make_layer()
    x = x_of(2, 5)
    q_nope, q_shared = layer.queries(x)
    latent, k_shared = layer.latents(x)
    w_uk, w_uv = layer.up_weights()
    args = [q_nope, q_shared, latent, k_shared, w_uk, w_uv, layer.scale]
    with pytest.raises(ValueError, match=r"latent must be \[B=2, S, R\], got \[1, 5, 16\]"):
        absorbed_attention(*args[:2], latent[:1], *args[3:], None)
    for mask in (torch.ones(3, 3, dtype=torch.bool), torch.zeros(5, 5)):
        with pytest.raises(ValueError, match=r"mask must be a bool tensor \[T=5, S=5\]"):
            absorbed_attention(*args, mask)
    with pytest.raises(ValueError, match="must share one dtype"):
        absorbed_attention(*args[:4], w_uk.float(), w_uv.float(), layer.scale, None)
    with pytest.raises(ValueError, match="cp must be a k3lab.kcp.KCPContext"):
        layer(x[:1], cp=3)


def test_flags_cache_tensors_queries_and_scale_of_the_wrong_kind_are_named():
    """use_cache="no" returned a cache and absorbed="no" ran the absorbed form (a non-empty string is true); a
    cache of lists failed with an AttributeError, a 3-D q_nope with Python's "not enough values to unpack", and
    a NaN scale gave NaN outputs."""
    layer = make_layer()
    x = x_of(2, 5)
    for name in ("use_cache", "absorbed"):
        with pytest.raises(ValueError, match=f"GatedMLA: {name} must be a bool, got 'no'"):
            layer(x, **{name: "no"})
    with pytest.raises(ValueError, match="cache.latent and cache.k_shared must be tensors"):
        layer(x, cache=MLACache([0.0], [0.0]))
    q_nope, q_shared = layer.queries(x)
    latent, k_shared = layer.latents(x)
    w_uk, w_uv = layer.up_weights()
    with pytest.raises(ValueError, match=r"q_nope must be \[B, T, H, Dn\], got \[5, 3, 8\]"):
        absorbed_attention(q_nope[0], q_shared, latent, k_shared, w_uk, w_uv, layer.scale, None)
    for scale in (float("nan"), 0.0, "0.2"):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            absorbed_attention(q_nope, q_shared, latent, k_shared, w_uk, w_uv, scale, None)


@pytest.mark.parametrize("R, cu", [(2, None), (4, [0, 5, 16]), (4, [0, 3, 4, 11, 16])])
def test_context_mask_is_each_ranks_rows_of_the_packed_mask(R, cu):
    from k3lab.kcp import make_context
    from k3lab.mla import context_mask

    T = 16
    full = attention_mask(T, T, cu_seqlens=None if cu is None else torch.tensor(cu))
    for r in range(R):
        ctx = make_context(T, cu, rank=r, world_size=R)
        assert torch.equal(context_mask(ctx), full[ctx.start:ctx.stop]), (R, cu, r)


def test_context_parallel_rejects_caches_batches_and_wrong_lengths():
    from k3lab.kcp import make_context

    mla = GatedMLA(d_model=32, num_heads=2, kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=4,
                   qk_rope_head_dim=2, v_head_dim=4)
    ctx = make_context(8, rank=0, world_size=2)
    for kwargs, x in [({}, torch.randn(2, 4, 32)), ({}, torch.randn(1, 5, 32)), ({"use_cache": True}, torch.randn(1, 4, 32))]:
        with pytest.raises(ValueError, match="with cp, x must be this rank's one packed row"):
            mla(x, cp=ctx, **kwargs)


def test_an_input_dtype_other_than_the_parameters_is_refused_outside_autocast(check_dtype_guard):
    """A bf16 x on a float32 layer failed in the first matmul with torch's "same dtype" error; under
    autocast it is the training path and runs."""
    layer = GatedMLA(40, 3, 16, 24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    check_dtype_guard("GatedMLA", "x", lambda x: layer(x)[0], x_of(2, 5).float())


def test_a_cache_of_another_float_dtype_is_cast_and_a_non_float_one_refused():
    """The docstring said a cache of another dtype raises while the code casts it (as KDALayer does): a
    bf16 prefill continued in float32 equals decoding from the cache upcast by hand; an integer cache,
    which the cast would have truncated silently, is refused."""
    layer = make_layer(seed=8).float()
    x = x_of(2, 6, seed=9).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, cache = layer(x[:, :4].bfloat16(), use_cache=True)
    assert cache.latent.dtype == cache.k_shared.dtype == torch.bfloat16
    y, grown = layer(x[:, 4:], cache=cache, use_cache=True)
    y_ref, _ = layer(x[:, 4:], cache=MLACache(cache.latent.float(), cache.k_shared.float()))
    assert torch.equal(y, y_ref) and grown.latent.dtype == torch.float32
    with pytest.raises(ValueError, match=r"cache.latent and cache.k_shared must be floating point.*torch.int64"):
        layer(x[:, 4:], cache=MLACache(cache.latent.long(), cache.k_shared.float()))
