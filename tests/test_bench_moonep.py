"""k3lab.bench.moonep: the CPU smoke run (every section, the JSON's shape), the simulation's inputs and
priced traffic, and the command line's refusals."""
import json
import re

import pytest
import torch

from k3lab.bench import moonep as bench
from k3lab.moe import maxvio


def test_small_cpu_run_writes_the_json_shape(tmp_path):
    out = tmp_path / "moonep.json"
    result = bench.main(["--device", "cpu", "--small", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and "commit" in data and "date" in data and data["small"] is True
    assert data["sync_check"]["passed"] is True
    assert len(data["planner"]) == 4
    for row in data["planner"]:
        assert {"E", "R", "S", "K", "us", "graph_us", "triton_us", "triton_graph_us"} <= row.keys()
        assert row["us"] > 0 and row["graph_us"] is None and row["max_redundant"] <= row["bound"]
        # The Triton planner beside the torch one (here under the interpreter that conftest switches on).
        assert row["triton_us"] > 0 and row["triton_graph_us"] is None and "triton_skipped" not in row
    # The planner breakdown at the --small shape, every piece timed (eagerly: no CUDA graph on the CPU).
    assert [(r["E"], r["R"], r["K"], r["backend"]) for r in data["planner_breakdown"]] == [(16, 4, 2, "triton")]
    for row in data["planner_breakdown"]:
        for piece in bench.BREAKDOWN_PIECES:
            assert row[f"{piece}_us"] > 0 and row[f"{piece}_graph_us"] is None
    # Both placements of the hot experts; maxvio 4 needs E >= 5K.
    assert [(r["placement"], r["maxvio"]) for r in data["skew"]] == [
        (p, m) for p in ("scattered", "packed") for m in (0.0, 0.5, 1.0, 2.0)]
    C = data["shapes"]["skew"]["S"] * data["shapes"]["skew"]["K"]
    for row in data["skew"]:
        assert row["simulated"] is True and "143 GB/s" in row["comm_source"]
        assert row["moonep_ms"] > 0 and row["alltoall_ms"] > 0
        assert row["moonep"]["rows_per_rank"] == [C] * 4
        assert sum(row["alltoall"]["rows_per_rank"]) == 4 * C
        assert max(row["moonep"]["redundant_per_rank"]) <= 2
    assert all(result["floors"]["moonep_step_growth"][p]["simulated"] for p in ("scattered", "packed"))
    packed = [r for r in data["skew"] if r["placement"] == "packed"]
    assert packed[-1]["alltoall"]["busiest_over_SK"] > 2  # the hot experts all on rank 0
    for row in data["skew"]:
        for order in ("redundant_first", "longest_first"):
            assert row["moonep"][f"gemm_ms_{order}"] > 0
            assert row["moonep"][f"moonep_ms_{order}"] > row["moonep"][f"gemm_ms_{order}"]
    assert all("growth_longest_first" in g for g in result["floors"]["moonep_step_growth"].values())


def test_group_orders_permute_each_ranks_groups():
    counts = torch.tensor([[5, 0, 9, 1, 3, 3], [2, 2, 0, 7, 0, 4]])  # R = 2, L = 3
    orders = bench.group_orders(counts)
    assert orders["redundant_first"].tolist() == [[3, 4, 5, 0, 1, 2]] * 2
    longest = counts.gather(1, orders["longest_first"])
    assert longest.tolist() == [[9, 5, 3, 3, 1, 0], [7, 4, 2, 2, 0, 0]]
    for order in orders.values():
        assert (order.sort(1).values == torch.arange(6)).all()


def test_small_run_without_out_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bench.main(["--device", "cpu", "--small", "--skip-skew", "--planner-E", "8"])
    assert not any(tmp_path.iterdir())
    out = capsys.readouterr().out
    assert "planner latency" in out and "planner breakdown" in out


@pytest.mark.parametrize("target", [0.0, 0.5, 2.0, 4.0])
@pytest.mark.parametrize("placement", bench.PLACEMENTS)
def test_skew_counts_hit_the_asked_maxvio(target, placement):
    counts = bench.skew_counts(64, 8, 8192, 8, target, placement=placement)
    assert torch.equal(counts.sum(1), torch.full((8,), 8192 * 8))
    assert abs(float(bench.skew_profile(64, target).max()) * 64 - 1 - target) < 1e-9
    assert abs(maxvio(counts.sum(0)) - target) < 0.1


def test_priced_traffic_is_the_layouts():
    bench.check_traffic(torch.device("cpu"), E=16, R=4, S=40, K=4, seed=3)
    counts = torch.tensor([[3, 1], [0, 4]])  # R = 2, E = 2: rank 0 sends 1 pair to rank 1's expert
    assert bench.pair_traffic(counts, bench.home_assign(counts)).tolist() == [[3, 1], [0, 4]]


@pytest.mark.parametrize("argv, match", [
    (["--maxvio", "-1"], "--maxvio: expected a float >= 0, got -1.0"),
    (["--maxvio", "9"], r"--maxvio 9.0: \(1 \+ maxvio\) \* K / E = 1.25 > 1"),
    (["--planner-E", "100"], "planner shape E=100, R=8, K=8: E must be a multiple of R"),
    (["--comm-gbps", "0"], "--comm-gbps: expected a float > 0"),
    (["--reps", "0"], "--reps: expected a positive int, got 0"),
    (["--breakdown-E", "100"], "breakdown shape E=100, R=64, K=8: E must be a multiple of R"),
    (["--placement", "random"], "--placement: invalid choice: 'random'"),
    ([], "--device cpu needs --small"),
])
def test_bad_flags_stop_at_parsing(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cpu", *argv])
    assert exc.value.code == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_planner_has_no_host_sync_and_replays_as_a_cuda_graph():
    """On a GPU: plan + layout under set_sync_debug_mode("error"), then captured and replayed in a CUDA graph
    with the eager plan's result; both planner backends, and the Triton fill kernel alone at every width."""
    device = torch.device("cuda")
    counts, idx = bench.routing_counts(64, 8, 256, 4, device)
    for backend in ("torch", "triton"):
        check = bench.sync_check(counts, idx, 256, 4, backend)
        assert check["passed"], (backend, check["error"])
    row = bench.planner_row(64, 8, 256, 4, device, reps=2, graph=True, seed=0)
    assert row["graph_us"] is not None, row.get("graph_error")
    assert row["triton_graph_us"] is not None, row.get("triton_graph_error")
    assert row["plan_graph_us"] is not None and row["triton_plan_graph_us"] is not None
    assert all(row["triton_fill_graph_us"][str(w)] is not None for w in bench.FILL_WARPS)
    split = bench.planner_breakdown(64, 8, 256, 4, device, reps=2, graph=True, seed=0)
    assert split["backend"] == "triton" and "graph_error" not in split, split.get("graph_error")
    assert all(split[f"{piece}_graph_us"] is not None for piece in bench.BREAKDOWN_PIECES)
