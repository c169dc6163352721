"""FlashKDA: fused Triton kernels for chunkwise Kimi Delta Attention, forward and backward.

``flash_kda`` (in ``fused.py``) is the public entry point; ``short_conv_silu`` (in ``short_conv.py``) fuses
the layer's short convolutions with their SiLU. On a CPU-only machine call ``k3lab.setup()`` before
importing this package (it sets TRITON_INTERPRET=1).
"""
from k3lab.kernels.kda.fused import flash_kda
from k3lab.kernels.kda.short_conv import short_conv_silu

__all__ = ["flash_kda", "short_conv_silu"]
