"""k3lab.testing: the checks every other test leans on."""
import pytest
import torch

from k3lab.testing import assert_close


def test_assert_close_names_a_bad_tolerance_and_takes_empty_tensors():
    """tol=nan gave "0.000e+00 > tol nan", tol="1e-3" a TypeError; empty tensors an error of NaN."""
    assert assert_close("empty", torch.empty(0), torch.empty(0), 0.0) == 0.0
    for tol in (float("nan"), -1.0, "1e-3", True):
        with pytest.raises(ValueError, match="tol must be a finite number >= 0"):
            assert_close("x", torch.ones(3), torch.ones(3), tol)
