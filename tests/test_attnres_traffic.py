"""k3lab.attnres.traffic: the bytes model and the floor under it."""
import itertools

import pytest

from k3lab.attnres import block_sizes
from k3lab.attnres.traffic import bytes_floor, bytes_model, bytes_table, step_ms


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


def _enumerated_floor(L, N, buf, h, o, v):
    """The same floor counted kernel by kernel, over whole steps, each block's data flow chosen per pass
    ("P": phase 1 writes o_k for the merges; "R": every merge reads the blocks)."""
    # Standard, add fused with the next RMSNorm: sublayer 0 reads x_0; every later sublayer and the final
    # RMSNorm read x and v and write x. Backward: the final reads x_L and writes dx_L; each sublayer reads
    # x_k and dx_{k+1} and writes dx_k.
    std_f, std_b = h + L * (2 * h + v), 2 * h + 3 * L * h
    sizes = block_sizes(L, N)
    best_f = best_b = None
    for modes in itertools.product("PR", repeat=N):
        f, b = N * buf, (N + 1) * buf + 2 * h  # final: reads the N earlier blocks; backward: all, writes 2
        for j, (S, m) in enumerate(zip(sizes, modes)):
            n = j + 1
            f += n * buf - (buf if j else 0) + ((S - 1) * o if m == "P" else 0)  # phase 1 (o_k written)
            for k in range(1, S):  # merge k: o_k or the blocks; p_k = p_{k-1} + v_{k-1} (p_1 = v_0: no write)
                f += (o if m == "P" else n * buf) + (v if k == 1 else (v if k == 2 else h) + v + h)
            f += (v if S < 3 else h) + (v if S > 1 else 0) + buf  # store p_{S-1} + v_{S-1}
            b += ((S - 1) * o if m == "P" else 0) + n * buf + (S - 1) * o  # rebuilt o_k; phase 1 backward
            for k in range(1, S):  # rebuild h_k from o_k (or the blocks) and p_k, read dp_{k+1}, write dp_k, dO_k
                b += (o if m == "P" else n * buf) + (v if k == 1 else h) + h + h + o
            b += h + n * h if j == N - 1 else 2 * n * h  # the gradient sums
        best_f, best_b = (f, b) if best_f is None else (min(best_f, f), min(best_b, b))
    return dict(fwd=round((best_f - std_f) / L, 2), bwd=round((best_b - std_b) / L, 2))


@pytest.mark.parametrize("L, N", [(L, N) for L in range(1, 11) for N in range(1, min(L, 6) + 1)])
@pytest.mark.parametrize("sizes", [(4, 4, 4, 4), (4, 4, 2, 2), (2, 4, 2, 2), (2, 2, 2, 2), (4, 2, 2, 4)])
def test_floor_matches_a_kernel_by_kernel_count(L, N, sizes):
    assert bytes_floor(L, N, *sizes) == pytest.approx(_enumerated_floor(L, N, *sizes), abs=0.011)


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


def test_sizes_and_bandwidth():
    import numpy as np

    assert bytes_floor(buf=np.int64(2)) == bytes_floor(buf=2)
    for tbps in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="tbps must be"):
            step_ms(1.0, 48, tbps=tbps)
    assert "3.6 TB/s" in bytes_table(bytes_model(), tbps=3.6)
