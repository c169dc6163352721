"""``python -m k3lab.bench.train --small --device cpu``: the end-to-end benchmark runs on a CPU in seconds
(k3-tiny on the corpus shards), its correctness checks run, and its JSON carries the fields of the GPU result."""
import json
import math
import shutil

import pytest
import torch

from k3lab.bench.train import BF16_LOSS_BOUND, attnres_overhead, main, summarise
from k3lab.train import TrainConfig
from k3lab.train.metrics import FLOPS_CONVENTION

FIELDS = ("device", "commit", "date", "versions", "preset", "flops_convention", "mfu", "tokens_per_s", "peer",
          "peer_tokens_per_s", "peer_config", "attnres_overhead", "peak_GiB", "minutes", "loss_curve", "checks",
          "compile")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, one_thread):
    """(returned dict, written JSON) of one small CPU run."""
    out = tmp_path_factory.mktemp("bench_train") / "train.json"
    # A k3-tiny step near 0.1 s.
    with one_thread():
        result = main(["--small", "--device", "cpu", "--out", str(out)])
    return result, json.loads(out.read_text())


def test_small_run_writes_the_result_fields(small_run):
    result, written = small_run
    assert set(FIELDS) <= set(written)
    assert written == json.loads(json.dumps(result))
    assert written["preset"] == "k3-tiny" and written["flops_convention"] == FLOPS_CONVENTION
    assert written["device"] == "cpu" and written["mfu"] is None  # no GPU peak to divide by
    assert written["compile"] is False and "compile" not in written["checks"]  # --compile is opt-in
    assert [s for s, _ in written["loss_curve"]] == list(range(1, written["steps"] + 1))
    assert all(math.isfinite(loss) and 0 < loss < 20 for _, loss in written["loss_curve"])
    assert written["tokens_per_s"] > 0 and written["peak_GiB"] > 0 and written["minutes"] > 0
    assert written["params"]["total"] > written["params"]["active"] > 0


def test_small_run_checks_ran(small_run):
    checks = small_run[1]["checks"]
    bf16 = checks["bf16"]
    assert bf16["ok"] and 0 <= bf16["loss_rel_err"] <= BF16_LOSS_BOUND
    assert bf16["loss_fp32"] != bf16["loss_bf16"]  # bf16 autocast really ran
    assert math.isfinite(bf16["logits_rel_rms_err"]) and bf16["logits_rel_rms_err"] > 0
    # With the float32 routing replayed the logits differ by bf16 arithmetic only, and that is bounded.
    assert 0 < bf16["logits_rel_rms_err_same_routing"] <= bf16["logits_bound_same_routing"] < 1
    sync = checks["sync_debug"]
    assert sync == {"ok": True, "enforced": False, "steps": 2, "error": None, "where": []}


def test_small_run_times_both_residuals(small_run):
    a = small_run[1]["attnres"]
    assert a["attnres_ms"] > 0 and a["standard_ms"] > 0
    assert small_run[1]["attnres_overhead"] == pytest.approx(a["attnres_ms"] / a["standard_ms"] - 1)
    assert a["step_tokens_per_s"] == pytest.approx(a["tokens"] / a["attnres_ms"] * 1e3)
    assert "eager_ms" not in a and "compile_speedup" not in a  # only a compiled model has an eager twin


def test_compiled_overhead_run_also_times_the_same_model_eager(monkeypatch, one_thread):
    stances = []
    real = torch.compiler.set_stance

    def spy(stance, *args, **kwargs):
        stances.append(stance)
        return real(stance, *args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    config = TrainConfig(preset="k3-tiny", batch_size=2, seq_len=32, compile=True, progress=False)
    with one_thread():
        a = attnres_overhead(config, torch.device("cpu"), steps=2, warmup=1)
    assert stances == ["force_eager"] * 3  # one eager step per round, warm-up included
    assert a["attnres_ms"] > 0 and a["standard_ms"] > 0 and a["eager_ms"] > 0
    assert a["compile_speedup"] == pytest.approx(a["eager_ms"] / a["attnres_ms"])


def test_small_run_peer_is_counted_when_torchtitan_is_installed(small_run):
    r = small_run[1]
    assert r["peer_tokens_per_s"] is None and r["vs_peer"] is None  # FlexAttention has no CPU backward
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        assert r["peer"] is None and r["peer_config"] is None
        return
    n = r["peer_params"]
    assert n["target_active"] == r["params"]["active"]
    assert abs(n["active"] - n["target_active"]) <= 0.05 * n["target_active"]
    assert r["peer_config"]["dim"] == 64 and r["peer_config"]["n_layers"] == 5


def test_tokens_per_s_is_the_median_of_the_windows_after_the_first():
    config = TrainConfig(preset="k3-tiny", steps=7, log_every=2)
    rates = {1: 10.0, 2: 10.0, 3: 20.0, 4: 20.0, 5: 40.0, 6: 40.0, 7: 30.0}
    records = [dict(step=s, loss=5.0, tokens_per_s=r, peak_mem_GiB=1.0, peak_mem_kind="cpu_peak_rss")
               for s, r in rates.items()]
    s = summarise(records, config, torch.device("cpu"))
    assert s["tokens_per_s_windows"] == [10.0, 20.0, 40.0, 30.0]
    assert s["tokens_per_s"] == 30.0  # the median of 20, 40 and 30
    assert s["steady"] and s["mfu"] is None
    # A run in two parts, the second resumed at step 5: its first window (steps 5-6, recompiling) is out too.
    parts = [records[:4], records[4:]]
    s = summarise(records, config, torch.device("cpu"), parts)
    assert s["tokens_per_s"] == 25.0 and s["steady"]  # the median of 20 and 30
    # Every part within its first window: nothing steady, the median of all windows.
    s = summarise(records[:2], config, torch.device("cpu"), [records[:2]])
    assert s["tokens_per_s"] == 10.0 and not s["steady"]


@pytest.mark.parametrize("argv, message", [
    (["--minutes", "0"], "--minutes: expected a positive number, got 0.0"),
    (["--minutes", "nan"], "--minutes: expected a positive number, got nan"),
    (["--batch-size", "0"], "--batch-size: expected a positive int, got 0"),
    (["--device", "mps"], "--device: invalid choice"),
    (["--microbatches", "0"], "--microbatches: expected a positive int, got 0"),
    (["--small", "--device", "cpu", "--seq-len", "1"], "--seq-len must be an int >= 2, got 1"),
])
def test_bad_flags_stop_at_parsing(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cpu_without_small_is_refused():
    with pytest.raises(SystemExit, match="--device cpu needs --small"):
        main(["--device", "cpu"])


def test_micro_batches_make_the_global_batch_and_leave_the_bare_step_at_one(one_thread, capsys):
    """--microbatches M: each optimizer step runs M micro-batches of --batch-size sequences (the peer's too);
    the AttnRes overhead's bare step stays at one micro-batch, so it is not set beside the peer's step."""
    with one_thread():
        r = main(["--small", "--device", "cpu", "--out", "", "--microbatches", "2", "--no-torchtitan"])
    assert r["microbatches"] == 2 and r["batch_size"] == 4
    assert r["tokens_per_step"] == 2 * 4 * 32 and r["attnres"]["tokens"] == 4 * 32
    assert r["vs_peer_bare_step"] is None
    assert "B x T = 4 x 32, 2 micro-batches a step" in capsys.readouterr().out


def test_a_run_in_parts_continues_one_loss_curve(small_run, tmp_path, one_thread, capsys):
    """--run-dir with --stop-after-minutes: each invocation stops after a window with a checkpoint and writes
    no JSON; repeating the command continues the run, and the invocation that finishes it writes the whole
    run's curve (the uninterrupted run's losses), its parts and their stepping minutes."""
    out, run = tmp_path / "train.json", tmp_path / "run"
    argv = ["--small", "--device", "cpu", "--out", str(out), "--no-torchtitan", "--run-dir", str(run),
            "--stop-after-minutes", "1e-6"]
    stops = []
    with one_thread():
        for _ in range(5):
            r = main(argv)
            if "stopped_at" not in r:
                break
            assert not out.exists()
            stops.append(r["stopped_at"])
    assert stops == [2, 4]  # every --log-every (2) window is past a budget of 1e-6 minutes
    written = json.loads(out.read_text())
    assert written["parts"] == 3 and written["steps"] == 6
    assert [s for s, _ in written["loss_curve"]] == [s for s, _ in small_run[1]["loss_curve"]]
    for (_, a), (_, b) in zip(written["loss_curve"], small_run[1]["loss_curve"]):
        assert a == pytest.approx(b, rel=1e-6)
    assert 0 < written["minutes"] and "in 3 parts" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="steps default there, 7 now"):
        main([*argv, "--steps", "7"])
    # The same command once more, the run finished: it says so, measures the rest again, keeps the curve.
    with one_thread():
        again = main(argv)
    assert "had already reached step 6: measuring the AttnRes overhead" in capsys.readouterr().out
    assert again["parts"] == 3 and again["loss_curve"] == written["loss_curve"]


def test_stop_after_minutes_needs_a_run_dir(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--small", "--device", "cpu", "--stop-after-minutes", "1"])
    assert exc.value.code == 2 and "--stop-after-minutes needs --run-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--small", "--device", "cpu", "--run-dir", "", "--stop-after-minutes", "1"])
    assert exc.value.code == 2 and "--run-dir must name a folder, got ''" in capsys.readouterr().err


def test_stop_after_minutes_counts_from_the_command_start(tmp_path, monkeypatch, one_thread):
    """The budget is a job's time limit: the trainer is handed what the checks and warm-up left of it (they
    take seconds here, so less than the 2 minutes given and no less than 2 minutes minus the time it took)."""
    import time

    import k3lab.bench.train as bench

    seen, real_train = [], bench.train

    def fake_train(config):
        if config.stop_after_minutes is None:  # the checks' and warm-up's runs
            return real_train(config)
        seen.append((config.stop_after_minutes, time.monotonic()))
        raise KeyboardInterrupt  # the benchmark stops here

    monkeypatch.setattr(bench, "train", fake_train)
    start = time.monotonic()
    with one_thread(), pytest.raises(KeyboardInterrupt):
        main(["--small", "--device", "cpu", "--out", "", "--no-torchtitan", "--run-dir", str(tmp_path / "run"),
              "--stop-after-minutes", "2"])
    (budget, handed), = seen
    assert 2 - (handed - start) / 60 <= budget < 2 - 0.5 / 60  # the checks and warm-up took over half a second


def test_a_run_dir_that_cannot_hold_the_run_stops_before_the_checks(tmp_path, monkeypatch, capsys):
    """A --run-dir that is a file (or lies under one) is refused at parsing, not after the checks and warm-up."""
    import k3lab.bench.train as bench

    monkeypatch.setattr(bench, "check_bf16", lambda *a: pytest.fail("the checks ran"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for run_dir in (blocker, blocker / "run"):
        with pytest.raises(SystemExit) as exc:
            main(["--small", "--device", "cpu", "--out", "", "--run-dir", str(run_dir), "--stop-after-minutes", "1"])
        assert exc.value.code == 2 and f"--run-dir {run_dir} cannot hold the run" in capsys.readouterr().err


def _first_part(tmp_path, one_thread):
    run = tmp_path / "run"
    argv = ["--small", "--device", "cpu", "--out", str(tmp_path / "train.json"), "--no-torchtitan",
            "--run-dir", str(run), "--stop-after-minutes", "1e-6"]
    with one_thread():
        assert main(argv)["stopped_at"] == 2
    return argv, run


def test_a_hand_edited_plan_stops_with_the_reason(tmp_path, one_thread):
    """A plan whose fields were removed or changed, or a checkpoint it does not describe, stops the next part with
    a message naming --run-dir (no traceback from the trainer)."""
    argv, run = _first_part(tmp_path, one_thread)
    plan_path = run / "bench_plan.json"
    saved = json.loads(plan_path.read_text())
    edits = [("steps", None, "bench_plan.json is unreadable (KeyError: 'steps')"),
             ("steps", "six", "bench_plan.json is unreadable (ValueError: steps 'six')"),
             ("batch_size", None, "bench_plan.json is unreadable (ValueError: batch_size None)"),
             ("step_s", None, "bench_plan.json is unreadable (ValueError: step_s None)"),
             ("checks", None, "bench_plan.json is unreadable (KeyError: 'checks')"),
             ("steps", 5, "--steps 5 (saved: 6) differ")]
    for key, value, message in edits:
        plan = dict(saved)
        if value is None and key in ("steps", "checks"):
            del plan[key]
        else:
            plan[key] = value
        plan_path.write_text(json.dumps(plan))
        with pytest.raises(SystemExit, match=f"--run-dir {run}") as exc:
            main(argv)
        assert message in str(exc.value.code)


def test_minutes_count_a_step_replayed_after_a_kill_once(tmp_path, one_thread):
    """A part killed before its checkpoint (here: the checkpoint removed) is replayed by the next part from the
    checkpoint before; the run's minutes are its steps' stepping time, each step once."""
    argv, run = _first_part(tmp_path, one_thread)
    with one_thread():
        assert main(argv)["stopped_at"] == 4
        shutil.rmtree(run / "step_00000004")
        for _ in range(3):
            r = main(argv)
            if "stopped_at" not in r:
                break
    steps = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "step":
            steps[rec["step"]] = rec["step_s"]
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert r["minutes"] == pytest.approx(sum(steps.values()) / 60, rel=1e-9)
