"""Shared fixtures of the kernel and layer tests: the device, the Triton interpreter switch, FlashKDA's input
builder, its float64 reference and comparison, and AttnRes's reference sublayers.

On a machine without CUDA the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``), which
Triton reads when a kernel is defined: this file is imported before any test module, so before
``k3lab.kernels``. Test files take what they share from here, never from each other.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# The device, FlashKDA's argument names and its tolerances, shared with the test files.
from k3lab.testing import DEVICE, FLASH_KDA_ARGS, FLASH_KDA_TOL_GRAD, FLASH_KDA_TOL_OUT  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreted_ranks: spawns gloo ranks that run the Triton kernels under "
                                       "the interpreter (skipped where numpy is too new for it)")


def pytest_collection_modifyitems(config, items):
    # KCP tests whose gloo ranks run the kernels under the interpreter even on a GPU machine: an environment
    # not built from the project's pins (a newer numpy) cannot run them.
    marked = [item for item in items if item.get_closest_marker("interpreted_ranks")]
    if not marked:
        return
    from k3lab.kernels import numpy_supports_interpreter

    if not numpy_supports_interpreter():
        skip = pytest.mark.skip(reason="Triton 3.6's interpreter needs numpy<2.4 (the project's pin)")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """"cuda" where a GPU is present, else "cpu" (the kernels then run under the interpreter)."""
    return DEVICE


def _kda_inputs(B, T, H, HV, K, V, N=None, seed=0):
    """Fresh float64 inputs of the fused KDA op: q, k [B, T, H, K], v [B, T, HV, V], z [B, T, HV, K], beta
    logits [B, T, HV], A_log [HV], dt_bias [HV * K], initial state [N or B, HV, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return [r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), r(B, T, HV, K), r(B, T, HV),
            0.5 * r(HV), 0.5 * r(HV * K), r(N or B, HV, K, V)]


def _kda_check(inputs, cu_seqlens=None, lower_bound=-5.0, vanishing=(), gate_tol=FLASH_KDA_TOL_GRAD):
    """Forward (with autograd recording, and without: only the first stores the chunk states), final
    state and every gradient of flash_kda (float32) vs ``naive_fused_kda`` in float64; gradients named in
    ``vanishing`` are ~0 in the reference and must be ~0 (< 1e-30) here too."""
    from k3lab.kda import naive_fused_kda
    from k3lab.kernels.kda import flash_kda
    from k3lab.testing import assert_close

    ours = [x.float().to(DEVICE).requires_grad_() for x in inputs]
    ref = [x.clone().requires_grad_() for x in inputs]
    cu_dev = cu_seqlens.to(DEVICE) if cu_seqlens is not None else None
    run = lambda: flash_kda(*ours[:7], initial_state=ours[7], output_final_state=True,  # noqa: E731
                            cu_seqlens=cu_dev, lower_bound=lower_bound)
    o_ref, s_ref = naive_fused_kda(*ref[:7], initial_state=ref[7], cu_seqlens=cu_seqlens, lower_bound=lower_bound)
    with torch.no_grad():
        o, s = run()
    assert_close("o (no autograd)", o_ref, o.cpu(), FLASH_KDA_TOL_OUT)
    assert_close("final_state (no autograd)", s_ref, s.cpu(), FLASH_KDA_TOL_OUT)
    o, s = run()
    assert_close("o", o_ref, o.cpu(), FLASH_KDA_TOL_OUT)
    assert_close("final_state", s_ref, s.cpu(), FLASH_KDA_TOL_OUT)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    ds = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64)
    ((o.double().cpu() * do).sum() + (s.double().cpu() * ds).sum()).backward()
    ((o_ref * do).sum() + (s_ref * ds).sum()).backward()
    for name, a, b in zip(FLASH_KDA_ARGS, ref, ours):
        if name in vanishing:
            assert a.grad.abs().max() < 1e-30 and b.grad.abs().max() < 1e-30, name
        else:
            tol = gate_tol if name in ("z", "A_log", "dt_bias") else FLASH_KDA_TOL_GRAD
            assert_close(f"d{name}", a.grad, b.grad.cpu(), tol)


def _kda_run_both(inputs, want=FLASH_KDA_ARGS, cu_seqlens=None, lower_bound=-5.0, scale=None, ref_dtype=torch.float64):
    """flash_kda (float32) and ``naive_fused_kda`` (``ref_dtype``) on the same inputs (None entries skipped),
    the loss <o, do> + <final state, ds> backpropagated through both. Returns (ours, ref): each a dict of o,
    final state and the gradients of the inputs named in ``want``."""
    from k3lab.kda import naive_fused_kda
    from k3lab.kernels.kda import flash_kda

    gen = torch.Generator().manual_seed(1)
    do = ds = None
    out = []
    for fn, dtype, device in ((flash_kda, torch.float32, DEVICE), (naive_fused_kda, ref_dtype, "cpu")):
        xs = [None if x is None else x.detach().to(device, dtype, copy=True).requires_grad_(n in want)
              for n, x in zip(FLASH_KDA_ARGS, inputs)]
        cu = None if cu_seqlens is None else cu_seqlens.to(device)
        o, s = fn(*xs[:7], scale=scale, initial_state=xs[7], output_final_state=True, cu_seqlens=cu,
                  lower_bound=lower_bound)
        if do is None:
            do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
            ds = torch.randn(s.shape, generator=gen, dtype=torch.float64)
        ((o.double().cpu() * do).sum() + (s.double().cpu() * ds).sum()).backward()
        res = {"o": o.detach().cpu(), "final_state": s.detach().cpu()}
        res.update({f"d{n}": x.grad.cpu() for n, x in zip(FLASH_KDA_ARGS, xs) if n in want and x is not None})
        out.append(res)
    return out


@pytest.fixture
def kda_inputs():
    """``kda_inputs(B, T, H, HV, K, V, N=None, seed=0)``: fresh float64 inputs of the fused KDA op."""
    return _kda_inputs


@pytest.fixture
def kda_reference():
    """``k3lab.kda.naive_fused_kda``: the fused op's float64 reference, as the bench and chapter 02 use it."""
    from k3lab.kda import naive_fused_kda

    return naive_fused_kda


@pytest.fixture
def kda_check():
    """``kda_check(inputs, cu_seqlens=None, lower_bound=-5.0, vanishing=(), gate_tol=...)``: flash_kda's
    outputs, final state and all 8 gradients against the float64 reference, with and without autograd."""
    return _kda_check


@pytest.fixture
def kda_run_both():
    """``kda_run_both(inputs, want, cu_seqlens, lower_bound, scale, ref_dtype) -> (ours, ref)`` dicts of o,
    final state and the gradients named in ``want``."""
    return _kda_run_both


class _DoublesItsInput(torch.nn.Module):
    """A sublayer that doubles its input in place, then applies ``inner`` to it."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, h):
        return self.inner(h.mul_(2))


def _uniform_block_average(h0: torch.Tensor, sublayers, n_blocks: int) -> torch.Tensor:
    """Block AttnRes with every pseudo-query zero, written without softmax: each read is the plain mean of
    its sources (completed blocks and the running partial sum), the output the mean of all blocks.
    h0 [B, T, d] -> [B, T, d]."""
    from k3lab.attnres import block_sizes

    blocks, layer = [h0], 0
    for size in block_sizes(len(sublayers), n_blocks):
        partial = None
        for _ in range(size):
            sources = blocks + ([partial] if partial is not None else [])
            v = sublayers[layer](sum(sources) / len(sources))
            partial = v if partial is None else partial + v
            layer += 1
        blocks.append(partial)
    return sum(blocks) / len(blocks)


@pytest.fixture
def doubles_its_input():
    """The class of a sublayer that doubles its input in place before ``inner`` (AttnRes's in-place cases)."""
    return _DoublesItsInput


@pytest.fixture
def uniform_block_average():
    """Block AttnRes at zero pseudo-queries, written as plain means: ``(h0, sublayers, n_blocks) -> out``."""
    return _uniform_block_average


def _assert_all_close(ours, ref, tol=FLASH_KDA_TOL_GRAD, skip=()):
    """Every entry of ``ref`` (a ``kda_run_both`` dict) against ``ours`` within ``tol``, except ``skip``."""
    from k3lab.testing import assert_close

    for name in ref:
        if name not in skip:
            print(f"{name}: {assert_close(name, ref[name], ours[name], tol):.1e}")


@pytest.fixture
def assert_all_close():
    """``assert_all_close(ours, ref, tol=..., skip=())`` over two ``kda_run_both`` dicts."""
    return _assert_all_close


def _compile_sm90_lines(script: str, timeout: float = 600) -> list[str]:
    """Run ``script`` (which prints ``sm90_compile.compile_sm90`` lines) in a fresh process without
    TRITON_INTERPRET, where the interpreter's leniency cannot hide what the GPU compiler refuses; its stdout
    lines. Fails the test with the script's stderr when it does not exit 0."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


@pytest.fixture
def compile_sm90_lines():
    """``_compile_sm90_lines``: compile kernels for sm_90 in a subprocess (no GPU needed)."""
    return _compile_sm90_lines


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def one_thread():
    """``with one_thread(): ...`` runs torch on one thread inside the block and restores the count after: on
    two shared cores one thread keeps a k3-tiny training step short (two threads contend). Session-scoped, so
    module fixtures can use it."""
    return _one_thread


def _check_dtype_guard(who: str, name: str, run, x: torch.Tensor) -> None:
    """A float32 module ``run`` (x -> its output tensor) on ``x`` in other dtypes. Under CPU bf16 autocast a
    bf16 ``x`` runs (training's normal path) to a finite output; outside autocast a bf16 or float64 ``x``,
    and under autocast a float64 one (autocast casts no float64), is a ValueError naming ``name``'s dtype,
    the module's and both remedies, raised before any host read."""
    from k3lab.testing import forbid_host_sync

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = run(x.bfloat16())
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    for dtype, autocast in ((torch.bfloat16, False), (torch.float64, False), (torch.float64, True)):
        want = rf"{who}: {name} is {dtype} but the module's parameters are torch.float32; .*autocast.*\.to\("
        with (torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), forbid_host_sync(x.device),
              pytest.raises(ValueError, match=want)):
            run(x.to(dtype))


@pytest.fixture
def check_dtype_guard():
    """``check_dtype_guard(who, name, run, x)``: a module refuses a mismatched input dtype outside autocast
    and runs under it (``_check_dtype_guard``)."""
    return _check_dtype_guard
