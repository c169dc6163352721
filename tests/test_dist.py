"""k3lab.dist: the named device mesh and the wrapped collectives on 4 gloo ranks, and launch's errors."""
from __future__ import annotations

import pytest
import torch

from k3lab.dist import AXES, launch, mesh_worker


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
