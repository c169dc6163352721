"""k3lab.bench.moe_quality: the latent / full-width pair has equal routed expert compute, and a small run
writes every field the chapter reads."""
import json
import math

import pytest

from k3lab.bench.moe_quality import main, pair, routed_cost


def test_the_pair_routes_the_same_expert_compute_at_half_width():
    configs = pair(d_model=128, n_layers=2, n_experts=64, top_k=4, expert_hidden=64)
    full, latent = configs["full width"], configs["latent"]
    assert (full.n_experts, full.top_k, full.routed_dim) == (32, 2, 128)
    assert (latent.n_experts, latent.top_k, latent.routed_dim) == (64, 4, 64)
    assert routed_cost(full) == routed_cost(latent) == (2 * 2 * 3 * 128 * 64, 2 * 3 * 128 * 64)
    # The latent layer pays for its projections on top: 4 d l more forward FLOPs per token, and twice the router.
    assert latent.flops_per_token() - full.flops_per_token() == 4 * 128 * 64 + 2 * 128 * 32


def test_small_run_writes_curves_and_summary(tmp_path):
    out = tmp_path / "q.json"
    result = main(["--small", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["summary"] == json.loads(json.dumps(result["summary"]))
    assert [r["name"] for r in saved["runs"]] == ["full width", "latent"]
    for r in saved["runs"]:
        assert r["step"] == saved["runs"][0]["step"] and len(r["val_loss"]) == len(r["step"])
        assert all(math.isfinite(v) and 0 < v < 20 for v in r["val_loss"])
    diff = saved["summary"]["latent_minus_full"]["mean"]
    assert math.isclose(diff, saved["runs"][1]["val_loss"][-1] - saved["runs"][0]["val_loss"][-1], rel_tol=1e-12)
    assert saved["configs"]["latent"]["routed_flops_per_token"] == saved["configs"]["full width"]["routed_flops_per_token"]


@pytest.mark.parametrize("argv,match", [
    (["--seeds", "0", "0"], "--seeds: each seed once"),
    (["--lr", "-1"], "--lr: expected a positive number"),
    (["--lr", "nan"], "--lr: expected a positive number"),
    (["--device", "gpu0"], "--device: expected cpu, cuda or cuda:N"),
    (["--d-model", "24"], "d_model must be a multiple of 16"),
    (["--expert-hidden", "12"], "expert_hidden of 8"),
], ids=["duplicate-seeds", "negative-lr", "nan-lr", "bad-device", "d-model-24", "hidden-12"])
def test_bad_flags_stop_before_training(argv, match, capsys):
    """Duplicate seeds were run twice and counted twice in the paired summary; a negative or NaN --lr, an
    unknown --device or a d_model the grouped expert matmul cannot take stopped with a traceback."""
    with pytest.raises(SystemExit) as e:
        main(["--small", "--out", "", *argv])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_out_under_a_file_stops_before_training(tmp_path, capsys):
    """--out below an existing file failed only when the JSON was written, after every run."""
    (tmp_path / "a").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["--small", "--out", str(tmp_path / "a" / "q.json")])
    assert e.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err


def test_small_keeps_the_flags_given(tmp_path):
    """--small replaced every size, so --small --seeds 3 ran seed 0."""
    result = main(["--small", "--seeds", "3", "--steps", "2", "--seq-len", "300", "--out",
                   str(tmp_path / "new" / "q.json")])
    assert [r["seed"] for r in result["runs"]] == [3, 3] and result["settings"]["steps"] == 2
    # Windows longer than the tiny LM's default 256 positions (the GPU size's 512 failed in the first forward).
    assert result["settings"]["seq_len"] == 300
    assert result["settings"]["d_model"] == 32 and (tmp_path / "new" / "q.json").is_file()
