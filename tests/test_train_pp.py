"""Pipeline parallelism: Block AttnRes stages chained over any cuts equal the formula (forward and gradients,
float64); a K3Model split into stages equals the whole model; gradient accumulation equals one big batch;
on gloo ranks pp=2, pp=2 x dp=2 and interleaved 1F1B reproduce one process (losses and first-step
gradients), a pp=2 checkpoint resumes at pp=1; layouts that do not compose are refused by name."""
from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch
import torch.nn as nn

from k3lab.attnres import BlockAttnRes, block_attnres_stage, carried_sources, naive_block_attnres
from k3lab.norm import RMSNorm
from k3lab.testing import assert_close


def _sublayers(L: int, d: int, seed: int) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(nn.Sequential(RMSNorm(d), nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
                         for _ in range(L)).double()


def _chain(h0, subs, queries, sizes, cuts):
    state = h0[None]
    for a, b in zip(cuts, cuts[1:]):
        state = block_attnres_stage(state, subs[a:b], queries, sizes, a, b)
    return state


# ---------------------------------------------------------------- Block AttnRes stages

def test_carried_sources_follow_the_block_boundaries():
    sizes = [4, 4, 2]
    got = [carried_sources(sizes, 10, c) for c in range(11)]
    assert got == [(1, False), (1, True), (1, True), (1, True), (2, False), (2, True), (2, True), (2, True),
                   (3, False), (3, True), (4, False)]
    with pytest.raises(ValueError, match="cut must be an int in \\[0, L=10\\]"):
        carried_sources(sizes, 10, 11)


@pytest.mark.parametrize("sizes, cuts", [
    ([4, 4, 2], [0, 4, 10]), ([4, 4, 2], [0, 3, 10]), ([4, 4, 2], [0, 1, 5, 6, 9, 10]), ([4, 4, 2], [0, 10]),
    ([1] * 5, [0, 2, 5]), ([3, 2, 2], list(range(8))),
], ids=["at-block", "inside-block", "five-stages", "one-stage", "full-attnres", "every-sublayer"])
def test_chained_stages_equal_the_formula_and_the_module(sizes, cuts):
    L, d = sum(sizes), 12
    subs = _sublayers(L, d, seed=len(cuts))
    g = torch.Generator().manual_seed(7)
    h0 = torch.randn(2, 5, d, generator=g, dtype=torch.float64)
    queries = torch.randn(L + 1, d, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 5, d, generator=g, dtype=torch.float64)
    results = {}
    for name in ("stages", "formula", "module"):
        x, w, fs = h0.clone().requires_grad_(), queries.clone().requires_grad_(), copy.deepcopy(subs)
        if name == "stages":
            out = _chain(x, fs, w, sizes, cuts)
        elif name == "formula":
            out = naive_block_attnres(x, fs, w, sizes)
        else:
            res = BlockAttnRes(d, L, sizes, path="memory").double()
            with torch.no_grad():
                res.queries.copy_(w)
            out, w = res(x, fs), res.queries
        (out * dout).sum().backward()
        results[name] = dict(out=out.detach(), dh0=x.grad, dqueries=w.grad,
                             **{f"d{n}": p.grad for n, p in fs.named_parameters()})
    worst = max(assert_close(f"{cuts} {key} vs {ref}", want, results["stages"][key], 1e-12)
                for ref in ("formula", "module") for key, want in results[ref].items())
    print(f"cuts {cuts}: max rel RMS error of output and gradients vs formula and module {worst:.1e} (float64)")


def test_a_stage_reads_only_its_query_rows():
    sizes, L, d = [4, 4, 2], 10, 8
    subs = _sublayers(L, d, seed=0)
    queries = torch.randn(L + 1, d, dtype=torch.float64, requires_grad=True)
    state = torch.randn(3, 1, 3, d, dtype=torch.float64)
    block_attnres_stage(state, subs[5:8], queries, sizes, 5, 8).sum().backward()
    touched = queries.grad.abs().sum(1) > 0
    assert touched.tolist() == [5 <= r < 8 for r in range(L + 1)]


def test_stage_errors_name_the_argument():
    sizes, d = [4, 4, 2], 8
    subs = _sublayers(10, d, seed=0)
    queries = torch.randn(11, d, dtype=torch.float64)
    h0 = torch.randn(1, 2, 3, d, dtype=torch.float64)
    with pytest.raises(ValueError, match="need 0 <= start < stop <= L=10, got start=3, stop=3"):
        block_attnres_stage(h0, [], queries, sizes, 3, 3)
    with pytest.raises(ValueError, match="expected stop - start = 2 sublayers, got 3"):
        block_attnres_stage(h0, subs[:3], queries, sizes, 0, 2)
    with pytest.raises(ValueError, match=r"state at sublayer 5 must be \[3, B, T, d\] \(2 completed source\(s\) "
                                         r"and a partial sum\), got \[1, 2, 3, 8\]"):
        block_attnres_stage(h0, subs[5:7], queries, sizes, 5, 7)
    with pytest.raises(ValueError, match=r"queries must be \[L \+ 1, d\]"):
        block_attnres_stage(h0, subs[:2], queries[0], sizes, 0, 2)
    bad = torch.randn(3, 2, 3, d, dtype=torch.float64)
    bad[2, 0, 0, 0] = float("nan")
    # The entry is named (here the cut block's partial sum), not "h0".
    with pytest.raises(ValueError, match=r"^state\[2\] \(the partial sum\) contains NaN or inf$"):
        block_attnres_stage(bad, subs[5:7], queries, sizes, 5, 7)
    with pytest.raises(ValueError, match=r"^state's width d = 4 differs from the queries' \[L \+ 1, d\] = \[11, 8\]"):
        block_attnres_stage(h0[..., :4], subs[:2], queries, sizes, 0, 2)
    with pytest.raises(ValueError, match="sublayer 5 must return a tensor of its input's shape"):
        block_attnres_stage(bad.nan_to_num(), [lambda h: h[:, :1]] * 2, queries, sizes, 5, 7)


# ---------------------------------------------------------------- a K3Model split into stages

def _tiny(dtype=torch.float64, **overrides):
    from k3lab.model import K3Config, K3Model

    torch.manual_seed(0)
    return K3Model(K3Config.preset("k3-tiny", **overrides)).to(dtype)


def _stage_grad_errors(whole, stages) -> list[float]:
    """The stages' gradients (queries summed over the stages first) against the whole model's, each bounded
    at 1e-10 relative (float64); their errors."""
    from k3lab.model import sum_queries_grad

    sum_queries_grad(stages)
    grads = dict(whole.named_parameters())
    return [assert_close(f"grad {n}", grads[n].grad, p.grad, 1e-10) for s in stages for n, p in s.named_parameters()]


@pytest.mark.parametrize("cuts", [[0, 5, 10], [0, 3, 10], [0, 1, 4, 7, 10], 2],
                         ids=["at-layer", "inside-block", "four-stages", "balanced"])
def test_split_stages_equal_the_whole_model(cuts):
    import torch.nn.functional as F

    from k3lab.model import split_model

    whole = _tiny()
    ref = copy.deepcopy(whole)
    stages = split_model(whole, cuts)
    # Parameter names are the whole model's, each on exactly one stage but the queries on all.
    names = [n for s in stages for n, _ in s.named_parameters() if n != "residual.queries"]
    assert sorted(names + ["residual.queries"]) == sorted(n for n, _ in ref.named_parameters())
    assert sorted({k for s in stages for k in s.state_dict()}) == sorted(ref.state_dict())
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 256, (2, 24), generator=g)
    tgt = torch.randint(0, 256, (2, 24), generator=g)
    logits_ref, loss_ref = ref(idx, tgt)
    loss_ref.backward()
    x = idx
    for s in stages:
        x = s(x)
    loss = F.cross_entropy(x.flatten(0, 1), tgt.flatten())
    loss.backward()
    errs = [assert_close("logits", logits_ref, x, 1e-10), *_stage_grad_errors(ref, stages)]
    print(f"cuts {[s.start for s in stages] + [stages[-1].stop]}: max rel RMS error of logits and gradients "
          f"{max(errs):.1e} (float64)")


def test_stages_given_the_targets_pass_them_on_and_return_the_loss_without_logits():
    """forward(x, targets): each stage but the last returns (state, targets); the last returns the mean
    cross-entropy from the head in chunks (its head module is never called, so no logits), equal to the whole
    model's loss and gradients in float64; targets of another shape are named."""
    from k3lab.model import split_model

    whole = _tiny()
    ref = copy.deepcopy(whole)
    stages = split_model(whole, [0, 3, 10])
    stages[-1].head.forward = lambda *a: pytest.fail("the head's logits were formed")
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(0, 256, (2, 24), generator=g)
    tgt = torch.randint(0, 256, (2, 24), generator=g)
    tgt[0, :5] = -100
    _, loss_ref = ref(idx, tgt)
    loss_ref.backward()
    state, passed = stages[0](idx, tgt)
    assert passed is tgt
    loss = stages[1](state, tgt)
    assert loss.ndim == 0
    loss.backward()
    errs = [assert_close("loss", loss_ref, loss, 1e-12), *_stage_grad_errors(ref, stages)]
    print(f"loss {float(loss.detach()):.6f}; max rel RMS error of the loss and gradients {max(errs):.1e} (float64)")
    bad = r"targets must be integer ids \[B, T\] = \[2, 24\] on cpu \(the stage's tokens\), got "
    for stage, x in ((stages[0], idx), (stages[1], state.detach())):  # named on the first stage already
        with pytest.raises(ValueError, match=bad + r"\[2, 23\] torch.int64 on cpu"):
            stage(x, tgt[:, 1:])
        with pytest.raises(ValueError, match=bad + r"\[2, 24\] torch.float64 on cpu"):
            stage(x, tgt.double())
        with pytest.raises(ValueError, match=bad + r"\[2, 24\] torch.int64 on meta"):
            stage(x, tgt.to("meta"))
    with pytest.raises(ValueError, match="targets"):
        stages[1](state.detach(), torch.full_like(tgt, 256))


def test_split_refuses_what_does_not_compose():
    from k3lab.model import balanced_cuts, split_model

    with pytest.raises(ValueError, match="tie_word_embeddings=True does not combine with pipeline stages"):
        split_model(_tiny(tie_word_embeddings=True), 2)
    with pytest.raises(ValueError, match="--mtp \\(num_nextn_predict_layers=1\\) does not combine"):
        split_model(_tiny(num_nextn_predict_layers=1), 2)
    with pytest.raises(ValueError, match="cuts must be increasing sublayer indices from 0 to 2L=10"):
        split_model(_tiny(), [0, 5, 5, 10])
    with pytest.raises(ValueError, match="n_stages must be an int in \\[1, 10\\]"):
        split_model(_tiny(), 11)
    for cuts in (True, 2.0):
        with pytest.raises(ValueError, match="cuts must be a stage count S \\(int\\) or the sublayer cuts"):
            split_model(_tiny(), cuts)
    # Two stages from one model would share its modules.
    with pytest.raises(ValueError, match="stages must be distinct indices in \\[0, 2\\), got \\[0, 0\\]"):
        split_model(_tiny(), 2, [0, 0])
    # The largest stage is as small as it can be: equal costs split evenly, the head's cost moves cuts up.
    assert balanced_cuts([1.0] * 8, 4) == [0, 2, 4, 6, 8]
    assert balanced_cuts([1.0] * 8, 2, last_extra=2.0) == [0, 5, 8]
    with pytest.raises(RuntimeError, match="sublayer 9 runs on another pipeline stage"):
        split_model(_tiny(), [0, 5, 10])[0].sublayers[9](torch.zeros(1))


# ---------------------------------------------------------------- the trainer

# k3-tiny on the corpus's vocabulary, 4 x 32 tokens a step (as tests/test_train.py): fast on 2 shared cores.
BASE = dict(preset="k3-tiny", steps=5, batch_size=4, seq_len=32, lr=3e-3, progress=False, seed=0)


def _curves(records):
    """Each step's loss and global gradient norm: the norm checks that the stages' shares add up once (the
    pseudo-queries, which every stage holds, counted once), which Muon's scale-free update hides from the
    losses."""
    return np.array([[r["loss"], r["grad_norm"]] for r in records])


@pytest.fixture(scope="module")
def reference(one_thread):
    """One process, one batch a step: BASE's losses over 5 steps and its first-step gradients."""
    from k3lab.train import TrainConfig, train
    from k3lab.train.workers import first_step_grads

    with one_thread():
        return _curves(train(TrainConfig(**BASE))), first_step_grads(TrainConfig(**BASE))


def _merged(per_rank: list[dict]) -> dict:
    # Each pipeline rank returns its own stages' parameters; the union is the whole model.
    return {k: v for grads in per_rank for k, v in grads.items()}


def _check_grads(label, want: dict, got: dict, tol=1e-4) -> float:
    assert got.keys() == want.keys(), f"{label}: {sorted(set(want) ^ set(got))}"
    worst = max(assert_close(f"{label} grad {name}", want[name], g, tol) for name, g in got.items())
    print(f"{label}: first-step gradients, max rel RMS error {worst:.1e} over {len(got)} parameters")
    return worst


def _check_curves(label, want, got, tol=1e-4) -> None:
    """Losses to ``tol``; the gradient norm of the first step (same weights on both sides) to 1e-5, later
    steps' to 2e-3: the norm of a gradient amplifies the layouts' rounding differences in the weights
    (about 5e-4 after 3 steps, against 1e-5 in the losses)."""
    rel = np.abs(got - want) / np.abs(want)
    print(f"{label}: max relative difference over {len(got)} steps: losses {rel[:, 0].max():.1e}, gradient norms "
          f"{rel[:, 1].max():.1e} (first step {rel[0, 1]:.1e})")
    assert rel[:, 0].max() < tol, f"{label}: losses {got[:, 0]} vs one process {want[:, 0]}"
    assert rel[0, 1] < 1e-5 and rel[:, 1].max() < 2e-3, f"{label}: gradient norms {got[:, 1]} vs one process {want[:, 1]}"


def test_gradient_accumulation_equals_one_big_batch(one_thread):
    from k3lab.train import TrainConfig
    from k3lab.train.workers import first_step_grads

    with one_thread():
        big, acc = [first_step_grads(TrainConfig(**BASE, microbatches=m)) for m in (1, 4)]
    _check_grads("--microbatches 4 vs one batch", big, acc, 1e-5)


def test_two_ranks_pipeline_matches_one_process_and_resumes_at_pp1(tmp_path, reference, one_thread):
    from k3lab.dist import launch
    from k3lab.train import TrainConfig, train
    from k3lab.train.workers import train_worker

    ref, ref_grads = reference
    pp = dict(BASE, pp=2, microbatches=2)
    runs = [dict(pp, ckpt_dir=str(tmp_path / "pp2"), ckpt_every=3), dict(pp, pp_schedule="interleaved-1f1b")]
    grads = [pp, dict(BASE, dp=2, microbatches=2)]
    out = launch(train_worker, 2, runs, grads, timeout_s=300)
    one_f, interleaved = (_curves(r) for r in out[0]["runs"])
    _check_curves("pp=2, 1f1b, 2 micro-batches", ref, one_f)
    _check_curves("pp=2, interleaved 1f1b (4 stages)", ref, interleaved)
    np.testing.assert_allclose(interleaved[:, 0], one_f[:, 0], rtol=1e-5)  # losses
    np.testing.assert_allclose(interleaved[:, 1], one_f[:, 1], rtol=1e-4)  # gradient norms
    # Rank 0 (stage 0) logs every MoE layer's balance, the last stage's included.
    assert all(len(r["maxvio"]) == 4 for r in out[0]["runs"][0])
    _check_grads("pp=2 x 2 micro-batches", ref_grads, _merged([o["grads"][0] for o in out]))
    _check_grads("dp=2 x 2 micro-batches (FSDP reduces once)", ref_grads, out[0]["grads"][1])

    # The pp=2 checkpoint of step 3 (model, optimizer state, loader) resumed by one process: steps 4 and 5
    # give the pipeline run's losses.
    relaid = tmp_path / "pp1"
    relaid.mkdir()
    shutil.copytree(tmp_path / "pp2" / "step_00000003", relaid / "step_00000003")
    with one_thread():
        resumed = _curves(train(TrainConfig(**BASE, ckpt_dir=str(relaid), resume=True)))
    _check_curves("pp=2 checkpoint resumed at pp=1", one_f[3:], resumed)


def test_four_ranks_pipeline_composes_with_dp_ep_cp(reference):
    # pp=2 x dp=2: FSDP shards each stage over its dp pair, the schedule reduces once after the last
    # micro-batch. pp=2 x ep=2 and pp=2 x cp=2 (first-step gradients): MoonEP and KCP inside the stages.
    from k3lab.dist import launch
    from k3lab.train.workers import train_worker

    ref, ref_grads = reference
    pp = dict(BASE, pp=2, microbatches=2)
    layouts = {"dp=2": dict(pp, dp=2), "ep=2": dict(pp, ep=2), "cp=2": dict(pp, cp=2)}
    out = launch(train_worker, 4, [layouts["dp=2"]], list(layouts.values()), timeout_s=600)
    _check_curves("pp=2 x dp=2, 2 micro-batches", ref, _curves(out[0]["runs"][0]))
    for i, name in enumerate(layouts):
        _check_grads(f"pp=2 x {name}, 2 micro-batches", ref_grads, _merged([o["grads"][i] for o in out]))


@pytest.mark.parametrize("argv, message", [
    (["--pp", "2", "--microbatches", "2", "--doc-mask"], "--doc-mask does not combine with --pp > 1"),
    (["--pp", "2", "--microbatches", "2", "--mtp", "1"], "--mtp does not combine with --pp > 1"),
    (["--pp-schedule", "zb"], "invalid choice"),
    (["--microbatches", "0"], "--microbatches must be an int >= 1"),
    (["--pp", "2", "--microbatches", "2"], "--pp 2 x --dp 1 x --cp 1 x --ep 1 = 2 ranks, but 1 were launched"),
    (["--microbatches", "3"], "--microbatches 3 must divide the 4 sequences of a data row"),
    (["--pp", "2", "--microbatches", "1"], "--microbatches must be >= --pp 2 for --pp-schedule 1f1b"),
    (["--pp", "2", "--pp-schedule", "gpipe"], "--pp 2 x --dp 1 x --cp 1 x --ep 1 = 2 ranks"),
    # --microbatches defaults to --pp: the layout check is the first to refuse.
    (["--pp", "2"], "--pp 2 x --dp 1 x --cp 1 x --ep 1 = 2 ranks"),
], ids=["doc-mask", "mtp", "schedule", "microbatches", "world", "divide", "in-flight", "gpipe-any-count",
        "default-microbatches"])
def test_layouts_that_do_not_compose_are_usage_errors(argv, message, capsys):
    from k3lab.train import main

    argv = ["--batch-size", "4", "--seq-len", "16", "--no-progress", *argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
