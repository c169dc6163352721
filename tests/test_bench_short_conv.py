"""``python -m k3lab.bench.short_conv --small --device cpu``: the short-convolution benchmark checks every method
against float64, times them and writes its JSON; a method that disagrees stops it before any timing."""
import json

import pytest
import torch

import k3lab.bench.short_conv as bench


def test_small_run_checks_times_and_writes_every_method(tmp_path, capsys):
    out = tmp_path / "short_conv.json"
    result = bench.main(["--small", "--device", "cpu", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["cases"] == result["cases"] and {"device", "commit", "date", "copy_TBps"} <= saved.keys()
    row = saved["cases"][0]
    assert all(row[f"{m}_ms"] > 0 for m in bench.METHODS) and row["floor_ms"] > 0
    checks = saved["checks"]["tiny"]
    assert set(checks["float32_vs_float64"]) == set(bench.METHODS)
    assert max(e for errs in checks["float32_vs_float64"].values() for e in errs.values()) < bench.FP32_BOUND
    assert "floor" in capsys.readouterr().out


def test_a_wrong_method_stops_the_check(monkeypatch):
    right = bench.method
    monkeypatch.setattr(bench, "method", lambda name: (lambda x, w: 1.01 * right(name)(x, w)) if name == "triton"
                        else right(name))
    with pytest.raises(AssertionError, match="short conv triton .* disagrees"):
        bench.check((2, 12, 16, 4), (2, 12, 16, 4), torch.device("cpu"))


def test_cpu_needs_small():
    with pytest.raises(SystemExit, match="needs --small"):
        bench.main(["--device", "cpu", "--out", ""])


def test_help_gives_the_whole_first_sentence(capsys):
    """The description was the docstring's first line, cut off after "PyTorch under ``torch.compile`` and"."""
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "the fused Triton kernels" in " ".join(capsys.readouterr().out.split())


def test_table_keeps_a_space_between_time_and_floor_ratio():
    """A time 10^5 times the floor (the Triton interpreter in a --small run) ran into the ms column:
    "380.998220269.7x"."""
    row = dict(name="tiny", B=2, T=40, C=32, W=4, min_bytes=12800, floor_ms=0.00173,
               torch_ms=0.286, torch_compiled_ms=0.241, triton_ms=380.998)
    text = bench.table(dict(device="cpu", date="today", copy_TBps=0.01, cases=[row]))
    line = next(s for s in text.splitlines() if " triton " in s)
    assert line.split()[1:] == ["triton", "380.998", "220230.1x"]
