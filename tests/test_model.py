"""K3Config and K3Model: the full-size meta build counts K3's parameters, hand counts of the
accounting, k3-tiny forward/backward on CPU, packed documents == documents one by one, cached
decoding == the full forward (float64), validation."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k3lab.kda import KDALayer
from k3lab.mla import GatedMLA
from k3lab.model import K3Config, K3Model, count_params, flops_per_token, format_table, mfu
from k3lab.testing import assert_close


@pytest.fixture(scope="module")
def full_table():
    return count_params("k3-full")


def test_k3_full_config_matches_table_1():
    c = K3Config.preset("k3-full")
    assert c.full_attn_layers == list(range(4, 93, 4)) + [93]
    assert c.layer_types().count("kda") == 69 and c.layer_types().count("mla") == 24
    assert c.ffn_types()[:2] == ["dense", "moe"] and c.ffn_types().count("dense") == 1
    assert c.n_attn_res_blocks == 8
    # K3's Block AttnRes boundaries: 12 layers (24 sublayers) per block, the last block 9 layers.
    assert c.attn_res_sizes() == [24] * 7 + [18]
    with torch.device("meta"):
        assert K3Model(c).residual.sizes == [24] * 7 + [18]
    assert K3Config.preset("k3-tiny").attn_res_sizes() == [4, 4, 2]
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.vocab_size) == (7168, 96, 128, 163840)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (896, 16, 2)
    assert (c.moe_intermediate_size, c.moe_latent_size, c.intermediate_size) == (3072, 3584, 33792)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert (c.activation_situ_beta, c.activation_situ_linear_beta, c.kda_gate_lower_bound) == (4.0, 25.0, -5.0)
    assert c.moe_renormalize is True and c.routed_scaling_factor == 1.0 and c.attn_res_block_size == 12


def test_meta_count_matches_k3(full_table):
    print("\n" + format_table(full_table))
    total, active = full_table["total"]
    assert abs(total / 2.78e12 - 1) < 0.01, total
    assert abs(active / 104.2e9 - 1) < 0.02, active


def test_meta_count_by_hand(full_table):
    """Every component against its formula (nn.Linear weights [out, in])."""
    d, H, V, E, K, h, l, Rq, R = 7168, 96, 128, 896, 16, 3072, 3584, 1536, 512
    kda = (3 * d * H * 128 + d * H * 128 + (d * 128 + 128 * H * V + H * V) + H * V * d + H * d
           + 3 * H * 128 * 4 + H + H * 128 + V)
    mla = d * Rq + Rq + Rq * H * 192 + d * (R + 64) + R + R * H * 256 + d * H * V + H * V * d
    t = full_table
    assert t["kda"] == (69 * kda, 69 * kda)
    assert t["mla"] == (24 * mla, 24 * mla)
    assert t["dense ffn"][0] == 3 * d * 33792
    assert t["moe routed experts"] == (92 * E * 3 * l * h, 92 * K * 3 * l * h)
    assert t["moe shared experts"][0] == 92 * 2 * 3 * d * h
    assert t["moe latent projections"][0] == 92 * (2 * d * l + l)
    assert t["moe router"][0] == 92 * E * d
    assert t["embedding"] == (163840 * d, 0) and t["head"] == (163840 * d, 163840 * d)
    assert t["attnres queries"][0] == (2 * 93 + 1) * d


def test_flops_per_token_by_hand(full_table):
    c = K3Config.preset("k3-tiny")
    active = count_params(c)["total"][1]
    # 2 MLA layers, 2 heads, q/k 16 + 8, v 16.
    assert flops_per_token(c, 100) == 6 * active + 2 * 6 * 2 * (16 + 8 + 16) * 100
    assert flops_per_token(c, 100, causal=True) == 6 * active + 2 * 6 * 2 * 40 * 100 / 2
    # An MTP depth runs the shared head once more (not in the activated parameters) and its own MLA layer.
    m = K3Config.preset("k3-tiny", num_nextn_predict_layers=1)
    assert flops_per_token(m, 100) == (6 * count_params(m)["total"][1] + 6 * m.hidden_size * m.vocab_size
                                       + 3 * 6 * 2 * (16 + 8 + 16) * 100)
    f = flops_per_token("k3-full", 8192)
    assert f == 6 * full_table["total"][1] + 24 * 6 * 96 * 320 * 8192
    # ~0.68 PFLOP per token: 6 x 104.2B plus ~9% for attention at 8K.
    assert 0.66e12 < f < 0.70e12
    assert mfu(1000.0, f, "h100", n_gpus=8) == pytest.approx(1000 * f / (8 * 989.4e12))
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1.0, 1.0, "a100")
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(c, 0)


def test_packed_documents_with_use_cache_are_refused():
    """The KDA layers returned a state per document and the MLA layers one cache of every packed document
    together: no later call could continue from them."""
    model = K3Model(K3Config.preset("k3-tiny"))
    idx = torch.randint(0, model.config.vocab_size, (1, 8))
    with pytest.raises(ValueError, match="cu_seqlens with use_cache is not supported"):
        model(idx, cu_seqlens=torch.tensor([0, 3, 8]), use_cache=True)


def tiny(dtype=torch.float32, seed=0, **overrides):
    torch.manual_seed(seed)
    model = K3Model(K3Config.preset("k3-tiny", **overrides)).to(dtype)
    with torch.no_grad():
        # Non-trivial AttnRes queries: zero ones would make every depth read a uniform average.
        model.residual.queries.normal_(0, 0.5)
    return model


def test_flops_and_mfu_take_numpy_numbers_and_name_a_causal_that_is_not_a_bool():
    """A throughput from numpy (np.float32 of a median, np.int64 of a count) was refused as "must be a positive
    finite number, got np.float32(1000.0)", a numpy seq_len as "must be a positive int, got 100"; causal="no"
    halved the attention term."""
    np = pytest.importorskip("numpy")
    c = K3Config.preset("k3-tiny")
    f = flops_per_token(c, 100)
    assert flops_per_token(c, np.int64(100)) == f
    assert mfu(np.float32(1000.0), f, n_gpus=np.int64(2)) == pytest.approx(mfu(1000.0, f, n_gpus=2))
    assert mfu(np.int64(1000), np.float64(f), np.float64(989.4e12)) == pytest.approx(mfu(1000, f))
    with pytest.raises(ValueError, match="causal must be a bool, got 'no'"):
        flops_per_token(c, 100, causal="no")
    with pytest.raises(ValueError, match=r"tokens_per_s must be a positive finite number, got np.float64\(nan\)"):
        mfu(np.float64("nan"), f)


def test_tiny_forward_backward():
    model = tiny()
    types = [type(m) for m in model.mixers()]
    assert types == [KDALayer, KDALayer, KDALayer, GatedMLA, GatedMLA]
    idx = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx, targets=idx)
    assert logits.shape == (2, 20, 256) and logits.dtype == torch.float32
    assert abs(loss.item() - math.log(256)) < 0.5
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing


def test_packed_documents_equal_documents_one_by_one():
    model = tiny(torch.float64, seed=2).eval()
    lengths = [7, 1, 12, 4]
    idx = torch.randint(0, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 7, 8, 20, 24])
    with torch.no_grad():
        packed, _ = model(idx, cu_seqlens=cu)
        alone = torch.cat([model(part)[0] for part in idx.split(lengths, dim=1)], dim=1)
    # The router scores in float32 (k3lab.moe), the rest is float64.
    assert_close("packed", alone, packed, 1e-6)


def test_cached_decoding_equals_full_forward():
    model = tiny(torch.float64, seed=4).eval()
    idx = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full, _ = model(idx)
        logits, _, caches = model(idx[:, :5], use_cache=True)
        pieces = [logits]
        for start, n in ((5, 1), (6, 3), (9, 1), (10, 3)):
            logits, _, caches = model(idx[:, start : start + n], caches=caches, use_cache=True)
            pieces.append(logits)
    # The router scores in float32 (k3lab.moe), the rest is float64.
    assert_close("decoded", full, torch.cat(pieces, dim=1), 1e-7)


def test_generate_greedy_equals_recomputed_argmax():
    model = tiny(torch.float64, seed=6).eval()
    prompt = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(7))
    out = model.generate(prompt, 3, temperature=0)
    ref = prompt
    with torch.no_grad():
        for _ in range(3):
            ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)
    sampled = model.generate(prompt, 2, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 5) and torch.equal(sampled[:, :3], prompt)
    # numpy scalars were refused with "must be a finite number >= 0, got np.float32(1.0)".
    again = model.generate(prompt, np.int64(2), temperature=np.float32(1.0), top_k=np.int64(5),
                           generator=torch.Generator().manual_seed(0))
    assert torch.equal(again, sampled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324], ids=["1e-40", "1e-300", "smallest-double"])
def test_generate_at_a_tiny_temperature_is_greedy(dtype, temperature):
    """logits / temperature overflowed to inf below about 1e-38 (float32) and softmax gave NaN:
    torch.multinomial raised "probability tensor contains either inf, nan or element < 0"."""
    model = tiny(dtype, seed=6).eval()
    prompt = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(7))
    greedy = model.generate(prompt, 3, temperature=0)
    for top_k in (None, 5):
        out = model.generate(prompt, 3, temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(0))
        assert torch.equal(out, greedy)


def test_generate_in_training_mode_leaves_the_balancers_statistics_and_the_mode_alone():
    """generate on a model in training mode counted the prompt's and every decoded token's routing into the MoE
    layers' Quantile Balancing statistics, so the next bias update moved the routers by the samples."""
    from k3lab.moe import moe_layers

    model = tiny(seed=6)
    prompt = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(7))
    out = model.generate(prompt, 3, temperature=0)
    assert model.training
    for m in moe_layers(model):
        assert int(m.balance.counts.sum()) == 0 and int(m.balance.hist.sum()) == 0
    assert torch.equal(out, model.eval().generate(prompt, 3, temperature=0)) and not model.training


def test_use_cache_that_is_not_a_bool_is_named():
    """use_cache="no" failed in the first KDA layer with "output_final_state must be a bool", an argument the
    model's caller never passed."""
    with pytest.raises(ValueError, match="use_cache must be a bool, got 'no'"):
        tiny()(torch.zeros(1, 4, dtype=torch.long), use_cache="no")


@pytest.mark.parametrize("overrides, match", [
    (dict(num_experts_per_tok=8), r"^K3Config.moe_balance='qb' needs num_experts_per_tok < n_routed_experts"),
    (dict(init_std=0.0), r"^K3Config.init_std must be a finite number > 0"),
    (dict(moe_latent_size=36), r"^K3Config.moe_latent_size must be a multiple of 8"),
    (dict(moe_intermediate_size=20), r"^K3Config.moe_intermediate_size must be a multiple of 8"),
    (dict(moe_latent_size=None, hidden_size=60, num_attention_heads=2), r"^K3Config.hidden_size must be a multiple of 8"),
    (dict(moe_experts=4), r"^K3Config has no field\(s\) \['moe_experts'\]"),
    (dict(moe_latent_size=128), r"^K3Config.moe_latent_size 128 is wider than hidden_size 64"),
], ids=["qb-top-k-equals-experts", "init-std-zero", "latent-width", "expert-hidden", "full-width-experts",
        "unknown-field", "latent-wider"])
def test_config_refuses_what_the_model_cannot_build(overrides, match):
    """These configs were accepted and failed only at K3Model(config) or its first forward, with a message
    naming a class or a width (expert_ffn's d, h) the user never set; an unknown override was dataclasses'
    TypeError."""
    with pytest.raises(ValueError, match=match):
        K3Config.preset("k3-tiny", **overrides)
    K3Model(K3Config.preset("k3-tiny", num_experts_per_tok=8, moe_balance="none"))


def test_validation():
    with pytest.raises(ValueError, match="unknown preset"):
        K3Config.preset("k3-huge")
    with pytest.raises(ValueError, match="activation_situ_beta"):
        K3Config(activation_situ_beta=3.0)
    with pytest.raises(ValueError, match="full_attn_layers"):
        K3Config(full_attn_layers=[0, 4])
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        K3Config(num_nextn_predict_layers=-1)
    with pytest.raises(ValueError, match="mtp_loss_weight"):
        K3Config(mtp_loss_weight=float("nan"))
    with pytest.raises(ValueError, match="hidden_size"):
        K3Config(hidden_size=0)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        K3Config.preset("k3-tiny", num_experts_per_tok=9)
    model = tiny()
    idx = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="idx"):
        model(idx[0])
    with pytest.raises(ValueError, match="idx"):
        model(idx + 256)
    with pytest.raises(ValueError, match="targets"):
        model(idx, targets=idx[:, :3])
    with pytest.raises(ValueError, match="B=1"):
        model(idx, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="caches"):
        model(idx, caches=[None] * 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(idx, -1)


def test_config_and_layer_indices_are_checked_where_they_are_used():
    """A field changed after construction reached torch ("negative dimension"); k3_full_attn_layers(0) gave
    [0] (not a 1-based index) and every=0 "range() arg 3 must not be zero"; no costs read "[1, 0]"."""
    from k3lab.model import balanced_cuts
    from k3lab.model.config import k3_full_attn_layers

    c = K3Config.preset("k3-tiny")
    c.hidden_size = -1
    with pytest.raises(ValueError, match="K3Config.hidden_size must be an int >= 0, got -1"):
        K3Model(c)
    with pytest.raises(ValueError, match="num_hidden_layers must be an int >= 1, got 0"):
        k3_full_attn_layers(0)
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        k3_full_attn_layers(8, 0)
    assert k3_full_attn_layers(8) == [4, 8] and k3_full_attn_layers(93)[-2:] == [92, 93]
    with pytest.raises(ValueError, match="balanced_cuts: costs is empty"):
        balanced_cuts([], 1)


@pytest.mark.parametrize("costs, last_extra, match", [
    ([1.0, float("inf"), 1.0], 0.0, r"costs\[1\] must be a finite number >= 0, got inf"),
    ([1.0, float("nan"), 1.0], 0.0, r"costs\[1\] must be a finite number >= 0, got nan"),
    ([1.0, -2.0, 1.0], 0.0, r"costs\[1\] must be a finite number >= 0, got -2.0"),
    ([1.0, True, 1.0], 0.0, r"costs\[1\] must be a finite number >= 0, got True"),
    ([1.0, 1.0, 1.0], -1.0, r"last_extra must be a finite number >= 0, got -1.0"),
], ids=["inf", "nan", "negative", "bool", "negative_extra"])
def test_balanced_cuts_refuses_costs_that_are_not_finite_and_non_negative(costs, last_extra, match):
    """An inf cost gave an empty stage ([0, 0, 3]: every split ties at inf); NaN and negative costs went
    unchecked. Finite costs still cut as before."""
    from k3lab.model import balanced_cuts

    with pytest.raises(ValueError, match=match):
        balanced_cuts(costs, 3, last_extra)
    assert balanced_cuts([1.0, 5.0, 1.0, 1.0], 2) == [0, 2, 4] and balanced_cuts([0.0] * 3, 3) == [0, 1, 2, 3]


def test_a_forward_on_the_meta_device_is_one_clear_error():
    """Chapter 08 builds k3-full on the meta device to count it; a forward there failed deep inside (an
    .item() in the id check, an autocast lookup in the experts). It reads values (the checks, KDA's kernels,
    which have no meta versions), so it refuses meta idx or a meta model at its entry and points to the
    counters."""
    with torch.device("meta"):
        meta_model = K3Model(K3Config.preset("k3-tiny"))
    real_model = tiny()
    idx = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    want = r"K3Model.forward: meta tensors carry no values; .*count_params.*flops_per_token"
    for model, x in ((meta_model, idx.to("meta")), (meta_model, idx), (real_model, idx.to("meta"))):
        with pytest.raises(ValueError, match=want):
            model(x, targets=x)
        with pytest.raises(ValueError, match=want):
            model.generate(x, 2)


def test_loss_is_the_mean_over_counted_targets_and_zero_when_none_count():
    """An all -100 batch (every position padding) gave the mean of nothing, NaN, and NaN gradients.
    A partly ignored batch keeps the float64 mean cross-entropy over the counted positions."""
    model = tiny(torch.float64, seed=8)
    idx = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(9))
    targets = idx.roll(-1, 1)
    targets[0, 3:] = -100
    logits, loss = model(idx, targets=targets)
    keep = targets != -100
    ref = -torch.log_softmax(logits.detach(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0][keep].mean()
    assert_close("loss over counted targets", ref, loss.detach(), 1e-12)
    _, loss = model(idx, targets=torch.full_like(idx, -100))
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p.grad)) for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_ids_of_any_integer_dtype_are_checked_by_value(dtype):
    """uint8 ids were compared with vocab_size 256 in uint8 (256 is 0 there): every valid prompt was refused."""
    model = tiny().eval()
    idx = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        want, _ = model(idx)
        got, _ = model(idx.to(dtype))
    assert torch.equal(got, want)
    if dtype != torch.uint8:
        with pytest.raises(ValueError, match=r"idx must be token ids in \[0, vocab_size=256\), got min -1"):
            model(torch.full((1, 3), -1, dtype=dtype))
    with pytest.raises(ValueError, match="targets must be token ids"):
        model(idx.to(dtype), targets=torch.full((2, 6), 300 if dtype != torch.uint8 else 255, dtype=torch.int64) + 1)


def test_generate_checks_the_prompt_before_casting_it():
    """A float prompt was truncated to other ids by ``.long()`` (forward refuses floats), and with
    max_new_tokens = 0 out-of-range ids came back unchecked; top_k=True failed inside torch.topk."""
    model = tiny()
    prompt = torch.tensor([[3, 7, 9]])
    with pytest.raises(ValueError, match="integer tensor of token ids"):
        model.generate(prompt.float() + 0.7, 2)
    with pytest.raises(ValueError, match=r"token ids in \[0, vocab_size=256\)"):
        model.generate(prompt + 300, 0)
    with pytest.raises(ValueError, match=r"idx must be \[B, T\]"):
        model.generate(prompt[0], 1)
    with pytest.raises(ValueError, match="top_k must be None or an int >= 1, got True"):
        model.generate(prompt, 1, top_k=True)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got True"):
        model.generate(prompt, 1, temperature=True)
    assert torch.equal(model.generate(prompt.to(torch.uint8), 0), prompt)


def test_bias_update_visits_the_mtp_moe_layers_and_a_stage_without_moe_is_a_no_op():
    """torchtitan#4494 / #1689: MTP MoE layers were skipped by the bias update; a pipeline stage with no MoE
    layer crashed it."""
    from k3lab.moe import moe_layers, update_biases
    from k3lab.model import split_model

    model = tiny(num_nextn_predict_layers=1)
    layers = moe_layers(model)
    assert len(layers) == 5 and layers[-1] is model.mtp[0].ffn.fn
    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(11))
    model(idx, targets=idx)
    loads = update_biases(model)
    assert len(loads) == 5 and all(int(load.sum()) > 0 for load in loads)
    assert model.mtp[0].ffn.fn.router.bias.abs().sum() > 0
    first = split_model(tiny(), [0, 2, 10])[0]
    assert moe_layers(first) == [] and update_biases(first) == []


def test_sum_queries_grad_of_no_stages_is_named():
    """An empty list of stages (a rank that builds none) failed inside torch.stack with "stack expects a
    non-empty TensorList"."""
    from k3lab.model import sum_queries_grad

    with pytest.raises(ValueError, match="sum_queries_grad: stages must hold at least one K3Stage, got 0"):
        sum_queries_grad([])


def test_trains_under_bf16_autocast_with_value_checks_off():
    # The trainer's GPU step: bf16 autocast over float32 weights (the stacked experts run grouped_mm,
    # which autocast does not cast: the layer does), no per-call value checks.
    model = K3Model(K3Config.preset("k3-tiny"))
    model.value_checks(False)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, targets=idx)
    loss.backward()
    assert torch.isfinite(loss) and 4 < loss.item() < 7
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def mtp_model():
    torch.manual_seed(0)
    c = K3Config.preset("k3-tiny", num_nextn_predict_layers=2, mtp_loss_weight=0.5)
    return K3Model(c).double()


def _mtp_reference(model, x, targets):
    """The main loss plus the weighted mean of the depths, each run on the positions that have a target
    (t + k < T): depth k reads x_{t+k} and predicts targets[:, t+k]; -100 targets ignored."""
    h = model.residual(model.embed(x), model.sublayers)
    main = F.cross_entropy(model.head(model.norm(h)).flatten(0, 1), targets.flatten())
    state, depth_losses = h, []
    for k, module in enumerate(model.mtp, start=1):
        n = x.shape[1] - k
        state, normed = module(state[:, :n], model.embed(x[:, k:k + n]))
        depth_losses.append(F.cross_entropy(model.head(normed).flatten(0, 1), targets[:, k:k + n].flatten()))
    return main + model.config.mtp_loss_weight * sum(depth_losses) / len(depth_losses)


def test_mtp_loss_equals_the_depths_run_on_truncated_sequences(mtp_model):
    # The model shifts and pads (position t of depth k reads x_{t+k}, predicts x_{t+k+1}); the reference
    # truncates each depth to the positions that have a target. Causal mixers and per-token FFNs make
    # the two agree wherever a target exists.
    model = mtp_model
    seq = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(1))
    x, targets = seq[:, :-1], seq[:, 1:]
    _, loss = model(x, targets=targets)
    assert_close("mtp loss", _mtp_reference(model, x, targets).detach(), loss.detach(), 1e-12)
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert all(p.grad is not None for p in model.mtp.parameters())
    # One token: no depth has a target; the loss is the main loss, not NaN.
    _, short = model(x[:, :1], targets=targets[:, :1])
    assert torch.isfinite(short)
    # Decoding ignores the MTP modules; the counts put them under "mtp", and the released config has none.
    assert model.generate(x[:, :4], 3, temperature=0).shape == (2, 7)
    assert count_params(model.config)["mtp"][0] > 0 and count_params("k3-tiny")["mtp"] == (0, 0)


def test_mtp_reads_the_input_ids_so_a_masked_target_changes_no_other_position(mtp_model):
    # The MTP input once came from the targets with -100 clamped to id 0: masking the target of position 3
    # fed token 0 to depth 1 at position 2 and changed the loss of positions that still count.
    model = mtp_model
    seq = torch.randint(1, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    x, targets = seq[:, :-1], seq[:, 1:].clone()
    targets[0, 3] = targets[1, 7] = -100
    _, loss = model(x, targets=targets)
    assert_close("mtp loss with masked targets", _mtp_reference(model, x, targets).detach(), loss.detach(), 1e-12)


def test_mtp_with_packed_documents_equals_the_documents_as_a_batch(mtp_model):
    # Packed into one row, depth k once scored a document's last positions against the next document's
    # first targets; with cu_seqlens each depth stops at its document's end, as a row of its own does.
    model = mtp_model
    seq = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(3))
    x, targets = seq[:, :-1], seq[:, 1:]
    _, batch = model(x, targets=targets)
    cu = torch.tensor([0, 12, 24])
    _, packed = model(x.reshape(1, 24), targets=targets.reshape(1, 24), cu_seqlens=cu)
    assert_close("packed mtp loss", batch.detach(), packed.detach(), 1e-12)
    # Documents of unequal lengths, one shorter than the MTP depth: the loss of each document run alone,
    # weighted by its counted targets (the main loss and each depth are means over their targets).
    lens = [9, 2, 13]
    seq = torch.randint(0, 256, (1, sum(lens) + 1), generator=torch.Generator().manual_seed(4))
    x, targets = seq[:, :-1], seq[:, 1:]
    cu = torch.tensor([0, 9, 11, 24])
    _, packed = model(x, targets=targets, cu_seqlens=cu)
    main_and_depths = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        xd, td = x[:, a:b], targets[:, a:b]
        hd = model.residual(model.embed(xd), model.sublayers)
        terms = [(F.cross_entropy(model.head(model.norm(hd)).flatten(0, 1), td.flatten(), reduction="sum"), b - a)]
        state = hd
        for k, module in enumerate(model.mtp, start=1):
            n = max(b - a - k, 0)
            if n == 0:  # the document is too short for this depth (and the deeper ones)
                terms.append((torch.zeros((), dtype=torch.float64), 0))
                continue
            state, normed = module(state[:, :n], model.embed(xd[:, k:k + n]))
            terms.append((F.cross_entropy(model.head(normed).flatten(0, 1), td[:, k:k + n].flatten(),
                                          reduction="sum"), n))
        main_and_depths.append(terms)
    sums = [sum(doc[i][0] for doc in main_and_depths) / sum(doc[i][1] for doc in main_and_depths)
            for i in range(len(model.mtp) + 1)]
    want = sums[0] + model.config.mtp_loss_weight * sum(sums[1:]) / len(model.mtp)
    assert_close("packed mtp loss, unequal documents", want.detach(), packed.detach(), 1e-12)


def test_value_checks_and_cp_reject_wrong_types():
    model = K3Model(K3Config.preset("k3-tiny"))
    with pytest.raises(ValueError, match="enabled must be a bool"):
        model.value_checks("no")
    idx = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="cp must be a k3lab.kcp.KCPContext"):
        model(idx, targets=idx, cp="abc")
