"""`KDALayer`: the Kimi Delta Attention token mixer as an nn.Module (K3 report, Sec. 2.1; Kimi Linear,
Sec. 3).

    q, k = L2Norm(SiLU(ShortConv(W_q x))), L2Norm(SiLU(ShortConv(W_k x)))     [B, T, H, K]
    v    = SiLU(ShortConv(W_v x))                                              [B, T, HV, V]
    beta = sigmoid(W_b x)                                                      [B, T, HV]
    g    = gate(W_f x)  (full-rank decay projection; K3's lower-bounded gate)  [B, T, HV, K]
    o    = KDA(q, k, v, g, beta)                                               [B, T, HV, V]
    y    = W_o [ sigmoid(W_g x) * RMSNorm_head(o) ]                            [B, T, d]

The short convolutions are depthwise and causal (kernel 4). For decoding, ``KDACache`` keeps the
last kernel-1 inputs of each convolution (zero-padded when a sequence is shorter than the kernel)
and the recurrent state, so running a sequence token by token gives the full-sequence output.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3lab.kda.checks import NonFiniteError, _shape, check_chunk_size, check_cu_seqlens, check_kda_inputs
from k3lab.kda.chunk import chunk_kda
from k3lab.kda.gate import check_lower_bound, kimi_linear_gate, lower_bounded_gate
from k3lab.norm import RMSNorm
from k3lab.precision import widen

GATES = ("lower_bounded", "kimi_linear")
CONV_BACKENDS = ("torch", "triton")


@dataclass
class KDACache:
    """Decoding state of one ``KDALayer`` for N sequences.

    Attributes:
        conv_q, conv_k (Tensor): [N, kernel-1, H*K] the last kernel-1 inputs of the q/k convolutions.
        conv_v (Tensor): [N, kernel-1, HV*V] the same for v.
        state (Tensor): [N, HV, K, V] the recurrent state S (float32, or float64 for float64 inputs).
    """

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    state: torch.Tensor


def reference_kda_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta_logits: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor | None, scale: float | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, lower_bound: float = -5.0, *, gate: str = "lower_bounded",
    chunk_size: int = 64, cp=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA on un-normalised q/k, the gate pre-activation and beta logits, in PyTorch:
    ``chunk_kda(L2Norm(q), L2Norm(k), v, gate(z), sigmoid(beta_logits))``.

    The signature (up to the keyword-only ``gate``/``chunk_size``) is that of the fused Triton
    kernel ``k3lab.kernels.kda.flash_kda``, so either can serve as the layer's operator.

    Args:
        q, k (Tensor): [B, T, H, K] before L2 normalisation (eps 1e-6 under the root).
        v (Tensor): [B, T, HV, V].
        z (Tensor): [B, T, HV, K] the decay projection's output (gate pre-activation).
        beta_logits (Tensor): [B, T, HV] write-strength logits.
        A_log (Tensor): [HV]; dt_bias (Tensor | None): [HV * K] or [HV, K].
        scale, initial_state, output_final_state, cu_seqlens: as in ``chunk_kda``.
        lower_bound (float): g_min of the lower-bounded gate.
        gate (str): "lower_bounded" or "kimi_linear".
        chunk_size (int): C for ``chunk_kda``.
        cp (KCPContext | None): context parallel (``k3lab.kcp``): q ... beta_logits are this rank's
            tokens [1, T_local, ...] of the sequence ``cp`` describes, and ``kcp_kda`` runs instead of
            ``chunk_kda`` (cu_seqlens must then be None: the documents are ``cp``'s).

    Returns:
        (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None).

    Raises:
        ValueError: everything ``chunk_kda`` (or ``kcp_kda``) and ``lower_bounded_gate`` raise; an unknown
            ``gate``; cu_seqlens together with cp.
    """
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if cp is not None and cu_seqlens is not None:
        raise ValueError("cu_seqlens must be None with cp: the context's seq_bounds place the documents")
    # The operator's own names and checks before any arithmetic (an integer q reached torch.finfo).
    check_kda_inputs(q, k, v, z, beta_logits, None if cp is not None else initial_state, cu_seqlens,
                     check_values=False, scale=scale, output_final_state=output_final_state,
                     names=("z", "beta_logits"))
    z = widen(z)
    g = (lower_bounded_gate(z, A_log, dt_bias, lower_bound) if gate == "lower_bounded"
         else kimi_linear_gate(z, A_log, dt_bias))
    q, k, beta = _l2norm(q), _l2norm(k), torch.sigmoid(widen(beta_logits))
    if cp is not None:
        from k3lab.kcp import kcp_kda  # noqa: PLC0415  (k3lab.kcp imports this package)

        return kcp_kda(q, k, v, g, beta, cp, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, chunk_size=chunk_size)
    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def _kda_op(device: torch.device, gate: str, chunk_size: int, cp=None, check_values: bool = True):
    """The KDA operator used on ``device``: the single place where the fast path plugs in.

    Returns a function with ``reference_kda_op``'s (= ``flash_kda``'s) positional signature:
    ``op(q, k, v, z, beta_logits, A_log, dt_bias, scale=None, initial_state=None,
    output_final_state=False, cu_seqlens=None, lower_bound=-5.0) -> (o, final_state)``.
    On CPU it is always the PyTorch reference (kernel modules are never imported there). With ``cp`` (a
    ``k3lab.kcp.KCPContext``) the operator is context parallel: ``kcp_kda`` in PyTorch, ``kcp_flash_kda``
    on CUDA. ``check_values=False`` skips the fused kernels' NaN/inf and range checks (one host sync per
    call); the PyTorch reference always checks.
    """
    reference = functools.partial(reference_kda_op, gate=gate, chunk_size=chunk_size, cp=cp)
    if device.type != "cuda" or gate != "lower_bounded":
        return reference
    # FlashKDA on CUDA (imported here so a CPU process never loads Triton kernels); the reference for
    # what the fused kernel does not take: float64, K > 256, lower_bound below its -10 limit.
    from k3lab.kernels.kda import flash_kda
    from k3lab.kernels.kda.fused import MAX_K, MIN_LOWER_BOUND

    def fused(q, k, v, z, beta, A_log, dt_bias, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, lower_bound=-5.0):
        if cp is None:
            return flash_kda(q, k, v, z, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                             cu_seqlens, lower_bound, check_values=check_values)
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens must be None with cp: the context's seq_bounds place the documents")
        from k3lab.kcp import kcp_flash_kda  # noqa: PLC0415

        return kcp_flash_kda(q, k, v, z, beta, A_log, dt_bias, cp, scale, initial_state, output_final_state,
                             lower_bound, check_values=check_values)

    def op(q, *args, **kwargs):
        lower_bound = kwargs.get("lower_bound", -5.0)
        # Not a number: flash_kda's checks name the argument.
        too_low = (isinstance(lower_bound, numbers.Real) and not isinstance(lower_bound, bool)
                   and lower_bound < MIN_LOWER_BOUND)
        fits = q.dtype != torch.float64 and q.shape[-1] <= MAX_K and not too_low
        return (fused if fits else reference)(q, *args, **kwargs)

    return op


def causal_short_conv(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution with a carried state (the ShortConv of KDA), no activation.

    y[t, c] = sum_j weight[c, j] * x[t - (W-1) + j, c], where inputs before a sequence's first token
    come from ``conv_state`` (zeros when None): each packed sequence starts from its own state.

    Args:
        x (Tensor): [B, T, C].
        weight (Tensor): [C, W] per-channel taps (W = kernel width).
        conv_state (Tensor | None): [N, W-1, C] the W-1 inputs before each sequence.
        cu_seqlens (Tensor | None): int [N+1] offsets of packed sequences (B == 1); None: N = B.

    Returns:
        (y [B, T, C], new_state [N, W-1, C]) where new_state holds the last W-1 inputs of each
        sequence (earlier state rows or zeros fill in when a sequence is shorter than W-1).

    Raises:
        ValueError: ``x`` not [B, T, C] floating point; ``weight`` not a floating-point [C, W] with W >= 1;
            ``cu_seqlens`` not valid offsets for T (``check_cu_seqlens``) or given with B > 1; ``conv_state`` not
            a floating-point [N, W-1, C] tensor.
    """
    if not (isinstance(x, torch.Tensor) and x.ndim == 3 and x.is_floating_point()):
        raise ValueError(f"causal_short_conv: x must be a floating-point [B, T, C] tensor, got {_shape(x)}"
                         + (f" {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    B, T, C = x.shape
    if not (isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.shape[0] == C and weight.shape[1] >= 1
            and weight.is_floating_point()):
        raise ValueError(f"causal_short_conv: weight must be a floating-point [C, W] with C = x.shape[-1] = {C} and "
                         f"W >= 1, got {_shape(weight)}{' ' + str(weight.dtype) if isinstance(weight, torch.Tensor) else ''}")
    W = weight.shape[1]
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"causal_short_conv: cu_seqlens packs sequences into one row: x must be [1, T, C], "
                             f"got B = {B}")
        check_cu_seqlens(cu_seqlens, T)
    seqs = x[0].split(cu_seqlens.diff().tolist()) if cu_seqlens is not None else None
    N = B if seqs is None else len(seqs)
    if conv_state is None:
        conv_state = x.new_zeros(N, W - 1, C)
    elif not (isinstance(conv_state, torch.Tensor) and conv_state.is_floating_point()
              and conv_state.shape == (N, W - 1, C)):
        raise ValueError(f"conv_state must be a floating-point [N, W-1, C] = {[N, W - 1, C]} tensor, got "
                         f"{_shape(conv_state)}{' ' + str(conv_state.dtype) if isinstance(conv_state, torch.Tensor) else ''}")
    w = weight.to(x.dtype)
    if cu_seqlens is None:
        # [B, W-1 + T, C]: the carried inputs, then the sequence.
        full = torch.cat([conv_state.to(x.dtype), x], dim=1)
        return _shift_sum(full, w, T), full[:, T:]
    outs, states = [], []
    for n, xs in enumerate(seqs):
        full = torch.cat([conv_state[n].to(xs.dtype), xs])
        outs.append(_shift_sum(full[None], w, xs.shape[0])[0])
        states.append(full[xs.shape[0]:])
    return torch.cat(outs)[None], torch.stack(states)


def _shift_sum(full: torch.Tensor, w: torch.Tensor, L: int) -> torch.Tensor:
    """y[:, t] = sum_j w[:, j] * full[:, t + j] for t < L: full [B, W-1 + L, C], w [C, W] -> [B, L, C].
    (W shifted multiply-adds: much faster on CPU than a depthwise F.conv1d.)"""
    y = full[:, :L] * w[:, 0]
    for j in range(1, w.shape[1]):
        y = y + full[:, j : j + L] * w[:, j]
    return y


class KDALayer(nn.Module):
    """Kimi Delta Attention layer (K3 report, Sec. 2.1, Eq. 3-5; Kimi Linear, Sec. 3).

    Args:
        d_model (int): d, the model width.
        num_heads (int): H, query/key heads.
        head_dim (int): K, the key head dim (also V unless ``v_head_dim`` is given; K3: 128).
        num_v_heads (int | None): HV, value heads, a multiple of H (GVA); default H.
        v_head_dim (int | None): V; default K.
        conv_size (int): kernel width W of the short convolutions (K3: 4).
        gate (str): "lower_bounded" (K3, Eq. 5: g = g_min sigmoid(exp(A) z)) or "kimi_linear"
            (g = -exp(A_log) softplus(z + dt_bias)).
        lower_bound (float): g_min of the lower-bounded gate (K3: -5).
        norm_eps (float): eps of the per-head output RMSNorm.
        chunk_size (int): C for ``chunk_kda`` (the reference path; ``flash_kda`` on CUDA always uses
            64).
        gate_rank (int | None): None: a full-rank output gate W_g [HV V, d]; r: the low-rank gate of
            Kimi Linear (fla's ``KimiDeltaAttention``), W_g = W_g2 W_g1 with W_g1 [r, d] and W_g2
            [HV V, r] plus a bias (``k3lab.model``'s K3 config uses r = 128, the convention under which the
            full-size build counts K3's 2.78T / 104.2B parameters).
        conv_backend (str | None): the short convolutions with their SiLU: "torch" (``causal_short_conv`` then
            ``F.silu``), "triton" (``k3lab.kernels.kda.short_conv``, one fused kernel forward and two backward,
            also inside torch.compile; on the CPU only under TRITON_INTERPRET=1) wherever it computes the same thing, or None: "triton"
            for CUDA inputs. The kernel takes every row as its own sequence from zeros, so a forward with a
            cache, cu_seqlens, cp or use_cache, or a float64 one, or conv_size outside [2, 8] always runs "torch"
            (``forward``'s use_cache defaults to True: training passes use_cache=False).

    Shapes: ``forward(x [B, T, d]) -> (y [B, T, d], KDACache | None)``.

    Raises:
        ValueError: non-positive sizes, gate_rank not a positive int or None, HV not a multiple of H,
            unknown gate, conv_size < 1, lower_bound not a finite negative number, chunk_size not accepted
            by ``chunk_kda``, norm_eps not a finite number > 0, conv_backend not one of "torch", "triton", None.

    Example:
        >>> layer = KDALayer(d_model=64, num_heads=2, head_dim=32)
        >>> y, cache = layer(torch.randn(1, 10, 64))
        >>> y.shape, cache.state.shape
        (torch.Size([1, 10, 64]), torch.Size([1, 2, 32, 32]))
    """

    def __init__(
        self, d_model: int, num_heads: int, head_dim: int, num_v_heads: int | None = None,
        v_head_dim: int | None = None, conv_size: int = 4, gate: str = "lower_bounded",
        lower_bound: float = -5.0, norm_eps: float = 1e-5, chunk_size: int = 64, gate_rank: int | None = None,
        conv_backend: str | None = None,
    ):
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        sizes = dict(d_model=d_model, num_heads=num_heads, head_dim=head_dim, num_v_heads=num_v_heads,
                     v_head_dim=v_head_dim, conv_size=conv_size, chunk_size=chunk_size)
        for name, n in sizes.items():
            if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if gate_rank is not None and not (isinstance(gate_rank, int) and not isinstance(gate_rank, bool)
                                          and gate_rank > 0):
            raise ValueError(f"gate_rank must be a positive int or None (full rank), got {gate_rank!r}")
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_heads={num_heads} (GVA)")
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        check_lower_bound(lower_bound)
        check_chunk_size(chunk_size)
        if not (isinstance(norm_eps, (int, float)) and not isinstance(norm_eps, bool) and math.isfinite(norm_eps)
                and norm_eps > 0):
            raise ValueError(f"norm_eps must be a finite number > 0 (0 gives a zero vector 0/0), got {norm_eps!r}")
        if conv_backend not in (*CONV_BACKENDS, None):
            raise ValueError(f"conv_backend must be one of {CONV_BACKENDS} or None, got {conv_backend!r}")
        self.H, self.K, self.HV, self.V = num_heads, head_dim, num_v_heads, v_head_dim
        self.conv_size, self.gate, self.lower_bound, self.chunk_size = conv_size, gate, lower_bound, chunk_size
        self.conv_backend = conv_backend
        qk_dim, v_dim = num_heads * head_dim, num_v_heads * v_head_dim

        self.q_proj = nn.Linear(d_model, qk_dim, bias=False)
        self.k_proj = nn.Linear(d_model, qk_dim, bias=False)
        self.v_proj = nn.Linear(d_model, v_dim, bias=False)
        # Depthwise taps [C, W]; the last tap multiplies the current token.
        self.q_conv = nn.Parameter(torch.empty(qk_dim, conv_size))
        self.k_conv = nn.Parameter(torch.empty(qk_dim, conv_size))
        self.v_conv = nn.Parameter(torch.empty(v_dim, conv_size))
        self.b_proj = nn.Linear(d_model, num_v_heads, bias=False)
        # Full-rank decay projection (K3) to one pre-activation per value head and key channel.
        self.f_proj = nn.Linear(d_model, num_v_heads * head_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads * head_dim))
        # Sigmoid output gate (full rank, or Kimi Linear's low rank) and per-head RMSNorm.
        self.g_proj = (nn.Linear(d_model, v_dim, bias=False) if gate_rank is None else
                       nn.Sequential(nn.Linear(d_model, gate_rank, bias=False), nn.Linear(gate_rank, v_dim, bias=True)))
        self.o_norm = RMSNorm(v_head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(v_dim, d_model, bias=False)
        # The fused kernels' NaN/inf and range checks cost one host sync per call; a trainer that
        # validates its inputs once turns them off (``K3Model.value_checks``).
        self.check_values = True
        self.reset_gate_parameters()

    def reset_gate_parameters(self) -> None:
        """Initialise conv taps, A_log and dt_bias (projections keep nn.Linear's init unless the
        owner re-initialises them).

        A_log: 0 for K3's lower-bounded gate (K3 report); log U(1, 16) for Kimi Linear's gate.
        dt_bias: softplus^-1(dt) with dt log-uniform in [1e-3, 0.1] (Mamba's init), so both gates
        start with slow decay on most channels.
        """
        with torch.no_grad():
            bound = 1 / math.sqrt(self.conv_size)
            for w in (self.q_conv, self.k_conv, self.v_conv):
                w.uniform_(-bound, bound)
            if self.gate == "lower_bounded":
                self.A_log.zero_()
            else:
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1)))
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """g = gate(W_f x): [B, T, d] -> [B, T, HV, K] log-decay (<= 0), float32 (float64 for float64 x)."""
        z = widen(self.f_proj(x)).unflatten(-1, (self.HV, self.K))
        if self.gate == "lower_bounded":
            return lower_bounded_gate(z, self.A_log, self.dt_bias, self.lower_bound)
        return kimi_linear_gate(z, self.A_log, self.dt_bias)

    def forward(
        self, x: torch.Tensor, cache: KDACache | None = None, cu_seqlens: torch.Tensor | None = None,
        use_cache: bool = True, cp=None,
    ) -> tuple[torch.Tensor, KDACache | None]:
        """Mix tokens causally.

        Args:
            x (Tensor): [B, T, d].
            cache (KDACache | None): state after the previous tokens of each sequence (N = B, or the
                number of packed sequences with ``cu_seqlens``); None starts from zeros.
            cu_seqlens (Tensor | None): int [N+1] offsets of packed sequences; requires B == 1.
            use_cache (bool): return the updated cache (False returns None, e.g. for training).
            cp (KCPContext | None): context parallel (``k3lab.kcp.make_context``): x is this rank's
                [1, T_local, d] slice of the packed sequence ``cp`` describes (its documents, its group);
                the short convolutions take their halo from the previous rank (``kcp_short_conv``) and
                KDA runs as ``kcp_kda`` (``kcp_flash_kda`` on CUDA). No cache, cu_seqlens or use_cache.

        Returns:
            (y [B, T, d] in x's dtype, KDACache | None).

        Raises:
            ValueError: x is not [B, T, d_model] with B, T >= 1 or not in the weights' dtype (outside
                autocast); use_cache not a bool; a
                cache that is not a KDACache, or a field of it (named ``cache.<field>``) not a
                floating-point tensor of its shape on x's device; bad cu_seqlens, B > 1 with cu_seqlens;
                cp with B > 1, a cache, cu_seqlens or use_cache;
                a NaN or inf in x or the cache, or an x or cache.state so large that KDA overflows
                (``k3lab.kda.checks.NonFiniteError``, naming x or the cache field rather than the
                operator's internal q, k, v or initial_state).
        """
        d = self.q_proj.in_features
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != d or 0 in x.shape[:2]:
            raise ValueError(f"x must be [B, T, d_model={d}] with B, T >= 1, got "
                             f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not isinstance(use_cache, bool):
            raise ValueError(f"use_cache must be a bool, got {type(use_cache).__name__}")
        w_dtype = self.q_proj.weight.dtype
        if not x.is_floating_point() or (x.dtype != w_dtype and not torch.is_autocast_enabled(x.device.type)):
            raise ValueError(f"x must be a floating-point tensor in the layer's dtype {w_dtype} "
                             f"(or run under autocast), got {x.dtype}")
        if cache is not None and not isinstance(cache, KDACache):
            raise ValueError(f"cache must be a KDACache or None, got {type(cache).__name__}")
        if cu_seqlens is not None and x.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B=1, got B={x.shape[0]}")
        N = check_cu_seqlens(cu_seqlens, x.shape[1]) if cu_seqlens is not None else x.shape[0]
        conv = causal_short_conv
        if cp is not None:
            if x.shape[0] != 1 or cache is not None or cu_seqlens is not None or use_cache:
                raise ValueError(f"with cp, x must be this rank's one packed row [1, T_local, d] with no cache, "
                                 f"cu_seqlens or use_cache (cp places the documents), got x {list(x.shape)}, "
                                 f"cache={type(cache).__name__}, cu_seqlens={cu_seqlens is not None}, "
                                 f"use_cache={use_cache}")
            from k3lab.kcp import kcp_short_conv  # noqa: PLC0415  (k3lab.kcp imports this package)

            def conv(y, weight, state, cu):
                return kcp_short_conv(y, weight, cp), None
        if cache is not None:
            self._check_cache(cache, N, x.device)
        c = cache or KDACache(None, None, None, None)
        # The fused kernel where it computes what the convolution then SiLU do: each row its own sequence from
        # zeros, and no convolution state to return. Its kernels are custom ops, so compiled regions call them
        # too (inductor's fusion of the PyTorch form reads and writes the tensor several times more).
        fused = (self._conv_backend(x.device) == "triton" and cache is None and cu_seqlens is None and cp is None
                 and not use_cache and 2 <= self.conv_size <= 8)

        def conv_silu(u, weight, state):
            # SiLU(ShortConv(u)) and the convolution's new state (None from the kernel, which keeps none).
            if fused and u.dtype in (torch.float16, torch.bfloat16, torch.float32):
                from k3lab.kernels.kda.short_conv import short_conv_silu  # noqa: PLC0415  (CUDA or interpreter only)

                return short_conv_silu(u, weight), None
            u, new_state = conv(u, weight, state, cu_seqlens)
            return F.silu(u), new_state

        q, cq = conv_silu(self.q_proj(x), self.q_conv, c.conv_q)
        k, ck = conv_silu(self.k_proj(x), self.k_conv, c.conv_k)
        v, cv = conv_silu(self.v_proj(x), self.v_conv, c.conv_v)
        q = q.unflatten(-1, (self.H, self.K))
        k = k.unflatten(-1, (self.H, self.K))
        v = v.unflatten(-1, (self.HV, self.V))
        z = self.f_proj(x).unflatten(-1, (self.HV, self.K))
        with torch.autocast(x.device.type, enabled=False):
            # x in the weights' dtype: under autocast it may be bf16 while the weights are float32.
            beta = self.b_proj(x.to(self.b_proj.weight.dtype))
        o, state = _run_kda_op(self, x, c, q, k, v, z, beta, cu_seqlens, use_cache, cp)
        o = o.to(x.dtype)
        if self.check_values:
            # RMSNorm is scale-free too: a head output whose squares would overflow is brought into range
            # first (ordinary outputs are divided by exactly 1), or it would come out as zeros.
            o = o / _unsquarable(widen(o)).to(o.dtype)
        o = self.o_norm(o) * torch.sigmoid(self.g_proj(x)).unflatten(-1, (self.HV, self.V))
        y = self.o_proj(o.flatten(-2))
        return y, (KDACache(cq, ck, cv, state) if use_cache else None)

    def _conv_backend(self, device: torch.device) -> str:
        """``conv_backend`` resolved for inputs on ``device``: None is "triton" on CUDA, "torch" elsewhere (as
        ``_kda_op`` keeps the CPU on PyTorch, interpreter or not)."""
        if self.conv_backend is not None:
            return self.conv_backend
        return "triton" if device.type == "cuda" else "torch"

    def _check_cache(self, cache: KDACache, N: int, device: torch.device) -> None:
        """ValueError naming ``cache.<field>`` unless each field is None or a floating-point tensor of its
        shape for N sequences on ``device`` (the operator and the convolutions would name their own
        arguments, conv_state and initial_state)."""
        W, qk, vd = self.conv_size - 1, self.H * self.K, self.HV * self.V
        expected = dict(conv_q=("[N, conv_size-1, H*K]", (N, W, qk)), conv_k=("[N, conv_size-1, H*K]", (N, W, qk)),
                        conv_v=("[N, conv_size-1, HV*V]", (N, W, vd)),
                        state=("[N, HV, K, V]", (N, self.HV, self.K, self.V)))
        for field, (legend, shape) in expected.items():
            t = getattr(cache, field)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ValueError(f"cache.{field} must be {legend} = {list(shape)} for N={N} sequences, got {_shape(t)}")
            if t.device != device:
                raise ValueError(f"cache.{field} must be on x's device {device}, got {t.device}")
            if not t.is_floating_point():
                raise ValueError(f"cache.{field} must be a floating-point tensor, got dtype {t.dtype}")

    def _blame(self, err: NonFiniteError, x: torch.Tensor, cache: KDACache) -> NonFiniteError:
        """The tensor behind the operator's value error ``err``: the first of x, the cache fields and the
        layer's own parameters (a diverged weight, or an A_log whose exp overflows) holding a NaN or inf;
        else cache.state when the operator named its initial state, and x otherwise (q, k, v, the gate and
        beta are all computed from x and the weights). One host sync, on this error path only."""
        named = {"x": x, **{f"cache.{f}": getattr(cache, f) for f in ("conv_q", "conv_k", "conv_v", "state")}}
        named.update(self.named_parameters())
        if "A_log" in named:
            # The gate uses exp(A_log): finite weights whose exp is not break it as surely as a NaN does.
            named["A_log (its exp)"] = named["A_log"].detach().float().exp()
        named = {name: t for name, t in named.items() if t is not None}
        bad = torch.stack([~torch.isfinite(t).all() for t in named.values()]).tolist()
        for name, is_bad in zip(named, bad):
            if is_bad:
                return NonFiniteError(name, f"{name} contains NaN or inf")
        if err.name == "initial_state":
            return NonFiniteError("cache.state",
                                  f"cache.state is out of range (the KDA operator's initial_state): {err}")
        return NonFiniteError("x", (f"x is too large: with max |x| = {x.abs().max().item():.3g} the layer's "
                                    f"{err.name} overflowed inside the KDA operator: {err}"))


# Eager under torch.compile: FlashKDA is a Triton autograd.Function with host-side checks, and the PyTorch
# reference a Python loop over chunks.
@torch.compiler.disable
def _run_kda_op(layer: KDALayer, x: torch.Tensor, cache: KDACache, q, k, v, z, beta, cu_seqlens, use_cache: bool,
                cp) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``layer``'s KDA operator (``_kda_op``) on q, k, v, z and beta, an operator value error blamed on the
    layer's own argument (``KDALayer._blame``)."""
    op = _kda_op(x.device, layer.gate, layer.chunk_size, cp, layer.check_values)
    # The operator normalises q/k, applies the gate and sigmoid(beta) and picks its own precision
    # (the reference computes in float32): keep autocast from making its matmuls bf16.
    with torch.autocast(x.device.type, enabled=False):
        try:
            return op(q, k, v, z, beta, layer.A_log, layer.dt_bias, initial_state=cache.state,
                      output_final_state=use_cache, cu_seqlens=cu_seqlens, lower_bound=layer.lower_bound)
        except NonFiniteError as err:
            raise layer._blame(err, x, cache) from err


def _unsquarable(x: torch.Tensor) -> torch.Tensor:
    """Per row of the last dim: max |x| where squaring and summing it could overflow x's dtype, else 1.
    Dividing by it leaves ordinary rows bit for bit unchanged and brings huge ones into range."""
    big = x.abs().amax(-1, keepdim=True)
    limit = torch.finfo(x.dtype).max ** 0.5 / (4 * x.shape[-1])
    return torch.where(big > limit, big, torch.ones_like(big))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (computed in float32 or wider). Scale-free, so a row whose
    squares would overflow is divided by its max |x| first (eps / s^2 keeps the formula) rather than
    normalised to zero."""
    xf = widen(x)
    s = _unsquarable(xf)
    xs = xf / s
    return (xs * torch.rsqrt(xs.pow(2).sum(-1, keepdim=True) + eps / s.pow(2))).to(x.dtype)
