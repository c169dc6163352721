"""FlashKDA's forward: outputs and final states against the float64 reference (``kda_check`` also runs
the backward), at odd sizes, GVA, K tiles, precisions and launch settings; inference and training
forwards agree; the benchmark's command line.

Float32 kernels (TRITON_INTERPRET=1 on CPU, set by tests/conftest.py) against ``k3lab.kda.naive_fused_kda``
in float64; the bf16 GPU check is ``python -m k3lab.bench.flash_kda --check-only``.
"""
import pytest
import torch
import triton

from k3lab.kernels.kda import chunk_bwd, chunk_fwd, flash_kda
from k3lab.kernels.kda.utils import chunk_index, launch_fitting
from k3lab.testing import DEVICE, FLASH_KDA_ARGS, FLASH_KDA_TOL_OUT, assert_close


@pytest.mark.timeout(300)
def test_gva_batch_tail_chunk(kda_check, kda_inputs):
    """B=2, GVA (2 value heads per q/k head), T = 70: a full chunk plus a 6-token tail."""
    kda_check(kda_inputs(2, 70, 1, 2, 16, 16))


@pytest.mark.timeout(300)
def test_short_sequence_T_below_16(kda_check, kda_inputs):
    """T = 5 < 16: one partial sub-tile; K = 32, V = 16 (K != V)."""
    kda_check(kda_inputs(1, 5, 1, 1, 32, 16, seed=2))


def test_training_after_inference_mode_at_the_same_shape(kda_inputs):
    """The cached chunk tables were built under torch.inference_mode() when the first call at a shape
    came from evaluation: they were inference tensors, and every later training call at that shape
    failed in save_for_backward ("Inference tensors cannot be saved for backward")."""
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in kda_inputs(1, 9, 1, 1, 16, 16, seed=14))
    with torch.inference_mode():
        o_eval, _ = flash_kda(q, k, v, z, beta, A_log, dt_bias, cu_seqlens=torch.tensor([0, 2, 9], device=DEVICE))
    q.requires_grad_()
    o, _ = flash_kda(q, k, v, z, beta, A_log, dt_bias, cu_seqlens=torch.tensor([0, 2, 9], device=DEVICE))
    o.sum().backward()
    assert torch.equal(o.detach(), o_eval) and torch.isfinite(q.grad).all()


def test_no_grad_matches_and_no_state(kda_inputs, kda_reference):
    """Inference (no autograd: intermediates in the input dtype), no initial or final state."""
    q, k, v, z, beta, A_log, dt_bias, _ = kda_inputs(1, 20, 1, 1, 16, 16, seed=7)
    with torch.no_grad():
        o, s = flash_kda(*(x.float().to(DEVICE) for x in (q, k, v, z, beta, A_log, dt_bias)))
    assert s is None
    o_ref, _ = kda_reference(q, k, v, z, beta, A_log, dt_bias)
    assert_close("o", o_ref, o.cpu(), FLASH_KDA_TOL_OUT)


@pytest.mark.timeout(300)
def test_same_results_as_kdalayer_reference_op(kda_inputs):
    """KDALayer runs flash_kda on CUDA and ``reference_kda_op`` elsewhere: same signature, same results."""
    from k3lab.kda.layer import reference_kda_op

    q, k, v, z, beta, A_log, dt_bias, h0 = (x.float() for x in kda_inputs(1, 20, 1, 2, 16, 16, seed=9))
    o_ref, s_ref = reference_kda_op(q, k, v, z, beta, A_log, dt_bias, initial_state=h0, output_final_state=True)
    with torch.no_grad():
        o, s = flash_kda(*(x.to(DEVICE) for x in (q, k, v, z, beta, A_log, dt_bias)),
                         initial_state=h0.to(DEVICE), output_final_state=True)
    assert_close("o", o_ref, o.cpu(), FLASH_KDA_TOL_OUT)
    assert_close("final_state", s_ref, s.cpu(), FLASH_KDA_TOL_OUT)


@pytest.mark.timeout(300)
def test_float16_inference_is_finite(kda_inputs, kda_reference):
    """float16 without autograd used float16 intermediates: a diagonal sub-tile's factor
    exp(r - G_j) reaches exp(8 |lower_bound|) = e^40 > float16's max, so every output from T ~ 10 on
    was NaN. T = 20 with the default lower bound."""
    q, k, v, z, beta, A_log, dt_bias, _ = kda_inputs(1, 20, 1, 1, 16, 16, seed=11)
    o_ref, _ = kda_reference(q, k, v, z, beta, A_log, dt_bias)
    with torch.no_grad():
        o, _ = flash_kda(*(x.half().to(DEVICE) for x in (q, k, v, z, beta)), A_log.float().to(DEVICE),
                         dt_bias.float().to(DEVICE))
    assert o.dtype == torch.float16
    assert_close("o", o_ref, o.cpu(), 5e-3)


@pytest.mark.timeout(300)
def test_bfloat16_forward_and_backward(kda_inputs, kda_reference):
    """bfloat16 q, k, v, z, beta: on CPU the bf16 intermediates went through the Triton interpreter,
    which has no bf16 arithmetic, and every output and gradient was garbage (relative error ~1e12)."""
    inputs = kda_inputs(1, 20, 1, 1, 16, 16, seed=15)
    ref = [x.clone().requires_grad_() for x in inputs[:7]]
    ours = [x.to(DEVICE, torch.bfloat16 if i < 5 else torch.float32).requires_grad_() for i, x in enumerate(inputs[:7])]
    o, _ = flash_kda(*ours)
    o_ref, _ = kda_reference(*ref)
    assert o.dtype == torch.bfloat16
    assert_close("o", o_ref, o.cpu(), 1e-2)
    # Without autograd a GPU's bf16 forward runs the packed gate and the fused inverse + W/U kernel: G
    # rebuilt to within 6.1e-4, so the same output to bf16's rounding; on CPU (float32 intermediates)
    # the autograd forward's path, bit for bit.
    with torch.no_grad():
        o_inference = flash_kda(*ours)[0]
    assert_close("o without autograd", o_ref, o_inference.cpu(), 1e-2)
    assert DEVICE == "cuda" or torch.equal(o_inference, o)
    do = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (o.double().cpu() * do).sum().backward()
    (o_ref * do).sum().backward()
    for name, a, b in zip(FLASH_KDA_ARGS, ref, ours):
        assert_close(f"d{name}", a.grad, b.grad.cpu(), 2e-2)


def test_layer_dispatch_takes_numpy_lower_bounds(kda_inputs):
    """KDALayer's CUDA operator sent np.float32(-12) to flash_kda (which refuses < -10) instead of the
    reference: its "too low" test knew only int and float. On a CPU the kernels run under the interpreter."""
    import numpy as np

    from k3lab.kda.layer import _kda_op, reference_kda_op

    op = _kda_op(torch.device("cuda"), "lower_bounded", 16)
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in kda_inputs(1, 20, 1, 1, 16, 16))
    for lb in (np.float32(-12.0), np.float64(-3.0)):
        o, _ = op(q, k, v, z, beta, A_log, dt_bias, lower_bound=lb)
        o_ref, _ = reference_kda_op(q, k, v, z, beta, A_log, dt_bias, lower_bound=float(lb), chunk_size=16)
        print(f"lower_bound {lb!r}: {assert_close('o', o_ref, o, FLASH_KDA_TOL_OUT):.1e}")


def test_bench_flash_kda_help_names_the_module(capsys):
    """--help printed `usage: flash_kda.py`; it must show how the bench is run."""
    from k3lab.bench import flash_kda as bench

    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m k3lab.bench.flash_kda "), out[:80]


def test_bench_takes_fla_times_from_several_files(tmp_path):
    """--fla-from FILE...: the first file with a time for a shape wins, and each time says which run
    timed fla (a live run's date, or the date its file took the time from); a bad file is named."""
    import json

    from k3lab.bench.flash_kda import fla_times

    def case(B, fwd):
        return {"B": B, "T": 8192, "H": 16, "K": 128, "fla_fwd_ms": fwd, "fla_fwd_bwd_ms": None if fwd is None
                else 4 * fwd, "fla_peak_mib": 1.0}

    copied = {"versions": {"fla_times_from": "10:51"}, "date": "18:37", "cases": [case(1, 0.9), case(2, None)]}
    live = {"versions": {"fla-core": "0.6.0"}, "date": "18:54", "cases": [case(1, 0.5), case(2, 1.2), case(4, 1.8)]}
    paths = []
    for name, data in (("copied", copied), ("live", live)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    times = fla_times(paths)
    assert sorted(times) == [(1, 8192, 16, 128), (2, 8192, 16, 128), (4, 8192, 16, 128)]
    assert times[1, 8192, 16, 128] == {"fla_fwd_ms": 0.9, "fla_fwd_bwd_ms": 3.6, "fla_peak_mib": 1.0,
                                       "fla_times_from": "10:51"}
    assert times[2, 8192, 16, 128]["fla_times_from"] == "18:54" and times[2, 8192, 16, 128]["fla_fwd_ms"] == 1.2
    assert fla_times(paths[::-1])[1, 8192, 16, 128]["fla_fwd_ms"] == 0.5
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        fla_times([tmp_path / "bad.json"])


def tune_with_three_configs(monkeypatch, tuned) -> list:
    """Give each autotuned kernel in ``tuned`` three configs and a stand-in benchmark that runs each twice
    (the interpreter has no timer) and picks the last; returns the list that gets one entry per timing."""
    runs = []

    def bench_twice(kernel_call, quantiles):
        kernel_call()
        kernel_call()
        runs.append(1)
        return [1.0 / len(runs)] * 3

    for fn in tuned:
        monkeypatch.setattr(fn, "configs", [triton.Config({}, num_warps=w) for w in (1, 2, 4)])
        monkeypatch.setattr(fn, "cache", {})
        monkeypatch.setitem(fn.__dict__, "do_bench", bench_twice)
    return runs


def test_autotuning_leaves_in_place_buffers_intact(monkeypatch, kda_check, kda_inputs):
    """On a GPU, Triton's autotuner runs each config of an autotuned kernel before picking one; the
    W/U, dW/dv and intra-backward kernels update buffers in place, so without ``restore_value``
    the tuning runs would add their terms several times. Here every autotuned kernel is tuned over three
    configs (``tune_with_three_configs``): the results must still match the reference."""
    from k3lab.kernels.kda import chunk_bwd, chunk_fwd

    tuned = [fn for mod in (chunk_fwd, chunk_bwd) for fn in vars(mod).values()
             if isinstance(fn, triton.runtime.Autotuner)]
    assert len(tuned) == 7
    runs = tune_with_three_configs(monkeypatch, tuned)
    kda_check(kda_inputs(1, 70, 1, 2, 16, 16, seed=11))
    # scores, inverse, W/U, dq/dk, dW/dv, intra bwd: 3 configs each (the scores kernel is tuned for the
    # float32 intermediates the interpreter runs; a fixed launch serves bf16 at K <= 128). On a GPU,
    # float32 intermediates launch dW/dv untuned (``chunk_bwd.kda_dwv_bwd``). The fused inverse + W/U
    # kernel serves 16-bit intermediates only: the next test tunes it.
    assert len(runs) == 3 * (5 if DEVICE == "cuda" else 6)


@pytest.mark.timeout(300)
def test_inverse_fused_into_wu_gives_the_split_kernels_results(monkeypatch, kda_inputs):
    """``kda_inverse_wu_fwd_kernel`` (a forward with no backward, 16-bit intermediates on a GPU: T assembled
    in registers, never stored) against ``kda_inverse_fwd_kernel`` + ``kda_wu_fwd_kernel`` on the same L:
    W and U bit for bit, on packed sequences of 20 and 70 tokens (tail chunks) with GVA, the fused kernel
    tuned over three configs (it rewrites W in place, like the W/U kernel)."""
    from k3lab.kernels.kda import chunk_fwd as cf
    from k3lab.kernels.kda.utils import chunk_index

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    inputs = kda_inputs(1, 90, 1, 2, 16, 16, N=2, seed=31)
    q, k, v, z, beta = (x[0].to(DEVICE, dtype) for x in inputs[:5])
    A_log, dt_bias = (x.float().to(DEVICE) for x in inputs[5:7])
    cu, chunk_indices, _ = chunk_index([20, 70], DEVICE)
    G, Tinv, Aqk, *split = cf.kda_intra_fwd(q, k, v, z, beta, A_log, dt_bias, 0.25, -5.0, cu, chunk_indices, dtype)
    # kda_intra_fwd picks the fused kernel for 16-bit intermediates when T is not kept.
    kept = cf.kda_intra_fwd(q, k, v, z, beta, A_log, dt_bias, 0.25, -5.0, cu, chunk_indices, dtype, keep_t=False)[1]
    assert (kept is None) == (dtype == torch.bfloat16)
    runs = tune_with_three_configs(monkeypatch, [cf.kda_inverse_wu_fwd_kernel])
    L = torch.empty(90, 2, 64, device=DEVICE)
    fused = cf._launch_intra(q, k, v, beta, G, L, None, torch.empty_like(Aqk), 0.25, cu, chunk_indices, dtype,
                             replay=False)
    assert len(runs) == 3
    for name, a, b in zip(("W", "U", "KG", "QG"), split, fused):
        assert a.abs().max() > 1e-2 and torch.equal(a, b), name


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lower_bound", [-5.0, -10.0])
def test_packed_gate_against_the_float32_gate(lower_bound, kda_inputs):
    """The packed gate (int16 codes within 16-row sub-tiles, the sub-tiles' ends E; what a forward with no
    backward runs with 16-bit intermediates) against the float32 G, on packed sequences of 20, 70 and 130
    tokens (tail chunks) with GVA, run here with float32 intermediates so the interpreter takes it: G
    rebuilt from the codes to within half their step, E equal to G at the sub-tiles' last rows, the
    scores kernel's W, KG, QG, Aqk, U and the state kernel's output and final state from it within the
    codes' rounding (a factor exp(+-step / 2) per decay term)."""
    from k3lab.kernels.kda import chunk_fwd as cf
    from k3lab.kernels.kda.utils import chunk_index

    lengths = [20, 70, 130]
    inputs = kda_inputs(1, sum(lengths), 1, 2, 16, 16, N=3, seed=41)
    q, k, v, z, beta = (x[0].to(DEVICE, torch.float32) for x in inputs[:5])
    A_log, dt_bias = (x.float().to(DEVICE) for x in inputs[5:7])
    z = 3 * z  # gates from near 0 to near the bound
    cu, chunk_indices, chunk_offsets = chunk_index(lengths, DEVICE)
    NT, (T, HV, K) = chunk_indices.shape[0], z.shape
    G, _, _ = cf.kda_gate_fwd(z, A_log, dt_bias, lower_bound, cu, chunk_indices, exact_sum=False, packed=False)
    X, E, step = cf.kda_gate_fwd(z, A_log, dt_bias, lower_bound, cu, chunk_indices, exact_sum=False, packed=True)
    assert X.dtype == torch.int16 and E.shape == (NT, HV, 4, K)
    # Rebuild G token by token: r = the previous sub-tile's end in the token's chunk (0 for the first).
    pos = torch.cat([torch.arange(n) for n in lengths]).to(DEVICE)
    length = torch.repeat_interleave(torch.tensor(lengths), torch.tensor(lengths)).to(DEVICE)
    c = chunk_offsets[:-1].long().repeat_interleave(torch.tensor(lengths, device=DEVICE)) + pos // 64
    sub = pos % 64 // 16
    r = torch.cat([torch.zeros_like(E[:, :, :1]), E[:, :, :3]], 2)[c, :, sub]
    rebuilt = r + step * (X.float() - 32767)
    assert (rebuilt - G).abs().max() <= 0.5 * step + 1e-5 * G.abs().max()
    ends = (pos % 16 == 15) | (pos == length - 1)
    assert torch.allclose(E[c[ends], :, sub[ends]], G[ends], rtol=1e-5, atol=1e-5)
    Aqk = [torch.empty(T, HV, 64, device=DEVICE) for _ in range(2)]
    L = torch.empty(T, HV, 64, device=DEVICE)
    Tinv = torch.empty(T, HV, 64, device=DEVICE)
    ref = cf._launch_intra(q, k, v, beta, G, L, Tinv, Aqk[0], 0.25, cu, chunk_indices, torch.float32, replay=False)
    packed = cf._launch_intra(q, k, v, beta, X, L, Tinv, Aqk[1], 0.25, cu, chunk_indices, torch.float32,
                              replay=False, E=E, x_scale=step)
    bound = 2 * step
    for name, a, b in zip(("W", "U", "KG", "QG", "Aqk"), (*ref, Aqk[0]), (*packed, Aqk[1])):
        assert_close(name, a, b, bound)
    outs = []
    for (W, U, KG, QG), gate, A in ((ref, G, Aqk[0]), (packed, E, Aqk[1])):
        o = torch.empty(T, HV, 16, device=DEVICE)
        outs += [o, cf.kda_state_fwd(W, U, KG, gate, None, True, cu, chunk_offsets, NT, store_states=False,
                                     output=(QG, A, o))[2]]
    assert_close("o", outs[0], outs[2], bound)
    assert_close("final state", outs[1], outs[3], bound)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("K, V", [(48, 40), (24, 20)], ids=["K48-V40", "K24-V20"])
def test_k_not_a_multiple_of_the_k_tile(K, V, kda_check, kda_inputs):
    """K = 48: two K tiles of 32 in the intra backward (the second half masked), state halves of 32 rows
    (rows 48..63 masked); K = 24: one partial K tile, state halves of 16 (the second 8 rows). GVA 2,
    T = 70 (a full chunk and a 6-token tail), initial and final state."""
    kda_check(kda_inputs(1, 70, 1, 2, K, V, seed=21))


@pytest.mark.timeout(300)
def test_largest_k(kda_check, kda_inputs):
    """K = 256 (the limit): 8 K tiles in the intra backward, state halves of 128 rows; T = 20. (On an
    H200 the state kernels' shared memory at K = 256 fits 1 or 2 pipeline stages, not 3: ``launch_fitting``.)"""
    kda_check(kda_inputs(1, 20, 1, 1, 256, 16, seed=22))


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
def test_gpu_tile_sizes(monkeypatch, kda_check, kda_inputs):
    """The tiles only a GPU picks, here under the interpreter: the state kernels' V tile of 16 (several
    V tiles per value head with the state in two K halves) and the dq/dk and dW/dv kernels' V tile of 32.
    K = 48, V = 40."""
    for mod in (chunk_fwd, chunk_bwd):
        monkeypatch.setattr(mod, "state_tile", lambda N, HV, V, device: 16)
    tiles = chunk_bwd._dqkw_tiles
    monkeypatch.setattr(chunk_bwd, "_dqkw_tiles", lambda K, V, cuda: tiles(K, V, True))
    kda_check(kda_inputs(1, 70, 1, 1, 48, 40, seed=24))
