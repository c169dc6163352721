"""``flash_kda``: chunkwise KDA in fused Triton kernels, forward and backward (K3 report, Sec. 2.1 and
Eq. 5; Kimi Linear, Sec. 3.2). The autograd function and the public entry point."""
from __future__ import annotations

import numbers

import torch

from k3lab.autograd import differentiable_once
from k3lab.kda.checks import NonFiniteError, check_kda_inputs, overflow_error
from k3lab.kda.gate import check_gate_shapes
from k3lab.kernels import interpreting
from k3lab.kernels.kda.chunk_bwd import kda_dqk_bwd, kda_dwv_bwd, kda_intra_bwd, kda_state_bwd
from k3lab.kernels.kda.chunk_fwd import kda_intra_fwd, kda_state_fwd
from k3lab.kernels.kda.utils import chunk_index

# 8 |lower_bound| must stay below ~88 (float32/bfloat16 exponent range) for the diagonal sub-tiles.
MIN_LOWER_BOUND = -10.0
MAX_K = 256


def check_gate_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, A_log, dt_bias, lower_bound: float,
                    scale=None) -> None:
    """The checks ``flash_kda`` adds to ``check_kda_inputs`` (run after it, on the same q, k, v).

    Raises:
        ValueError: A_log not a floating-point [HV] tensor, dt_bias not a floating-point [HV * K] or
            [HV, K] one, either on another device than q, lower_bound not a number (int or float, not a
            tensor or bool) in [-10, 0), K > 256, q, k, v not one of float16/bfloat16/float32, a scale
            tensor that requires grad (the kernels take scale as a number: its gradient would be lost).
        RuntimeError: CPU tensors without TRITON_INTERPRET=1.
    """
    K = q.shape[3]
    HV = v.shape[2]
    for name, x in dict(A_log=A_log, dt_bias=dt_bias).items():
        if isinstance(x, torch.Tensor) and x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
    check_gate_shapes(HV, K, A_log, dt_bias)
    if not (isinstance(lower_bound, numbers.Real) and not isinstance(lower_bound, bool)
            and MIN_LOWER_BOUND <= lower_bound < 0):
        raise ValueError(f"lower_bound must be a float in [{MIN_LOWER_BOUND}, 0), got {lower_bound!r}")
    if K > MAX_K:
        raise ValueError(f"flash_kda supports K <= {MAX_K}, got K={K}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or len({q.dtype, k.dtype, v.dtype}) > 1:
        raise ValueError(f"q, k, v must share one of float16/bfloat16/float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if isinstance(scale, torch.Tensor) and scale.requires_grad:
        raise ValueError("scale must be a number: flash_kda does not differentiate it, got a tensor that requires "
                         "grad (use k3lab.kda.chunk_kda for a learned scale)")
    if q.device.type == "cpu" and not interpreting():
        raise RuntimeError("flash_kda on CPU needs TRITON_INTERPRET=1 set before kernels are imported: "
                           "call k3lab.setup() first")


def check_finite(**named: torch.Tensor | None) -> None:
    """ValueError "<name> contains NaN or inf" for the first such tensor (None entries skipped); one host sync."""
    named = {name: x for name, x in named.items() if x is not None}
    flags = torch.stack([~torch.isfinite(x).all() for x in named.values()]).tolist()
    for name, bad in zip(named, flags):
        if bad:
            raise ValueError(f"{name} contains NaN or inf")


def value_flags(**named: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """max |x| of each tensor as a float64 scalar on its device, without a host sync (None skipped):
    NaN or inf when x has one, so a single reduction per input serves both the NaN/inf and the
    range checks of ``check_values``."""
    return {name: torch.linalg.vector_norm(x, float("inf")).double() for name, x in named.items() if x is not None}


def raise_value_errors(flags: dict[str, torch.Tensor], K: int, o: torch.Tensor, final_state: torch.Tensor | None,
                       v: torch.Tensor, initial_state: torch.Tensor | None) -> None:
    """The value checks of ``flash_kda``, read with one host sync after the kernels ran (a sync before
    them as well would stall the launch queue twice per call).

    Raises:
        NonFiniteError (a ValueError): "<name> contains NaN or inf"; q or k so large that ||x||^2
            overflows float32 in the kernels' L2 norm (max |x| > sqrt(float32 max / K), ~4.6e18 at
            K = 16: the norm would come out inf and the normalised vector 0); an initial_state beyond
            float32's range (the kernels keep the state in float32); an A_log whose exp overflows
            float32; finite inputs whose output or final state is still NaN or inf (v or initial_state
            named by ``overflow_error``).
    """
    outputs = [torch.isfinite(o).all()] + ([torch.isfinite(final_state).all()] if final_state is not None else [])
    values = torch.stack(list(flags.values()) + [torch.stack(outputs).all().double()]).tolist()
    *maxima, outputs_finite = values
    maxima = dict(zip(flags, maxima))
    f32 = torch.finfo(torch.float32).max
    for name, m in maxima.items():
        if m != m or m == float("inf"):
            raise NonFiniteError(name, f"{name} contains NaN or inf")
    norm_limit = (f32 / K) ** 0.5
    for name in ("q", "k"):
        if maxima[name] > norm_limit:
            raise NonFiniteError(name, (
                f"{name} is too large for flash_kda's L2 norm: max |{name}| = {maxima[name]:.3g}, but ||{name}||^2 is "
                f"summed in float32 and overflows beyond max |{name}| = sqrt(3.4e38 / K) = {norm_limit:.3g} (K={K}); "
                f"scale {name} down (the norm removes the scale)"))
    if maxima.get("initial_state", 0.0) > f32:
        raise NonFiniteError("initial_state", (
            f"initial_state is out of range: max |initial_state| = {maxima['initial_state']:.3g} exceeds float32's "
            f"largest value {f32:.3g}, and flash_kda keeps the state in float32"))
    if not outputs_finite:
        # exp(A_log) scales the gate pre-activation: inf beyond 88 in float32, and inf * 0 is NaN.
        if maxima["A_log"] > 88.0:
            raise NonFiniteError("A_log", (
                f"A_log is too large: exp(A_log) overflows float32 beyond 88 and the gate came out NaN where "
                f"z + dt_bias = 0, got max |A_log| = {maxima['A_log']:.3g}"))
        # Keys are normalised and beta = sigmoid(beta_logits) in the kernels: the state cannot grow geometrically,
        # so only the sizes of v and initial_state are left to blame. The kernels compute in float32; a float16
        # output runs out at 6.55e4 first: name the range that ran out (as ``check_kda_result`` does).
        dtype = min([torch.float32, o.dtype] + ([final_state.dtype] if final_state is not None else []),
                    key=lambda d: torch.finfo(d).max)
        raise overflow_error(dtype, v, initial_state, remedy="use k3lab.kda.chunk_kda in float64")


def intermediate_dtype(q: torch.Tensor) -> torch.dtype:
    """The intermediates' dtype (W, U, KG, QG, Aqk, the UT inverse T as stored, the chunk states), forward
    and backward: bfloat16 for bfloat16 inputs, as tensor-core operands with float32 accumulators (the
    gate's cumsum G, the scores' L, the inverse's block products and every gradient accumulator stay
    float32); float32 otherwise, and on CPU (the Triton
    interpreter has no bf16 arithmetic: bf16 intermediates there gave garbage). Never float16: a
    diagonal sub-tile's factor exp(8 |lower_bound|) (e^40 at -5) exceeds its range."""
    return torch.bfloat16 if q.dtype == torch.bfloat16 and q.device.type == "cuda" else torch.float32


def input_grads(dq, dk, dv, dz, dbeta, dA_part, dbias_part, q, v, A_log, dt_bias):
    """The backward's flat outputs (dq, dk [T, H, K], per-chunk gate sums) -> the gradients of
    q, k [B, T, H, K], v [B, T, HV, V], z [B, T, HV, K], beta [B, T, HV], A_log, dt_bias in their dtypes."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    dq, dk = dq.view(B, T, H, K), dk.view(B, T, H, K)
    dA_log = dA_part.sum(0).to(A_log.dtype)
    ddt_bias = dbias_part.sum(0).view(dt_bias.shape).to(dt_bias.dtype) if dt_bias is not None else None
    return dq, dk, dv.view(B, T, HV, V), dz.view(B, T, HV, K), dbeta.view(B, T, HV), dA_log, ddt_bias


class FlashKDAFunction(torch.autograd.Function):
    """Forward: intra (gate, norms, UT inverse, W, U, Aqk) -> state scan, writing the output as it goes
    and, when autograd records, the chunk states h and pseudo-values V~ for the backward, which also
    saves W, KG, QG, G, Tinv, Aqk. Backward: the reverse state scan -> per-chunk dq/dk/dW/dv -> sub-tile
    score gradients, norm and gate backward."""

    @staticmethod
    def forward(ctx, q, k, v, z, beta, A_log, dt_bias, initial_state, scale, lower_bound, cu_seqlens,
                chunk_indices, chunk_offsets, output_final_state, for_backward):
        B, T, H, K = q.shape
        HV, V = v.shape[2:]
        flat = [x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, z, beta)]
        inter = intermediate_dtype(q)
        G, Tinv, Aqk, W, U, KG, QG = kda_intra_fwd(*flat, A_log, dt_bias, scale, lower_bound, cu_seqlens,
                                                   chunk_indices, inter, keep_t=for_backward)
        # o in the output's shape, the kernel writing a flat view of it: a view made inside a Function and
        # returned could not be modified in place by the caller.
        o = torch.empty(B, T, HV, V, device=U.device, dtype=U.dtype)
        h, Vn, ht = kda_state_fwd(W, U, KG, G, initial_state, output_final_state, cu_seqlens, chunk_offsets,
                                  chunk_indices.shape[0], store_states=for_backward, output=(QG, Aqk, o.view_as(U)))
        # Everything the backward reads goes through save_for_backward, so saved-tensor hooks
        # (non-reentrant checkpointing, CPU offload) see it; without autograd nothing is kept.
        kept = (W, KG, QG, h, Vn) if for_backward else ()
        ctx.save_for_backward(q, k, v, z, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices,
                              chunk_offsets, G, Tinv, Aqk, *kept)
        ctx.scale, ctx.lower_bound = scale, lower_bound
        return o.to(q.dtype), ht

    @staticmethod
    @differentiable_once
    def backward(ctx, do, dht):
        (q, k, v, z, beta, A_log, dt_bias, h0, cu_seqlens, chunk_indices, chunk_offsets, G, Tinv, Aqk,
         W, KG, QG, h, Vn) = ctx.saved_tensors
        scale, lb = ctx.scale, ctx.lower_bound
        B, T, H, K = q.shape
        HV, V = v.shape[2:]
        NT = chunk_indices.shape[0]
        qf, kf, vf, zf, bf = (x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, z, beta))
        do = do.reshape(B * T, HV, V).contiguous()
        dh, dVn, dh0 = kda_state_bwd(QG, KG, W, G, Aqk, do, dht.contiguous() if dht is not None else None,
                                     h0 is not None, cu_seqlens, chunk_offsets, NT)
        dqs, dkn, dG, dW, dgx, rn = kda_dqk_bwd(qf, kf, G, h, dh, Vn, dVn, do, scale, cu_seqlens, chunk_indices)
        del dh  # before dW/dv's outputs exist: the backward's peak memory
        db, dv, dAqk, dAkk = kda_dwv_bwd(kf, vf, bf, G, Tinv, dW, dVn, do, Vn, dkn, dG, rn, cu_seqlens, chunk_indices)
        del dVn, dW
        dq, dk, dz, dbeta, dA_part, dbias_part = kda_intra_bwd(
            qf, kf, zf, bf, A_log, dt_bias, G, rn, dAqk, dAkk, dqs, dkn, dG, dgx, db, scale, lb, cu_seqlens, chunk_indices)
        dh0 = dh0.to(h0.dtype) if h0 is not None else None
        return (*input_grads(dq, dk, dv, dz, dbeta, dA_part, dbias_part, q, v, A_log, dt_bias),
                dh0, None, None, None, None, None, None, None)


def flash_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    lower_bound: float = -5.0,
    *,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention with K3's lower-bounded gate, q/k L2 norm and beta sigmoid fused into
    Triton kernels; differentiable once in every tensor argument (the backward is kernels too).

    Computes, per value head (K3 report, Eq. 3-5):
        q_hat, k_hat = q / ||q||, k / ||k||           (eps 1e-6 under the root, as fla's l2norm)
        g      = lower_bound * sigmoid(exp(A_log) * (z + dt_bias))     (log-decay in (lower_bound, 0))
        beta   = sigmoid(beta_logits)
        S_t = (I - beta_t k_hat_t k_hat_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_hat_t v_t^T,
        o_t = S_t^T (scale q_hat_t)
    i.e. ``k3lab.kda.chunk_kda(l2norm(q), l2norm(k), v, lower_bounded_gate(z, A_log, dt_bias, lower_bound),
    sigmoid(beta_logits), ...)`` (``k3lab.kda.naive_fused_kda`` is its reference), and fla-core's ``chunk_kda(..., use_qk_l2norm_in_kernel=True,
    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=...)``.

    Dimensions: B batch, T tokens, H q/k heads, HV value heads (a multiple of H: GVA), K key dim
    (<= 256), V value dim, N sequences (B, or len(cu_seqlens) - 1).

    Args:
        q (Tensor): [B, T, H, K] queries (not normalised), bf16/fp16/fp32 (on CPU bf16 inputs get
            float32 intermediates: the Triton interpreter has no bf16 arithmetic).
        k (Tensor): [B, T, H, K] keys (not normalised), q's dtype.
        v (Tensor): [B, T, HV, V] values, q's dtype.
        z (Tensor): [B, T, HV, K] the gate pre-activation (the decay projection's output), any
            floating dtype (read into float32).
        beta_logits (Tensor): [B, T, HV] write-strength logits, any floating dtype (read into float32).
        A_log (Tensor): [HV] per-head log scale of the gate (float32 recommended; K3 inits 0).
        dt_bias (Tensor | None): [HV * K] or [HV, K] gate bias.
        scale (float | None): query scale, default K ** -0.5.
        initial_state (Tensor | None): [N, HV, K, V] state before each sequence, any floating dtype
            (used in float32; its gradient comes back in its dtype).
        output_final_state (bool): also return the state after each sequence.
        cu_seqlens (Tensor | None): int [N+1] offsets of N packed sequences (B must be 1).
        lower_bound (float): g_min in [-10, 0) (K3: -5). Beyond -10, 1/Gamma over half a 16-token
            sub-tile could overflow bf16/fp32. Where the gate saturates at a strong bound, the gate
            parameters' gradients lose accuracy, growing like e^|lb|: they are small differences of
            the O(1) terms the chunkwise form sums (the reverse cumsum of dG). In float32, saturated at
            the bound: dg and ddt_bias ~1.6e-4 and dA_log ~2.6e-3 relative at -7, ~5e-3 and ~9e-2 at
            -10 (torch's float32 autograd through the naive recurrence: ~3e-5 and ~2e-4); at -5 dA_log
            ~5e-4 (torch: 2.4e-4; its sum is ~540x its value). ``tests/test_flash_kda_numerics_edges.py``.
            The other gradients keep float32 accuracy.
        check_values (bool): also reject NaN/inf inputs, inputs out of the kernels' float32 range and
            outputs that overflowed (one device sync, after the kernels, and a read of every input and
            output; shapes are always checked). Benchmarks pass False.

    Memory: when autograd records, the forward keeps for the backward, besides its inputs, G (float32,
    [T, HV, K]) and, in the intermediates' dtype, the UT inverse and Aqk [T, HV, 64], W, KG, QG
    [T, HV, K], the pseudo-values [T, HV, V] and the chunk states [T / 64, HV, K, V]: the last five
    alone, at K = V = 128 with bf16 inputs and H = HV, 1.5x the bytes of q, k, v, z together, held per
    layer until its backward returns (which then skips recomputing them). They are saved tensors: saved-tensor hooks see them,
    so under non-reentrant activation checkpointing they live only while the layer is recomputed, and
    ``save_on_cpu`` offloads them.

    Returns:
        (o, final_state): o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] float32 or None.

    Raises:
        ValueError: the errors of ``k3lab.kda.checks.check_kda_inputs`` (shapes, GVA, cu_seqlens, a
            scale not finite and positive, a non-bool output_final_state), and A_log/dt_bias of bad
            shapes, integer dtypes or on another device, K > 256, mixed dtypes,
            lower_bound not a number in [-10, 0), a scale tensor that requires grad; with
            ``check_values``, after the kernels ran: NaN/inf inputs, q or k beyond the float32 L2 norm's
            range, initial_state beyond float32, an output or final state that overflowed
            (``raise_value_errors``).
        RuntimeError: on a CPU tensor without TRITON_INTERPRET=1 (call ``k3lab.setup()`` first);
            when a gradient taken with ``create_graph=True`` is differentiated again (no second derivatives).

    Example:
        >>> import k3lab; dev = k3lab.setup(verbose=False)
        >>> from k3lab.kernels.kda import flash_kda
        >>> B, T, H, K = 1, 20, 1, 16
        >>> q, k, v, z = (torch.randn(B, T, H, K) for _ in range(4))
        >>> o, s = flash_kda(q, k, v, z, torch.randn(B, T, H), torch.zeros(H), torch.zeros(H * K),
        ...                  output_final_state=True)
        >>> o.shape, s.shape
        (torch.Size([1, 20, 1, 16]), torch.Size([1, 1, 16, 16]))
    """
    check_kda_inputs(q, k, v, z, beta_logits, initial_state, cu_seqlens, check_values=False, scale=scale,
                     output_final_state=output_final_state, names=("z", "beta_logits"))
    check_gate_args(q, k, v, A_log, dt_bias, lower_bound, scale)
    flags = (value_flags(q=q, k=k, v=v, z=z, beta_logits=beta_logits, A_log=A_log, dt_bias=dt_bias,
                         initial_state=initial_state)
             if check_values else None)
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else float(scale)
    lengths = [T] * B if cu_seqlens is None else cu_seqlens.diff().tolist()
    cu, chunk_indices, chunk_offsets = chunk_index(lengths, q.device)
    q, k, v, z, beta_logits = (x.contiguous() for x in (q, k, v, z, beta_logits))
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    inputs = (q, k, v, z, beta_logits, A_log.contiguous(), dt_bias, h0)
    for_backward = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    o, final_state = FlashKDAFunction.apply(*inputs, scale, float(lower_bound), cu, chunk_indices, chunk_offsets,
                                            output_final_state, for_backward)
    if check_values:
        raise_value_errors(flags, K, o, final_state, v, initial_state)
    return o, final_state
