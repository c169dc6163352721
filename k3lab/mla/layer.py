"""`GatedMLA`: multi-head latent attention with a sigmoid output gate (K3 report, Eq. 7;
DeepSeek-V2, Sec. 2.1).

    c_q   = RMSNorm(W_dq x)                                   [B, T, Rq]      (Rq = q_lora_rank)
    q     = W_uq c_q  -> [q_nope | q_shared] per head          [B, T, H, Dn + Dr]
    c_kv  = RMSNorm(W_dkv x),  k_shared = W_kr x               [B, T, R], [B, T, Dr]  (R = kv_lora_rank)
    k     = [W_uk c_kv | k_shared] per head                    [B, T, H, Dn + Dr]   (k_shared shared by heads)
    v     = W_uv c_kv                                          [B, T, H, Dv]
    o     = softmax(q k^T / sqrt(Dn + Dr) + causal mask) v     [B, T, H, Dv]
    y     = W_o [ sigmoid(W_g x) * o ]                         [B, T, d]

K3 uses NoPE on every MLA layer: the Dr = 64 channels DeepSeek rotates are left unrotated, so the
KDA layers alone carry position. The softmax scale comes from the q/k head width Dn + Dr (192 at
full size), never from Dv or from the absorbed width R + Dr.

Decoding caches only c_kv and k_shared per token (R + Dr = 576 numbers at full size against
H (Dn + Dr + Dv) = 30720 for materialised keys and values) and runs the absorbed form: W_uk is
folded into the query (q_nope W_uk -> an R-wide latent query) and W_uv into the output, so

    o = W_uv softmax([q_nope W_uk | q_shared] [c_kv | k_shared]^T / sqrt(Dn + Dr)) c_kv

equals the materialised form exactly (up to rounding). At T = 1 with an empty cache the softmax
has one key and any scale gives the same output, so the two forms are compared at T >= 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3lab.kda.checks import check_cu_seqlens
from k3lab.norm import RMSNorm
from k3lab.precision import check_input_dtype, widen


@dataclass
class MLACache:
    """Decoding state of one ``GatedMLA`` layer for B sequences of S tokens so far.

    Attributes:
        latent (Tensor): [B, S, R] the normalised compressed key/value latent c_kv.
        k_shared (Tensor): [B, S, Dr] the head-shared (unrotated) key part.
    """

    latent: torch.Tensor
    k_shared: torch.Tensor

    @property
    def length(self) -> int:
        """S, the number of cached tokens."""
        return self.latent.shape[1]


def attention_mask(T: int, S: int, offset: int = 0, cu_seqlens: torch.Tensor | None = None,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """The boolean mask (True = may attend) of T queries at positions offset .. offset+T-1 over S keys.

    Query i sees key j when j <= i + offset and, with ``cu_seqlens``, both lie in the same packed
    document (a block-diagonal causal mask).

    Args:
        T (int): queries; S (int): keys (S = offset + T for a causal step).
        offset (int): the position of the first query (cached tokens before it).
        cu_seqlens (Tensor | None): int [N+1] document offsets over the T = S packed tokens (offset 0).
        device: where to build it.

    Returns:
        Tensor [T, S] bool.

    Raises:
        ValueError: T, S or offset not an int >= 0; ``cu_seqlens`` with offset != 0 or T != S, or not int
            [N+1] offsets strictly increasing from 0 to T (``k3lab.kda.checks.check_cu_seqlens``).
    """
    for name, n in (("T", T), ("S", S), ("offset", offset)):
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
            raise ValueError(f"attention_mask: {name} must be an int >= 0, got {n!r}")
    if cu_seqlens is not None:
        if offset != 0 or T != S:
            raise ValueError(f"cu_seqlens needs a full packed sequence (offset 0, T == S), got offset={offset}, "
                             f"T={T}, S={S}")
        check_cu_seqlens(cu_seqlens, T)
    return _attention_mask(T, S, offset, cu_seqlens, device)


def _attention_mask(T: int, S: int, offset: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """``attention_mask`` on arguments already checked (``GatedMLA.forward`` checks its cu_seqlens once)."""
    i = torch.arange(T, device=device)[:, None] + offset
    j = torch.arange(S, device=device)[None, :]
    mask = j <= i
    if cu_seqlens is not None:
        doc = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=device),
                                      cu_seqlens.diff().to(device))
        mask = mask & (doc[:, None] == doc[None, :])
    return mask


def context_mask(cp, device: torch.device | str | None = None) -> torch.Tensor:
    """The attention mask of this context-parallel rank's queries over the whole packed sequence.

    Rank r of ``cp`` holds global tokens [start, stop); its query at global position i sees key j of the
    T gathered keys when j <= i and both lie in one of ``cp``'s documents (``seq_bounds``).

    Args:
        cp (KCPContext): layout of the sequence over the context-parallel group (``k3lab.kcp``).
        device: where to build it.

    Returns:
        Tensor [T_local, T] bool (True = may attend).

    Raises:
        ValueError: cp not a KCPContext.
    """
    from k3lab.kcp import KCPContext  # noqa: PLC0415  (k3lab.kcp imports k3lab.kda, not this package)

    if not isinstance(cp, KCPContext):
        raise ValueError(f"cp must be a k3lab.kcp.KCPContext (make_context), got {type(cp).__name__}")
    T = cp.T
    j = torch.arange(T, device=device)
    i = j[cp.start:cp.stop, None]
    inner = torch.tensor(cp.seq_bounds[1:-1], device=device, dtype=j.dtype)
    doc = torch.bucketize(j, inner, right=True)
    return (j[None, :] <= i) & (doc[cp.start:cp.stop, None] == doc[None, :])


def absorbed_attention(q_nope: torch.Tensor, q_shared: torch.Tensor, latent: torch.Tensor,
                       k_shared: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                       mask: torch.Tensor | None) -> torch.Tensor:
    """MLA attention in the absorbed form, reading only the latent cache (K3 report, Eq. 7; DeepSeek-V2,
    Sec. 2.1.3).

    Args:
        q_nope (Tensor): [B, T, H, Dn] the per-head query channels that meet W_uk c_kv.
        q_shared (Tensor): [B, T, H, Dr] the query channels that meet the shared key part.
        latent (Tensor): [B, S, R] c_kv of every key.
        k_shared (Tensor): [B, S, Dr].
        w_uk (Tensor): [H, Dn, R] key up-projection; w_uv (Tensor): [H, Dv, R] value up-projection.
        scale (float): the softmax scale, 1/sqrt(Dn + Dr) (the materialised q/k head width).
        mask (Tensor | None): [T, S] bool (True = attend); None = all keys.

    Returns:
        Tensor [B, T, H, Dv] in q_nope's dtype.

    Raises:
        ValueError: shapes that disagree, a mask that is not a [T, S] bool tensor, a scale that is not a finite
            number > 0, or (outside autocast) inputs of more than one dtype.
    """
    if not (isinstance(q_nope, torch.Tensor) and q_nope.ndim == 4):
        got = list(q_nope.shape) if isinstance(q_nope, torch.Tensor) else type(q_nope).__name__
        raise ValueError(f"q_nope must be [B, T, H, Dn], got {got}")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0 (1/sqrt(Dn + Dr)), got {scale!r}")
    B, T, H, Dn = q_nope.shape
    if latent.ndim != 3 or latent.shape[0] != B:
        raise ValueError(f"latent must be [B={B}, S, R], got {list(latent.shape)}")
    S, R = latent.shape[1], latent.shape[2]
    if (q_shared.ndim != 4 or k_shared.ndim != 3 or q_shared.shape[:3] != (B, T, H) or k_shared.shape[:2] != (B, S)
            or k_shared.shape[2] != q_shared.shape[3]):
        raise ValueError(f"q_shared [B, T, H, Dr] and k_shared [B, S, Dr] disagree: q_nope {list(q_nope.shape)}, "
                         f"q_shared {list(q_shared.shape)}, latent {list(latent.shape)}, k_shared {list(k_shared.shape)}")
    if w_uk.shape != (H, Dn, R) or w_uv.ndim != 3 or w_uv.shape[0] != H or w_uv.shape[2] != R:
        raise ValueError(f"w_uk must be [H={H}, Dn={Dn}, R={R}] and w_uv [H, Dv, R], got {list(w_uk.shape)} "
                         f"and {list(w_uv.shape)}")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape == (T, S)):
        got = f"{mask.dtype} {list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a bool tensor [T={T}, S={S}] or None, got {got}")
    dtypes = {t.dtype for t in (q_nope, q_shared, latent, k_shared, w_uk, w_uv)}
    # Under autocast the einsums and SDPA cast their inputs to one dtype themselves.
    if len(dtypes) > 1 and not torch.is_autocast_enabled(q_nope.device.type):
        raise ValueError(f"q_nope, q_shared, latent, k_shared, w_uk and w_uv must share one dtype, got "
                         f"{sorted(map(str, dtypes))}")
    # W_uk folded into the query: (q_nope W_uk) . c_kv == q_nope . (W_uk c_kv).
    q_lat = torch.einsum("bthn,hnr->bhtr", q_nope, w_uk)
    q = torch.cat([q_lat, q_shared.transpose(1, 2)], dim=-1)                   # [B, H, T, R + Dr]
    k = torch.cat([latent, k_shared], dim=-1)[:, None]                         # [B, 1, S, R + Dr]
    # SDPA's default scale would be 1/sqrt(R + Dr) here (the absorbed width): pass the real one.
    o_lat = F.scaled_dot_product_attention(q, k, latent[:, None], attn_mask=mask, scale=scale,
                                           enable_gqa=True)                    # [B, H, T, R]
    # W_uv applied after the softmax-weighted sum of latents.
    return torch.einsum("bhtr,hvr->bthv", o_lat, w_uv)


class GatedMLA(nn.Module):
    """Gated multi-head latent attention (K3 report, Eq. 7), NoPE.

    Args:
        d_model (int): d.
        num_heads (int): H.
        kv_lora_rank (int): R, the compressed key/value latent width (K3: 512).
        q_lora_rank (int | None): Rq, the low-rank query path's width (K3: 1536); None: a full-rank W_q.
        qk_nope_head_dim (int): Dn, per-head key/query channels from the latent (K3: 128).
        qk_rope_head_dim (int): Dr, the head-shared key part (K3: 64, unrotated under NoPE).
        v_head_dim (int): Dv (K3: 128).
        norm_eps (float): eps of the latent RMSNorms.

    Parameters (nn.Linear weights are [out, in]): ``q_a_proj`` [Rq, d], ``q_a_norm`` [Rq], ``q_b_proj``
    [H (Dn + Dr), Rq] (or ``q_proj`` [H (Dn + Dr), d]); ``kv_a_proj`` [R + Dr, d] (c_kv rows, then the
    shared key rows); ``kv_a_norm`` [R]; ``kv_b_proj`` [H (Dn + Dv), R] (per head: Dn key rows, Dv value
    rows); ``g_proj`` [H Dv, d] (full rank); ``o_proj`` [d, H Dv].

    ``forward(x [B, T, d], cache, cu_seqlens, use_cache, absorbed) -> (y [B, T, d], MLACache | None)``.

    Raises:
        ValueError: non-positive sizes, norm_eps not a finite number > 0.

    Example:
        >>> mla = GatedMLA(d_model=64, num_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
        ...                qk_rope_head_dim=4, v_head_dim=8)
        >>> y, cache = mla(torch.randn(2, 10, 64), use_cache=True)
        >>> y.shape, cache.latent.shape, cache.k_shared.shape
        (torch.Size([2, 10, 64]), torch.Size([2, 10, 16]), torch.Size([2, 10, 4]))
    """

    def __init__(self, d_model: int, num_heads: int, kv_lora_rank: int, q_lora_rank: int | None = None,
                 qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64, v_head_dim: int = 128,
                 norm_eps: float = 1e-6):
        super().__init__()
        sizes = dict(d_model=d_model, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                     qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim)
        if q_lora_rank is not None:
            sizes["q_lora_rank"] = q_lora_rank
        for name, n in sizes.items():
            if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
                raise ValueError(f"GatedMLA: {name} must be a positive int, got {n!r}")
        if not (isinstance(norm_eps, (int, float)) and not isinstance(norm_eps, bool) and math.isfinite(norm_eps)
                and norm_eps > 0):
            raise ValueError(f"GatedMLA: norm_eps must be a finite number > 0 (0 gives a zero vector 0/0), got "
                             f"{norm_eps!r}")
        self.d_model, self.H, self.R, self.Rq = d_model, num_heads, kv_lora_rank, q_lora_rank
        self.Dn, self.Dr, self.Dv = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        # The q/k head width is what q.k sums over in the materialised form (192 at full size).
        self.scale = self.qk_head_dim ** -0.5
        H = num_heads
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, H * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, H * self.qk_head_dim, bias=False)
        self.kv_a_proj = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(kv_lora_rank, eps=norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, H * (qk_nope_head_dim + v_head_dim), bias=False)
        self.g_proj = nn.Linear(d_model, H * v_head_dim, bias=False)
        self.o_proj = nn.Linear(H * v_head_dim, d_model, bias=False)

    def extra_repr(self) -> str:
        return (f"H={self.H}, q_lora={self.Rq}, kv_lora={self.R}, qk={self.Dn}+{self.Dr} (NoPE), v={self.Dv}, "
                f"scale=1/sqrt({self.qk_head_dim})")

    def head_blocks(self) -> dict[str, list[int]]:
        """Rows of each Q/K/V projection weight that belong to one head (or one head's key or value
        part), in order: ``{"q_b_proj.weight": [Dn + Dr] * H, "kv_b_proj.weight": [Dn, Dv] * H}``
        (``q_proj.weight`` without the low-rank query path). Per-Head Muon orthogonalises each block."""
        q = "q_proj.weight" if self.Rq is None else "q_b_proj.weight"
        return {q: [self.qk_head_dim] * self.H, "kv_b_proj.weight": [self.Dn, self.Dv] * self.H}

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [H, Dn, R], W_uv [H, Dv, R]): views of ``kv_b_proj.weight``."""
        w = self.kv_b_proj.weight.view(self.H, self.Dn + self.Dv, self.R)
        return w[:, : self.Dn], w[:, self.Dn :]

    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_nope [B, T, H, Dn], q_shared [B, T, H, Dr]) from x [B, T, d]."""
        q = self.q_proj(x) if self.Rq is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.unflatten(-1, (self.H, self.qk_head_dim))
        return q[..., : self.Dn], q[..., self.Dn :]

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [B, T, R] normalised, k_shared [B, T, Dr]) from x [B, T, d]: what the cache keeps."""
        c, k_shared = self.kv_a_proj(x).split([self.R, self.Dr], dim=-1)
        return self.kv_a_norm(c), k_shared

    def forward(self, x: torch.Tensor, cache: MLACache | None = None, cu_seqlens: torch.Tensor | None = None,
                use_cache: bool = False, absorbed: bool | None = None, cp=None) -> tuple[torch.Tensor, MLACache | None]:
        """Attend causally (per packed document with ``cu_seqlens``).

        Args:
            x (Tensor): [B, T, d] float.
            cache (MLACache | None): the previous tokens' latents (S of them); the T new tokens sit at
                positions S .. S+T-1 and see every cached token. Any floating dtype, cast to the new
                tokens' latent dtype as ``KDALayer`` casts its cache: ``K3Model.generate`` builds and reads
                its caches in one dtype, and a prefill under bf16 autocast may be continued in float32.
            cu_seqlens (Tensor | None): int [N+1] offsets of packed documents over T; requires B == 1
                and no cache (each document attends only to itself).
            use_cache (bool): return the cache extended by these T tokens.
            absorbed (bool | None): run the absorbed form (True) or the materialised one (False);
                None: absorbed when a cache is given (decoding), materialised otherwise (training, prefill).
            cp (KCPContext | None): context parallel (``k3lab.kcp.make_context``): x is this rank's
                [1, T_local, d] slice of the packed sequence ``cp`` describes. The latents c_kv and
                k_shared ([T_local, R + Dr] per rank, the KV all-gather) are gathered from the group,
                and the local queries attend over all T keys under ``context_mask`` (the backward
                reduce-scatters the latents' gradients to their owners). No cache, cu_seqlens or
                use_cache.

        Returns:
            (y [B, T, d] in x's dtype (autocast's under autocast), MLACache | None).

        Raises:
            ValueError: x not a floating [B, T, d_model] tensor with T >= 1, or not in the parameters' dtype
                outside autocast (``k3lab.precision.check_input_dtype``); use_cache not a bool, absorbed not a
                bool or None; a cache that is not an MLACache, or whose batch or widths disagree, or whose
                tensors are not floating point tensors (another float dtype is cast, not refused); cu_seqlens
                with B > 1, with a cache, or invalid (``k3lab.kda.checks.check_cu_seqlens``); cp not a
                KCPContext, or with B > 1, a cache, cu_seqlens or use_cache, or x not holding the context's
                T_local tokens.
        """
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != self.d_model or not x.is_floating_point():
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"GatedMLA: x must be a floating [B, T, d_model={self.d_model}] tensor, got {got}")
        check_input_dtype("GatedMLA", "x", x, self.kv_a_proj.weight.dtype)
        B, T, _ = x.shape
        if T == 0:
            raise ValueError("GatedMLA: x must hold at least one token (T >= 1)")
        for name, flag in (("use_cache", use_cache), ("absorbed", absorbed)):
            if not (isinstance(flag, bool) or (name == "absorbed" and flag is None)):
                raise ValueError(f"GatedMLA: {name} must be a bool, got {flag!r}")
        if cache is not None:
            if not isinstance(cache, MLACache):
                raise ValueError(f"GatedMLA: cache must be an MLACache or None, got {type(cache).__name__}")
            if not (isinstance(cache.latent, torch.Tensor) and isinstance(cache.k_shared, torch.Tensor)):
                raise ValueError(f"GatedMLA: cache.latent and cache.k_shared must be tensors, got "
                                 f"{type(cache.latent).__name__} and {type(cache.k_shared).__name__}")
            want = [(B, cache.length, self.R), (B, cache.length, self.Dr)]
            if [tuple(cache.latent.shape), tuple(cache.k_shared.shape)] != want:
                raise ValueError(f"GatedMLA: cache must hold latent [B={B}, S, R={self.R}] and k_shared "
                                 f"[B, S, Dr={self.Dr}], got {list(cache.latent.shape)} and {list(cache.k_shared.shape)}")
            if not (cache.latent.is_floating_point() and cache.k_shared.is_floating_point()):
                raise ValueError(f"GatedMLA: cache.latent and cache.k_shared must be floating point (they are cast "
                                 f"to the new latents' dtype), got {cache.latent.dtype} and {cache.k_shared.dtype}")
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"GatedMLA: with cu_seqlens the documents must be packed into B=1, got B={B}")
            if cache is not None:
                raise ValueError("GatedMLA: cu_seqlens with a cache is not supported (decode documents as a batch)")
            check_cu_seqlens(cu_seqlens, T)
        if cp is not None:
            from k3lab.kcp import KCPContext  # noqa: PLC0415  (k3lab.kcp imports k3lab.kda, not this package)

            if not isinstance(cp, KCPContext):
                raise ValueError(f"GatedMLA: cp must be a k3lab.kcp.KCPContext (make_context) or None, got "
                                 f"{type(cp).__name__}")
        if cp is not None and (B != 1 or cache is not None or cu_seqlens is not None or use_cache or T != cp.T_local):
            raise ValueError(f"GatedMLA: with cp, x must be this rank's one packed row [1, T_local={cp.T_local}, d] with "
                             f"no cache, cu_seqlens or use_cache, got x {list(x.shape)}, cache={type(cache).__name__}, "
                             f"cu_seqlens={cu_seqlens is not None}, use_cache={use_cache}")
        q_nope, q_shared = self.queries(x)
        latent, k_shared = self.latents(x)
        mask = None
        if cp is not None:
            from k3lab.kcp.kcp import gather_from_group  # noqa: PLC0415  (k3lab.kcp imports k3lab.kda)

            # One all-gather of [T_local, R + Dr] per rank: the latents every rank's queries read. The gather is
            # eager under --compile; it takes a fresh tensor, since a view of a compiled graph's output came back
            # from inductor's cache with garbage sizes.
            full = gather_from_group(torch.cat([latent[0], k_shared[0]], dim=-1), cp, "mla_latent")
            latent, k_shared = full.reshape(1, cp.T, self.R + self.Dr).split([self.R, self.Dr], dim=-1)
            mask = context_mask(cp, x.device)
        offset = 0
        if cache is not None:
            offset = cache.length
            latent = torch.cat([cache.latent.to(latent.dtype), latent], dim=1)
            k_shared = torch.cat([cache.k_shared.to(k_shared.dtype), k_shared], dim=1)
        S = latent.shape[1]
        if absorbed is None:
            absorbed = cache is not None
        causal_only = cu_seqlens is None and offset == 0
        if cp is None and not (causal_only and not absorbed):
            mask = _attention_mask(T, S, offset, cu_seqlens, x.device)
        if absorbed:
            w_uk, w_uv = self.up_weights()
            o = absorbed_attention(q_nope, q_shared, latent, k_shared, w_uk.to(q_nope.dtype), w_uv.to(q_nope.dtype),
                                   self.scale, mask)
        else:
            kv = self.kv_b_proj(latent).unflatten(-1, (self.H, self.Dn + self.Dv))
            k_nope, v = kv.split([self.Dn, self.Dv], dim=-1)
            k = torch.cat([k_nope, k_shared[:, :, None].expand(-1, -1, self.H, -1)], dim=-1)
            q = torch.cat([q_nope, q_shared], dim=-1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale).transpose(1, 2)
        # The gate multiplies in float32: the attention output is kept in FP32 in training (K3 report).
        gate = torch.sigmoid(widen(self.g_proj(x)))
        y = self.o_proj((gate * widen(o.flatten(-2))).to(x.dtype))
        new_cache = MLACache(latent, k_shared) if use_cache else None
        return y, new_cache
