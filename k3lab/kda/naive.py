"""The KDA reference: the recurrence, one token at a time (K3 report, Eq. 3-4; Kimi Linear, Eq. 1)."""
from __future__ import annotations

import torch

from k3lab.kda.checks import check_kda_inputs, check_kda_result


def expand_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """Repeat q/k heads [B, T, H, K] -> [B, T, HV, K] for GVA: value head i reads q/k head i // (HV // H)."""
    H = x.shape[2]
    return x if H == HV else x.repeat_interleave(HV // H, dim=2)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention by its recurrence, per value head:

        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t)

    in the reference order: decay S, read k_t^T S, write beta_t k_t (v_t - k_t^T S)^T, read q.

    Args:
        q (Tensor): [B, T, H, K] queries.
        k (Tensor): [B, T, H, K] keys (normally L2-normalised).
        v (Tensor): [B, T, HV, V] values; HV a multiple of H (GVA).
        g (Tensor): [B, T, HV, K] log-space channel-wise decay, g <= 0 (alpha = exp(g)).
        beta (Tensor): [B, T, HV] write strengths, meant in (0, 1) (a sigmoid's output; values are not checked).
        scale (float | None): query scale, default K ** -0.5.
        initial_state (Tensor | None): [N, HV, K, V] state before the first token of each sequence.
        output_final_state (bool): also return the state after the last token.
        cu_seqlens (Tensor | None): int [N+1] offsets of N packed sequences (B must be 1).

    Returns:
        (o, final_state): o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] in the compute
        dtype (float64 for float64 inputs, else float32), or None.

    Raises:
        ValueError: bad shapes, HV not a multiple of H, bad cu_seqlens, g > 0, NaN/inf inputs, a scale
            that is not a finite positive number, a non-bool output_final_state
            (``k3lab.kda.checks.check_kda_inputs``); finite inputs whose output or state overflows
            (``k3lab.kda.checks.overflow_error``: k or beta when some beta_t ||k_t||^2 is outside
            [0, 2], else the largest of initial_state, v, q).

    Example:
        >>> B, T, H, K = 1, 5, 2, 4
        >>> q, k = torch.randn(B, T, H, K), torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
        >>> o, s = naive_recurrent_kda(q, k, torch.randn(B, T, H, K), -torch.rand(B, T, H, K),
        ...                            torch.rand(B, T, H), output_final_state=True)
        >>> o.shape, s.shape
        (torch.Size([1, 5, 2, 4]), torch.Size([1, 2, 4, 4]))
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale,
                         output_final_state=output_final_state)
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    scale = K**-0.5 if scale is None else scale
    out_dtype, dt = q.dtype, compute_dtype(q)
    inputs = dict(q=q, k=k, v=v, beta=beta, initial_state=initial_state, scale=scale)
    q, k = expand_heads(q, HV).to(dt) * scale, expand_heads(k, HV).to(dt)
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)

    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, T]
    outputs, finals = [], []
    for n in range(N):
        b, (t0, t1) = (0, bounds[n : n + 2]) if cu_seqlens is not None else (n, bounds)
        S = initial_state[n].to(dt) if initial_state is not None else q.new_zeros(HV, K, V)
        for t in range(t0, t1):
            S = S * g[b, t].exp()[..., None]
            read = torch.einsum("hk,hkv->hv", k[b, t], S)
            S = S + torch.einsum("hk,hv->hkv", k[b, t], beta[b, t, :, None] * (v[b, t] - read))
            outputs.append(torch.einsum("hk,hkv->hv", q[b, t], S))
        finals.append(S)
    o = torch.stack(outputs).view(B, T, HV, V).to(out_dtype)
    final_state = torch.stack(finals)
    check_kda_result(o, final_state, **inputs)
    return o, (final_state if output_final_state else None)


def naive_fused_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    lower_bound: float = -5.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused KDA op (``k3lab.kernels.kda.flash_kda``'s signature) by the recurrence, for checking it:

        g = lower_bound * sigmoid(exp(A_log) (z + dt_bias)),  beta = sigmoid(beta_logits)
        naive_recurrent_kda(q / ||q||, k / ||k||, v, g, beta)      (eps 1e-6 under the root)

    Run it in float64 for a ground truth. The one reference of the fused op: the benchmark, the tests and
    chapter 02 all check FlashKDA against it.

    Args:
        q, k (Tensor): [B, T, H, K] before L2 normalisation.
        v (Tensor): [B, T, HV, V].
        z (Tensor): [B, T, HV, K] gate pre-activation; A_log (Tensor): [HV]; dt_bias (Tensor | None):
            [HV * K] or [HV, K] (``k3lab.kda.lower_bounded_gate``).
        beta_logits (Tensor): [B, T, HV] write-strength logits.
        scale, initial_state, cu_seqlens: as in ``naive_recurrent_kda``.
        output_final_state (bool): return the final state (default True, unlike ``naive_recurrent_kda``:
            a check wants it).
        lower_bound (float): g_min, in [-10, 0) for FlashKDA.

    Returns:
        (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] in the compute dtype, or None).

    Raises:
        ValueError: what ``check_kda_inputs`` raises for q, k, v, z, beta_logits (named so: shapes, floating
            dtypes, one device), then what ``lower_bounded_gate`` and ``naive_recurrent_kda`` raise.
    """
    from k3lab.kda.gate import lower_bounded_gate

    check_kda_inputs(q, k, v, z, beta_logits, initial_state, cu_seqlens, check_values=False, scale=scale,
                     output_final_state=output_final_state, names=("z", "beta_logits"))

    qn = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    kn = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    g = lower_bounded_gate(z, A_log, dt_bias, lower_bound)
    return naive_recurrent_kda(qn, kn, v, g, beta_logits.sigmoid(), scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens)
