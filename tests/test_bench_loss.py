"""``python -m k3lab.bench.loss --small --device cpu``: the head-loss benchmark checks, times and writes its JSON on
a CPU in seconds; a method that disagrees with the plain head stops it before any timing."""
import json

import pytest

import k3lab.bench.loss as bench


def test_small_run_writes_every_method(tmp_path, capsys):
    out = tmp_path / "loss.json"
    result = bench.main(["--small", "--device", "cpu", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["cases"] == result["cases"] and {"device", "commit", "date", "ceiling_tflops"} <= saved.keys()
    row = saved["cases"][0]
    for m in bench.METHODS:
        assert row[f"{m}_ms"] > 0 and row[f"{m}_tflops"] > 0
    checks = saved["checks"]["tiny"]
    assert max(checks["chunked"].values()) < bench.BOUND and max(checks["float64"].values()) < 1e-10
    assert "chunked compiled / plain" in capsys.readouterr().out


def test_a_wrong_method_stops_the_check(monkeypatch):
    wrong = bench.method

    def shifted(name):
        fn = wrong(name)
        return fn if name == "plain" else (lambda h, w, t: 1.1 * fn(h, w, t))

    monkeypatch.setattr(bench, "method", shifted)
    with pytest.raises(AssertionError, match="disagrees with the plain head"):
        bench.check(40, 8, 50, __import__("torch").device("cpu"))


def test_cpu_needs_small():
    with pytest.raises(SystemExit, match="needs --small"):
        bench.main(["--device", "cpu", "--out", ""])
