"""``python -m k3lab.bench.memory --device cpu``: the activation-memory benchmark runs on k3-tiny in seconds, its
JSON carries what each policy set holds and costs, and its correctness check stops a broken policy."""
import json

import pytest
import torch

import k3lab.memory
from k3lab.bench.memory import EXACT_BOUND, FP8_BOUND, SETS, check_policies, main, policy_sets, table
from k3lab.memory import ActivationManager, apply_policies
from k3lab.model import K3Config, K3Model

SMALL = ["--device", "cpu", "--batch-size", "2", "--seq-len", "32", "--steps", "1"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, one_thread):
    """(returned dict, written JSON) of one small CPU run over every set."""
    out = tmp_path_factory.mktemp("bench_memory") / "memory.json"
    with one_thread():
        result = main(SMALL + ["--out", str(out)])
    return result, json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny():
    """(k3-tiny model, tokens [1, 32]) for the direct checks."""
    torch.manual_seed(0)
    model = K3Model(K3Config.preset("k3-tiny"))
    return model, torch.randint(0, model.config.vocab_size, (1, 32))


def test_small_run_writes_every_set(small_run):
    result, written = small_run
    assert written == json.loads(json.dumps(result))
    assert {"device", "commit", "date", "versions", "preset", "peak_kind", "check", "sets"} <= set(written)
    assert written["preset"] == "k3-tiny" and written["peak_kind"] == "manager_saved_peak"
    assert list(written["sets"]) == list(SETS)
    for name, s in written["sets"].items():
        assert s["step_ms"] > 0 and s["step_ms_min"] <= s["step_ms"], name
        assert 0 < s["loss"] < 20, name
        # Every set computes the same forward: the losses of the timed steps agree.
        assert s["loss"] == pytest.approx(written["sets"]["keep"]["loss"], rel=1e-6), name


def test_counters_show_what_each_set_saves(small_run):
    sets = small_run[1]["sets"]
    keep = sets["keep"]["saved_total_bytes"]
    # Nothing is wrapped without policies: the manager sees no saved tensor.
    assert sets["plain"]["saved_total_bytes"] == sets["plain"]["saved_tensors"] == 0
    assert keep > 0 and set(sets["keep"]["saved_bytes"]) == {"keep"}
    assert sets["recompute"]["saved_total_bytes"] < keep / 3
    assert sets["recompute_moe"]["saved_total_bytes"] < keep
    # Offload moves the sublayers' tensors to the host; the root's (logits, loss) stay on the device.
    off = sets["offload"]
    assert off["saved_total_bytes"] < keep / 3 and off["host_bytes"] > keep / 2
    assert off["saved_bytes"]["offload"] == 0 and off["saved_bytes"]["keep"] == off["saved_total_bytes"]
    assert sets["fp8_ffn"]["saved_total_bytes"] < keep and sets["fp8_ffn"]["saved_bytes"]["fp8"] > 0
    assert set(sets["k3_mix"]["saved_bytes"]) == {"keep", "recompute", "fp8"}
    for s in sets.values():
        assert s["peak_bytes"] >= s["saved_total_bytes"]


def test_check_compares_every_set_with_keep(small_run):
    check = small_run[1]["check"]
    assert check["shape"] == [2, 32] and check["keep_repeat"]["grad_rel_err"] == 0.0
    assert set(check["sets"]) == set(SETS) - {"keep"}
    for name, c in check["sets"].items():
        assert c["ok"] and c["loss_rel_err"] <= EXACT_BOUND, (name, c)
        if name in ("fp8_ffn", "k3_mix"):
            # Really fp8: the error is e4m3's, not zero, and within its bound.
            assert c["bound"] == FP8_BOUND and 1e-4 < c["grad_rel_err"] <= FP8_BOUND, (name, c)
        else:
            # Same values in the same order on a CPU: bitwise.
            assert c["bound"] == EXACT_BOUND and c["grad_rel_err"] == 0.0, (name, c)


def test_table_of_a_gpu_result_has_peak_and_start_gib(small_run):
    r = json.loads(json.dumps(small_run[1]))
    r["peak_kind"] = "cuda_max_memory_allocated"
    for i, s in enumerate(r["sets"].values()):
        s.update(peak_bytes=(10 + i) * 2**30, base_bytes=4 * 2**30)
    r["sets"]["offload"] = {"rules": {}, "oom": "CUDA out of memory"}
    lines = table(r).splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:]}
    assert "peak GiB" in lines[2] and "start GiB" in lines[2]
    saved_mib = f"{r['sets']['keep']['saved_total_bytes'] / 2**20:.1f}"
    assert rows["keep"][:4] == [saved_mib, "0.0", "11.00", "4.00"]
    assert rows["offload"] == ["out", "of", "memory"]


def test_policy_sets_name_every_sublayer(tiny):
    model, _ = tiny
    sets = policy_sets(model)
    n = len(model.sublayers)
    assert sets["plain"] == {}
    for name, rules in sets.items():
        if name != "plain":
            assert set(rules) == {""} | {f"sublayers.{i}" for i in range(n)}, name
    # k3-tiny: sublayer 1 is the dense FFN, the other odd ones MoE.
    moe = {f"sublayers.{i}" for i in range(3, n, 2)}
    assert {m for m, p in sets["recompute_moe"].items() if p == "recompute"} == moe
    assert {m for m, p in sets["k3_mix"].items() if p == "fp8"} == {"sublayers.1"}
    for rules in sets.values():
        apply_policies(model, rules, default=None).remove()


def _broken_offload(monkeypatch):
    unpack = ActivationManager._unpack

    def unpack_scaled(self, packed):
        out = unpack(self, packed)
        # A copy that comes back 0.1% off: what a stale or mis-synchronised host copy could look like.
        if getattr(packed, "policy", None) == "offload" and torch.is_tensor(out) and out.is_floating_point():
            return out * (1 + 1e-3)
        return out

    monkeypatch.setattr(ActivationManager, "_unpack", unpack_scaled)


def test_broken_offload_stops_the_run_and_writes_nothing(monkeypatch, tmp_path, one_thread):
    _broken_offload(monkeypatch)
    out = tmp_path / "memory.json"
    with one_thread(), pytest.raises(AssertionError, match="policy set 'offload' disagrees with keep"):
        main(SMALL + ["--sets", "offload", "--out", str(out)])
    assert not out.exists()


def test_coarse_fp8_is_caught(monkeypatch, tiny, one_thread):
    model, idx = tiny
    dequantize = k3lab.memory.fp8_dequantize

    def two_levels(q, scale, dtype, block=k3lab.memory.FP8_BLOCK):
        # One bit of mantissa left: far past e4m3's error.
        x = dequantize(q, scale, torch.float32)
        return (x.sign() * 2.0 ** x.abs().clamp_min(1e-30).log2().round()).to(dtype)

    sets = {k: v for k, v in policy_sets(model).items() if k in ("keep", "fp8_ffn")}
    with one_thread():
        check_policies(model, idx, sets)
        monkeypatch.setattr(k3lab.memory, "fp8_dequantize", two_levels)
        with pytest.raises(AssertionError, match="policy set 'fp8_ffn' disagrees with keep"):
            check_policies(model, idx, sets)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps: expected a positive int, got 0"),
    (["--sets", "keep,fp16"], "--sets: expected set names from"),
    (["--preset", "k3-full"], "--preset: invalid choice"),
    # A one-token vocabulary has zero loss: the check's relative error divided by it.
    (["--vocab-size", "1"], "--vocab-size: expected an int >= 2"),
])
def test_bad_flags_stop_at_parsing(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu"] + argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_an_out_folder_stops_before_the_run(tmp_path, capsys):
    """The JSON is written last: a folder given as --out failed only after the whole run."""
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--out", str(tmp_path)])
    assert e.value.code == 2 and "is a folder" in capsys.readouterr().err
