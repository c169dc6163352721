"""Argument checks of chapter 05's experiment helpers (the measurements themselves run in the book)."""
from __future__ import annotations

import pytest

import k3lab.lm as lm
from k3lab.moe import MoEConfig
from k3lab.moe.experiment import balance_floor, build_moe_lm


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
