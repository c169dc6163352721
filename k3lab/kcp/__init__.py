"""KCP: KDA context parallelism. Each rank's tokens act on the state as an affine map
S -> M S + S~; one all-gather of these fixed-size maps, a fold, then local chunkwise KDA.

Public: ``make_context``/``KCPContext`` (group and layout), ``kcp_kda`` (the entry, local KDA in
PyTorch), ``kcp_flash_kda`` (the entry on the FlashKDA Triton kernels), ``kcp_short_conv`` (the conv
halo), ``naive_kcp_kda`` (gather-everything reference).
"""
from k3lab.kcp.context import CommLog, KCPContext, make_context
from k3lab.kcp.conv import kcp_short_conv
from k3lab.kcp.kcp import kcp_kda
from k3lab.kcp.naive import naive_kcp_kda, short_conv_reference

__all__ = ["CommLog", "KCPContext", "make_context", "kcp_kda", "kcp_flash_kda", "kcp_short_conv",
           "naive_kcp_kda", "short_conv_reference"]


def __getattr__(name):
    # k3lab.kcp.flash defines Triton kernels on import: loaded on first use, so importing k3lab.kcp
    # never defines them before k3lab.setup() sets TRITON_INTERPRET on a CPU-only machine.
    if name == "kcp_flash_kda":
        from k3lab.kcp.flash import kcp_flash_kda

        return kcp_flash_kda
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
