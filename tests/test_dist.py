"""k3lab.dist: the named device mesh and the wrapped collectives on 4 gloo ranks, and launch's errors."""
from __future__ import annotations

import pytest
import torch

from k3lab.dist import AXES, environ_worker, exit_worker, launch, mesh_worker, signal_worker


def test_mesh_groups_and_collectives_on_four_ranks():
    """dp=2 x ep=2: ep ranks are consecutive, dp ranks stride 2; each collective moves what it says."""
    R = 4
    res = launch(mesh_worker, R, dict(dp=2, ep=2), timeout_s=120)
    for r, out in enumerate(res):
        assert out["coords"] == dict(pp=0, dp=r // 2, cp=0, ep=r % 2)
        assert out["groups"]["ep"] == [r - r % 2, r - r % 2 + 1]
        assert out["groups"]["dp"] == [r % 2, r % 2 + 2]
        assert out["groups"]["pp"] == out["groups"]["cp"] == [r]
        assert set(out["groups"]) == set(AXES)
        base = r - r % 2
        assert torch.equal(out["gathered"], torch.tensor([[base, base], [base + 1, base + 1]]))
        # sum over ranks s of (s * R + r) for both entries.
        assert torch.equal(out["scattered"], torch.full((2,), sum(s * R + r for s in range(R))))
        assert torch.equal(out["a2a_equal"], torch.tensor([100 * s + r for s in range(R)]))
        want = torch.cat([torch.full((r + 1, 3), 100.0 * s + r) for s in range(R)])
        assert torch.equal(out["a2a_rows"], want)


def test_launch_reports_a_bad_mesh_from_the_rank():
    """A mesh whose axes do not multiply to the world size fails in the rank with the sizes named."""
    with pytest.raises(Exception, match="has 3 ranks, the world has 1"):
        launch(mesh_worker, 1, dict(dp=3), timeout_s=60)


def test_the_first_rank_to_fail_is_the_one_reported(tmp_path):
    """A rank that raised made the others fail in a collective ("Connection closed by peer"), and spawn
    reported whichever exit it noticed first: sometimes a victim's gloo error instead of the cause. launch
    names the rank whose failure was recorded first."""
    from k3lab.dist import _first_failure

    assert _first_failure(str(tmp_path)) is None
    (tmp_path / "rank0.err").write_text("1700000002.5\nRuntimeError: Connection closed by peer\n")
    (tmp_path / "rank1.err").write_text("1700000001.25\nValueError: v contains NaN or inf\n")
    (tmp_path / "rank1.pt").write_text("")
    assert _first_failure(str(tmp_path)) == (1, "ValueError: v contains NaN or inf\n")


def test_env_is_in_place_when_a_rank_starts():
    """env was applied inside the rank after fn's module had been imported: TRITON_INTERPRET came too late for
    Triton kernels imported with it."""
    import os

    out = launch(environ_worker, 2, ["K3LAB_PROBE", "TRITON_INTERPRET"], env={"K3LAB_PROBE": "7"}, timeout_s=120)
    assert [o["K3LAB_PROBE"] for o in out] == ["7", "7"]
    assert "K3LAB_PROBE" not in os.environ  # the parent's environment is left as it was


@pytest.mark.parametrize("code, match", [(0, r"exited without a result; rank \d first:(.|\n)*SystemExit: 0"),
                                         ("worker gave up", "SystemExit: worker gave up")],
                         ids=["exit-0", "exit-message"])
def test_a_rank_that_exits_without_a_result_is_named(code, match):
    """sys.exit(0) in every rank ended in FileNotFoundError for rank0.pt; a SystemExit with a message was not
    recorded, so another rank's "Connection reset by peer" was blamed."""
    with pytest.raises((RuntimeError, Exception), match=match):
        launch(exit_worker, 2, code, timeout_s=120)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSEGV"])
def test_a_rank_killed_by_a_signal_is_named_first(sig):
    """A killed rank records nothing: launch blamed the rank waiting on it ("Connection closed by peer"), and
    a record read while being written ended in "could not convert string to float"."""
    import signal

    with pytest.raises(torch.multiprocessing.ProcessExitedException, match=f"process 1 was killed by {sig}") as e:
        launch(signal_worker, 2, 1, getattr(signal, sig), timeout_s=120)
    assert e.value.error_index == 1 and e.value.signal_name == sig


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=True), "world_size must be an int >= 1, got True"),
    (dict(timeout_s=float("nan")), "timeout_s must be a finite number of seconds > 0, got nan"),
    (dict(timeout_s=0), "timeout_s must be a finite number"),
    (dict(pg_timeout_s=-1), "pg_timeout_s must be a finite number"),
    (dict(backend="mpi"), "backend must be 'gloo' or 'nccl'"),
], ids=["bool-world", "nan-timeout", "zero-timeout", "negative-pg-timeout", "mpi"])
def test_launch_names_bad_arguments_before_starting_ranks(kwargs, match):
    args = dict(world_size=1, timeout_s=60.0)
    args.update(kwargs)
    world = args.pop("world_size")
    with pytest.raises(ValueError, match=match):
        launch(mesh_worker, world, dict(), **args)


def test_make_mesh_refuses_bool_sizes_and_unknown_devices():
    from k3lab.dist import make_mesh

    with pytest.raises(ValueError, match="mesh axis sizes must be ints >= 1, got {'ep': True}"):
        make_mesh(ep=True, cp=2)
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda', got 'tpu'"):
        make_mesh(device_type="tpu")
