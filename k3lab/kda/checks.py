"""Input validation shared by every KDA entry point (naive, chunk, Triton, KCP)."""
from __future__ import annotations

import math

import torch

from k3lab.precision import shape_of as _shape


class NonFiniteError(ValueError):
    """A ValueError about an argument's values: NaN, inf, or a magnitude the computation overflows on.

    ``name`` is the argument the message names, so a wrapper that builds KDA's inputs from its own
    (``KDALayer``: q, k, v from x; initial_state from cache.state) can name its caller's argument instead.
    """

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def check_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> int:
    """Validate ``cu_seqlens`` (int [N+1], 0 = c_0 < c_1 < ... < c_N = T); returns N.

    Raises:
        ValueError: not a tensor, wrong dtype/rank, on the meta device (no values to read), not starting
            at 0, not ending at T, or not strictly increasing (an empty or duplicate offset would be a
            zero-length sequence).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 torch.Tensor [N+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32/int64 tensor [N+1] with N >= 1, got dtype "
            f"{cu_seqlens.dtype} shape {_shape(cu_seqlens)}"
        )
    if cu_seqlens.is_meta:
        raise ValueError("cu_seqlens must be on a device with values (cpu or cuda), got meta")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {offsets[0]} ... {offsets[-1]}")
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    if min(lengths) <= 0:
        i = next(i for i, n in enumerate(lengths) if n <= 0)
        raise ValueError(
            f"cu_seqlens must be strictly increasing (no empty or duplicate offsets): "
            f"cu_seqlens[{i}]={offsets[i]}, cu_seqlens[{i + 1}]={offsets[i + 1]}"
        )
    return len(lengths)


def check_chunk_size(chunk_size: int, sub_tile: int = 16, name: str = "chunk_size") -> None:
    """Raise ValueError unless ``chunk_size`` is an int that is a multiple of 16 or one of 1, 2, 4, 8;
    ``name`` is the argument named in the message."""
    if not (isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size > 0
            and (chunk_size % sub_tile == 0 or chunk_size in (1, 2, 4, 8))):
        raise ValueError(f"{name} must be an int, a multiple of {sub_tile} or 1, 2, 4, 8, got {chunk_size!r}")


def check_initial_state(initial_state, shape: tuple[int, int, int, int], device: torch.device) -> None:
    """ValueError unless ``initial_state`` is None or a floating-point tensor of ``shape`` [N, HV, K, V] on
    ``device`` (the message names what it got)."""
    if initial_state is None:
        return
    if not isinstance(initial_state, torch.Tensor):
        raise ValueError(f"initial_state must be a torch.Tensor [N, HV, K, V], got {type(initial_state).__name__}")
    if initial_state.shape != shape:
        raise ValueError(f"initial_state must be [N, HV, K, V] = {list(shape)}, got {_shape(initial_state)}")
    if initial_state.device != device:
        raise ValueError(f"initial_state must be on q's device {device}, got {initial_state.device}")
    if not initial_state.is_floating_point():
        raise ValueError(f"initial_state must be a floating-point tensor, got dtype {initial_state.dtype}")


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    check_values: bool = True,
    scale: float | None = None,
    output_final_state: bool = False,
    *,
    names: tuple[str, str] = ("g", "beta"),
) -> int:
    """Check the shapes and values of KDA inputs; returns N (the number of sequences).

    Expected: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (log-decay, <= 0);
    beta [B, T, HV]; initial_state [N, HV, K, V]; cu_seqlens int [N+1] with B == 1. ``names``: what the
    messages call g and beta, the caller's own argument names (the fused ops take the gate
    pre-activation ``z`` and ``beta_logits`` in their places; their value checks are their own).

    Raises:
        ValueError: naming the argument, the shape it got and the one expected; a non-float dtype;
            a zero-sized dimension; HV not a multiple of H; tensors on the meta device; bad cu_seqlens;
            an initial_state that is not a floating-point tensor or not on q's device; a ``scale`` that
            is not a finite positive number; an ``output_final_state`` that is not a bool; g > 0; a NaN or
            inf in any input (when ``check_values``).
    """
    g_name, beta_name = names
    tensors = {"q": q, "k": k, "v": v, g_name: g, beta_name: beta}
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {_shape(q)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K] = {list(q.shape)}, got {_shape(k)}")
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}, got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if min(B, T, H, K, HV, V) == 0:
        raise ValueError(f"B, T, H, K, HV and V must be positive, got B={B}, T={T}, H={H}, K={K}, HV={HV}, V={V}")
    if HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's H={H} (GVA)")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"{g_name} must be [B, T, HV, K] = {[B, T, HV, K]}, got {_shape(g)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"{beta_name} must be [B, T, HV] = {[B, T, HV]}, got {_shape(beta)}")
    for name, x in tensors.items():
        # An integer q would give an integer (truncated) output; the math needs floats everywhere.
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    devices = {x.device for x in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"q, k, v, {g_name}, {beta_name} must be on one device, got {sorted(map(str, devices))}")
    if q.device.type == "meta":
        raise ValueError(f"q, k, v, {g_name}, {beta_name} are on the meta device: KDA has no meta kernels, "
                         "use a real device")
    if scale is not None:
        # A learned scale (a grad-tracking 0-d tensor, chunk_kda) is checked by value, outside the graph.
        value = scale.detach() if isinstance(scale, torch.Tensor) else scale
        try:
            ok = math.isfinite(value) and value > 0 and not isinstance(value, bool)
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    if not isinstance(output_final_state, bool):
        kind = type(output_final_state)
        # numpy.bool_ is named "bool" too
        name = kind.__name__ if kind.__name__ != "bool" else f"{kind.__module__}.{kind.__name__}"
        raise ValueError(f"output_final_state must be a bool, got {name}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B=1, got B={B}")
        N = check_cu_seqlens(cu_seqlens, T)
    check_initial_state(initial_state, (N, HV, K, V), q.device)
    if check_values:
        named = dict(tensors, initial_state=initial_state) if initial_state is not None else tensors
        # One host sync for all value checks.
        flags = torch.stack(
            [~torch.isfinite(x).all() for x in named.values()] + [(g > 0).any()]
        ).tolist()
        for name, bad in zip(named, flags):
            if bad:
                raise NonFiniteError(name, f"{name} contains NaN or inf")
        if flags[-1]:
            raise ValueError(f"g is a log-decay and must be <= 0, got max {g.max().item():.3g}")
    return N


def overflow_error(dtype: torch.dtype, v: torch.Tensor, initial_state: torch.Tensor | None,
                   q: torch.Tensor | None = None, scale: float | None = None, k: torch.Tensor | None = None,
                   beta: torch.Tensor | None = None, remedy: str = "compute in float64") -> NonFiniteError:
    """The error for finite inputs whose KDA output or state came out NaN or inf in ``dtype``, naming
    the argument to blame. Only built on that failure path, so its float64 reductions cost nothing
    on the way to a good result.

    With ``k`` and ``beta`` (a recurrence on the caller's keys): when some beta_t ||k_t||^2 lies outside
    [0, 2], the transition I - beta_t k_t k_t^T has an eigenvalue 1 - beta_t ||k_t||^2 of modulus > 1 and
    the state grows geometrically, so ``k`` (or ``beta``, if it is outside [0, 1]) is named. Otherwise
    the state stays bounded by its inputs' sizes and the largest of max |initial_state|, max |v| and
    max |q| * scale is named.
    """
    limit = torch.finfo(dtype).max
    if k is not None and beta is not None:
        HV = v.shape[2]
        # [B, T, H] -> [B, T, HV] as the value heads read the q/k heads (GVA).
        k_sq = k.double().pow(2).sum(-1).repeat_interleave(HV // k.shape[2], dim=2)
        growth = beta.double() * k_sq
        bad = (growth > 2) | (growth < 0)
        if bool(bad.any()):
            where = ((growth - 1).abs() * bad).flatten().argmax().item()
            b, t, h = torch.unravel_index(torch.tensor(where), growth.shape)
            kk, bb, gg = k_sq[b, t, h].item(), beta[b, t, h].item(), growth[b, t, h].item()
            name = "beta" if not 0 <= bb <= 1 else "k"
            return NonFiniteError(name, (
                f"{name} is out of range: KDA's state update (I - beta_t k_t k_t^T) stays bounded only for "
                f"beta_t * ||k_t||^2 in [0, 2], got {gg:.3g} (||k_t||^2 = {kk:.3g}, beta_t = {bb:.3g}) at "
                f"[b={b.item()}, t={t.item()}, head={h.item()}], so the state grew by up to {abs(1 - gg):.3g}x "
                f"per token and overflowed {str(dtype)[6:]}; L2-normalise k (KDALayer and flash_kda do) and keep beta "
                f"in [0, 1]"))
    sizes = {"initial_state": initial_state, "v": v, "q": q}
    sizes = {name: x.double().abs().max().item() for name, x in sizes.items() if x is not None}
    if "q" in sizes:
        sizes["q"] *= scale if scale is not None else q.shape[-1] ** -0.5
    name = max(sizes, key=sizes.get)
    listed = ", ".join(f"max |{n}|{' * scale' if n == 'q' else ''} = {m:.3g}" for n, m in sizes.items())
    return NonFiniteError(name, (
        f"{name} is too large: KDA's output or state overflowed {str(dtype)[6:]} (largest finite {limit:.3g}) although "
        f"every input is finite ({listed}); scale {name} down or {remedy}"))


def check_kda_result(o: torch.Tensor, final_state: torch.Tensor, **inputs) -> None:
    """Raise ``overflow_error`` (in the narrower of o's and final_state's dtypes) unless o and final_state
    are finite (one host sync). The recurrence can overflow on finite inputs (keys far from unit norm, huge states);
    a NaN returned silently would surface far from its cause."""
    if not bool(torch.isfinite(o).all() & torch.isfinite(final_state).all()):
        # o may be narrower than the compute dtype (float16 inputs): name the range that ran out.
        dtype = min(o.dtype, final_state.dtype, key=lambda d: torch.finfo(d).max)
        raise overflow_error(dtype, **inputs)
