"""The benchmarks' command lines refuse bad numbers before any work: --reps 0 ran the KCP check for a
minute, then died in statistics.median; --ranks 0 raised IndexError; a malformed flash_kda --cases was
parsed only after the correctness check."""
import importlib

import pytest

from k3lab.bench import shape_bth


@pytest.mark.parametrize("module, argv, match", [
    ("kcp", ["--reps", "0"], "--reps: expected a positive int, got 0"),
    ("kcp", ["--ranks", "0"], "--ranks: expected a positive int, got 0"),
    ("kcp", ["--T", "128", "-5"], "--T: expected a positive int, got -5"),
    ("flash_kda", ["--cases", "4x8192"], "--cases: expected BxTxH"),
    ("flash_kda", ["--cases", "4x0x16"], "--cases: expected BxTxH"),
    ("flash_kda", ["--rep", "ten"], "--rep: expected a positive int, got 'ten'"),
    ("attnres", ["--steps", "0"], "--steps: expected a positive int"),
    ("agentenv", ["--n", "0"], "--n: expected a positive int"),
    ("agentenv", ["--paused", "0"], "--paused: expected a positive int"),
    ("kcp", ["--budget-s", "nan"], "--budget-s: expected a positive"),
    ("moe", ["--rep", "0"], "--rep: expected a positive int, got 0"),
    ("moe", ["--cases", "k3"], "--cases: invalid choice"),
    ("moe_quality", ["--steps", "0"], "--steps: expected a positive int, got 0"),
    ("moe_quality", ["--top-k", "3"], "top_k must be even (the full-width model uses half of it), got 3"),
    ("moe_quality", ["--seeds", "-1"], "--seeds: expected"),
])
def test_bad_numbers_stop_at_parsing(module, argv, match, capsys):
    main = importlib.import_module(f"k3lab.bench.{module}").main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_shape_bth():
    assert shape_bth("4x8192x16") == (4, 8192, 16)


@pytest.mark.parametrize("argv, match", [
    (["--check-only", "--skip-check"], "not allowed with argument"),
    (["--fla-from", "x.json"], "--fla-from needs --no-fla"),
    (["--cases"], "--cases: expected at least one argument"),
    (["--K", "257"], "--K: flash_kda supports K <= 256, got 257"),
])
def test_flash_kda_bench_refuses_contradictions(argv, match, capsys):
    """These ran: --check-only --skip-check timed every case and rewrote the committed JSON; --fla-from
    without --no-fla was ignored; an empty --cases timed nothing; K = 257 failed after the check."""
    from k3lab.bench.flash_kda import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_flash_kda_bench_head_dim_limit_is_the_kernels():
    import k3lab

    k3lab.setup(verbose=False)
    from k3lab.bench.flash_kda import MAX_K as bench_max_k
    from k3lab.kernels.kda.fused import MAX_K

    assert bench_max_k == MAX_K


def test_attnres_bench_lm_steps_is_checked_at_parsing(capsys):
    """--lm-steps -5 ran the whole benchmark, then failed in its last section, losing the results."""
    from k3lab.bench.attnres import main

    with pytest.raises(SystemExit) as exc:
        main(["--lm-steps", "-5"])
    assert exc.value.code == 2
    assert "--lm-steps: expected an int >= 0, got -5" in capsys.readouterr().err


def test_attnres_table_prices_bytes_at_the_runs_shape():
    """The table priced the bytes model at 8192 tokens x d 2048 whatever --batch/--seq the run had."""
    from k3lab.attnres.traffic import bytes_model, step_ms
    from k3lab.bench.attnres import table

    model = bytes_model()
    floor = sum(model["floor"].values())
    base = dict(hardware="test", date="today", bytes_model=model, bandwidth=dict(shape=[1, 1], copy_TBps=4.0,
                                                                                  add_TBps=4.0))
    for shape in (dict(tokens=2048, d=2048), dict(tokens=8192, d=7168)):
        text = table(dict(base, bytes_priced_at=shape))
        assert f"for {shape['tokens']} x {shape['d']} over" in text
        assert f"copy bandwidth (4.00 TB/s): {step_ms(floor, 48, tbps=4.0, **shape):.2f} ms" in text
    assert "for 8192 x 2048 over" in table(base)  # JSONs written before the shape was recorded


def test_attnres_width_smoke_times_both_residuals(tmp_path):
    from k3lab.bench.attnres_width import main

    out = tmp_path / "width.json"
    result = main(["--smoke", "--out", str(out)])
    (row,) = result["rows"]
    assert row["d"] == 64 and row["variant"] == "block_N4"
    assert row["step_ms"] > 0 and row["standard_ms"] > 0
    assert abs(row["overhead"] - (row["step_ms"] / row["standard_ms"] - 1)) < 1e-12
    assert not out.exists()  # a smoke run writes no results


def test_attnres_width_rejects_a_bad_width(capsys):
    from k3lab.bench.attnres_width import main

    with pytest.raises(SystemExit) as exc:
        main(["--widths", "2048", "0"])
    assert exc.value.code == 2
    assert "--widths: expected a positive int, got 0" in capsys.readouterr().err


def test_bench_moe_smoke_on_cpu(capsys):
    """The MoE benchmark's script end to end at tiny sizes: checks, every timed layer, the table."""
    from k3lab.bench.moe import main

    result = main(["--small", "--device", "cpu", "--no-torchtitan", "--rep", "1"])
    (case,) = result["cases"]
    assert case["latent_tokens_per_s"] > 0 and case["full_tokens_per_s"] > 0 and case["gemm_ms"] > 0
    assert case["flops_ratio_full_over_latent"] > 1
    assert all(v <= 3e-2 for k, v in result["checks"]["tiny"].items() if not k.endswith("same_routing"))
    assert "One MoE layer" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--small"):
        main(["--device", "cpu"])


def test_bench_moe_bad_device_and_missing_torchtitan_stop_before_any_work(capsys, monkeypatch):
    import importlib.util

    from k3lab.bench.moe import main

    with pytest.raises(SystemExit) as exc:
        main(["--small", "--device", "foo"])
    assert exc.value.code == 2
    assert "--device: expected cpu, cuda or cuda:N, got 'foo'" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchtitan" else real(name, *a))
    with pytest.raises(SystemExit, match="--no-torchtitan"):
        main(["--small", "--device", "cpu"])


@pytest.mark.parametrize("text", ["meta", "mps", "cpu:1", "gpu0", "", "cuda:-1"])
def test_parse_device_refuses_devices_the_benchmarks_cannot_run_on(text, capsys):
    """--device meta used to pass and die in Tensor.item() after the model was built; mps in Tensor.to."""
    import argparse

    from k3lab.bench import parse_device

    with pytest.raises(SystemExit) as exc:
        parse_device(argparse.ArgumentParser(prog="b"), text)
    assert exc.value.code == 2 and f"--device: expected cpu, cuda or cuda:N, got {text!r}" in capsys.readouterr().err


def test_parse_device_refuses_a_card_that_is_not_there(capsys, monkeypatch):
    import argparse

    import torch

    from k3lab.bench import parse_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    p = argparse.ArgumentParser(prog="b")
    assert parse_device(p, "cuda:1") == torch.device("cuda:1") and parse_device(p, "cuda") == torch.device("cuda")
    assert parse_device(p, "cpu") == torch.device("cpu")
    with pytest.raises(SystemExit) as exc:
        parse_device(p, "cuda:2")
    assert exc.value.code == 2 and "cuda:2 names no card (2 visible" in capsys.readouterr().err
