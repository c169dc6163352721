"""One comparison helper for every fast path in k3lab."""
from __future__ import annotations

import torch


def rel_rms_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """RMS(out - ref) / RMS(ref), computed in float64. NaN/inf anywhere gives ``inf``."""
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
    """
    if ref.shape != out.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    err = rel_rms_error(ref, out)
    max_abs = (out.detach().double() - ref.detach().double()).abs().max().item() if ref.numel() else 0.0
    if not err <= tol:
        raise AssertionError(f"{name}: rel RMS error {err:.3e} > tol {tol:.1e} (max abs err {max_abs:.3e})")
    return err
