"""The Gated MLA reference (K3 report, Eq. 7): the materialised formula with plain matmuls and loops
over documents, heads and query positions, in float64. Every fast path of ``GatedMLA`` (SDPA with a
causal or block-diagonal mask, the absorbed form with a latent cache) is tested against it."""
from __future__ import annotations

import torch

from k3lab.kda.checks import check_cu_seqlens


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def naive_gated_mla(layer, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """y = W_o[sigmoid(W_g x) * softmax(q k^T / sqrt(Dn + Dr), causal per document) v], in float64.

    Args:
        layer (GatedMLA): whose weights are read (cast to float64; the layer is not modified).
        x (Tensor): [B, T, d] any float dtype.
        cu_seqlens (Tensor | None): int [N+1] document offsets over T (B == 1); None: one document per row.

    Returns:
        Tensor [B, T, d] float64.

    Raises:
        ValueError: x not [B, T, d]; cu_seqlens with B > 1, or not int [N+1] offsets strictly increasing from
            0 to T (``check_cu_seqlens``).
    """
    if x.ndim != 3 or x.shape[-1] != layer.d_model:
        raise ValueError(f"naive_gated_mla: x must be [B, T, d={layer.d_model}], got {list(x.shape)}")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"naive_gated_mla: cu_seqlens needs B == 1, got B={x.shape[0]}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, x.shape[1])
    W = {n: p.detach().double() for n, p in layer.named_parameters()}
    x = x.double()
    H, Dn, Dr, Dv, R = layer.H, layer.Dn, layer.Dr, layer.Dv, layer.R
    eps_q = layer.q_a_norm.eps if layer.Rq is not None else None
    if layer.Rq is None:
        q = x @ W["q_proj.weight"].T
    else:
        q = _rms_norm(x @ W["q_a_proj.weight"].T, W["q_a_norm.weight"], eps_q) @ W["q_b_proj.weight"].T
    q = q.unflatten(-1, (H, Dn + Dr))
    ckv = x @ W["kv_a_proj.weight"].T
    c = _rms_norm(ckv[..., :R], W["kv_a_norm.weight"], layer.kv_a_norm.eps)
    k_shared = ckv[..., R:]
    kv = (c @ W["kv_b_proj.weight"].T).unflatten(-1, (H, Dn + Dv))
    k = torch.cat([kv[..., :Dn], k_shared[:, :, None].expand(-1, -1, H, -1)], dim=-1)
    v = kv[..., Dn:]
    B, T = x.shape[:2]
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    o = torch.zeros(B, T, H, Dv, dtype=torch.float64)
    scale = 1.0 / (Dn + Dr) ** 0.5
    for b in range(B):
        for start, end in zip(bounds[:-1], bounds[1:]):
            for h in range(H):
                for t in range(start, end):
                    s = (k[b, start : t + 1, h] @ q[b, t, h]) * scale
                    p = torch.softmax(s, dim=0)
                    o[b, t, h] = p @ v[b, start : t + 1, h]
    gate = torch.sigmoid(x @ W["g_proj.weight"].T)
    return (gate * o.flatten(-2)) @ W["o_proj.weight"].T
