"""k3lab.bench.moe_balance: the settling rule, a small run's JSON, and bad flags refused before training."""
import json
import math

import pytest

from k3lab.bench.moe_balance import METHODS, main, settled_at, verdict


@pytest.mark.parametrize("worst, expected", [
    ([0.3, 0.04, 0.05, 0.01], 1),
    ([0.3, 0.04, 0.06, 0.01], 3),     # one step above the target resets the count
    ([0.01, 0.02, 0.2], None),        # above it at the end: never settled
    ([0.0], 0),
    ([0.01, float("nan"), 0.01], 2),  # a NaN step is not a settled one
    ([0.01, float("nan")], None),
    ([], None),
])
def test_settled_at_is_the_first_step_of_the_final_run_below_target(worst, expected):
    assert settled_at(worst) == expected


@pytest.mark.parametrize("settled, steps, expected", [
    (5, 120, True), (19, 21, True), (20, 120, False), (None, 120, False),
    (5, 20, None),  # a 10- or 20-step run settled at step 5 said "met": nothing after step 20 was run
    (None, 10, None),
])
def test_verdict_needs_a_run_past_step_20(settled, steps, expected):
    assert verdict(settled, steps) is expected


def test_small_run_writes_every_method(tmp_path):
    out = tmp_path / "b.json"
    result = main(["--small", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert list(saved["runs"]) == list(METHODS) and saved["met"] is None
    assert saved["tokens_per_step"] == 8 * 32 and saved["pairs_per_expert"] == 8 * 32 * 4 // 8
    for r in saved["runs"].values():
        assert len(r["maxvio"]) == 3 and all(len(layer) == 2 for layer in r["maxvio"])
        assert r["worst_maxvio"] == [max(step) for step in r["maxvio"]]
        assert all(math.isfinite(v) and v >= 0 for v in r["worst_maxvio"])
    assert result["runs"]["qb"]["settled_at"] == saved["runs"]["qb"]["settled_at"]
    floor = saved["sampling_floor"]
    assert len(floor["next_batch"]) == 2 and max(floor["same_batch"]) < 0.1
    assert all(n >= s for n, s in zip(floor["next_batch"], floor["same_batch"]))
    sweep = saved["qb_lr_sweep"]
    assert list(sweep) == ["0.0003", "0.0001"] and [r["lr"] for r in sweep.values()] == [3e-4, 1e-4]
    assert all(len(r["worst_maxvio"]) == 3 and r["met"] is None for r in sweep.values())


def test_a_run_cut_off_keeps_the_runs_it_finished(tmp_path, monkeypatch):
    """A job killed at its time limit lost every finished run: the JSON was written only at the end."""
    import k3lab.bench.moe_balance as bench

    real, calls = bench.train_moe_lm, []

    def cut_off_at_the_third_run(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the correctness check, then "none", then "qb"; the fourth is killed
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "train_moe_lm", cut_off_at_the_third_run)
    out = tmp_path / "b.json"
    with pytest.raises(KeyboardInterrupt):
        main(["--small", "--methods", "none", "qb", "sign", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert list(saved["runs"]) == ["none", "qb"] and "sampling_floor" in saved
    assert saved["complete"] is False and saved["met"] is None
    main(["--small", "--methods", "none", "qb", "--out", str(out)])
    assert json.loads(out.read_text())["complete"] is True


def test_the_lr_sweep_trains_qb_at_its_learning_rate(capsys):
    """A sweep run at lr x is the main QB run at --lr x (same initialisation and batches); the main --lr is not
    trained twice."""
    swept = main(["--small", "--out", "", "--methods", "qb", "--qb-lrs", "1e-3", "2e-3"])
    alone = main(["--small", "--out", "", "--methods", "qb", "--lr", "2e-3", "--qb-lrs"])
    assert list(swept["qb_lr_sweep"]) == ["0.002"] and alone["qb_lr_sweep"] == {}
    assert swept["qb_lr_sweep"]["0.002"]["worst_maxvio"] == alone["runs"]["qb"]["worst_maxvio"]
    assert swept["qb_lr_sweep"]["0.002"]["worst_maxvio"] != swept["runs"]["qb"]["worst_maxvio"]
    assert "qb (lr 0.002)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["--microbatches", "3"], "--microbatches: must divide --batch-size 8"),
    (["--top-k", "9"], "--top-k: below --n-experts 8"),
    (["--top-k", "8"], "--top-k: below --n-experts 8"),  # raised ValueError from MoEConfig before
    (["--methods", "qb", "none", "qb"], "--methods: each method once"),
    (["--d-model", "24"], "--d-model: a multiple of 16"),
    (["--methods", "bogus"], "--methods: invalid choice"),
    (["--device", "gpu0"], "--device: expected cpu, cuda or cuda:N"),
])
def test_bad_flags_stop_before_training(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--small", "--out", "", *argv])
    assert e.value.code == 2 and match in capsys.readouterr().err
