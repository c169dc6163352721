"""Argument checks of chapter 05's experiment helpers (the measurements themselves run in the book)."""
from __future__ import annotations

import pytest

import k3lab.lm as lm
from k3lab.moe import MoEConfig
from k3lab.moe.experiment import balance_floor, build_moe_lm, train_moe_lm


def _tiny_moe_lm() -> lm.LM:
    lm_cfg = lm.LMConfig.tiny(vocab_size=64, mixer="attention", d_model=16, n_layers=1, max_seq_len=8)
    return build_moe_lm(lm_cfg, MoEConfig(n_experts=4, top_k=1, d_model=16, expert_hidden=8, balance="qb"))


@pytest.mark.parametrize("bad, match", [
    (dict(split="test"), r"split must be one of \('train', 'val'\), got 'test'"),
    (dict(split=None), r"split must be one of .*got None"),
    (dict(batches=1), r"batches must be an int >= 2 .*got 1"),
    (dict(batches=0), r"batches must be an int >= 2 .*got 0"),
    (dict(batches=True), r"batches must be an int >= 2 .*got True"),
], ids=["split_test", "split_none", "batches_1", "batches_0", "batches_bool"])
def test_balance_floor_refuses_bad_arguments_and_leaves_the_model_in_training_mode(bad, match):
    """A bad split left the model in eval mode (the split was checked after model.eval()); batches < 2 has
    no pair t, t+1 and returned zeros, read as a perfectly balanced floor."""
    model = _tiny_moe_lm().train()
    kwargs = dict(batches=2, batch_size=2, seq_len=8, device="cpu") | bad
    with pytest.raises(ValueError, match=match):
        balance_floor(model, **kwargs)
    assert model.training


def test_the_bias_update_reads_every_micro_batch_of_a_step():
    """With micro-batches the MoE layer counts each pass's tokens and the update after the optimizer step
    reads them all: every step's load sums to B * T * top_k, as with one batch of B, and the first step
    (bias 0, same tokens) routes alike."""
    from k3lab.data import vocab_size

    lm_cfg = lm.LMConfig.tiny(vocab_size=vocab_size(), mixer="attention", d_model=16, n_layers=1, max_seq_len=16)
    moe_cfg = MoEConfig(n_experts=8, top_k=2, expert_hidden=8, balance="qb")
    loads = {}
    for m in (1, 4):
        model = build_moe_lm(lm_cfg, moe_cfg, seed=0)
        loads[m] = train_moe_lm(model, 3, 8, 16, 1e-3, "cpu", log_every=3, progress=False, microbatches=m)["loads"]
    assert loads[4].shape == loads[1].shape == (3, 1, 8)
    assert (loads[4].sum(-1) == 8 * 16 * 2).all()
    assert (loads[4][0] - loads[1][0]).abs().sum() <= 4, (loads[4][0], loads[1][0])
