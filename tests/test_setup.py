"""k3lab.setup(): argument checks happen before any generator is seeded."""
import random

import pytest

import k3lab


@pytest.mark.parametrize("seed, exc, match", [
    (-1, ValueError, r"seed must be in \[0, 2\*\*32\), got -1"),
    (2**40, ValueError, r"seed must be in \[0, 2\*\*32\), got 1099511627776"),
    (True, TypeError, "seed must be an int, got bool"),
    (1.5, TypeError, "seed must be an int, got float"),
], ids=["negative", "too_big", "bool", "float"])
def test_bad_seed_rejected_before_seeding(seed, exc, match):
    random.seed(123)
    before = random.getstate()
    with pytest.raises(exc, match=match):
        k3lab.setup(seed=seed, profile="cpu", verbose=False)
    assert random.getstate() == before  # Python's generator was not seeded


def test_numpy_int_seed_accepted():
    import numpy as np

    assert k3lab.setup(seed=np.int64(3), profile="cpu", verbose=False).type == "cpu"
