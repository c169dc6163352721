"""Attention Residuals (AttnRes paper, arXiv 2603.15031; K3 report, Sec. 2): attention over depth
replaces the residual stream.

- ``naive``: the formula (``naive_attnres``, ``naive_block_attnres``), the reference.
- ``mix``: the two-phase mixing's closed forms (phase 1 over a block's completed blocks for all
  its sublayers; the per-sublayer merge; forward and backward), PyTorch backend; the Triton
  backend is ``k3lab.kernels.attnres``.
- ``train``: the memory-efficient training path built from them (``block_attnres_train``).
- ``block``: the residual modules ``BlockAttnRes`` and ``AttnRes``.
- ``inference``: the two-phase inference path (``block_attnres_inference``).
- ``stage``: one pipeline stage's sublayers from the carried blocks (``block_attnres_stage``,
  ``carried_sources``).
- ``memory``: ``retained_bytes``, the activation memory a forward leaves for backward.
- ``traffic``: the bytes the mixing moves per training step (``bytes_model``) and the floor under
  any fused implementation (``bytes_floor``).
"""
from k3lab.attnres.block import AttnRes, BlockAttnRes
from k3lab.attnres.inference import block_attnres_inference
from k3lab.attnres.memory import retained_bytes
from k3lab.attnres.naive import block_sizes, depth_attention, naive_attnres, naive_block_attnres
from k3lab.attnres.stage import block_attnres_stage, carried_sources
from k3lab.attnres.train import block_attnres_train

__all__ = [
    "AttnRes", "BlockAttnRes", "block_attnres_inference", "block_attnres_stage", "block_attnres_train",
    "block_sizes", "carried_sources", "depth_attention", "naive_attnres", "naive_block_attnres", "retained_bytes",
]
