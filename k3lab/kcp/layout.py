"""What each rank of a ``kcp_flash_kda`` call sends and folds, as labels and as a drawing.

Read off ``KCPContext`` alone (no process group, no kernels), for the book and for anyone checking a
document layout before a run:

    import matplotlib.pyplot as plt
    from k3lab.kcp.layout import draw_layout
    fig, ax = plt.subplots(figsize=(10, 3))
    draw_layout(128, (0, 10, 80, 96, 100, 128), 4, ax)
"""
from __future__ import annotations

from typing import Sequence

from k3lab.kcp.context import KCPContext, make_context


def sent_map(ctx: KCPContext) -> str:
    """The map ``ctx``'s rank contributes to ``kcp_flash_kda``'s forward all-gather (flash.py, step 2).

    Returns:
        str: ``"[0|0] unused"`` when the rank's last piece ends its document (nobody folds the map);
        ``"[M|S̃] width K+V"`` when the rank lies wholly inside one document that continues on both
        sides (the identity-state trick, a state pass at width K+V); otherwise ``"[0|S_end]"``, the
        constant map whose ``S_end`` the rank's own state stage already produced.
    """
    if not ctx.last_continues:
        return "[0|0] unused"
    if ctx.first_continues and len(ctx.pieces()) == 1:
        return "[M|S̃] width K+V"
    return "[0|S_end]"


def folded_ranks(ctx: KCPContext) -> tuple[list[int], list[int]]:
    """The ranks whose gathered tensors ``ctx``'s rank folds.

    Returns:
        tuple[list[int], list[int]]: the ranks whose maps ``[M | S̃]`` the forward folds into the first
        piece's entering state (``fold_from`` .. rank−1, empty when the first piece starts its
        document), and the ranks whose state gradients ``b_r`` the backward folds into the last piece's
        end-state gradient (rank+1 .. ``end_rank``, empty when the last piece ends its document).
    """
    forward = list(range(ctx.fold_from, ctx.rank)) if ctx.first_continues else []
    backward = list(range(ctx.rank + 1, ctx.end_rank + 1)) if ctx.last_continues else []
    return forward, backward


def draw_layout(T: int, cu_seqlens: Sequence[int], R: int, ax) -> None:
    """Draw R ranks' pieces of the documents in ``cu_seqlens`` on ``ax``: documents as coloured boxes,
    the map each rank sends above it, red arrows to a rank from the ranks whose maps it folds forward,
    blue arrows from the ranks whose state gradients it folds backward.

    Args:
        T (int): global tokens, a multiple of R.
        cu_seqlens (Sequence[int]): global document offsets, 0 ... T, strictly increasing.
        R (int): ranks (world size).
        ax (matplotlib.axes.Axes): where to draw.

    Raises:
        ValueError: from ``make_context`` when T, cu_seqlens or R do not make a layout.
    """
    from matplotlib.patches import FancyArrowPatch, Rectangle
    from matplotlib.pyplot import cm

    ctxs = [make_context(T, cu_seqlens, rank=r, world_size=R) for r in range(R)]
    for r, ctx in enumerate(ctxs):
        for n, a, b in ctx.pieces():
            ax.add_patch(Rectangle((a, 0), b - a, 1, facecolor=cm.tab10.colors[n % 10], edgecolor="k", alpha=0.75))
            ax.text((a + b) / 2, 0.5, f"doc {n}", ha="center", va="center", fontsize=8)
        ax.axvline(ctx.start, color="k", lw=2)
        _, a, b = ctx.pieces()[-1]
        ax.text((ctx.start + ctx.stop) / 2, 1.62, f"rank {r}", ha="center", fontsize=9, weight="bold")
        ax.annotate("", xy=(a, 1.06), xytext=(b, 1.06), arrowprops=dict(arrowstyle="|-|", lw=1))
        ax.text((a + b) / 2, 1.15, sent_map(ctx), ha="center", fontsize=7)
        forward, backward = folded_ranks(ctx)
        for j in forward:
            src = (ctxs[j].start + ctxs[j].stop) / 2
            ax.add_patch(FancyArrowPatch((src, -0.05), (ctx.start + 2, -0.05), connectionstyle="arc3,rad=0.35",
                                         arrowstyle="-|>", mutation_scale=10, color="crimson"))
        for j in backward:
            src = (ctxs[j].start + ctxs[j].stop) / 2
            ax.add_patch(FancyArrowPatch((src, -0.1), (ctx.stop - 2, -0.1), connectionstyle="arc3,rad=-0.25",
                                         arrowstyle="-|>", mutation_scale=10, color="royalblue"))
    ax.axvline(T, color="k", lw=2)
    ax.set(xlim=(-2, T + 2), ylim=(-1.5, 1.9), yticks=[], xlabel="global token")
    ax.set_title("kcp_flash_kda: maps folded forward (red), state gradients folded backward (blue)", fontsize=10)
