"""Per-Head Muon: per-head equals a loop over heads of torch.optim.Muon (KDA and MLA projections; heads
of one shape run as batched GEMMs, so to bf16 rounding, while a split into other blocks is far off),
one block equals torch.optim.Muon, AdamW groups equal torch.optim.AdamW, raw-gradient clipping,
parameter split, and a torch.distributed.checkpoint round trip equal to the uninterrupted run."""
from __future__ import annotations

import copy
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from k3lab.kda import KDALayer
from k3lab.mla import GatedMLA
from k3lab.model import K3Config, K3Model
from k3lab.moe import GroupedExperts
from k3lab.testing import assert_close
from k3lab.optim import PerHeadMuon, head_blocks, muon_loop_reference, per_head_muon, per_head_steps, split_params
from k3lab.testing import assert_close, rel_rms_error


def _grads(shape, steps, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


@pytest.mark.parametrize("which", ["kda_q", "kda_v", "mla_q", "mla_kv"])
def test_per_head_equals_loop_over_heads(which):
    torch.manual_seed(0)
    kda = KDALayer(48, 3, 16, num_v_heads=6, v_head_dim=8)
    mla = GatedMLA(48, 4, 12, 20, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    param = {"kda_q": kda.q_proj.weight, "kda_v": kda.v_proj.weight, "mla_q": mla.q_b_proj.weight,
             "mla_kv": mla.kv_b_proj.weight}[which]
    blocks = {**head_blocks(kda), **head_blocks(mla)}[param]
    assert len(blocks) > 1 and sum(blocks) == param.shape[0]
    grads = _grads(param.shape, 3, seed=1)
    w = param.detach()
    out = per_head_steps(param, blocks, grads, lr=0.02, weight_decay=0.1)
    assert_close(which, muon_loop_reference(param, blocks, grads, lr=0.02, weight_decay=0.1) - w, out - w, 1e-2)
    # Not the full-matrix update: the split really happens (the updates differ by ~30-50%).
    assert rel_rms_error(per_head_steps(param, None, grads, lr=0.02, weight_decay=0.1) - w, out - w) > 0.2


def test_one_block_equals_torch_muon():
    w = torch.randn(24, 40)
    grads = _grads(w.shape, 3, seed=2)
    ref = muon_loop_reference(w, [24], grads, lr=0.01, weight_decay=0.1)
    assert torch.equal(per_head_steps(w, None, grads, lr=0.01, weight_decay=0.1), ref)
    assert torch.equal(per_head_steps(w, [24], grads, lr=0.01, weight_decay=0.1), ref)


def test_stacked_experts_are_orthogonalised_per_expert():
    w = torch.randn(3, 8, 12)
    grads = _grads(w.shape, 2, seed=3)
    p = torch.nn.Parameter(w.clone())
    opt = PerHeadMuon([dict(params=[p], algorithm="muon")], lr=0.01)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    for e in range(3):
        ref = muon_loop_reference(w[e], [8], [g[e] for g in grads], lr=0.01, weight_decay=0.1)
        assert_close(f"expert {e}", ref - w[e], p.detach()[e] - w[e], 1e-2)


def test_adamw_groups_equal_torch_adamw():
    w = torch.randn(5, 7)
    grads = _grads(w.shape, 3, seed=4)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    mine = PerHeadMuon([dict(params=[a], algorithm="adamw")], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    ref = torch.optim.AdamW([b], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        ref.step()
    assert torch.equal(a, b)


def test_clipping_scales_raw_gradients_only():
    w, v = torch.randn(16, 24), torch.randn(24)
    g_w, g_v = torch.randn(16, 24) * 10, torch.randn(24) * 10
    norm = torch.cat([g_w.flatten(), g_v]).norm()

    def run(clip, scale):
        p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(v.clone())
        opt = PerHeadMuon([dict(params=[p], algorithm="muon"), dict(params=[q], algorithm="adamw")],
                          lr=0.01, max_grad_norm=clip)
        p.grad, q.grad = g_w * scale, g_v * scale
        opt.step()
        return p.detach(), q.detach(), p.grad
    clipped = run(1.0, 1.0)
    by_hand = run(None, 1.0 / (norm + 1e-6))
    assert torch.allclose(clipped[0], by_hand[0], atol=1e-6) and torch.allclose(clipped[1], by_hand[1], atol=1e-6)
    assert abs(clipped[2].norm() - g_w.norm() / norm) < 1e-4


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return K3Model(K3Config.preset("k3-tiny", moe_balance="none"))


def test_split_params_of_k3():
    model = tiny_model()
    muon, adamw = split_params(model)
    muon_names = {n for n, _, _ in muon}
    blocked = {n for n, _, b in muon if b}
    adamw_names = {n for n, _ in adamw}
    # KDA (layers 0-2) and MLA (layers 3-4) Q/K/V projections, split by head.
    assert {f"sublayers.{2 * i}.fn.{w}.weight" for i in range(3) for w in ("q_proj", "k_proj", "v_proj")} <= blocked
    assert {f"sublayers.{2 * i}.fn.{w}.weight" for i in (3, 4) for w in ("q_b_proj", "kv_b_proj")} <= blocked
    assert "sublayers.2.fn.o_proj.weight" in muon_names and "sublayers.3.fn.experts.w_gate" in muon_names
    for name in ("embed.weight", "head.weight", "residual.queries", "sublayers.3.fn.router.weight",
                 "sublayers.0.fn.b_proj.weight", "sublayers.0.fn.q_conv", "sublayers.0.fn.A_log", "norm.weight"):
        assert name in adamw_names, name
    assert not muon_names & adamw_names
    assert len(muon_names) + len(adamw_names) == len(list(model.parameters()))


class Small(torch.nn.Module):
    """Embedding -> KDA -> Gated MLA -> stacked experts -> head: every kind of state PerHeadMuon keeps."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(32, 16)
        self.kda = KDALayer(16, 2, 8, chunk_size=16)
        self.mla = GatedMLA(16, 2, 8, 12, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
        self.experts = GroupedExperts(2, 16, 8)
        self.head = torch.nn.Linear(16, 32, bias=False)

    def forward(self, idx):
        h = self.embed(idx)
        h = h + self.kda(h, use_cache=False)[0]
        h = h + self.mla(h)[0]
        h = h + self.experts(h.flatten(0, 1), torch.tensor([10, 24], dtype=torch.int32)).view_as(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), idx.flatten())


def _train_step(model, opt, seed):
    idx = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(seed))
    opt.zero_grad(set_to_none=True)
    model(idx).backward()
    opt.step()


# One process on purpose (no group): DCP says so on every save and load, whatever it is told.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_save_load_step_equals_uninterrupted(tmp_path):
    """Two steps, save with torch.distributed.checkpoint, load into a fresh model and a fresh optimizer
    (no lazy state yet), step: equal to the third step of the uninterrupted run, and to a run restored by
    the optimizer's own load_state_dict."""
    model = Small(seed=1)
    opt = per_head_muon(model, lr=0.01, max_grad_norm=1.0)
    assert {g["algorithm"] for g in opt.param_groups} == {"muon", "adamw"}
    assert any(g["row_blocks"] for g in opt.param_groups)
    for s in range(2):
        _train_step(model, opt, s)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path))
    ref = Small(seed=2)
    ref.load_state_dict(model.state_dict())
    ref_opt = per_head_muon(ref, lr=0.01, max_grad_norm=1.0)
    # A copy: load_state_dict keeps the very tensors it is given when dtype and device already match.
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train_step(model, opt, 2)

    fresh = Small(seed=9)
    fresh_opt = per_head_muon(fresh, lr=0.01, max_grad_norm=1.0)
    assert len(fresh_opt.state) == 0
    sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    set_model_state_dict(fresh, sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
    _train_step(fresh, fresh_opt, 2)
    _train_step(ref, ref_opt, 2)
    for (name, a), b, c in zip(model.named_parameters(), fresh.parameters(), ref.parameters()):
        assert torch.equal(a, b), f"dcp: {name}"
        assert torch.equal(a, c), f"load_state_dict: {name}"
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert opt.state[p].keys() == fresh_opt.state[q].keys()
        for k in opt.state[p]:
            assert torch.equal(opt.state[p][k], fresh_opt.state[q][k]), k


def test_bf16_grads_with_float32_momentum():
    p = torch.nn.Parameter(torch.randn(8, 12, dtype=torch.bfloat16))
    opt = PerHeadMuon([dict(params=[p], algorithm="muon")], lr=0.01)
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    # torch's load_state_dict casts floating state to the parameter's dtype: the momentum must stay float32.
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(opt.state[p]["momentum_buffer"], saved["state"][0]["momentum_buffer"])
    p.grad = torch.randn_like(p)
    opt.step()
    assert torch.isfinite(p.float()).all()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_bf16_parameters_save_load_step_equals_uninterrupted(tmp_path):
    """Restored float32 momentum met bf16 gradients and raised a dtype error. A bf16 model (Muon on the
    matrices with float32 momentum, AdamW on the rest) saved with torch.distributed.checkpoint after two steps
    and loaded into a fresh model and optimizer steps bit for bit as the uninterrupted run."""
    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 8)).to(torch.bfloat16)
        groups = [dict(params=[model[0].weight, model[1].weight], algorithm="muon"),
                  dict(params=[model[0].bias, model[1].bias], algorithm="adamw")]
        return model, PerHeadMuon(groups, lr=0.01, max_grad_norm=1.0)

    def step(model, opt, seed):
        x = torch.randn(5, 12, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()

    model, opt = build(1)
    for s in range(2):
        step(model, opt, s)
    assert opt.state[model[0].weight]["momentum_buffer"].dtype == torch.float32
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path))
    step(model, opt, 2)
    fresh, fresh_opt = build(2)
    sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    set_model_state_dict(fresh, sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
    assert fresh_opt.state[fresh[0].weight]["momentum_buffer"].dtype == torch.float32
    step(fresh, fresh_opt, 2)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        for k, want in opt.state[p].items():
            got = fresh_opt.state[q][k]
            assert got.dtype == want.dtype and torch.equal(got, want), k


def test_validation():
    p = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match="algorithm"):
        PerHeadMuon([dict(params=[p])])
    with pytest.raises(ValueError, match="row_blocks"):
        PerHeadMuon([dict(params=[p], algorithm="muon", row_blocks=[4, 4])])
    with pytest.raises(ValueError, match="2-D or 3-D"):
        PerHeadMuon([dict(params=[torch.nn.Parameter(torch.randn(4))], algorithm="muon")])
    with pytest.raises(ValueError, match="lr"):
        PerHeadMuon([dict(params=[p], algorithm="muon")], lr=-1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        PerHeadMuon([dict(params=[p], algorithm="muon")], max_grad_norm=0.0)


def _stepped(algorithm="muon", row_blocks=None, shape=(6, 4), lr=1e-2):
    """A one-parameter PerHeadMuon after one step on a fixed gradient."""
    p = torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))
    opt = PerHeadMuon([dict(params=[p], names=["w"], algorithm=algorithm, row_blocks=row_blocks)], lr=lr)
    p.grad = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    opt.step()
    return p, opt


@pytest.mark.parametrize("edit, match", [
    (lambda sd: sd["param_groups"][0].update(lr=float("nan")), "param group 0: lr must be a finite number"),
    (lambda sd: sd["param_groups"][0].update(algorithm="adamw"), "saved algorithm 'adamw' differs"),
    (lambda sd: sd["param_groups"][0].update(row_blocks=[2, 4]), r"saved row_blocks \[2, 4\] differs"),
    (lambda sd: sd["state"][0].update(momentum_buffer=torch.zeros(4, 6)),
     r"momentum_buffer must be a floating tensor of shape \[6, 4\], got torch.float32 \[4, 6\]"),
    (lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])), "must hold 1 param_groups"),
    (lambda sd: sd["param_groups"][0].pop("lr"), r"the saved group lacks \['lr'\]"),
    (lambda sd: sd["state"][0].update(momentum_buffer=torch.zeros(())), r"shape \[6, 4\], got torch.float32 \[\]"),
    (lambda sd: sd["param_groups"][0].update(foo=1), r"lacks \[\] and has \['foo'\]"),
    (lambda sd: sd["param_groups"][0].update(names=["other"]), r"saved names \['other'\] differs"),
    (lambda sd: sd["state"][0].update(momentum_buffer=torch.zeros(6, 4, dtype=torch.long)), "got torch.int64"),
    (lambda sd: sd["state"].update({0: torch.zeros(6, 4)}), "a muon parameter keeps \['momentum_buffer'\], got Tensor"),
    (lambda sd: sd["state"].update({0: dict(step=torch.tensor(1.0), exp_avg=torch.zeros(6, 4),
                                             exp_avg_sq=torch.zeros(6, 4))}),
     r"a muon parameter keeps \['momentum_buffer'\], got \['exp_avg', 'exp_avg_sq', 'step'\]"),
    (lambda sd: sd["state"].update({9999: dict(momentum_buffer=torch.zeros(6, 4))}), "parameter 9999: no parameter"),
], ids=["nan-lr", "algorithm", "row-blocks", "shape", "groups", "missing-key", "0-dim", "extra-key", "names",
        "int-momentum", "not-a-dict", "adamw-state", "unknown-id"])
def test_load_state_dict_checks_what_it_loads_and_changes_nothing_when_it_refuses(edit, match):
    """load_state_dict took a NaN lr (NaN weights after one step), switched an AdamW group to Muon, replaced the
    row blocks, and a momentum of another shape failed only at step() with a bare size mismatch."""
    p, opt = _stepped(row_blocks=[3, 3])
    sd = copy.deepcopy(opt.state_dict())
    edit(sd)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert torch.equal(after["state"][0]["momentum_buffer"], before["state"][0]["momentum_buffer"])
    # The unedited state dict (tuples saved as lists, as a checkpoint may hold them) still loads.
    sd = copy.deepcopy(before)
    sd["param_groups"][0]["ns_coefficients"] = list(sd["param_groups"][0]["ns_coefficients"])
    sd["param_groups"][0]["betas"] = list(sd["param_groups"][0]["betas"])
    opt.load_state_dict(sd)
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(2))
    opt.step()  # a list of coefficients was used as a dict key: "unhashable type: 'list'"
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("edit, match", [
    (lambda st: st.pop("exp_avg_sq"), r"keeps \['exp_avg', 'exp_avg_sq', 'step'\], got \['exp_avg', 'step'\]"),
    (lambda st: st.update(step=torch.zeros(3)), r"step must be a floating tensor of shape \[\], got torch.float32 \[3\]"),
    (lambda st: st.update(step=1), "step must be a floating tensor of shape \\[\\], got int"),
], ids=["missing-moment", "step-shape", "step-int"])
def test_load_state_dict_checks_adamw_state(edit, match):
    """Each of these loaded and replaced the state, then step() failed (KeyError, "cannot be converted to
    Scalar", "list of singleton tensors")."""
    p, opt = _stepped(algorithm="adamw")
    sd = copy.deepcopy(opt.state_dict())
    edit(sd["state"][0])
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    for name in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(after["state"][0][name], before["state"][0][name])


@pytest.mark.parametrize("param_dtype, want", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_momentum_is_restored_in_the_dtype_a_fresh_step_gives(param_dtype, want):
    """A float16 momentum saved for a float32 parameter stayed float16 after loading."""
    p, opt = _stepped()
    p.data = p.data.to(param_dtype)
    sd = copy.deepcopy(opt.state_dict())
    saved = sd["state"][0]["momentum_buffer"]
    sd["state"][0]["momentum_buffer"] = saved.to(torch.float16)
    opt.load_state_dict(sd)
    buf = opt.state[p]["momentum_buffer"]
    assert buf.dtype == want
    torch.testing.assert_close(buf, saved.to(torch.float16).to(want), rtol=0, atol=0)


def test_an_empty_expert_stack_is_skipped():
    """A Muon stack [0, 3, 4] raised "stack expects a non-empty TensorList" from inside step()."""
    empty = torch.nn.Parameter(torch.randn(0, 3, 4))
    full = torch.nn.Parameter(torch.randn(2, 3, 4))
    opt = PerHeadMuon([dict(params=[empty, full], algorithm="muon")], lr=1e-2)
    empty.grad, full.grad = torch.zeros(0, 3, 4), torch.randn(2, 3, 4)
    before = full.detach().clone()
    opt.step()
    assert empty.shape == (0, 3, 4) and not torch.equal(full, before) and torch.isfinite(full).all()


def test_per_head_muon_of_something_other_than_a_module_is_a_type_error():
    """A list of parameters failed with AttributeError inside split_params."""
    with pytest.raises(TypeError, match=r"per_head_muon: model must be an nn.Module .*got list"):
        per_head_muon([torch.nn.Parameter(torch.randn(6, 4))])


@pytest.mark.parametrize("override, match", [
    (dict(momentum=1.5), r"param group 0: momentum must be a finite number in \[0, 1\)"),
    (dict(lr=-1.0), r"param group 0: lr must be"), (dict(weight_decay=float("nan")), "param group 0: weight_decay"),
    (dict(betas=(0.9, 1.0)), "param group 0: betas"), (dict(ns_steps=True), "param group 0: ns_steps"),
    (dict(eps=0.0), r"param group 0: eps must be a finite number in \(0, inf\)"),
])
def test_a_param_groups_own_hyperparameters_are_checked_like_the_defaults(override, match):
    """Only the defaults were checked: a group's momentum of 1.5 (a lerp weight of -0.5, a diverging buffer) or
    negative lr went through to the step."""
    p = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match=match):
        PerHeadMuon([dict(params=[p], algorithm="muon", **override)])


@pytest.mark.parametrize("kwargs, match", [(dict(lr=None), "lr must be a finite number"),
                                           (dict(lr="0.1"), "lr must be a finite number"),
                                           (dict(momentum=True), "momentum must be"),
                                           (dict(max_grad_norm="1"), "max_grad_norm")])
def test_hyperparameters_of_the_wrong_type_are_named(kwargs, match):
    """lr=None or a string raised TypeError from a comparison, momentum=True passed as 1."""
    p = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match=match):
        PerHeadMuon([dict(params=[p], algorithm="muon")], **kwargs)


@pytest.mark.parametrize("group, match", [
    (dict(algorithm="muon", row_blocks=6), "row_blocks must be a list of positive ints"),
    (dict(algorithm="muon", row_blocks=[True] * 6), "row_blocks must be a list of positive ints"),
    (dict(algorithm="adamw", row_blocks=[3, 3]), "row_blocks is for Muon groups"),
    (dict(algorithm="muon", nesterov="no"), "nesterov must be a bool"),
], ids=["int", "bools", "adamw", "nesterov"])
def test_row_blocks_and_nesterov_of_the_wrong_kind_are_named(group, match):
    """row_blocks=6 failed with "'int' object is not iterable", [True] * 6 passed as six rows of one, an AdamW
    group's row_blocks were ignored, and nesterov="no" ran Nesterov momentum."""
    p = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match=match):
        PerHeadMuon([dict(params=[p], **group)])


@pytest.mark.parametrize("rows, ranks, heads", [(18, 2, [6, 6, 6]), (4, 3, [1, 3])], ids=["cut_heads", "empty_shard"])
def test_sharded_parameter_is_orthogonalised_as_the_full_matrix(rows, ranks, heads):
    """An (18, 10) weight sharded by rows over 2 gloo ranks (9 rows each: no shard holds whole heads of 6), and
    a (4, 10) one over 3 ranks (shards of 2, 2 and 0 rows: dion#83's empty shard, heads across shards), get the
    one-process update."""
    from k3lab.dist import launch
    from k3lab.optim import sharded_step_worker

    w = torch.randn(rows, 10, generator=torch.Generator().manual_seed(0))
    grads = _grads(w.shape, 2, seed=5)
    options = [None, heads]
    for rank_out in launch(sharded_step_worker, ranks, w, grads, options, timeout_s=120):
        for blocks, out in zip(options, rank_out):
            assert torch.allclose(out, per_head_steps(w, blocks, grads, lr=0.01, weight_decay=0.1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [(dict(ns_steps=100), "ns_steps must be an int in"),
                                           (dict(ns_steps=-1), "ns_steps must be an int in"),
                                           (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients must be")])
def test_newton_schulz_blocks_rejects_bad_settings_for_one_block_or_many(kwargs, match):
    from k3lab.optim import newton_schulz_blocks

    for n in (1, 3):
        with pytest.raises(ValueError, match=match):
            newton_schulz_blocks([torch.randn(4, 6) for _ in range(n)], **kwargs)


def test_newton_schulz_blocks_names_a_block_that_is_not_2d():
    """A 1-D block failed with torch's "Input tensor gradient must be a 2D matrix" alone and, among several
    blocks, with Python's "not enough values to unpack"."""
    from k3lab.optim import newton_schulz_blocks

    for blocks in ([torch.randn(6)], [torch.randn(4, 6), torch.randn(6)]):
        with pytest.raises(ValueError, match=rf"blocks\[{len(blocks) - 1}\] must be a 2-D \[A, B\] tensor, got \[6\]"):
            newton_schulz_blocks(blocks)


def test_grad_norm_and_clipping_over_two_meshes_and_a_stage_group():
    """Gradients as the trainer holds them on 4 gloo ranks, two pipeline stages of (dp, ep) = (1, 2): FSDP
    shards on the batch mesh, expert shards on the 2-D expert mesh, a replicated tensor; stage s holds
    (s + 1) times the same gradients. The norm is that of all stages' gathered gradients, and clipping
    scales each by max_norm / norm."""
    from k3lab.dist import launch
    from k3lab.optim import grad_norm_worker

    torch.manual_seed(7)
    grads = [torch.randn(8, 6), torch.randn(4, 6) * 3, torch.randn(5)]
    expected = torch.cat([g.flatten() for g in grads]).norm() * 5 ** 0.5  # stages scaled by 1 and 2
    for rank, out in enumerate(launch(grad_norm_worker, 4, grads, 1.0, timeout_s=120)):
        assert_close(f"norm on rank {rank}", expected, out["norm"], 1e-6)
        coef = (out["stage"] + 1) / (expected + 1e-6)
        for i, g in enumerate(grads):
            assert_close(f"clipped gradient {i} on rank {rank}", g * coef, out["grads"][i], 1e-6)


def test_clip_grads_rejects_a_bound_that_would_flip_gradients():
    from k3lab.optim import clip_grads_, grad_norm

    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3) * 5
    norm = grad_norm([p])
    assert_close("norm of one plain gradient", p.grad.norm(), norm, 1e-6)
    for bad in (-1.0, 0.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="max_norm must be a positive finite number"):
            clip_grads_([p], bad, norm)
    with pytest.raises(ValueError, match="norm must be grad_norm's 0-dim tensor"):
        clip_grads_([p], 1.0, torch.ones(2))
    before = p.grad.clone()
    clip_grads_([p], 1.0, norm)
    assert_close("clipped", before / (before.norm() + 1e-6), p.grad, 1e-6)
    assert grad_norm([torch.nn.Parameter(torch.ones(2))]) == 0  # no gradients: 0


def test_grad_norm_of_bf16_gradients_is_float32_accurate():
    """bf16 gradients: the norm is accumulated in float32 (torch's get_total_norm rounds it to bf16, about
    1e-3 off), and clipping scales the bf16 gradients by it."""
    from k3lab.optim import clip_grads_, grad_norm

    g = torch.Generator().manual_seed(3)
    params = []
    for shape in ((300, 200), (64,), (7, 9, 5)):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
        p.grad = (torch.randn(shape, generator=g) * 3).bfloat16()
        params.append(p)
    want = torch.cat([p.grad.double().flatten() for p in params]).norm()
    norm = grad_norm(params)
    assert norm.dtype == torch.float32 and norm.ndim == 0
    assert abs(norm.double() - want) / want < 1e-5, (norm.item(), want.item())
    before = [p.grad.double() for p in params]
    clip_grads_(params, 1.0, norm)
    for i, (b, p) in enumerate(zip(before, params)):
        assert p.grad.dtype == torch.bfloat16
        assert_close(f"clipped bf16 gradient {i}", b / (want + 1e-6), p.grad.double(), 1e-2)


def test_grad_norm_of_float64_gradients_is_float64_and_clips_a_float64_model():
    """float64 gradients (a float64 model, as the float64 references run) failed in torch's foreach norm, which
    refuses to narrow them to float32; their norm is taken in float64, so PerHeadMuon's clipping runs on them."""
    from k3lab.optim import grad_norm

    g = torch.Generator().manual_seed(4)
    params = []
    for shape in ((6, 4), (5,)):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
        p.grad = torch.randn(shape, generator=g, dtype=torch.float64) * 3
        params.append(p)
    want = torch.cat([p.grad.flatten() for p in params]).norm()
    norm = grad_norm(params)
    assert norm.dtype == torch.float64 and norm.ndim == 0
    assert abs(norm - want) / want < 1e-12
    # Mixed with float32 gradients: the sum is in float64.
    q = torch.nn.Parameter(torch.zeros(3))
    q.grad = torch.full((3,), 2.0)
    assert_close("mixed norm", (want ** 2 + 12).sqrt(), grad_norm(params + [q]), 1e-7)
    before = [p.grad.clone() for p in params]
    opt = PerHeadMuon([dict(params=[params[0]], algorithm="muon"), dict(params=[params[1]], algorithm="adamw")],
                      lr=0.01, max_grad_norm=1.0)
    opt.step()
    for b, p in zip(before, params):
        assert p.grad.dtype == torch.float64
        assert_close("clipped float64 gradient", b / (want + 1e-6), p.grad, 1e-12)


def test_grad_norm_and_clip_grads_take_one_tensor_or_a_generator_and_refuse_other_types():
    """One tensor is one parameter (as in torch's clip_grad_norm_), not an iterable of its rows (which have no
    gradients: a silent norm of 0 and no clipping); param-group dicts or numbers are a TypeError."""
    from k3lab.optim import clip_grads_, grad_norm

    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3) * 5
    want = p.grad.norm()
    assert_close("norm of one tensor", want, grad_norm(p), 1e-6)
    assert_close("norm of a generator", want, grad_norm(q for q in [p]), 1e-6)
    before = p.grad.clone()
    clip_grads_(p, 1.0, grad_norm(p))
    assert_close("one tensor clipped", before / (want + 1e-6), p.grad, 1e-6)
    for bad, match in (([{"params": [p]}], "got dict at position 0"), (5, "got int"), ([p, 2.0], "got float at position 1")):
        with pytest.raises(TypeError, match=match):
            grad_norm(bad)
        with pytest.raises(TypeError, match=match):
            clip_grads_(bad, 1.0, torch.tensor(1.0))


def test_clip_grads_with_a_norm_that_requires_grad_leaves_gradients_without_history():
    from k3lab.optim import clip_grads_

    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    before = p.grad.clone()
    norm = torch.tensor(10.0, requires_grad=True)
    clip_grads_([p], 1.0, norm * 1.0)
    assert not p.grad.requires_grad and p.grad.grad_fn is None
    assert_close("clipped by a norm with history", before / (10.0 + 1e-6), p.grad, 1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
def test_grad_norm_over_gradients_on_two_devices():
    from k3lab.optim import grad_norm

    params = []
    for device in ("cuda", "cpu"):
        p = torch.nn.Parameter(torch.randn(6, device=device))
        p.grad = torch.randn(6, device=device)
        params.append(p)
    want = torch.cat([p.grad.double().cpu() for p in params]).norm()
    norm = grad_norm(params)
    assert norm.device.type == "cuda"
    assert_close("norm over two devices", want, norm.cpu(), 1e-6)
