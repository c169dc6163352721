"""Triton kernels for MoonEP: the plan (App. E's constructive fill and its derived fields) and the layout's
per-pair and per-row steps, one launch each."""
from k3lab.kernels.moonep.fill import MAX_BLOCK_L, MAX_TILE, fill_fits, plan_fill
from k3lab.kernels.moonep.layout import layout_rows

__all__ = ["plan_fill", "fill_fits", "layout_rows", "MAX_BLOCK_L", "MAX_TILE"]
