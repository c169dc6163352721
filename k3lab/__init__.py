"""k3lab: Kimi K3's infrastructure rebuilt from scratch, one component per chapter.

Dimension letters used throughout (fla's conventions):
    B  batch size              T  sequence length (tokens)
    H  query/key heads         HV value heads (a multiple of H; GVA when HV > H)
    K  key head dim            V  value head dim
    N  number of sequences (varlen, from cu_seqlens)
    E  experts   S  tokens per rank   R  ranks   C  chunk size
"""
from k3lab._setup import setup

__version__ = "0.1.0"
__all__ = ["setup", "__version__"]
