"""FlashKDA edge cases of the K-tiled intra backward, the gate and q/k norm backward kernels and the state kernels'
two K halves that tests/test_flash_kda.py does not reach (it runs K = 16 and 32 only: one K tile, both
state halves full or the second empty): K not a multiple of the 32-column tile, K = 256, GVA groups of
4 with varlen and no dt_bias, the GPU's tile sizes, repeated backward, a loss on the final state alone,
and KCP with a partial K tile.

Float32 kernels (TRITON_INTERPRET=1 on CPU) against the float64 reference of test_flash_kda.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is defined: before k3lab.kernels is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
from test_flash_kda import DEVICE, INTERPRETED_RANKS, NAMES, check, make_inputs, reference  # noqa: E402

from k3lab.kernels.kda import chunk_bwd, chunk_fwd, flash_kda  # noqa: E402
from k3lab.kernels.kda.chunk_bwd import kda_gate_bwd_kernel, kda_qk_norm_bwd_kernel  # noqa: E402
from k3lab.kernels.kda.utils import chunk_index, launch_fitting  # noqa: E402
from k3lab.testing import assert_close  # noqa: E402


@pytest.mark.timeout(300)
@pytest.mark.parametrize("K, V", [(48, 40), (24, 20)], ids=["K48-V40", "K24-V20"])
def test_k_not_a_multiple_of_the_k_tile(K, V):
    """K = 48: two K tiles of 32 in the intra backward (the second half masked), state halves of 32 rows
    (rows 48..63 masked); K = 24: one partial K tile, state halves of 16 (the second 8 rows). GVA 2,
    T = 70 (a full chunk and a 6-token tail), initial and final state."""
    check(make_inputs(1, 70, 1, 2, K, V, seed=21))


@pytest.mark.timeout(300)
def test_largest_k():
    """K = 256 (the limit): 8 K tiles in the intra backward, state halves of 128 rows; T = 20. (On an
    H200 the state kernels' shared memory at K = 256 fits 1 or 2 pipeline stages, not 3: ``launch_fitting``.)"""
    check(make_inputs(1, 20, 1, 1, 256, 16, seed=22))


class SharedMemoryBound:
    """A stand-in for a Triton kernel whose launch fits the GPU's shared memory at ``fits`` stages or fewer."""

    def __init__(self, fits):
        self.fits, self.tried = fits, []

    def __getitem__(self, grid):
        def launch(*args, num_stages, **kwargs):
            self.tried.append(num_stages)
            if num_stages > self.fits:
                raise triton.runtime.errors.OutOfResources(100_000 * num_stages, 232_448, "shared memory")
            return grid, args, kwargs
        return launch


def test_launch_fitting_drops_stages_until_the_kernel_fits():
    kernel = SharedMemoryBound(fits=1)
    assert launch_fitting(kernel, (2, 3), "x", num_stages=3, num_warps=4) == ((2, 3), ("x",), {"num_warps": 4})
    assert kernel.tried == [3, 2, 1]
    kernel = SharedMemoryBound(fits=3)
    launch_fitting(kernel, (1,), num_stages=3)
    assert kernel.tried == [3]
    with pytest.raises(triton.runtime.errors.OutOfResources, match="shared memory"):
        launch_fitting(SharedMemoryBound(fits=0), (1,), num_stages=2)


@pytest.mark.timeout(300)
def test_varlen_gva_group_of_4_without_dt_bias():
    """H = 1, HV = 4 (the norm kernel's GVA sum over 4 heads), K = 24, packed sequences of 5 and 65
    tokens (a tail chunk of 1), dt_bias=None (the gate without bias, no ddt_bias)."""
    cu = torch.tensor([0, 5, 70])
    q, k, v, z, beta, A_log, _, h0 = make_inputs(1, 70, 1, 4, 24, 16, N=2, seed=23)
    ours = [x.float().to(DEVICE).requires_grad_() for x in (q, k, v, z, beta, A_log, h0)]
    ref = [x.clone().requires_grad_() for x in (q, k, v, z, beta, A_log, h0)]
    o, s = flash_kda(*ours[:6], None, initial_state=ours[6], output_final_state=True, cu_seqlens=cu.to(DEVICE))
    o_ref, s_ref = reference(*ref[:6], None, initial_state=ref[6], cu_seqlens=cu)
    assert_close("o", o_ref, o.cpu(), 1e-4)
    assert_close("final_state", s_ref, s.cpu(), 1e-4)
    gen = torch.Generator().manual_seed(1)
    do, ds = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (o_ref, s_ref))
    ((o.double().cpu() * do).sum() + (s.double().cpu() * ds).sum()).backward()
    ((o_ref * do).sum() + (s_ref * ds).sum()).backward()
    for name, a, b in zip(("q", "k", "v", "g", "beta", "A_log", "initial_state"), ref, ours):
        assert_close(f"d{name}", a.grad, b.grad.cpu(), 1e-4)


@pytest.mark.timeout(300)
def test_gpu_tile_sizes(monkeypatch):
    """The tiles only a GPU picks, here under the interpreter: the state kernels' V tile of 16 (several
    V tiles per value head with the state in two K halves) and the dq/dk and dW/dv kernels' V tile of 32.
    K = 48, V = 40."""
    for mod in (chunk_fwd, chunk_bwd):
        monkeypatch.setattr(mod, "state_tile", lambda N, HV, V, device: 16)
    tiles = chunk_bwd._dqkw_tiles
    monkeypatch.setattr(chunk_bwd, "_dqkw_tiles", lambda K, V, cuda: tiles(K, V, True))
    check(make_inputs(1, 70, 1, 1, 48, 40, seed=24))


@pytest.mark.parametrize("H, HV, K", [(2, 4, 48), (1, 4, 256), (1, 1, 16)])
def test_qk_norm_bwd_kernel_gpu_block(H, HV, K):
    """``kda_qk_norm_bwd_kernel`` with the GPU's 32-token blocks (the CPU launch uses 16), T = 45 (a
    partial block): the GVA sum, the L2-norm backward of scale * q / |q| and k / |k| and dbeta's
    sigmoid backward against autograd in float64."""
    T, BR = 45, 32
    NKT, BK, scale = triton.cdiv(K, 32), max(16, triton.next_power_of_2(K)), K**-0.5
    gen = torch.Generator().manual_seed(25)
    q, k, dq_hat, dk_hat = (torch.randn(T, *s, generator=gen) for s in ((H, K), (H, K), (HV, K), (HV, K)))
    beta, db = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    db_parts = torch.randn(NKT, T, HV, generator=gen)
    dq, dk, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(beta)
    args = [x.to(DEVICE) for x in (q, k, beta, dq_hat, dk_hat, db_parts, db)]
    out = [x.to(DEVICE) for x in (dq, dk, dbeta)]
    kda_qk_norm_bwd_kernel[(triton.cdiv(T, BR), H)](*args, *out, T, scale, H=H, HV=HV, K=K, NKT=NKT, BR=BR, BK=BK)
    qd, kd, bd = (x.double().requires_grad_() for x in (q, k, beta))
    norm = lambda x: x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()  # noqa: E731
    loss = ((norm(qd) * scale).repeat_interleave(HV // H, 1) * dq_hat.double()).sum() \
        + (norm(kd).repeat_interleave(HV // H, 1) * dk_hat.double()).sum() \
        + (bd.sigmoid() * (db_parts.double().sum(0) + db.double())).sum()
    loss.backward()
    for name, a, b in zip(("dq", "dk", "dbeta"), (qd, kd, bd), out):
        assert_close(name, a.grad, b.cpu(), 1e-6)


@pytest.mark.parametrize("HV, K, bias", [(4, 48, True), (2, 256, False), (1, 16, True)])
def test_gate_bwd_kernel(HV, K, bias):
    """``kda_gate_bwd_kernel`` alone against autograd in float64, on two sequences of 45 and 70 tokens
    (partial chunks): the in-chunk reverse cumsum of dG, dgx, and the gate backward (dz, dA_log, ddt_bias)."""
    lengths, lb, BKT = [45, 70], -5.0, 32
    T, NKT = sum(lengths), triton.cdiv(K, BKT)
    gen = torch.Generator().manual_seed(26)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    z, A_log, dt_bias, dG, dgx = r(T, HV, K), 0.5 * r(HV), 0.5 * r(HV * K), r(T, HV, K), r(T, HV, K)
    cu, chunk_indices, _ = chunk_index(lengths, DEVICE)
    NT = chunk_indices.shape[0]
    dz, dA_part, dbias_part = (torch.empty(*s, device=DEVICE) for s in ((T, HV, K), (NKT, NT, HV), (NT, HV, K)))
    dev = lambda x: x.float().to(DEVICE)  # noqa: E731
    kda_gate_bwd_kernel[(NKT, NT, HV)](dev(z), dev(A_log), dev(dt_bias) if bias else None, dev(dG), dev(dgx),
                                       dz, dA_part, dbias_part, cu, chunk_indices, lb, HV=HV, K=K, HAS_BIAS=bias,
                                       BT=64, BKT=BKT)
    zd, ad, biasd = (x.clone().requires_grad_() for x in (z, A_log, dt_bias))
    g = lb * torch.sigmoid(ad.exp()[:, None] * (zd + (biasd.view(HV, K) if bias else 0)))
    G = torch.cat([c.cumsum(0) for n in g.split(lengths) for c in n.split(64)])
    ((G * dG).sum() + (g * dgx).sum()).backward()
    assert_close("dz", zd.grad, dz.double().cpu(), 1e-5)
    assert_close("dA_log", ad.grad, dA_part.sum((0, 1)).double().cpu(), 1e-5)
    if bias:
        assert_close("ddt_bias", biasd.grad, dbias_part.sum(0).view(-1).double().cpu(), 1e-5)


@pytest.mark.timeout(300)
def test_backward_twice_with_retain_graph():
    """Two backward passes through one graph (retain_graph) give the same gradients: nothing the
    backward updates in place is a saved tensor. K = 48 (two K tiles), GVA 2."""
    inputs = [x.float().to(DEVICE).requires_grad_() for x in make_inputs(1, 20, 1, 2, 48, 16, seed=26)]
    o, s = flash_kda(*inputs[:7], initial_state=inputs[7], output_final_state=True)
    loss = o.pow(2).sum() + s.pow(2).sum()
    first = torch.autograd.grad(loss, inputs, retain_graph=True)
    second = torch.autograd.grad(loss, inputs)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


@pytest.mark.timeout(300)
def test_loss_on_the_final_state_only():
    """Only the final state in the loss: the backward gets do = 0 and the state gradient alone. q never
    reaches the state, so its gradient is exactly zero (the reference has none); the rest match."""
    inputs = make_inputs(1, 40, 1, 2, 24, 16, seed=27)
    ours = [x.float().to(DEVICE).requires_grad_() for x in inputs]
    ref = [x.clone().requires_grad_() for x in inputs]
    _, s = flash_kda(*ours[:7], initial_state=ours[7], output_final_state=True)
    _, s_ref = reference(*ref[:7], initial_state=ref[7])
    s.double().pow(2).sum().backward()
    s_ref.pow(2).sum().backward()
    assert ref[0].grad is None and torch.count_nonzero(ours[0].grad) == 0
    for name, a, b in list(zip(NAMES, ref, ours))[1:]:
        assert_close(f"d{name}", a.grad, b.grad.cpu(), 1e-4)


@pytest.mark.timeout(240)
@INTERPRETED_RANKS
def test_kcp_flash_partial_k_tile(monkeypatch):
    """KCP over 2 gloo ranks with K = 48, V = 40: the state kernel's lead columns (values [0 | U], V' =
    K + V = 88) with the state in two halves of 32 rows, and the K-tiled backward on each rank."""
    from k3lab.kcp.workers import (
        FLASH_REPLICATED, FLASH_SHARDED, FlashCase, errors_vs_reference, flash_check_worker,
    )
    from k3lab.dist import launch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = FlashCase(T=90, HV=1, K=48, V=40, seed=28)
    results = launch(flash_check_worker, 2, [case], timeout_s=200)
    errs = errors_vs_reference(results[0]["refs"][0], [res["runs"][0] for res in results], FLASH_SHARDED,
                               FLASH_REPLICATED)
    bad = {name: e for name, e in errs.items() if not e <= 1e-5}
    assert not bad, bad


# The interpreter runs the kernels in numpy, which warns where they overflow as intended here.
INTERPRETER_OVERFLOW = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")


def flash_inputs(seed=40, T=20):
    """float32 inputs on DEVICE (B = 1, T tokens, H = HV = 1, K = V = 16) and their float64 originals."""
    inputs = make_inputs(1, T, 1, 1, 16, 16, seed=seed)
    return [x.float().to(DEVICE) for x in inputs], inputs


@pytest.mark.timeout(300)
def test_keys_scaled_by_1e3_match_the_reference():
    """flash_kda normalises q and k itself: keys 1e3 times too large give the float64 result."""
    ours, ref = flash_inputs()
    ours[1], ref[1] = ours[1] * 1e3, ref[1] * 1e3
    o, s = flash_kda(*ours[:7], initial_state=ours[7], output_final_state=True)
    o_ref, s_ref = reference(*ref[:7], initial_state=ref[7])
    assert_close("o", o_ref, o.cpu(), 1e-4)
    assert_close("final_state", s_ref, s.cpu(), 1e-4)


@INTERPRETER_OVERFLOW
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["q", "k"])
def test_q_k_beyond_the_float32_norm_raise(name):
    """max |k| = 3e20: ||k||^2 overflowed float32 in the kernels' norm and k came out as 0, a finite
    and wrong output (0.09 where the reference has 0.14). check_values=False still skips the check."""
    ours, _ = flash_inputs()
    i = NAMES.index(name)
    ours[i] = ours[i] * 1e20
    with pytest.raises(ValueError, match=rf"^{name} is too large for flash_kda's L2 norm: max \|{name}\| = .*K=16"):
        flash_kda(*ours[:7], initial_state=ours[7])
    flash_kda(*ours[:7], initial_state=ours[7], check_values=False)


@INTERPRETER_OVERFLOW
@pytest.mark.timeout(300)
def test_initial_state_beyond_float32_raises():
    """A float64 initial_state of 1e300: check_finite passed it, the kernels' float32 copy was inf."""
    ours, _ = flash_inputs()
    huge = torch.full(ours[7].shape, 1e300, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match=r"^initial_state is out of range: max \|initial_state\| = 1e\+300 exceeds "
                                         r"float32's largest value"):
        flash_kda(*ours[:7], initial_state=huge)


@INTERPRETER_OVERFLOW
@pytest.mark.timeout(300)
def test_output_overflow_names_initial_state():
    """A float32 state of 3e38 with the gate at ~0 (z = -100: no decay): o overflows float32 -> ValueError,
    never an inf/NaN returned."""
    ours, _ = flash_inputs()
    ours[3] = torch.full_like(ours[3], -100.0)
    ours[6] = torch.zeros_like(ours[6])
    huge = torch.full_like(ours[7], 3e38)
    with pytest.raises(ValueError, match=r"^initial_state is too large: .*overflowed float32.*k3lab.kda.chunk_kda"):
        flash_kda(*ours[:7], initial_state=huge)


@INTERPRETER_OVERFLOW
@pytest.mark.timeout(300)
def test_nan_input_still_named():
    """The value checks now read their flags after the kernels (one sync): a NaN input is still named."""
    ours, _ = flash_inputs()
    ours[2] = ours[2].index_fill(1, torch.tensor([3], device=DEVICE), float("nan"))
    with pytest.raises(ValueError, match=r"^v contains NaN or inf$"):
        flash_kda(*ours[:7], initial_state=ours[7])
