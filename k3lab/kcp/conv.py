"""The short convolution under KCP: a halo of W-1 tokens from the previous rank.

KDA's q, k, v pass through a depthwise causal convolution of width W (K3: 4) before the recurrence.
Token t reads inputs t-W+1 ... t of its own document, so a rank's first W-1 tokens need the last
W-1 inputs of the previous rank (when the document continues across the boundary). Every rank's
last W-1 inputs are all-gathered ([R, W-1, D]: independent of T); the backward reduce-scatters the
halo's gradient back to its owner (``GatherFromGroup``).
"""
from __future__ import annotations

import torch

from k3lab.kcp.context import KCPContext, check_context
from k3lab.kcp.kcp import gather_from_group


def kcp_short_conv(x: torch.Tensor, weight: torch.Tensor, ctx: KCPContext) -> torch.Tensor:
    """Depthwise causal convolution of this rank's tokens, documents kept apart, halo from rank r-1.

    y[t, c] = sum_j weight[c, j] * x[t - (W-1) + j, c], with inputs before the start of t's
    document taken as zero (like ``KDALayer``'s ``causal_short_conv`` with no carried state).

    Args:
        x (Tensor): [1, T_local, D] this rank's inputs (T_local >= W-1 when R > 1).
        weight (Tensor): [D, W] per-channel taps (``nn.Conv1d`` depthwise weight[:, 0, :]).
        ctx (KCPContext): group and document layout.

    Returns:
        Tensor: [1, T_local, D] in x's dtype. The gradient of ``weight`` on a rank is that rank's
        contribution: sum it over the group (as for any replicated parameter).

    Raises:
        ValueError: ctx not a KCPContext or layout-only (``check_context``), x or weight not a
            floating-point tensor, x not [1, T_local, D], weight not [D, W >= 1], or T_local < W-1
            with R > 1.
    """
    check_context(ctx)
    for name, t in (("x", x), ("weight", weight)):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            # An integer x cast the taps to int (0.5 -> 0): all-zero output, no error.
            raise ValueError(f"{name} must be a floating-point tensor, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if x.ndim != 3 or x.shape[0] != 1 or x.shape[1] != ctx.T_local:
        raise ValueError(f"x must be [1, T_local={ctx.T_local}, D], got {list(x.shape)}")
    D = x.shape[2]
    if weight.ndim != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight must be [D={D}, W] with W >= 1, got {list(weight.shape)}")
    W = weight.shape[1]
    if ctx.world_size > 1 and ctx.T_local < W - 1:
        raise ValueError(f"each rank needs at least W-1={W - 1} tokens for the halo, got T_local={ctx.T_local}")
    xs = x[0]
    if W > 1:
        # Every rank's last W-1 inputs; rank r reads rank r-1's (rank 0 reads row -1, fully masked
        # below, so the autograd graph, and the order of collectives, is the same on every rank).
        tails = gather_from_group(xs[ctx.T_local - (W - 1):], ctx, "conv_halo")
        xs = torch.cat([tails[ctx.rank - 1], xs])
    # Global position of every input, and the start of the document of every output token.
    pos = torch.arange(ctx.start - (W - 1), ctx.stop, device=x.device)
    doc_start = torch.cat([
        torch.full((b - a,), ctx.seq_bounds[n], device=x.device) for n, a, b in ctx.pieces()
    ])
    # windows[t, :, j] = input at global position start + t - (W-1) + j
    windows = xs.unfold(0, W, 1)
    inside = pos.unfold(0, W, 1) >= doc_start[:, None]
    return (windows * inside[:, None, :].to(x.dtype) * weight.to(x.dtype)).sum(-1)[None]
