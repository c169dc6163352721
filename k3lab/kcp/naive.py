"""The KCP reference: gather the whole sequence on every rank and run one-process KDA.

Communication grows with T (every rank receives all R * T_local tokens of q, k, v, g, beta), which
is exactly what KCP avoids; use it to check KCP, never to train.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3lab.kcp.context import KCPContext, check_context
from k3lab.kcp.kcp import gather_from_group
from k3lab.kda import chunk_kda
from k3lab.kda.checks import check_cu_seqlens, check_kda_inputs


def naive_kcp_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    ctx: KCPContext, scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``kcp_kda`` (local [1, T_local, ...] inputs, final-state rows only on the
    rank holding each document's end), computed by all-gathering every input along T (backward:
    reduce-scatter) and running ``chunk_kda`` on the whole sequence: the reference KCP is checked
    against (K3 report, Sec. 2.2).

    Args:
        q, k (Tensor): [1, T_local, H, K]; v (Tensor): [1, T_local, HV, V]; g (Tensor): [1, T_local, HV, K]
            log-decay <= 0; beta (Tensor): [1, T_local, HV]; all one float dtype. ctx (KCPContext): the
            group and layout; scale, initial_state ([N, HV, K, V]), output_final_state (bool),
            chunk_size: as in ``chunk_kda``.

    Returns:
        (o [1, T_local, HV, V] in q's dtype, final_state [N, HV, K, V] float32 (float64 for float64
        inputs) or None), as ``kcp_kda``.

    Raises:
        ValueError: ctx not a KCPContext or layout-only (``check_context``), the local inputs'
            errors of ``check_kda_inputs`` (as ``kcp_kda``: shapes, dtypes, output_final_state not a
            bool), and ``chunk_kda``'s on the gathered ones.
    """
    check_context(ctx)
    local_cu = torch.tensor(ctx.local_cu_seqlens) if len(ctx.local_docs) > 1 else None
    check_kda_inputs(q, k, v, g, beta, None, local_cu, output_final_state=output_final_state)
    full = [gather_from_group(x[0], ctx, f"naive_{name}").flatten(0, 1)[None]
            for name, x in zip("qkvgb", (q, k, v, g, beta))]
    cu = torch.tensor(ctx.seq_bounds, device=q.device) if ctx.N > 1 else None
    o, final = chunk_kda(*full, scale=scale, initial_state=initial_state, output_final_state=True,
                         cu_seqlens=cu, chunk_size=chunk_size)
    o = o[:, ctx.start : ctx.stop]
    if not output_final_state:
        return o, None
    mine = torch.tensor([ctx.rank_of(ctx.seq_bounds[n + 1] - 1) == ctx.rank for n in range(ctx.N)],
                        device=final.device)
    return o, final * mine[:, None, None, None].to(final.dtype)


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """One-process depthwise causal convolution, one ``F.conv1d`` per document (zero left padding).

    Args:
        x (Tensor): [1, T, D]; weight (Tensor): [D, W]; cu_seqlens (list[int] | None): N+1 offsets.

    Returns:
        Tensor: [1, T, D].

    Raises:
        ValueError: cu_seqlens not N+1 strictly increasing offsets from 0 to T (``check_cu_seqlens``;
            offsets past T gave a longer output).
    """
    T, D = x.shape[1:]
    W = weight.shape[1]
    if cu_seqlens is not None:
        check_cu_seqlens(torch.as_tensor(cu_seqlens), T)
    bounds = cu_seqlens if cu_seqlens is not None else [0, T]
    outs = [F.conv1d(x[0, a:b].T[None], weight[:, None, :], padding=W - 1, groups=D)[0, :, : b - a].T
            for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs)[None]
