"""KCP: Kimi Delta Attention with the sequence split over a process group (K3 report, Sec. 4, KCP).

Forward, on every rank r at once:
  1. map:    [M_r | S~_r] [HV, K, K+V] float32, the affine map of r's LAST piece (the part of the
             document that may continue on the next rank), from a zero state (``affine.segment_map``).
  2. gather: one all-gather of the R maps -> [R, HV, K, K+V]: R * HV * K * (K+V) * 4 bytes, whatever T.
  3. fold:   the state entering r's first piece, S <- M_j S + S~_j over the earlier ranks j holding
             the same document, starting from its initial state (sequential, or a log-depth scan).
  4. local:  chunkwise KDA over r's pieces from their entering states.
Backward, mirrored: the local backward gives d(entering state) and so d(gathered maps) through the
fold; a reduce-scatter (the transpose of the all-gather) sums, for every rank j, the gradients the
later ranks sent to M_j, S~_j; then the backward of j's own map computation.
"""
from __future__ import annotations

import torch

from k3lab.autograd import differentiable_once
from k3lab.dist import all_gather_stacked, reduce_scatter_sum
from k3lab.kcp.affine import fold_scan, fold_sequential, segment_map
from k3lab.kcp.context import KCPContext, _is_int, check_context
from k3lab.kda import chunk_kda
from k3lab.kda.checks import check_chunk_size, check_initial_state, check_kda_inputs
from k3lab.kda.naive import compute_dtype, expand_heads

FOLDS = ("sequential", "scan")


class GatherFromGroup(torch.autograd.Function):
    """Stack every rank's ``x`` [*] into [R, *].

    Forward collective: all_gather (all_gather_single / all_gather_into_tensor).
    Backward collective: reduce_scatter_tensor with SUM, its transpose: rank j receives
    sum over ranks r of grad_r[j], the gradient every rank sent to j's piece.
    Both record the buffer size in ``ctx.comm``.
    """

    @staticmethod
    def forward(fctx, x: torch.Tensor, ctx: KCPContext, name: str) -> torch.Tensor:
        fctx.kcp, fctx.name = ctx, name
        out = all_gather_stacked(x, ctx.world_size, ctx.group)
        ctx.comm.add(f"fwd/all_gather/{name}", out.numel() * out.element_size())
        return out

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        ctx = fctx.kcp
        out = reduce_scatter_sum(grad, ctx.group)
        ctx.comm.add(f"bwd/reduce_scatter/{fctx.name}", grad.numel() * grad.element_size())
        return out, None, None


# Eager under torch.compile: a collective whose autograd.Function records its traffic in the context.
@torch.compiler.disable
def gather_from_group(x: torch.Tensor, ctx: KCPContext, name: str) -> torch.Tensor:
    """[*] -> [R, *], differentiable (see ``GatherFromGroup``); no collective when R == 1."""
    if ctx.world_size == 1:
        return x[None]
    return GatherFromGroup.apply(x, ctx, name)


def _reduce_scatter(grad: torch.Tensor, ctx: KCPContext, name: str) -> torch.Tensor:
    out = reduce_scatter_sum(grad, ctx.group)
    ctx.comm.add(f"bwd/reduce_scatter/{name}", grad.numel() * grad.element_size())
    return out


def _last_piece_map(q, k, v, g, beta, ctx: KCPContext, chunk_size, slab_tokens) -> torch.Tensor:
    """[HV, K, K+V] map of this rank's last piece, in the compute dtype (float32 / float64)."""
    HV, dt = v.shape[2], compute_dtype(q)
    p0 = ctx.local_cu_seqlens[-2]
    kk = expand_heads(k[:, p0:], HV)[0].transpose(0, 1).to(dt)
    vv, gg = (x[0, p0:].transpose(0, 1).to(dt) for x in (v, g))
    return segment_map(kk, vv, gg, beta[0, p0:].T.to(dt), chunk_size, slab_tokens)


def _entering_states(maps, h0, ctx: KCPContext, fold: str, HV, K, V, dtype, device) -> torch.Tensor:
    """[N_local, HV, K, V]: the state before each local piece (fold for a continued first piece)."""
    states = []
    for i, n in enumerate(ctx.local_docs):
        h = h0[n].to(dtype) if h0 is not None else None
        if i == 0 and ctx.first_continues:
            if fold == "sequential":
                h = fold_sequential(maps, ctx.fold_from, ctx.rank, h)
            else:
                resets = torch.tensor(ctx.resets, device=device)
                h = fold_scan(maps, resets, ctx.fold_from, ctx.rank, h)
        states.append(h if h is not None else torch.zeros(HV, K, V, dtype=dtype, device=device))
    return torch.stack(states).to(dtype)


def _slabs(T: int, slab_tokens: int | None, n_pieces: int) -> list[int]:
    if n_pieces > 1 or slab_tokens is None or T <= slab_tokens:
        return [0, T]
    return list(range(0, T, slab_tokens)) + [T]


def _local_forward(op, xs, init, local_cu, scale, chunk_size, bounds):
    """Step 4 over slabs [bounds[i], bounds[i+1]) of one piece (or all pieces in one call).

    Returns (o, final states [N_local, HV, K, V], the state entering each slab)."""
    outs, entering, S = [], [], init
    for a, b in zip(bounds[:-1], bounds[1:]):
        entering.append(S)
        o, S = op(*(x[:, a:b] for x in xs), scale=scale, initial_state=S, output_final_state=True,
                  cu_seqlens=local_cu, chunk_size=chunk_size)
        outs.append(o)
    return torch.cat(outs, dim=1), S, entering


class KCPFunction(torch.autograd.Function):
    """KDA over a context-parallel group; one call per layer per rank, all ranks together.

    Forward collective: one all_gather of the [HV, K, K+V] float32 maps (``GatherFromGroup``'s op).
    Backward collective: one reduce_scatter_tensor (SUM) of the maps' gradients [R, HV, K, K+V], the
    all-gather's transpose. Every rank runs both collectives whatever its document layout, so the
    autograd graph is the same on every rank and collectives can never be issued out of order.
    The backward recomputes the forward slab by slab (states entering each slab are saved).
    """

    @staticmethod
    def forward(fctx, q, k, v, g, beta, h0, ctx, scale, fold, chunk_size, slab_tokens, op):
        B, T, H, K = q.shape
        HV, V = v.shape[2:]
        dt = compute_dtype(q)
        local_cu = torch.tensor(ctx.local_cu_seqlens, device=q.device) if len(ctx.local_docs) > 1 else None
        if ctx.world_size > 1:
            # 1-2: this rank's map, then the one all-gather.
            m = _last_piece_map(q, k, v, g, beta, ctx, chunk_size, slab_tokens)
            maps = all_gather_stacked(m, ctx.world_size, ctx.group)
            ctx.comm.add("fwd/all_gather/maps", maps.numel() * maps.element_size())
        else:
            maps = torch.zeros(1, HV, K, K + V, dtype=dt, device=q.device)
        # 3-4: fold, then the local chunkwise KDA.
        init = _entering_states(maps, h0, ctx, fold, HV, K, V, dt, q.device)
        bounds = _slabs(T, slab_tokens, len(ctx.local_docs))
        o, final, entering = _local_forward(op, (q, k, v, g, beta), init, local_cu, scale, chunk_size, bounds)
        fctx.save_for_backward(q, k, v, g, beta, h0, maps, *entering)
        fctx.args = (ctx, scale, fold, chunk_size, slab_tokens, op, local_cu, bounds)
        # Final states of the documents that end on this rank; other rows are zero.
        out_final = final.new_zeros(ctx.N, HV, K, V)
        owned = [i for i, e in enumerate(ctx.ends_here) if e]
        out_final[[ctx.local_docs[i] for i in owned]] = final[owned]
        return o, out_final

    @staticmethod
    # The recompute below runs its own autograd passes: their gradients hold no second-order terms.
    @differentiable_once
    def backward(fctx, d_o, d_final):
        q, k, v, g, beta, h0, maps, *entering = fctx.saved_tensors
        ctx, scale, fold, chunk_size, slab_tokens, op, local_cu, bounds = fctx.args
        HV, K, V = v.shape[2], k.shape[3], v.shape[3]
        owned = [i for i, e in enumerate(ctx.ends_here) if e]
        d_final_local = torch.zeros(len(ctx.local_docs), HV, K, V, dtype=d_final.dtype, device=d_final.device)
        d_final_local[owned] = d_final[[ctx.local_docs[i] for i in owned]]
        xs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
        # Step 4 backward, last slab first: each slab recomputed from the state that entered it.
        d_S = d_final_local
        for i in reversed(range(len(bounds) - 1)):
            a, b = bounds[i], bounds[i + 1]
            S = entering[i].detach().requires_grad_()
            with torch.enable_grad():
                o, S_end = op(*(x[:, a:b] for x in xs), scale=scale, initial_state=S,
                              output_final_state=True, cu_seqlens=local_cu, chunk_size=chunk_size)
                torch.autograd.backward([o, S_end], [d_o[:, a:b], d_S])
            d_S = S.grad
        # Step 3 backward: entering states -> the gathered maps and the initial states.
        h0_leaf = h0.detach().requires_grad_() if h0 is not None else None
        maps_leaf = maps.detach().requires_grad_()
        with torch.enable_grad():
            init = _entering_states(maps_leaf, h0_leaf, ctx, fold, HV, K, V, maps.dtype, maps.device)
            if init.requires_grad:
                torch.autograd.backward(init, d_S)
        d_maps = maps_leaf.grad if maps_leaf.grad is not None else torch.zeros_like(maps)
        # Steps 2-1 backward: the reduce-scatter, then this rank's map computation.
        if ctx.world_size > 1:
            d_m = _reduce_scatter(d_maps, ctx, "maps")
            with torch.enable_grad():
                m = _last_piece_map(*xs, ctx, chunk_size, slab_tokens)
                torch.autograd.backward(m, d_m)
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]
        d_h0 = h0_leaf.grad if h0_leaf is not None and h0_leaf.grad is not None else (
            torch.zeros_like(h0) if h0 is not None else None)
        return (*grads, d_h0, None, None, None, None, None, None)


def kcp_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ctx: KCPContext,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    fold: str = "sequential",
    chunk_size: int = 64,
    slab_tokens: int | None = None,
    local_op=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention with the sequence split across ``ctx.group`` (KCP). Exact: every rank's
    outputs and gradients equal the single-process ``chunk_kda`` on the whole sequence.

    Call on every rank of the group with that rank's tokens; every rank must call backward.

    Args:
        q, k (Tensor): [1, T_local, H, K] this rank's queries and keys (T_local = T / R).
        v (Tensor): [1, T_local, HV, V].
        g (Tensor): [1, T_local, HV, K] log-decay (<= 0).
        beta (Tensor): [1, T_local, HV].
        ctx (KCPContext): group, rank and document layout (``make_context``).
        scale (float | None): query scale, default K ** -0.5.
        initial_state (Tensor | None): [N, HV, K, V] per global document, the same on every rank.
            Its gradient on a rank is that rank's contribution: sum it over the group, as for any
            replicated parameter.
        output_final_state (bool): also return final states.
        fold (str): "sequential" (R - 1 dependent steps) or "scan" (ceil(log2 R) rounds).
        chunk_size (int): C of the chunkwise form.
        slab_tokens (int | None): run the local KDA (one-document ranks) and the map in slabs of this
            many tokens to bound memory (a multiple of ``chunk_size``); None: one slab.
        local_op (callable | None): the one-device KDA of step 4, any function with ``chunk_kda``'s
            signature and differentiable by autograd; None: ``k3lab.kda.chunk_kda`` (the PyTorch
            chunkwise form, on CPU and CUDA). FlashKDA (``k3lab.kernels.kda.flash_kda``) fuses the
            gate, the q/k norms and the beta sigmoid into its inputs, so it is not a drop-in here:
            ``k3lab.kcp.kcp_flash_kda`` is KCP on its kernel stages.

    Returns:
        (o [1, T_local, HV, V] in q's dtype, final_state [N, HV, K, V] float32 (float64 for float64
        inputs) or None). Row n of final_state is non-zero only on the rank holding document n's last
        token; summing over the group (all_reduce) gives every document's final state.

    Raises:
        ValueError: ctx not a KCPContext or layout-only (``check_context``), bad shapes (see
            ``check_kda_inputs``, output_final_state not a bool and scale not a finite positive number
            included), B != 1, T_local != ctx.T_local,
            initial_state not a floating-point [N, HV, K, V] tensor on q's device, unknown ``fold``,
            slab_tokens not a multiple of chunk_size, a bad chunk_size (``check_chunk_size``), local_op not
            callable.
    """
    check_context(ctx)
    check_chunk_size(chunk_size)
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[0] != 1 or q.shape[1] != ctx.T_local:
        raise ValueError(f"q must be a tensor [1, T_local={ctx.T_local}, H, K] on rank {ctx.rank}, got "
                         f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    local_cu = torch.tensor(ctx.local_cu_seqlens) if len(ctx.local_docs) > 1 else None
    check_kda_inputs(q, k, v, g, beta, None, local_cu, scale=scale, output_final_state=output_final_state)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    check_initial_state(initial_state, (ctx.N, HV, K, V), q.device)
    if fold not in FOLDS:
        raise ValueError(f"fold must be one of {FOLDS}, got {fold!r}")
    if slab_tokens is not None and not (_is_int(slab_tokens) and slab_tokens > 0 and slab_tokens % chunk_size == 0):
        raise ValueError(f"slab_tokens must be an int, a positive multiple of chunk_size={chunk_size}, "
                         f"got {slab_tokens!r}")
    if local_op is not None and not callable(local_op):
        raise ValueError(f"local_op must be None or a function with chunk_kda's signature, got {type(local_op).__name__}")
    scale = K**-0.5 if scale is None else scale
    op = chunk_kda if local_op is None else local_op
    o, final = KCPFunction.apply(q, k, v, g, beta, initial_state, ctx, scale, fold, chunk_size, slab_tokens, op)
    return o, (final if output_final_state else None)
