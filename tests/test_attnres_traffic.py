"""k3lab.attnres.traffic: the bytes model and the floor under it."""
import pytest

from k3lab.attnres.traffic import bytes_floor, bytes_model, bytes_table


def test_floor_by_hand_two_sublayers_one_block():
    """L = 2, N = 1, 4-byte tensors. Forward: sublayer 0 reads b_0 where the standard reads x_0; sublayer
    1 reads b_0 and v_0 where the standard reads x_0 and v_0 and writes x_1 (-4); the block b_1 = v_0 + v_1
    is written where the standard writes x_2; the final aggregation reads b_0 and b_1 where the standard
    reads x_2 (+4): 0. Backward, the standard: the final RMSNorm reads x_2 and writes dx_2, each
    sublayer reads x_k and dx_{k+1} and writes dx_k (8 + 12 + 12 = 32). Block: the final aggregation
    reads b_0, b_1 and writes their gradient sums (16); sublayer 1 reads b_0, v_0 (its input, rebuilt)
    and db_1, writes dv_0 and dO_1 (20); phase 1 with sublayer 0 reads b_0 and dO_1 and reads and writes
    db_0 (16): 52 - 32 = 20."""
    assert bytes_floor(2, 1, buf=4, h=4, o=4, v=4) == dict(fwd=0.0, bwd=10.0)


def test_floor_by_hand_one_sublayer():
    """L = N = 1 (S = 1). Forward: the block b_1 = v_0 is written where the standard reads x_0 and v_0 and
    writes x_1 (-4); the final aggregation reads b_0 and b_1 where the standard reads x_1 (+4): 0.
    Backward: the standard's final RMSNorm reads x_1, writes dx_1, its sublayer reads x_0 and dx_1 and
    writes dx_0 (20); Block's final aggregation reads b_0, b_1 and writes their gradient sums (16), phase 1
    with the sublayer reads b_0 and reads and writes db_0 (12): 28 - 20 = 8."""
    assert bytes_floor(1, 1, buf=4, h=4, o=4, v=4) == dict(fwd=0.0, bwd=8.0)


@pytest.mark.parametrize("L, N", [(48, 8), (48, 4), (48, 48), (12, 5), (7, 3)])
def test_floor_scales_with_the_bytes(L, N):
    """Every term is a byte count: doubling every dtype's size doubles the floor."""
    one, two = bytes_floor(L, N, 1, 1, 1, 1), bytes_floor(L, N, 2, 2, 2, 2)
    assert two == pytest.approx({k: 2 * x for k, x in one.items()}, abs=0.011)


@pytest.mark.parametrize("L, N", [(48, 8), (48, 4), (48, 2), (48, 48), (24, 6), (7, 3)])
@pytest.mark.parametrize("buf, h, o", [(4, 4, 2), (4, 4, 4), (2, 4, 2), (2, 2, 2)])
def test_the_modelled_path_is_above_the_floor(L, N, buf, h, o):
    model = bytes_model(L, N, buf=buf, h=h, o=o)
    extra = sum(model["two_phase"].values()) - sum(model["standard"].values())
    floor = sum(model["floor"].values())
    assert 0 < floor < extra
    assert model["floor"] == bytes_floor(L, N, buf, h, o)


def test_bytes_table_shows_the_floor():
    text = bytes_table(bytes_model())
    assert "floor" in text.splitlines()[-1]
    old = {k: v for k, v in bytes_model().items() if k != "floor"}  # a model stored before the floor
    assert "floor" not in bytes_table(old)


@pytest.mark.parametrize("kw, match", [(dict(N=9, L=8), "n_blocks must be"), (dict(buf=0), "buf must be"),
                                       (dict(o=2.0), "o must be"), (dict(h=True), "h must be")])
def test_bad_sizes_raise(kw, match):
    for f in (bytes_floor, bytes_model):
        with pytest.raises(ValueError, match=match):
            f(**kw)
