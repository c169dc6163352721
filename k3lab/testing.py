"""The comparison helpers every fast path in k3lab is checked with, the device and tolerances the kernel tests
share, and the guard against host syncs that the benchmarks and the trainer's --sync-debug (on CUDA) use."""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

# The tensor methods that read a value back to the host; the CPU form of ``forbid_host_sync`` patches them.
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

# Where the kernel tests run: the GPU when there is one, else the CPU, with the Triton kernels under the
# interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The fused KDA op's tensor inputs in the order of ``k3lab.kernels.kda.flash_kda``'s arguments (the initial
# state, a keyword there, last), as the tests build them and name their gradients (``dz``, ``dbeta_logits``).
FLASH_KDA_ARGS = ("q", "k", "v", "z", "beta_logits", "A_log", "dt_bias", "initial_state")
# Bounds on RMS(out - ref) / RMS(ref) of flash_kda's float32 kernels against the float64 reference: about
# 1e-6 on a CPU; tf32 dots on a GPU need the slack.
FLASH_KDA_TOL_OUT = 1e-4 if DEVICE == "cpu" else 5e-3
FLASH_KDA_TOL_GRAD = 1e-4 if DEVICE == "cpu" else 1e-2


def rel_rms_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """RMS(out - ref) / RMS(ref), computed in float64 (broadcast as ``out - ref``; ``assert_close`` checks
    the shapes). NaN/inf anywhere gives ``inf``; empty tensors give 0."""
    if ref.numel() == 0 and out.numel() == 0:
        return 0.0
    ref64, out64 = ref.detach().double(), out.detach().double()
    if not (torch.isfinite(ref64).all() and torch.isfinite(out64).all()):
        return float("inf")
    diff = (out64 - ref64).pow(2).mean().sqrt()
    scale = ref64.pow(2).mean().sqrt()
    return float(diff / scale) if scale > 0 else float(diff)


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float) -> float:
    """Assert RMS(out - ref) / RMS(ref) <= tol; returns the ratio.

    Raises:
        AssertionError: shapes differ, a NaN/inf appears, or the ratio exceeds ``tol``; the message
            gives the ratio and the max absolute error.
        ValueError: ``tol`` not a finite number >= 0.
    """
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < float("inf"):
        raise ValueError(f"assert_close: tol must be a finite number >= 0, got {tol!r}")
    if ref.shape != out.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    err = rel_rms_error(ref, out)
    max_abs = (out.detach().double() - ref.detach().double()).abs().max().item() if ref.numel() else 0.0
    if not err <= tol:
        raise AssertionError(f"{name}: rel RMS error {err:.3e} > tol {tol:.1e} (max abs err {max_abs:.3e})")
    return err


@contextlib.contextmanager
def forbid_host_sync(device: torch.device):
    """On CUDA: ``torch.cuda.set_sync_debug_mode("error")``; on CPU: the host-reading tensor methods
    (``SYNC_METHODS``) raise. Either way a host read inside the block raises RuntimeError (on a CPU,
    where nothing is asynchronous, it stands in for the GPU check: code that passes it reads nothing back)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return

    def sync(*args, **kwargs):
        raise RuntimeError("host synchronisation: a tensor value read on the host")

    with contextlib.ExitStack() as stack:
        for name in SYNC_METHODS:
            stack.enter_context(mock.patch.object(torch.Tensor, name, sync))
        yield
