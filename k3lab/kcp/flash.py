"""KCP on the FlashKDA kernel stages (``k3lab.kernels.kda``): exact context-parallel KDA whose affine
maps come from the same kernel stages as the local pass, and whose backward never differentiates
through a map (K3 report, Sec. 4, KCP; Eq. 3-5 for KDA and the lower-bounded gate).

Rank j holds pieces p_0 .. p_{n-1} (parts of documents, see ``KCPContext``). p_0 may continue a
document begun on an earlier rank (its entering state S_in is known only after the fold); p_{n-1} may
continue on the next rank (a later rank folds its map). Every other piece starts its document here,
so its entering state is KNOWN: the document's initial state, or zero.

Forward, every rank at once:
  1. intra:  gate, norms, UT transform -> G, T, Aqk, W, U, KG, QG, once (``kda_intra_fwd``).
  2. known:  the state stage over the pieces with a known entering state, writing their outputs.
             The map [M | S~] [HV, K, K+V] float32 of p_{n-1} when it continues:
               * its entering state is known: the CONSTANT map [0 | S_end], S_end from this stage;
               * p_{n-1} = p_0 continues on both sides: the state stage at width K+V from [I | 0] on
                 values [0 | U] (the identity-state trick), chunk states not stored;
             otherwise [0 | 0]: nobody folds it, but every rank joins the all-gather.
  3. gather: one all-gather of the maps (R * HV * K * (K+V) * 4 bytes, whatever T); the fold
             S <- M_r S + S~_r over the earlier ranks of p_0's document. Its first rank sent a constant
             map, so the fold starts from zero: the initial state entered through that rank's S_end.
  4. local:  the state stage for p_0 from the folded S_in, writing its outputs.
Backward, mirrored. Given S_in(j), the loss depends on rank j's inputs only through (o_j, S_end(j)),
so their exact gradient is ONE local backward with cotangents (dO_j, D_j), D_j = dL/dS_end(j):
  1. intra's W, U, KG, QG again from the saved G, Tinv (``kda_intra_replay``).
  2. the reverse state stage over the pieces whose end-state gradient is known (all but a continuing
     p_{n-1}: a final-state gradient, or zero); its dS_in of p_0 is b_j = dL/dS_in(j) with D_j = 0.
     When p_0 = p_{n-1} continues, b_j takes one extra reverse pass over p_0 (dht = 0).
  3. gather: one all-gather of the b_r [HV, K, V] float32; D_j from the reverse fold D <- M_r^T D + b_r
     over the later ranks of p_{n-1}'s document, from its last rank (whose b is its whole dS_in) down.
     The forward chunk states are recomputed (from the saved S_in) while the gather is in flight.
  4. local:  the reverse state stage for p_{n-1} with dht = D_j; the chunk-parallel gradient stages
     (``kda_dqk_bwd``, ``kda_dwv_bwd``, ``kda_intra_bwd``) over all pieces. dS_in of a piece that starts its document
     here is its initial state's gradient.
The M's of step 3 are the forward's gathered maps, saved: nothing about a map is differentiated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3lab.autograd import differentiable_once
from k3lab.dist import all_gather_stacked
from k3lab.kcp.affine import fold_scan, fold_sequential, identity_map
from k3lab.kcp.context import KCPContext, check_context
from k3lab.kcp.kcp import FOLDS
from k3lab.kda.checks import _shape, check_initial_state, check_kda_inputs
from k3lab.kernels.kda.chunk_bwd import kda_dqk_bwd, kda_dwv_bwd, kda_intra_bwd, kda_state_bwd
from k3lab.kernels.kda.chunk_fwd import kda_intra_fwd, kda_intra_replay, kda_state_fwd
from k3lab.kernels.kda.fused import check_finite, check_gate_args, input_grads, intermediate_dtype
from k3lab.kernels.kda.utils import chunk_index


@dataclass(frozen=True)
class Layout:
    """This rank's pieces as the kernels see them, built once per call (one host-to-device copy).

    Attributes:
        cu (Tensor): int32 [n+1] piece offsets in the rank's tokens.
        chunk_indices (Tensor): int32 [NT, 2], chunk_offsets (Tensor): int32 [n+1] (``chunk_index``).
        resets, first_ends (Tensor): bool [R], the forward and backward folds' segment starts (scan only).
        cont_in (bool): p_0 continues a document from an earlier rank.
        cont_out (bool): p_{n-1} continues on the next rank.
    """

    cu: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    resets: torch.Tensor
    first_ends: torch.Tensor
    cont_in: bool
    cont_out: bool

    @property
    def n(self) -> int:
        return self.cu.numel() - 1

    @property
    def NT(self) -> int:
        return self.chunk_indices.shape[0]

    def span(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of pieces a .. b-1 for a state-stage launch over them alone."""
        return self.cu[a : b + 1], self.chunk_offsets[a : b + 1]


def make_layout(ctx: KCPContext, device: torch.device) -> Layout:
    """``Layout`` of ``ctx``'s rank on ``device``: the int tables go in one (pinned, non-blocking) copy."""
    cu = ctx.local_cu_seqlens
    _, ci, co = chunk_index([b - a for a, b in zip(cu[:-1], cu[1:])], torch.device("cpu"))
    parts = [torch.tensor(cu, dtype=torch.int32), ci.view(-1), co,
             torch.tensor(ctx.resets, dtype=torch.int32), torch.tensor(ctx.first_ends, dtype=torch.int32)]
    host = torch.cat(parts)
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    cu_d, ci_d, co_d, resets, first_ends = flat.split([p.numel() for p in parts])
    return Layout(cu_d, ci_d.view(-1, 2), co_d, resets.bool(), first_ends.bool(), ctx.first_continues,
                  ctx.last_continues)


def _entering(h0, S_in, ctx: KCPContext, a: int, b: int, shape, device) -> torch.Tensor | None:
    """[b-a, HV, K, V] float32 states entering pieces a .. b-1: S_in for a continued p_0, else the
    document's initial state; None when all are zero."""
    rows = [S_in if i == 0 and S_in is not None else (h0[ctx.local_docs[i]] if h0 is not None else None)
            for i in range(a, b)]
    if all(r is None for r in rows):
        return None
    zero = torch.zeros(shape, dtype=torch.float32, device=device)
    return torch.stack([zero if r is None else r.float() for r in rows])


def _fold_forward(maps, ctx: KCPContext, lay: Layout, fold: str) -> torch.Tensor:
    """S_in of p_0: S <- M_r S + S~_r over ranks fold_from .. rank-1, from zero."""
    if fold == "sequential":
        return fold_sequential(maps, ctx.fold_from, ctx.rank)
    return fold_scan(maps, lay.resets, ctx.fold_from, ctx.rank)


def _fold_backward(maps, parts, ctx: KCPContext, lay: Layout, fold: str) -> torch.Tensor:
    """D = dL/dS_end of p_{n-1}: D <- M_r^T D + b_r over ranks end_rank, ..., rank+1, from zero; the
    forward fold on the maps [M_r^T | b_r] in reverse rank order."""
    K, R = maps.shape[-2], ctx.world_size
    rev = torch.cat([maps[..., :K].transpose(-1, -2), parts], -1).flip(0)
    first, stop = R - 1 - ctx.end_rank, R - 1 - ctx.rank
    if fold == "sequential":
        return fold_sequential(rev, first, stop)
    return fold_scan(rev, lay.first_ends.flip(0), first, stop)


class KCPFlashFunction(torch.autograd.Function):
    """KDA over a context-parallel group on the FlashKDA stages; one call per layer per rank, all
    ranks together (see the module docstring for the steps).

    Forward collective: one all_gather of the [HV, K, K+V] float32 maps. Backward collective: one
    all_gather of the [HV, K, V] float32 state gradients b_r. Every rank joins both whatever its
    layout, both are started asynchronously and waited for only where their result is read.
    Saved: the inputs, S_in [HV, K, V], the gathered maps and intra's G, Tinv, Aqk (the backward recomputes
    the rest).
    """

    @staticmethod
    def forward(fctx, q, k, v, z, beta, A_log, dt_bias, h0, ctx, lay, scale, lower_bound, fold):
        fctx.set_materialize_grads(False)
        _, T, H, K = q.shape
        HV, V = v.shape[2:]
        R, n, NT, dev = ctx.world_size, lay.n, lay.NT, q.device
        flat = [x.reshape(T, *x.shape[2:]) for x in (q, k, v, z, beta)]
        inter = intermediate_dtype(q)
        # 1. intra, shared by the map and the local pass.
        G, Tinv, Aqk, W, U, KG, QG = kda_intra_fwd(*flat, A_log, dt_bias, scale, lower_bound, lay.cu,
                                                   lay.chunk_indices, inter)
        o = torch.empty(1, T, HV, V, device=dev, dtype=U.dtype)  # not a view: see FlashKDAFunction.forward
        final = [None] * n
        # 2. the state stage from the known entering states, then this rank's map.
        a = int(lay.cont_in)
        if a < n:
            _, _, ht = kda_state_fwd(W, U, KG, G, _entering(h0, None, ctx, a, n, (HV, K, V), dev), True,
                                     *lay.span(a, n), NT, store_states=False, output=(QG, Aqk, o[0]))
            final[a:] = ht.unbind(0)
        S_in = maps = None
        if R > 1:
            if lay.cont_out and a < n:
                m = torch.cat([torch.zeros(HV, K, K, device=dev), final[-1]], -1)
            elif lay.cont_out:
                m = kda_state_fwd(W, U, KG, G, identity_map(HV, K, V, torch.float32, dev)[None], True, lay.cu,
                                  lay.chunk_offsets, NT, lead=K, store_states=False)[2][0]
            else:
                m = torch.zeros(HV, K, K + V, device=dev)
            # 3. the all-gather and the fold.
            maps, work = all_gather_stacked(m, R, ctx.group, async_op=True)
            ctx.comm.add("fwd/all_gather/maps", maps.numel() * maps.element_size())
            if lay.cont_in:
                work.wait()
                S_in = _fold_forward(maps, ctx, lay, fold)
                # 4. the continued piece's states from the folded state.
                final[0] = kda_state_fwd(W, U, KG, G, S_in[None].contiguous(), True, *lay.span(0, 1), NT,
                                         store_states=False, output=(QG, Aqk, o[0]))[2][0]
        if R > 1 and not lay.cont_in:
            work.wait()
        fctx.save_for_backward(q, k, v, z, beta, A_log, dt_bias, h0, S_in, maps, G, Tinv, Aqk)
        fctx.args = (ctx, lay, scale, lower_bound, fold)
        # Final states of the documents that end on this rank; other rows are zero.
        out_final = torch.zeros(ctx.N, HV, K, V, device=dev)
        for i, ends in enumerate(ctx.ends_here):
            if ends:
                out_final[ctx.local_docs[i]] = final[i]
        return o.to(q.dtype), out_final

    @staticmethod
    @differentiable_once
    def backward(fctx, do, d_final):
        q, k, v, z, beta, A_log, dt_bias, h0, S_in, maps, G, Tinv, Aqk = fctx.saved_tensors
        ctx, lay, scale, lb, fold = fctx.args
        _, T, H, K = q.shape
        HV, V = v.shape[2:]
        R, n, NT, dev = ctx.world_size, lay.n, lay.NT, q.device
        qf, kf, vf, zf, bf = (x.reshape(T, *x.shape[2:]) for x in (q, k, v, z, beta))
        # 1. intra's cheap part again, from the saved G and Tinv.
        W, U, KG, QG = kda_intra_replay(qf, kf, vf, bf, G, Tinv, scale, lay.cu, lay.chunk_indices,
                                        intermediate_dtype(q))
        do = do.reshape(T, HV, V).contiguous() if do is not None else torch.zeros(T, HV, V, device=dev)
        dh = torch.empty(NT, HV, K, V, device=dev, dtype=W.dtype)
        dVn = torch.empty(T, HV, V, device=dev, dtype=W.dtype)
        d_in = [None] * n
        # 2. the reverse state stage where the end-state gradient is known (pieces that end here).
        b = n - int(lay.cont_out)
        if b > 0:
            dht = (torch.stack([d_final[ctx.local_docs[i]] for i in range(b)]).contiguous()
                   if d_final is not None else None)
            d_in[:b] = kda_state_bwd(QG, KG, W, G, Aqk, do, dht, True, *lay.span(0, b), NT, dh=dh, dVn=dVn)[2].unbind(0)
        if R > 1:
            if lay.cont_in and b == 0:
                part = kda_state_bwd(QG, KG, W, G, Aqk, do, None, True, *lay.span(0, 1), NT, dh=dh, dVn=dVn)[2][0]
            elif lay.cont_in:
                part = d_in[0]
            else:
                part = torch.zeros(HV, K, V, device=dev)
            # 3. the all-gather of the b_r, in flight while the forward states are recomputed.
            parts, work = all_gather_stacked(part, R, ctx.group, async_op=True)
            ctx.comm.add("bwd/all_gather/dstate", parts.numel() * parts.element_size())
        h, Vn, _ = kda_state_fwd(W, U, KG, G, _entering(h0, S_in, ctx, 0, n, (HV, K, V), dev), False, lay.cu,
                                 lay.chunk_offsets, NT)
        del U
        if R > 1:
            work.wait()
            if lay.cont_out:
                # 4. the continued piece's reverse pass from D.
                D = _fold_backward(maps, parts, ctx, lay, fold)
                d_in[n - 1] = kda_state_bwd(QG, KG, W, G, Aqk, do, D[None].contiguous(), True, *lay.span(n - 1, n),
                                            NT, dh=dh, dVn=dVn)[2][0]
        del QG, KG, W, Aqk
        dqs, dkn, dG, dW, dgx, rn = kda_dqk_bwd(qf, kf, G, h, dh, Vn, dVn, do, scale, lay.cu, lay.chunk_indices)
        del h, dh
        db, dv, dAqk, dAkk = kda_dwv_bwd(kf, vf, bf, G, Tinv, dW, dVn, do, Vn, dkn, dG, rn, lay.cu, lay.chunk_indices)
        del Vn, dVn, dW, Tinv
        dq, dk, dz, dbeta, dA_part, dbias_part = kda_intra_bwd(
            qf, kf, zf, bf, A_log, dt_bias, G, rn, dAqk, dAkk, dqs, dkn, dG, dgx, db, scale, lb, lay.cu,
            lay.chunk_indices)
        d_h0 = None
        if h0 is not None:
            d_h0 = torch.zeros_like(h0)
            for i in range(int(lay.cont_in), n):
                d_h0[ctx.local_docs[i]] = d_in[i]
        return (*input_grads(dq, dk, dv, dz, dbeta, dA_part, dbias_part, q, v, A_log, dt_bias), d_h0,
                None, None, None, None, None)


def kcp_flash_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    ctx: KCPContext,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    lower_bound: float = -5.0,
    fold: str = "sequential",
    *,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``k3lab.kernels.kda.flash_kda`` with the sequence split across ``ctx.group`` (KCP). Exact: every
    rank's outputs and gradients equal the single-process ``flash_kda`` on the whole sequence.

    Call on every rank of the group with that rank's tokens; every rank must call backward. The raw
    inputs are flash_kda's: q, k not normalised, z the gate pre-activation, beta_logits; the gate is
    lower_bound * sigmoid(exp(A_log) (z + dt_bias)) (K3 report, Eq. 5).

    Args:
        q, k (Tensor): [1, T_local, H, K] this rank's queries and keys (T_local = T / R).
        v (Tensor): [1, T_local, HV, V].
        z (Tensor): [1, T_local, HV, K] gate pre-activation.
        beta_logits (Tensor): [1, T_local, HV] write-strength logits.
        A_log (Tensor): [HV]; dt_bias (Tensor | None): [HV * K] or [HV, K]. Replicated: their
            gradients on a rank are its contribution (sum over the group, as for any replicated parameter).
        ctx (KCPContext): group, rank and document layout (``make_context``).
        scale (float | None): query scale, default K ** -0.5.
        initial_state (Tensor | None): [N, HV, K, V] per global document, the same on every rank; its
            gradient on a rank is that rank's contribution (the rank where each document starts).
        output_final_state (bool): also return final states.
        lower_bound (float): g_min in [-10, 0) (K3: -5).
        fold (str): "sequential" (R - 1 dependent steps) or "scan" (ceil(log2 R) rounds), both ways.
        check_values (bool): also reject NaN/inf inputs (one host sync). Benchmarks pass False.

    Returns:
        (o [1, T_local, HV, V] in q's dtype, final_state [N, HV, K, V] float32 or None). Row n of
        final_state is non-zero only on the rank holding document n's last token; summing over the
        group (all_reduce) gives every document's final state.

    Raises:
        ValueError: ctx not a KCPContext or layout-only (``check_context``), q not
            [1, T_local, H, K], fold unknown, initial_state not a floating-point [N, HV, K, V] tensor on
            q's device, and every error of ``flash_kda`` (``check_kda_inputs``, ``check_gate_args``,
            NaN/inf when ``check_values``).
        RuntimeError: CPU tensors without TRITON_INTERPRET=1 (call ``k3lab.setup()`` first);
            when a gradient taken with ``create_graph=True`` is differentiated again (no second derivatives).
    """
    check_context(ctx)
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[0] != 1 or q.shape[1] != ctx.T_local:
        raise ValueError(f"q must be [1, T_local={ctx.T_local}, H, K] on rank {ctx.rank}, "
                         f"got {_shape(q)}")
    local_cu = torch.tensor(ctx.local_cu_seqlens) if len(ctx.local_docs) > 1 else None
    check_kda_inputs(q, k, v, z, beta_logits, None, local_cu, check_values=False, scale=scale,
                     output_final_state=output_final_state, names=("z", "beta_logits"))
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    check_initial_state(initial_state, (ctx.N, HV, K, V), q.device)
    if fold not in FOLDS:
        raise ValueError(f"fold must be one of {FOLDS}, got {fold!r}")
    check_gate_args(q, k, v, A_log, dt_bias, lower_bound, scale)
    if check_values:
        check_finite(q=q, k=k, v=v, z=z, beta_logits=beta_logits, A_log=A_log, dt_bias=dt_bias,
                     initial_state=initial_state)
    scale = K**-0.5 if scale is None else float(scale)
    lay = make_layout(ctx, q.device)
    q, k, v, z, beta_logits = (x.contiguous() for x in (q, k, v, z, beta_logits))
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    o, final = KCPFlashFunction.apply(q, k, v, z, beta_logits, A_log.contiguous(),
                                      dt_bias.contiguous() if dt_bias is not None else None, h0, ctx, lay, scale,
                                      float(lower_bound), fold)
    return o, (final if output_final_state else None)
