"""The per-rank functions of KCP's tests and notebook, run by ``k3lab.dist.launch``. They live here
because mp.spawn cannot pickle functions defined in a notebook cell.

The checked model is KDA's token mixer without its projections: q, k = L2Norm(SiLU(ShortConv(x))),
v = SiLU(ShortConv(x)), then KDA; loss = <o, w_o> + <final_state, w_s> with fixed random weights.
``FlashCase``/``flash_check_worker`` check ``kcp_flash_kda`` the same way on FlashKDA's raw inputs
(q, k, v, z, beta, A_log, dt_bias, initial state) against one-process ``flash_kda``; they import the
Triton kernels only when run (set TRITON_INTERPRET=1 first on a CPU-only machine).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from k3lab.kcp.context import make_context
from k3lab.kcp.conv import kcp_short_conv
from k3lab.kcp.kcp import kcp_kda
from k3lab.kcp.naive import naive_kcp_kda, short_conv_reference
from k3lab.kda import chunk_kda

LEAVES = ("xq", "xk", "xv", "g", "beta", "wq", "wk", "wv", "h0")
SHARDED = ("xq", "xk", "xv", "g", "beta")


@dataclass(frozen=True)
class Case:
    """One checked configuration: global sizes and document offsets."""

    T: int = 96
    cu_seqlens: tuple[int, ...] | None = None
    H: int = 2
    HV: int = 2
    K: int = 8
    V: int = 8
    W: int = 4
    with_h0: bool = True
    chunk_size: int = 16
    slab_tokens: int | None = None
    seed: int = 0
    dtype: str = "float32"
    folds: tuple[str, ...] = field(default=("sequential", "scan", "naive"))


def make_inputs(case: Case) -> dict[str, torch.Tensor]:
    """Fresh random full-sequence inputs (never zeros) for ``case``, the same on every rank."""
    gen = torch.Generator().manual_seed(case.seed)
    dt = getattr(torch, case.dtype)
    N = len(case.cu_seqlens) - 1 if case.cu_seqlens else 1
    T, H, HV, K, V, W = case.T, case.H, case.HV, case.K, case.V, case.W

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dt)

    return dict(
        xq=randn(1, T, H * K), xk=randn(1, T, H * K), xv=randn(1, T, HV * V),
        g=-(0.02 + 0.5 * torch.rand(1, T, HV, K, generator=gen, dtype=dt)),
        beta=torch.sigmoid(randn(1, T, HV)),
        wq=randn(H * K, W) / W, wk=randn(H * K, W) / W, wv=randn(HV * V, W) / W,
        h0=0.5 * randn(N, HV, K, V),
        w_o=randn(1, T, HV, V), w_s=randn(N, HV, K, V),
    )


def _mixer(x: dict, case: Case, conv, kda):
    T = x["xq"].shape[1]
    q = F.normalize(F.silu(conv(x["xq"], x["wq"])).view(1, T, case.H, case.K), dim=-1, eps=1e-6)
    k = F.normalize(F.silu(conv(x["xk"], x["wk"])).view(1, T, case.H, case.K), dim=-1, eps=1e-6)
    v = F.silu(conv(x["xv"], x["wv"])).view(1, T, case.HV, case.V)
    return kda(q, k, v, x["g"], x["beta"], x["h0"] if case.with_h0 else None)


def reference(case: Case) -> dict:
    """One process, the whole sequence: o, final state and the gradient of every input."""
    full = make_inputs(case)
    x = {n: full[n].clone().requires_grad_() for n in LEAVES}
    cu = list(case.cu_seqlens) if case.cu_seqlens else None
    cu_t = torch.tensor(cu) if cu else None

    def kda(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_t,
                         chunk_size=case.chunk_size)

    o, final = _mixer(x, case, lambda y, w: short_conv_reference(y, w, cu), kda)
    ((o * full["w_o"]).sum() + (final * full["w_s"]).sum()).backward()
    return dict(o=o.detach(), final=final.detach(), grads={n: x[n].grad for n in LEAVES})


def rank_run(rank: int, world_size: int, group, case: Case, fold: str) -> dict:
    """This rank's part of ``reference(case)`` under KCP (``fold`` "sequential"/"scan") or the
    gather-everything reference (``fold`` "naive"): local o, final-state rows, local gradients of
    the sharded inputs, this rank's contribution to the replicated ones, bytes communicated."""
    full = make_inputs(case)
    ctx = make_context(case.T, case.cu_seqlens, group)
    sl = slice(ctx.start, ctx.stop)
    x = {n: (full[n][:, sl] if n in SHARDED else full[n]).clone().requires_grad_() for n in LEAVES}

    def kda(q, k, v, g, beta, h0):
        if fold == "naive":
            return naive_kcp_kda(q, k, v, g, beta, ctx, initial_state=h0, output_final_state=True,
                                 chunk_size=case.chunk_size)
        return kcp_kda(q, k, v, g, beta, ctx, initial_state=h0, output_final_state=True, fold=fold,
                       chunk_size=case.chunk_size, slab_tokens=case.slab_tokens)

    o, final = _mixer(x, case, lambda y, w: kcp_short_conv(y, w, ctx), kda)
    ((o * full["w_o"][:, sl]).sum() + (final * full["w_s"]).sum()).backward()
    return dict(rank=rank, start=ctx.start, stop=ctx.stop, o=o.detach(), final=final.detach(),
                grads={n: x[n].grad for n in LEAVES}, comm=list(ctx.comm.records))


def check_worker(rank: int, world_size: int, group, cases: list[Case]) -> list[dict]:
    """Every case under every fold in ``case.folds``, in one process group (spawning is the slow part)."""
    out = []
    for case in cases:
        for fold in case.folds:
            res = rank_run(rank, world_size, group, case, fold)
            res.update(case=asdict(case), fold=fold)
            out.append(res)
    return out


def errors_vs_reference(ref: dict, ranks: list[dict], sharded=SHARDED,
                        replicated=("wq", "wk", "wv", "h0")) -> dict[str, float]:
    """Relative RMS errors of R ranks' results against ``reference``: per rank for the ``sharded``
    tensors ("o@r1", "grad_g@r0", ...), summed over ranks for final states and ``replicated`` inputs."""
    from k3lab.testing import rel_rms_error  # noqa: PLC0415

    errs = {}
    for res in ranks:
        r, sl = res["rank"], slice(res["start"], res["stop"])
        errs[f"o@r{r}"] = rel_rms_error(ref["o"][:, sl], res["o"])
        for n in sharded:
            errs[f"grad_{n}@r{r}"] = rel_rms_error(ref["grads"][n][:, sl], res["grads"][n])
    errs["final"] = rel_rms_error(ref["final"], sum(res["final"] for res in ranks))
    for n in replicated:
        if ref["grads"][n] is not None:
            errs[f"grad_{n}"] = rel_rms_error(ref["grads"][n], sum(res["grads"][n] for res in ranks))
    return errs


FLASH_LEAVES = ("q", "k", "v", "z", "beta", "A_log", "dt_bias", "h0")
FLASH_SHARDED = ("q", "k", "v", "z", "beta")
FLASH_REPLICATED = ("A_log", "dt_bias", "h0")


@dataclass(frozen=True)
class FlashCase:
    """One ``kcp_flash_kda`` check: global sizes, document offsets, folds (float32)."""

    T: int = 150
    cu_seqlens: tuple[int, ...] | None = None
    H: int = 1
    HV: int = 2
    K: int = 16
    V: int = 16
    with_h0: bool = True
    seed: int = 0
    folds: tuple[str, ...] = ("sequential",)


def make_flash_inputs(case: FlashCase) -> dict[str, torch.Tensor]:
    """Fresh random full-sequence raw FlashKDA inputs for ``case`` (the same on every rank), and the
    loss weights w_o, w_s."""
    gen = torch.Generator().manual_seed(case.seed)
    N = len(case.cu_seqlens) - 1 if case.cu_seqlens else 1
    T, H, HV, K, V = case.T, case.H, case.HV, case.K, case.V

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    # Log-decays mostly in (-0.1, -0.002) per token (z + dt_bias around -6): a state lives for tens of
    # tokens, so a rank's entering state and its end-state gradient reach far into its tokens. w_o has
    # mean 1: A_log's gradient sums every token's gate term, and with zero-mean weights those cancel
    # down to float32 round-off (then two chunkings' round-offs would be compared, not KCP).
    return dict(q=randn(1, T, H, K), k=randn(1, T, H, K), v=randn(1, T, HV, V), z=randn(1, T, HV, K) - 6,
                beta=randn(1, T, HV), A_log=0.2 * randn(HV), dt_bias=0.3 * randn(HV * K),
                h0=0.5 * randn(N, HV, K, V), w_o=randn(1, T, HV, V) + 1, w_s=randn(N, HV, K, V))


def _flash_loss_backward(x: dict, w_o, w_s, case: FlashCase, kda):
    o, final = kda(*(x[n] for n in FLASH_LEAVES[:7]), x["h0"] if case.with_h0 else None)
    ((o * w_o).sum() + (final * w_s).sum()).backward()
    return o.detach(), final.detach()


def flash_reference(case: FlashCase, device: str | torch.device = "cpu") -> dict:
    """One process, ``flash_kda`` on the whole sequence: o, final state and every input's gradient."""
    from k3lab.kernels.kda import flash_kda  # noqa: PLC0415

    full = {n: t.to(device) for n, t in make_flash_inputs(case).items()}
    x = {n: full[n].clone().requires_grad_() for n in FLASH_LEAVES}
    cu = torch.tensor(case.cu_seqlens, device=device) if case.cu_seqlens else None

    def kda(*args):
        return flash_kda(*args[:7], initial_state=args[7], output_final_state=True, cu_seqlens=cu)

    o, final = _flash_loss_backward(x, full["w_o"], full["w_s"], case, kda)
    return dict(o=o, final=final, grads={n: x[n].grad for n in FLASH_LEAVES})


def flash_rank_run(rank: int, world_size: int, group, case: FlashCase, fold: str,
                   device: str | torch.device = "cpu") -> dict:
    """This rank's part of ``flash_reference(case)`` under ``kcp_flash_kda``: local o, final-state rows,
    local gradients of the sharded inputs, this rank's contribution to the replicated ones, bytes."""
    from k3lab.kcp.flash import kcp_flash_kda  # noqa: PLC0415

    full = {n: t.to(device) for n, t in make_flash_inputs(case).items()}
    ctx = make_context(case.T, case.cu_seqlens, group)
    sl = slice(ctx.start, ctx.stop)
    x = {n: (full[n][:, sl] if n in FLASH_SHARDED else full[n]).clone().requires_grad_() for n in FLASH_LEAVES}

    def kda(*args):
        return kcp_flash_kda(*args[:7], ctx, initial_state=args[7], output_final_state=True, fold=fold)

    o, final = _flash_loss_backward(x, full["w_o"][:, sl], full["w_s"], case, kda)
    return dict(rank=rank, start=ctx.start, stop=ctx.stop, o=o, final=final,
                grads={n: x[n].grad for n in FLASH_LEAVES}, comm=list(ctx.comm.records))


def flash_check_worker(rank: int, world_size: int, group, cases: list[FlashCase]) -> dict:
    """Every case under every fold in ``case.folds``, in one process group: {"runs": [one dict per
    (case, fold)], "refs": {i: flash_reference(cases[i])} for the cases i with i % R == rank}. The
    references are computed here, spread over the ranks, so the launching process never loads the
    Triton kernels."""
    runs = []
    for case in cases:
        for fold in case.folds:
            res = flash_rank_run(rank, world_size, group, case, fold)
            res.update(case=asdict(case), fold=fold)
            runs.append(res)
    refs = {i: flash_reference(case) for i, case in enumerate(cases) if i % world_size == rank}
    return dict(runs=runs, refs=refs)
