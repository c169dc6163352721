"""FlashKDA: fused Triton kernels for chunkwise Kimi Delta Attention, forward and backward.

``flash_kda`` (in ``fused.py``) is the public entry point. On a CPU-only machine call
``k3lab.setup()`` before importing this package (it sets TRITON_INTERPRET=1).
"""
from k3lab.kernels.kda.fused import flash_kda

__all__ = ["flash_kda"]
