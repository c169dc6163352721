"""k3lab.memory: every storage policy gives the keep policy's gradients (bitwise for keep, recompute
and offload; within FP8 error for fp8), the counters show what each policy saves, nothing is retained
across steps (pytorch#161186: a custom Function saving its output as the last op of a checkpointed
region), and K3Model under policies trains on the same gradients."""
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

from k3lab.memory import (POLICIES, ActivationManager, activation_policy, apply_policies,
                          fp8_dequantize, fp8_quantize, parse_rules)
from k3lab.testing import rel_rms_error

# Relative RMS error of fp8-stored activations on the gradients of a float32 MLP: e4m3 keeps 3 mantissa
# bits (~2^-4 worst relative error per value), and errors of independent values average out in the RMS.
FP8_GRAD_TOL = 0.1


class ExpOut(torch.autograd.Function):
    """exp(x), saving its output (not its input) for backward: the pattern of pytorch#161186."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class Block(nn.Module):
    def __init__(self, d, h, custom_last=False):
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)
        self.custom_last = custom_last

    def forward(self, x):
        y = self.down(torch.nn.functional.gelu(self.up(x)))
        # The custom Function is the region's last op, its saved output is the region's output.
        return ExpOut.apply(0.1 * y) if self.custom_last else y


class MLP(nn.Module):
    def __init__(self, d=48, h=160, n=3, custom_last=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h, custom_last) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.out(x).square().mean()


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _run(policy, x, dtype, custom_last=False, seed=0):
    torch.manual_seed(seed)
    model = MLP(custom_last=custom_last).to(dtype)
    mgr = ActivationManager()
    if policy is not None:
        apply_policies(model, {"blocks.[0-9]": policy}, manager=mgr, default=None)
    loss = model(x.to(dtype))
    stats = mgr.stats()
    loss.backward()
    return _grads(model), stats, mgr


@pytest.mark.parametrize("custom_last", [False, True], ids=["plain", "custom_fn_last"])
@pytest.mark.parametrize("policy", ["keep", "recompute", "offload"])
def test_exact_policies_equal_plain(policy, custom_last):
    x = torch.randn(37, 48)
    ref, _, _ = _run(None, x, torch.float32, custom_last)
    out, _, mgr = _run(policy, x, torch.float32, custom_last)
    for r, o in zip(ref, out):
        assert torch.equal(r, o)
    assert mgr.live_tensors() == 0 and mgr.live_bytes() == 0


def test_fp8_gradients_within_bound():
    x = torch.randn(64, 48)
    ref, _, _ = _run(None, x, torch.float64)
    out, _, _ = _run("fp8", x, torch.float32)
    errs = [rel_rms_error(r, o) for r, o in zip(ref, out)]
    assert max(errs) < FP8_GRAD_TOL, errs
    # The error is FP8's, not zero: the activations really went through e4m3.
    assert max(errs) > 1e-4, errs


def test_fp8_roundtrip_blocks():
    # D = 200: one full block of 128 and one padded block per row; one outlier per block stays local.
    x = torch.randn(3, 5, 200, dtype=torch.float64)
    x[0, 0, 3] = 1e4
    q, scale = fp8_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (3, 5, 2)
    assert scale[0, 0, 0] == 1e4 / 448 and scale[0, 0, 1] < 1
    y = fp8_dequantize(q, scale, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_rms_error(x[1:], y[1:]) < 0.05
    # Rows other than the outlier's keep their precision (per-block scales).
    assert rel_rms_error(x[0, 1:], y[0, 1:]) < 0.05
    assert torch.equal(fp8_dequantize(*fp8_quantize(torch.zeros(4, 7)), torch.float32), torch.zeros(4, 7))


def test_fp8_one_non_finite_value_loses_only_itself():
    """One inf in a block of 128 made the block's scale inf and the whole block NaN."""
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    x[0, 5], x[1, 200] = float("inf"), float("nan")
    y = fp8_dequantize(*fp8_quantize(x), torch.float32)
    bad = ~torch.isfinite(x)
    assert torch.isnan(y[bad]).all() and torch.isfinite(y[~bad]).all()
    assert rel_rms_error(x[~bad], y[~bad]) < 0.05


def test_fp8_of_float64_keeps_float64_range():
    """float64 went through float32: values past 3.4e38 came back NaN, values near 1e-300 zero."""
    for magnitude in (1e300, 1e-300):
        x = torch.randn(3, 130, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * magnitude
        q, scale = fp8_quantize(x)
        y = fp8_dequantize(q, scale, torch.float64)
        assert scale.dtype == torch.float64 and y.dtype == torch.float64
        err = rel_rms_error(x / magnitude, y / magnitude)  # squares of 1e300 would overflow
        print(f"float64 x ~{magnitude:.0e}: rel RMS error {err:.1e}")
        assert err < 0.05


def test_fp8_block_of_subnormal_values_dequantises_finite():
    """A block whose maximum is below 448 x the smallest subnormal (~6e-43) got scale 0 and came back NaN."""
    x = torch.zeros(2, 130)
    x[0, 3], x[1, 129] = 1e-43, -5e-44
    x[1, 5] = 2.0
    y = fp8_dequantize(*fp8_quantize(x), torch.float32)
    assert torch.isfinite(y).all()
    assert (y - x).abs().max() < 1e-37 + 2.0 * 2 ** -4


@pytest.mark.parametrize("block", [0, -128, True, 2.0])
def test_fp8_block_must_be_a_positive_int(block):
    """block=0 raised ZeroDivisionError; True passed as 1."""
    x = torch.randn(2, 130)
    with pytest.raises(ValueError, match=rf"fp8_quantize: block \(values per scale\) must be a positive int, got {block!r}"):
        fp8_quantize(x, block=block)
    q, scale = fp8_quantize(x, block=64)
    with pytest.raises(ValueError, match=r"fp8_dequantize: block"):
        fp8_dequantize(q, scale, torch.float32, block=block)
    assert rel_rms_error(x, fp8_dequantize(q, scale, torch.float32, block=64)) < 0.05


def test_fp8_dequantize_refuses_scales_of_another_block_or_shape():
    """Scales made with block=7 read with the default 128 came back as another tensor, silently (each value
    took the scale of another block); a scale of the wrong shape failed in a broadcast."""
    x = torch.randn(3, 300)
    q, scale = fp8_quantize(x, block=7)
    with pytest.raises(ValueError, match=r"fp8_dequantize: scale must be float32 or float64 \[3, 3\] for q \[3, 300\] "
                                         r"with block=128 \(fp8_quantize's\), got torch.float32 \[3, 43\]"):
        fp8_dequantize(q, scale, torch.float32)
    with pytest.raises(ValueError, match=r"scale must be float32 or float64 \[3, 43\]"):
        fp8_dequantize(q, scale[:, :1], torch.float32, block=7)
    with pytest.raises(ValueError, match="q must be a float8_e4m3fn tensor"):
        fp8_dequantize(x, scale, torch.float32, block=7)
    assert rel_rms_error(x, fp8_dequantize(q, scale, torch.float32, block=7)) < 0.05


@pytest.mark.parametrize("scale_dtype, dtype, match", [
    (torch.int64, torch.float32, "got torch.int64"),
    (torch.float32, torch.int64, "dtype must be a floating torch.dtype, got torch.int64"),
    (torch.float32, None, "dtype must be a floating torch.dtype, got None"),
], ids=["int-scale", "int-dtype", "no-dtype"])
def test_fp8_dequantize_refuses_non_floating_dtypes(scale_dtype, dtype, match):
    """An int64 scale came back as zeros; dtype=int64 or bool was taken and None gave float32."""
    q, scale = fp8_quantize(torch.randn(2, 130))
    with pytest.raises(ValueError, match=match):
        fp8_dequantize(q, scale.to(scale_dtype), dtype)


def test_fp8_block_wider_than_the_row_costs_the_row():
    """A block of 2^28 padded a one-value row to 2^28 values (3.6 GB); the row is one block."""
    x = torch.randn(3, 5, dtype=torch.float64)
    q, scale = fp8_quantize(x, block=2 ** 40)
    assert q.shape == (3, 5) and scale.shape == (3, 1)
    y = fp8_dequantize(q, scale, torch.float64, block=2 ** 40)
    torch.testing.assert_close(y, fp8_dequantize(*fp8_quantize(x, block=5), torch.float64, block=5), rtol=0, atol=0)
    assert rel_rms_error(x, y) < 0.05


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_a_tensor_written_in_place_after_its_save_is_refused_as_plain_autograd_does(policy):
    """The keep policy handed backward the modified tensor (a wrong gradient, silently) where plain autograd
    raises; inside a recompute region the region's saved input is checked the same way."""
    a = torch.randn(4, 8, requires_grad=True)
    b = a * 1.0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c = b.sin()
        b.add_(1.0)
        c.sum().backward()
    mgr = ActivationManager()
    b = a * 1.0
    if policy == "keep":
        with activation_policy("keep", manager=mgr):
            c = b.sin()
    else:
        c = mgr.run("recompute", torch.sin, b)
    b.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation after it was saved"):
        c.sum().backward()
    # Untouched, the same region gives plain autograd's gradient.
    a.grad = None
    with activation_policy("keep", manager=mgr):
        c = (a * 1.0).sin()
    c.sum().backward()
    assert torch.equal(a.grad, a.detach().cos())


def test_counters_show_savings():
    x = torch.randn(64, 48)
    live = {}
    for policy in POLICIES:
        _, stats, _ = _run(policy, x, torch.float32)
        live[policy] = stats[policy]["live_bytes"]
    assert live["keep"] > 0
    assert live["recompute"] < live["keep"] / 4
    assert live["fp8"] < live["keep"] / 3.5
    assert live["offload"] == 0
    _, stats, _ = _run("offload", x, torch.float32)
    assert stats["offload"]["host_bytes"] == live["keep"]


@pytest.mark.parametrize("policy", ["keep", "offload", "fp8"])
def test_copies_of_weights_made_for_the_call_are_not_activations(policy):
    """expert_ffn's concatenation of the gate and up weights and autocast's bf16 cast of a weight were stored
    as activations: offloaded every call, fp8-quantised (dx off by 4%) and counted (131,072 of 131,584 bytes
    for one token through a 256 x 256 linear under autocast)."""
    from k3lab.moe import GroupedExperts

    torch.manual_seed(3)
    experts = GroupedExperts(8, 32, 64)
    x = torch.randn(4, 32, requires_grad=True)
    offsets = torch.tensor([1, 2, 2, 3, 3, 4, 4, 4], dtype=torch.int32)
    (plain,) = torch.autograd.grad(experts(x, offsets).square().sum(), x)
    handle = apply_policies(experts, {"": policy})
    y = experts(x, offsets)
    stats = handle.manager.stats()[policy]
    # Saved: x (4 x 32), the gate/up output (4 x 128) and the activation (4 x 64); no [8, 32, 128] weights.
    assert max(stats["total_bytes"], stats["host_bytes"]) < 8 * 32 * 128 * 4 / 4, stats
    (got,) = torch.autograd.grad(y.square().sum(), x)
    assert rel_rms_error(got, plain) < (5e-2 if policy == "fp8" else 1e-7)
    handle.remove()
    lin = nn.Linear(256, 256)
    handle = apply_policies(lin, {"": policy})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(torch.randn(1, 256, requires_grad=True))
    stats = handle.manager.stats()[policy]
    assert max(stats["total_bytes"], stats["host_bytes"]) <= 256 * 2, stats
    handle.remove()


@pytest.mark.parametrize("policy", POLICIES)
def test_flat_over_100_steps(policy):
    torch.manual_seed(1)
    model = MLP(d=16, h=32, n=2, custom_last=True)
    mgr = ActivationManager()
    apply_policies(model, {"blocks.[0-9]": policy}, manager=mgr)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    outs, counts = [], []
    for step in range(100):
        x = torch.randn(8, 16)
        loss = model(x)
        assert mgr.live_tensors() > 0
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert mgr.live_tensors() == 0 and mgr.live_bytes() == 0, (step, mgr.stats())
        outs.append(weakref.ref(loss))
        del loss
        if step in (9, 99):
            gc.collect()
            with warnings.catch_warnings():  # the scan touches torch.distributed's deprecated reduce_op object
                warnings.simplefilter("ignore", FutureWarning)
                counts.append(sum(1 for o in gc.get_objects() if torch.is_tensor(o)))
    # Without gc: the graph (and what ExpOut saved) died with the loss.
    assert all(r() is None for r in outs)
    assert counts[1] <= counts[0], counts


def test_custom_function_output_freed_without_gc():
    # pytorch#161186: the saved output of the region's last op must not keep a reference cycle alive.
    model = MLP(d=16, h=32, n=1, custom_last=True)
    mgr = ActivationManager()
    apply_policies(model, {"blocks.0": "recompute"}, manager=mgr)
    gc.disable()
    try:
        refs = []
        hook = model.blocks[0].register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
        for _ in range(5):
            model(torch.randn(4, 16)).backward()
        hook.remove()
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_context_manager_and_nesting():
    lin = nn.Linear(32, 32)
    x = torch.randn(10, 32, requires_grad=True)
    mgr = ActivationManager()
    with activation_policy("fp8", manager=mgr):
        y = torch.tanh(lin(x))
        with activation_policy("offload", manager=mgr):
            z = torch.sigmoid(y)
    s = mgr.stats()
    # Innermost wins: sigmoid's saved output offloaded, the rest fp8; the weight never counted.
    assert s["offload"]["live_tensors"] == 1 and s["fp8"]["live_tensors"] == 2
    z.sum().backward()
    assert mgr.live_tensors() == 0


def test_mixed_rules_first_match_and_remove():
    torch.manual_seed(0)
    model = MLP()
    handle = apply_policies(model, {"blocks.0": "recompute", "blocks.*": "offload", "blocks.1.up": "fp8"})
    # blocks.1.up matched "blocks.*" first; inside blocks.0 (recompute) its children are not wrapped.
    assert handle.assigned["blocks.0"] == "recompute" and handle.assigned["blocks.1.up"] == "offload"
    assert handle.assigned[""] == "keep"
    with pytest.raises(ValueError, match="already has activation policies"):
        apply_policies(model, {"out": "keep"})
    handle.remove()
    assert "forward" not in model.blocks[0].__dict__
    apply_policies(model, {"out": "keep"}).remove()


def test_the_first_matching_rule_wins_in_the_strings_order():
    """A broad rule before a narrow one takes the module; the narrow one first takes it instead."""
    model = MLP()
    handle = apply_policies(model, parse_rules("blocks.*=recompute,blocks.1=offload"))
    assert handle.assigned["blocks.1"] == "recompute"
    handle.remove()
    handle = apply_policies(model, parse_rules(" blocks.1 = offload, blocks.[0-9]=recompute,"))
    assert handle.assigned["blocks.1"] == "offload" and handle.assigned["blocks.0"] == "recompute"
    handle.remove()
    assert list(parse_rules("b=fp8,a=keep,b=fp8")) == ["b", "a"]


def test_one_pattern_given_two_policies_is_refused():
    """A dict keeps a repeated key's last value: "blocks.1=recompute,blocks.1=offload" ran offload."""
    with pytest.raises(ValueError, match=r"pattern 'blocks.1' is given two policies, 'recompute' and 'offload'"):
        parse_rules("blocks.1=recompute,blocks.1=offload")
    with pytest.raises(ValueError, match=r"expected PATTERN=POLICY entries separated by commas, got 'blocks.1'"):
        parse_rules("blocks.1")
    with pytest.raises(ValueError, match=r"unknown activation policy 'fp16'"):
        parse_rules("blocks.1=fp16")
    with pytest.raises(ValueError, match=r"rules must be a str of PATTERN=POLICY entries, got dict"):
        parse_rules({"blocks.1": "keep"})


def test_bad_names():
    model = MLP()
    with pytest.raises(ValueError, match="unknown activation policy 'fp16'"):
        apply_policies(model, {"blocks.0": "fp16"})
    with pytest.raises(ValueError, match="unknown activation policy"):
        apply_policies(model, {"blocks.0": "keep"}, default="nope")
    with pytest.raises(ValueError, match="match no module"):
        apply_policies(model, {"*.experts": "fp8"})
    with pytest.raises(ValueError, match="unknown activation policy"):
        with activation_policy("offlaod"):
            pass
    with pytest.raises(ValueError, match="needs a region"):
        with activation_policy("recompute"):
            pass
    # A model or manager of the wrong kind failed with AttributeError deep inside.
    with pytest.raises(ValueError, match="model must be an nn.Module, got int"):
        apply_policies(5, {"": "keep"})
    with pytest.raises(ValueError, match="manager must be an ActivationManager or None, got int"):
        apply_policies(model, {"blocks.0": "keep"}, manager=5)
    with pytest.raises(ValueError, match="manager must be an ActivationManager or None, got str"):
        with activation_policy("keep", manager="m"):
            pass
    assert "forward" not in model.__dict__


K3_RULES = {
    "keep": {"": "keep"},
    "recompute": {"sublayers.[0-9]": "recompute"},
    "offload": {"": "offload"},
    "mixed": {"sublayers.[02468]": "recompute", "*.experts": "offload", "*.shared": "keep"},
    # FP8 on the FFNs (dense and LatentMoE); the KDA mixers' saved decay cumsums turn fp8's 2^-4 into a
    # ~0.3 error on A_log's gradient, so mixers are recomputed, as K3 stores its attention side.
    "fp8": {"sublayers.[13579]": "fp8", "sublayers.[02468]": "recompute"},
}


@pytest.fixture(scope="module")
def k3_reference():
    from k3lab.model import K3Config, K3Model
    torch.manual_seed(0)
    model = K3Model(K3Config.preset("k3-tiny"))
    idx = torch.randint(0, model.config.vocab_size, (2, 24))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _, loss = model(idx, targets=idx)
    loss.backward()
    return model, state, idx, loss.detach(), _grads(model)


@pytest.mark.parametrize("name", list(K3_RULES))
def test_k3_tiny_same_gradients(k3_reference, name):
    from k3lab.model import K3Model
    ref_model, state, idx, ref_loss, ref_grads = k3_reference
    model = K3Model(ref_model.config)
    model.load_state_dict(state)
    mgr = ActivationManager()
    apply_policies(model, K3_RULES[name], manager=mgr)
    _, loss = model(idx, targets=idx)
    assert mgr.live_tensors() > 0
    loss.backward()
    assert mgr.live_tensors() == 0
    grads = _grads(model)
    if name == "fp8":
        assert rel_rms_error(ref_loss, loss) < 1e-6
        errs = [rel_rms_error(r, g) for r, g in zip(ref_grads, grads)]
        bad = {n: e for (n, _), e in zip(model.named_parameters(), errs) if not e < FP8_GRAD_TOL}
        assert not bad, bad
    else:
        assert torch.equal(loss, ref_loss)
        for (n, _), r, g in zip(model.named_parameters(), ref_grads, grads):
            assert torch.equal(r, g), n


def test_recompute_of_mixers_on_packed_documents_replays_with_their_cu_seqlens(k3_reference):
    """A mixer reads its per-call context (cu_seqlens, caches, the cp layout) from the model's forward; a
    recompute replays it in backward, after that forward has returned, and must replay it with the same
    document boundaries (without them the replay ran another function and failed in backward)."""
    from k3lab.model import K3Model

    ref_model, state, _, _, _ = k3_reference
    torch.manual_seed(1)
    idx = torch.randint(0, ref_model.config.vocab_size, (1, 40))
    cu = torch.tensor([0, 13, 40])
    plain = K3Model(ref_model.config)
    plain.load_state_dict(state)
    ref_loss = plain(idx, targets=idx, cu_seqlens=cu)[1]
    ref_loss.backward()
    model = K3Model(ref_model.config)
    model.load_state_dict(state)
    mgr = ActivationManager()
    apply_policies(model, {"sublayers.*": "recompute"}, manager=mgr, default=None)
    loss = model(idx, targets=idx, cu_seqlens=cu)[1]
    loss.backward()
    assert torch.equal(loss, ref_loss) and mgr.live_tensors() == 0
    for (n, p), r in zip(model.named_parameters(), _grads(plain)):
        assert torch.equal(p.grad, r), n


@pytest.mark.parametrize("name", ["recompute", "mixed"])
def test_recompute_counts_each_moe_token_once(k3_reference, name):
    """A full activation-checkpoint recompute counted every token twice in the balancer. The recompute here
    is the manager's (the trainer's --activations), not torch's checkpoint: every MoE layer's counts and
    histogram after forward and backward equal one plain forward's, and so does the bias update. (Doubled
    counts would leave the losses unchanged: the quantiles and maxvio are ratios.)"""
    from k3lab.model import K3Model
    from k3lab.moe import moe_layers, update_biases

    ref_model, state, idx, _, _ = k3_reference
    model = K3Model(ref_model.config)
    model.load_state_dict(state)
    apply_policies(model, K3_RULES[name], manager=ActivationManager())
    model(idx, targets=idx)[1].backward()
    layers, ref_layers = moe_layers(model), moe_layers(ref_model)
    assert len(layers) == 4
    for i, (m, ref) in enumerate(zip(layers, ref_layers)):
        assert int(m.balance.counts.sum()) == idx.numel() * m.config.top_k, i
        assert torch.equal(m.balance.counts, ref.balance.counts) and torch.equal(m.balance.hist, ref.balance.hist), i
    # The reference's statistics are the fixture's: its update runs on a copy.
    twin = K3Model(ref_model.config)
    twin.load_state_dict(state)
    for m, ref in zip(moe_layers(twin), ref_layers):
        m.balance.counts.copy_(ref.balance.counts)
        m.balance.hist.copy_(ref.balance.hist)
    for load, want in zip(update_biases(model), update_biases(twin)):
        assert torch.equal(load, want)
    for m, ref in zip(layers, moe_layers(twin)):
        assert torch.equal(m.router.bias, ref.router.bias) and m.router.bias.abs().sum() > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_unused_graph_freed_without_gc(policy):
    # A forward whose graph never sees backward (a value check, an eval under grad) must free its saved
    # outputs when dropped: stored with their grad_fn they would form a cycle only gc can break.
    model = MLP(d=16, h=32, n=1, custom_last=True)
    mgr = ActivationManager()
    apply_policies(model, {"blocks.0": policy}, manager=mgr)
    gc.disable()
    try:
        loss = model(torch.randn(4, 16))
        assert mgr.live_tensors() > 0
        del loss
        assert mgr.live_tensors() == 0 and mgr.live_bytes() == 0
    finally:
        gc.enable()


def test_recompute_replays_the_forwards_expert_choice():
    """On a GPU a replay's router logits can differ from the forward's in the last bit, and a flipped near-tie
    would route the replayed tokens to other experts. Here the replay's router input is negated, which
    reverses every choice: under the recompute policy top-k still returns the forward's experts."""
    from torch.utils.checkpoint import checkpoint

    from k3lab.moe import MoE, MoEConfig
    from k3lab.moe.balance import in_backward

    torch.manual_seed(0)
    moe = MoE(MoEConfig(d_model=16, n_experts=8, top_k=2, expert_hidden=8, latent_dim=8, n_shared=1))
    chosen = []
    # The same ops in the forward and the replay (a selective checkpoint matches them one to one).
    moe.router.register_forward_pre_hook(lambda m, args: (args[0] * (-1.0 if in_backward() else 1.0),))
    moe.router.register_forward_hook(lambda m, args, out: chosen.append(out.topk_idx.clone()))
    x = torch.randn(1, 12, 16, requires_grad=True)
    ActivationManager().run("recompute", moe, x).square().sum().backward()
    assert len(chosen) == 2 and torch.equal(chosen[0], chosen[1])
    # The check can fail: a plain checkpoint replays the negated input's own choice.
    chosen.clear()
    checkpoint(moe, x, use_reentrant=False).square().sum().backward()
    assert len(chosen) == 2 and not torch.equal(chosen[0], chosen[1])


@pytest.mark.parametrize("policy", ["offload", "fp8"])
def test_an_empty_tensor_saved_under_a_policy_that_cannot_change_it_is_kept(policy):
    """Offload and fp8 keep an empty tensor as it is; offload's unpack then took the kept tensor's version
    counter for its (device, event) pair and failed in backward ("cannot unpack non-iterable int")."""
    a = torch.randn(5, 3, requires_grad=True)
    empty = torch.randn(0, 3, requires_grad=True)
    mgr = ActivationManager()
    with activation_policy(policy, manager=mgr):
        out = (a * a).sum() + (empty * empty).sum()
    out.backward()
    # fp8 stores a's copies in e4m3 (its error bound); the empty tensor's gradient is exact under both.
    assert rel_rms_error(a.grad, 2 * a.detach()) < (0 if policy == "offload" else FP8_GRAD_TOL) + 1e-12
    assert empty.grad.shape == (0, 3) and mgr.live_tensors() == 0
