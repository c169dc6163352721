"""Triton kernels for MoonEP: App. E's constructive fill in one kernel launch."""
from k3lab.kernels.moonep.fill import MAX_BLOCK_L, MAX_TILE, fill_fits, plan_fill

__all__ = ["plan_fill", "fill_fits", "MAX_BLOCK_L", "MAX_TILE"]
