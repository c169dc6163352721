"""Triton kernels for Attention Residuals: two-phase Block AttnRes training (each block stored with its
logits, phase 1 over the blocks, the per-sublayer merge), forward and backward."""
from k3lab.kernels.attnres.mix import merge_bwd, merge_fwd, phase1_bwd, phase1_fwd, store_block

__all__ = ["store_block", "phase1_fwd", "phase1_bwd", "merge_fwd", "merge_bwd"]
