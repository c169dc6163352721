"""Block AttnRes inference: batched inter-block attention + online-softmax merge (AttnRes paper, Sec. 4.2).

Inside block n every sublayer reads the same completed blocks b_0..b_{n-1}; only the query differs.
Phase 1 (once per block): normalise the n block keys once and, for all S queries of the block at
once, compute the inter-block logits [S, n, tokens], their max m, sum-exp l and un-normalised
weighted sums o [S, tokens, d] (one batched product instead of S separate reads).
Phase 2 (per sublayer): the intra-block source (the partial sum p) has one logit s_p; merge with
the online-softmax rule

    m' = max(m, s_p),   h = (e^{m - m'} o + e^{s_p - m'} p) / (e^{m - m'} l + e^{s_p - m'})

The block's first sublayer has no partial sum and reads o / l directly.
"""
from __future__ import annotations

import torch

from k3lab.attnres.naive import _check_inputs, block_sizes, rms_norm


def _inter_block(blocks: torch.Tensor, Q: torch.Tensor, eps: float):
    """Phase 1: blocks [n, ..., d] (compute dtype), Q [S, d] -> (m [S, ...], l [S, ...], o [S, ..., d])."""
    with torch.autocast(blocks.device.type, enabled=False):
        return _inter_block_fp32(blocks, Q, eps)


def _inter_block_fp32(blocks: torch.Tensor, Q: torch.Tensor, eps: float):
    logits = torch.einsum("sd,n...d->sn...", Q, rms_norm(blocks, eps))
    m = logits.amax(1)
    e = torch.exp(logits - m[:, None])
    return m, e.sum(1), torch.einsum("sn...,n...d->s...d", e, blocks)


@torch.no_grad()
def block_attnres_inference(h0: torch.Tensor, sublayers, queries: torch.Tensor, n_blocks: int,
                            eps: float = 1e-6, *, check_values: bool = True) -> torch.Tensor:
    """Block AttnRes forward without autograd, two-phase (see the module docstring).

    Args:
        h0 (Tensor): [B, T, d]; sublayers: L callables [B, T, d] -> [B, T, d]; queries (Tensor):
            [L + 1, d]; n_blocks (int | list[int]): N in [1, L] or the block sizes
            (``block_sizes``); eps (float): RMSNorm eps; check_values (bool): as in
            ``naive_block_attnres``.

    Returns:
        Tensor: [B, T, d] in h0's dtype (mixing computed in float32; float64 stays float64); equal to
        ``naive_block_attnres`` up to float rounding.

    Raises:
        ValueError: N < 1 or N > L or bad block sizes, h0 or queries not a floating-point tensor, queries not [L + 1, d],
            h0 not [B, T, d], eps not a finite number > 0, a sublayer returning
            anything but a tensor of h0's shape; with ``check_values``, NaN/inf in h0 or queries or an h0
            beyond RMSNorm's range.
    """
    L = len(sublayers)
    sizes = block_sizes(L, n_blocks)
    sublayers = _check_inputs(h0, sublayers, queries, eps, check_values)
    dt = torch.float64 if h0.dtype == torch.float64 else torch.float32
    Q = queries.to(dt)
    blocks = [h0.to(dt)]
    layer = 0
    for size in sizes:
        m, l, o = _inter_block(torch.stack(blocks), Q[layer : layer + size], eps)
        partial = None
        for k in range(size):
            if partial is None:
                h = o[k] / l[k, ..., None]
            else:
                with torch.autocast(partial.device.type, enabled=False):
                    s_p = rms_norm(partial, eps) @ Q[layer]
                m_new = torch.maximum(m[k], s_p)
                a, b = torch.exp(m[k] - m_new), torch.exp(s_p - m_new)
                h = (a[..., None] * o[k] + b[..., None] * partial) / (a * l[k] + b)[..., None]
            v = sublayers[layer](h.to(h0.dtype)).to(dt)
            partial = v if partial is None else partial + v
            layer += 1
        blocks.append(partial)
    m, l, o = _inter_block(torch.stack(blocks), Q[L:], eps)
    return (o[0] / l[0, ..., None]).to(h0.dtype)
