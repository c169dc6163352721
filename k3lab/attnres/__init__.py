"""Attention Residuals (AttnRes paper, arXiv 2603.15031; K3 report, Sec. 2): attention over depth
replaces the residual stream.

- ``naive``: the formula (``naive_attnres``, ``naive_block_attnres``), the reference.
- ``mix``: depth-softmax reads with recompute-in-backward over a shared ``DepthBuffer``
  (``read``; ``depth_mix`` for one stand-alone read), PyTorch backend; the Triton backend is
  ``k3lab.kernels.attnres``.
- ``block``: the residual modules ``BlockAttnRes`` and ``AttnRes`` (memory-efficient training path).
- ``inference``: the two-phase inference path (``block_attnres_inference``).
- ``memory``: ``retained_bytes``, the activation memory a forward leaves for backward.
"""
from k3lab.attnres.block import AttnRes, BlockAttnRes
from k3lab.attnres.inference import block_attnres_inference
from k3lab.attnres.memory import retained_bytes
from k3lab.attnres.mix import depth_mix
from k3lab.attnres.naive import block_sizes, depth_attention, naive_attnres, naive_block_attnres

__all__ = [
    "AttnRes", "BlockAttnRes", "block_attnres_inference", "block_sizes", "depth_attention", "depth_mix",
    "naive_attnres", "naive_block_attnres", "retained_bytes",
]
