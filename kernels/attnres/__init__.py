"""Triton kernels for Attention Residuals: the depth-softmax mixing, forward and backward."""
from k3lab.kernels.attnres.mix import mix_bwd, mix_fwd

__all__ = ["mix_fwd", "mix_bwd"]
