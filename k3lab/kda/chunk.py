"""KDA in chunkwise form, in PyTorch: the algorithm the Triton kernels implement (K3 report, Sec. 2.1;
Kimi Linear, Sec. 3.2). Differentiable by autograd; the reference for every fast path."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3lab.kda.checks import check_chunk_size, check_kda_inputs, check_kda_result
from k3lab.kda.naive import compute_dtype, expand_heads

SUB_TILE = 16
# Per-token log-decays below this are raised to it before the in-chunk cumsum (a decay of e^-60 ~ 1e-26
# clears the state either way): a reset of -1e6 left G so large that the small gates after it were lost
# to rounding in G_i - G_j (float32 outputs 3e-2 off; float64 0.1 off at -1e30).
G_FLOOR = -60.0


def decayed_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """Within-chunk scores with channel-wise decay, without ever forming 1/Gamma.

    out[..., i, j] = sum_c a[i, c] * b[j, c] * exp(G[i, c] - G[j, c])   for j <= i (j < i if not inclusive)

    which is ((Gamma * a) (b / Gamma)^T)[i, j]. G is non-increasing along the chunk (g <= 0), so every
    exponent below is <= 0: the diagonal 16-token sub-tiles use the pairwise differences directly, and an
    off-diagonal block (rows in sub-tile I, columns before it) factors through the reference point
    r = G at the last token before sub-tile I: exp(G_i - G_j) = exp(G_i - r) exp(r - G_j), both <= 1.

    Args:
        a, b, G (Tensor): [..., C, K] in one float dtype; G is the in-chunk cumulative log-decay.
        inclusive (bool): keep the diagonal (j == i).

    Returns:
        Tensor: [..., C, C], lower triangular.
    """
    C = a.shape[-2]
    sub = min(SUB_TILE, C)
    mask = torch.ones(sub, sub, dtype=torch.bool, device=a.device).tril(0 if inclusive else -1)
    rows = []
    for s0 in range(0, C, sub):
        s1 = min(s0 + sub, C)
        a_i, b_i, G_i = a[..., s0:s1, :], b[..., s0:s1, :], G[..., s0:s1, :]
        n = s1 - s0
        diff = (G_i[..., :, None, :] - G_i[..., None, :, :]).masked_fill(~mask[:n, :n, None], float("-inf"))
        blocks = [torch.einsum("...ik,...jk,...ijk->...ij", a_i, b_i, diff.exp())]
        if s0 > 0:
            r = G[..., s0 - 1 : s0, :]
            left = (a_i * (G_i - r).exp()) @ (b[..., :s0, :] * (r - G[..., :s0, :]).exp()).transpose(-1, -2)
            blocks.insert(0, left)
        if s1 < C:
            blocks.append(a.new_zeros(*a.shape[:-2], n, C - s1))
        rows.append(torch.cat(blocks, dim=-1))
    return torch.cat(rows, dim=-2)


def chunk_kda_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    S: torch.Tensor, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunkwise algorithm on prepared inputs (heads expanded, q scaled, one float dtype).

    Args:
        q, k (Tensor): [B, HV, T, K] with T a multiple of ``chunk_size``; v [B, HV, T, V];
            g [B, HV, T, K]; beta [B, HV, T]; S [B, HV, K, V] the state before the first token.

    Returns:
        (o [B, HV, T, V], final state [B, HV, K, V]).
    """
    B, HV, T, K = k.shape
    C = chunk_size
    q, k, v, g = (x.unflatten(2, (T // C, C)) for x in (q, k, v, g))
    beta = beta.unflatten(2, (T // C, C))[..., None]
    # Gamma: cumulative decay inside each chunk, as a log (G <= 0, non-increasing).
    G = g.clamp(min=G_FLOOR).cumsum(-2)
    # UT transform: (I + StrictTril(Diag(beta) (Gamma K)(K / Gamma)^T)) Delta = Diag(beta)(V - (Gamma K) S).
    L = torch.eye(C, dtype=k.dtype, device=k.device) + beta * decayed_scores(k, k, G, inclusive=False)
    U = torch.linalg.solve_triangular(L, beta * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(L, beta * (k * G.exp()), upper=False, unitriangular=True)
    A_qk = decayed_scores(q, k, G, inclusive=True)
    q_decayed = q * G.exp()
    G_last = G[..., -1:, :]
    k_to_end = k * (G_last - G).exp()
    outputs = []
    for n in range(T // C):
        v_pseudo = U[:, :, n] - W[:, :, n] @ S
        outputs.append(q_decayed[:, :, n] @ S + A_qk[:, :, n] @ v_pseudo)
        S = G_last[:, :, n].exp().transpose(-1, -2) * S + k_to_end[:, :, n].transpose(-1, -2) @ v_pseudo
    return torch.cat(outputs, dim=2), S


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention in chunkwise (UT/WY) form: same results as ``naive_recurrent_kda``.

    Per chunk of C tokens with in-chunk cumulative decay Gamma (K3 report, Sec. 2.1):
        M = (I + StrictTril(Diag(beta)(Gamma K)(K/Gamma)^T))^-1 Diag(beta),  W = M (Gamma K),  U = M V
        V~ = U - W S,   O = (Gamma Q) S + Tril((Gamma Q)(K/Gamma)^T) V~
        S <- Diag(gamma_C) S + (Gamma_{i->C} K)^T V~
    Decays enter only as exp(non-positive) (see ``decayed_scores``): nothing overflows for any g <= 0.
    Gates below ``G_FLOOR`` (-60) are raised to it first, so a hard reset (g = -1e6, say) does not
    swamp the in-chunk cumsum; G's rounding still grows with |G|, so in float32 a chunk of many
    near-reset tokens is good to about 1e-4 relative rather than the naive recurrence's 1e-7.
    The tail chunk is padded with g = 0, beta = 0, k = 0, which leaves outputs and state unchanged.

    Args:
        q (Tensor): [B, T, H, K] queries.
        k (Tensor): [B, T, H, K] keys (normally L2-normalised).
        v (Tensor): [B, T, HV, V] values; HV a multiple of H (GVA).
        g (Tensor): [B, T, HV, K] log-space channel-wise decay, g <= 0.
        beta (Tensor): [B, T, HV] write strengths.
        scale (float | None): query scale, default K ** -0.5.
        initial_state (Tensor | None): [N, HV, K, V].
        output_final_state (bool): also return the final state.
        cu_seqlens (Tensor | None): int [N+1] offsets of N packed sequences (B must be 1).
        chunk_size (int): C, a multiple of 16 or one of 1, 2, 4, 8.

    Returns:
        (o, final_state): o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] in float32
        (float64 for float64 inputs), or None.

    Raises:
        ValueError: bad shapes, HV not a multiple of H, bad cu_seqlens, g > 0, NaN/inf inputs, a scale
            that is not a finite positive number, a non-bool output_final_state
            (``k3lab.kda.checks.check_kda_inputs``), a chunk_size that is not a multiple of 16 or a
            power of two below 16, or finite inputs whose output or state overflows (as
            ``naive_recurrent_kda``; the UT transform's triangular solve can overflow where the
            recurrence does not, on keys far from unit norm).
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale,
                         output_final_state=output_final_state)
    check_chunk_size(chunk_size, SUB_TILE)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    out_dtype, dt = q.dtype, compute_dtype(q)
    inputs = dict(q=q, k=k, v=v, beta=beta, initial_state=initial_state, scale=scale)
    q, k = expand_heads(q, HV).to(dt) * scale, expand_heads(k, HV).to(dt)
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)
    if cu_seqlens is not None:
        lengths = cu_seqlens.diff().tolist()
        q, k, v, g, beta = (
            torch.nn.utils.rnn.pad_sequence(x[0].split(lengths), batch_first=True) for x in (q, k, v, g, beta)
        )
    L = q.shape[1]
    pad = -L % chunk_size
    # [B, L, HV, D] -> [B, HV, L + pad, D]: zero padding = no decay, no write, no read.
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad)).transpose(1, 2)
    S0 = initial_state.to(dt) if initial_state is not None else q.new_zeros(N, HV, K, V)
    o, S = chunk_kda_fwd(q, k, v, g, beta, S0, chunk_size)
    o = o[:, :, :L].transpose(1, 2)
    if cu_seqlens is not None:
        o = torch.cat([o[n, :length] for n, length in enumerate(lengths)])[None]
    o = o.to(out_dtype)
    check_kda_result(o, S, **inputs)
    return o, (S if output_final_state else None)
