"""The affine-map view of KDA: a run of tokens acts on the state as S -> M S + S~.

Per value head, one token maps S_{t-1} to (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
(K3 report, Eq. 3): linear part A_t [K, K], constant part b_t [K, V]. A run of tokens is the
composition, M = A_T ... A_1 and S~ = the state reached from S = 0. A map is stored as ONE tensor
[..., K, K + V] = [M | S~]; composing "first, then second" is

    [M2 | S2] o [M1 | S1] = [M2 M1 | M2 S1 + S2],

which is associative, so runs can be composed in any bracketing: a sequential fold, a tree
reduction, a parallel prefix scan. Maps are kept in float32 (float64 for float64 inputs).

Within one rank the per-chunk maps come straight from the chunkwise (UT) form (``chunk_maps``):
with W, U from the UT transform and k_end = Gamma_{i->C} * K,
    S_next = Diag(gamma_C) S + k_end^T (U - W S) = (Diag(gamma_C) - k_end^T W) S + k_end^T U,
so A_chunk = Diag(gamma_C) - k_end^T W and S~_chunk = k_end^T U; all chunks at once, then a tree
reduction (log2(#chunks) batched matmuls) gives the rank's map with no loop over chunks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from k3lab.kda.chunk import decayed_scores


def apply_map(m: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """M S + S~ for m = [M | S~] [..., K, K+V] and state [..., K, V]."""
    K = m.shape[-2]
    return m[..., :K] @ state + m[..., K:]


def compose(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The map "apply ``first``, then ``second``": [M2 M1 | M2 S1 + S2], both [..., K, K+V]."""
    K = first.shape[-2]
    out = second[..., :K] @ first
    return torch.cat([out[..., :K], out[..., K:] + second[..., K:]], dim=-1)


def identity_map(HV: int, K: int, V: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[I | 0]: [HV, K, K+V]."""
    eye = torch.eye(K, dtype=dtype, device=device).expand(HV, K, K)
    return torch.cat([eye, torch.zeros(HV, K, V, dtype=dtype, device=device)], dim=-1)


# Per-token log-decay bound under which ``bounded_scores`` is exact in float32: 15 tokens of a
# 16-token sub-tile then decay by at most e^-75, so e^{+-75} factors neither overflow nor underflow.
BOUNDED_G_MIN = -5.0


def bounded_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, inclusive: bool, sub: int = 16) -> torch.Tensor:
    """``decayed_scores`` by one matmul per 16-token sub-tile, valid when every per-token log-decay
    is >= -5 (K3's lower-bounded gate, Eq. 5): rows of sub-tile I are scaled by exp(G_i - r_I) and
    columns by exp(r_I - G_j), with r_I = G at I's first token, both factors within e^{+-75}.

    Args:
        a, b, G (Tensor): [..., C, K]; G the in-chunk cumulative log-decay.
        inclusive (bool): keep the diagonal.

    Returns:
        Tensor: [..., C, C], lower triangular.
    """
    C = a.shape[-2]
    rows = []
    for s0 in range(0, C, sub):
        s1 = min(s0 + sub, C)
        r = G[..., s0 : s0 + 1, :]
        a_i = a[..., s0:s1, :] * (G[..., s0:s1, :] - r).exp()
        b_j = b[..., :s1, :] * (r - G[..., :s1, :]).exp()
        rows.append(F.pad(a_i @ b_j.transpose(-1, -2), (0, C - s1)))
    mask = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(0 if inclusive else -1)
    return torch.cat(rows, dim=-2) * mask


def chunk_maps(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               bounded: bool = False) -> torch.Tensor:
    """Every chunk's affine map from the UT transform, all chunks at once.

    Args:
        k (Tensor): [..., NC, C, K] keys (heads expanded), float32/64.
        v (Tensor): [..., NC, C, V] values.
        g (Tensor): [..., NC, C, K] log-decay (<= 0).
        beta (Tensor): [..., NC, C] write strengths.
        bounded (bool): every g >= BOUNDED_G_MIN, so ``bounded_scores`` (matmuls only) may replace
            ``decayed_scores``.

    Returns:
        Tensor: [..., NC, K, K+V], chunk n's map [Diag(gamma_C) - k_end^T W | k_end^T U].
    """
    C = k.shape[-2]
    beta = beta[..., None]
    G = g.cumsum(-2)
    scores = bounded_scores if bounded else decayed_scores
    L = torch.eye(C, dtype=k.dtype, device=k.device) + beta * scores(k, k, G, inclusive=False)
    # One triangular solve for [U | W]: the UT transform of values and decayed keys together.
    UW = torch.linalg.solve_triangular(L, beta * torch.cat([v, k * G.exp()], -1), upper=False, unitriangular=True)
    G_last = G[..., -1:, :]
    k_end = k * (G_last - G).exp()
    V = v.shape[-1]
    # [U | W] -> k_end^T [U | W] = [S~ | k_end^T W]
    kUW = k_end.transpose(-1, -2) @ UW
    A = torch.diag_embed(G_last[..., 0, :].exp()) - kUW[..., V:]
    return torch.cat([A, kUW[..., :V]], dim=-1)


def reduce_maps(maps: torch.Tensor) -> torch.Tensor:
    """Compose maps [..., n, K, K+V] in order (index 0 first) by a tree: log2(n) batched steps.

    Returns:
        Tensor: [..., K, K+V].
    """
    while maps.shape[-3] > 1:
        n = maps.shape[-3]
        pairs = compose(maps[..., 0 : n - 1 : 2, :, :], maps[..., 1:n:2, :, :])
        maps = torch.cat([pairs, maps[..., n - 1 :, :, :]], dim=-3) if n % 2 else pairs
    return maps[..., 0, :, :]


def _slab_map(k, v, g, beta, C: int, bounded: bool) -> torch.Tensor:
    HV, L, K = k.shape
    k, v, g = (x.unflatten(1, (L // C, C)) for x in (k, v, g))
    return reduce_maps(chunk_maps(k, v, g, beta.unflatten(1, (L // C, C)), bounded))


def segment_map(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    chunk_size: int = 64, slab_tokens: int | None = None,
) -> torch.Tensor:
    """The affine map [M | S~] of one run of tokens of ONE document (M_i, S~_i of the KCP paper notes).

    The run is front-padded to a multiple of ``chunk_size`` with k = 0, g = 0, beta = 0 tokens,
    whose map is the identity. Long runs are split into slabs of ``slab_tokens`` (a multiple of the
    chunk size), each reduced to one map under activation checkpointing, so the [T, 16, K] score
    intermediates of only one slab live at a time; the slab maps are composed in order.

    Args:
        k (Tensor): [HV, L, K] keys (heads expanded), float32 or float64.
        v (Tensor): [HV, L, V] values.
        g (Tensor): [HV, L, K] log-decay (<= 0).
        beta (Tensor): [HV, L].
        chunk_size (int): C, a multiple of 16 (or 1, 2, 4, 8).
        slab_tokens (int | None): tokens per slab; None: one slab.

    Returns:
        Tensor: [HV, K, K+V], the same dtype as k. Equals the final state of chunk_kda started from
        [I | 0] with values [0 | v] (the identity-state trick), computed without a loop over chunks.

    Raises:
        ValueError: slab_tokens not a positive multiple of chunk_size.
    """
    C = chunk_size
    if slab_tokens is not None and (slab_tokens <= 0 or slab_tokens % C):
        raise ValueError(f"slab_tokens must be a positive multiple of chunk_size={C}, got {slab_tokens}")
    HV, L, K = k.shape
    pad = -L % C
    if pad:
        k, v, g = (F.pad(x, (0, 0, pad, 0)) for x in (k, v, g))
        beta = F.pad(beta, (pad, 0))
    L += pad
    step = L if slab_tokens is None else slab_tokens
    # One host sync: K3's lower-bounded gate allows the matmul-only scores.
    bounded = bool(g.min() >= BOUNDED_G_MIN)
    m = None
    for s in range(0, L, step):
        args = (k[:, s : s + step], v[:, s : s + step], g[:, s : s + step], beta[:, s : s + step])
        if step < L and torch.is_grad_enabled():
            part = checkpoint(_slab_map, *args, C, bounded, use_reentrant=False)
        else:
            part = _slab_map(*args, C, bounded)
        m = part if m is None else compose(m, part)
    return m


def fold_sequential(
    maps: torch.Tensor, first: int, stop: int, state: torch.Tensor | None = None
) -> torch.Tensor:
    """S <- M_j S + S~_j for j = first, ..., stop-1 (R - 1 dependent steps at most).

    Args:
        maps (Tensor): [R, HV, K, K+V] every rank's map (the all-gathered pieces).
        first, stop (int): ranks to fold, first <= j < stop.
        state (Tensor | None): [HV, K, V] state before rank ``first``'s piece; None: zeros.

    Returns:
        Tensor: [HV, K, V] the state entering rank ``stop``.
    """
    K = maps.shape[-2]
    S = state if state is not None else maps.new_zeros(maps.shape[1], K, maps.shape[-1] - K)
    for j in range(first, stop):
        S = apply_map(maps[j], S.to(maps.dtype))
    return S


def scan_maps(maps: torch.Tensor, resets: torch.Tensor) -> torch.Tensor:
    """Segmented inclusive prefix scan of maps (Hillis-Steele, ceil(log2 R) batched rounds).

    out[j] = maps[j] o maps[j-1] o ... o maps[s], where s <= j is the last index with resets[s]
    True (a rank whose piece starts its document composes with nothing earlier). The operator
    (f_a, a) + (f_b, b) = (f_a or f_b, b if f_b else b o a) is associative.

    Args:
        maps (Tensor): [R, ..., K, K+V].
        resets (Tensor): [R] bool.

    Returns:
        Tensor: [R, ..., K, K+V].
    """
    R = maps.shape[0]
    flags = resets.to(device=maps.device, dtype=torch.bool)
    d = 1
    while d < R:
        joined = compose(maps[: R - d], maps[d:])
        keep = flags[d:].view(-1, *([1] * (maps.ndim - 1)))
        maps = torch.cat([maps[:d], torch.where(keep, maps[d:], joined)])
        flags = torch.cat([flags[:d], flags[d:] | flags[: R - d]])
        d *= 2
    return maps


def fold_scan(
    maps: torch.Tensor, resets: torch.Tensor, first: int, stop: int, state: torch.Tensor | None = None
) -> torch.Tensor:
    """The same result as ``fold_sequential`` from the prefix scan: prefix[stop-1] applied to ``state``.

    ``resets[first]`` must be True and resets[first+1 : stop] False (the document starts on rank
    ``first`` and covers the ranks in between), which ``KCPContext`` guarantees.
    """
    prefix = scan_maps(maps, resets)[stop - 1]
    K = maps.shape[-2]
    if state is None:
        return prefix[..., K:]
    return apply_map(prefix, state.to(maps.dtype))
