"""Routings, the one-process reference and the per-rank function of MoonEP's tests and notebook.

Ranks are started with ``k3lab.dist.launch(check_worker, R, cases)``; the function lives here because
mp.spawn cannot pickle functions defined in a notebook cell. Every rank builds the same global batch
from ``Case.seed`` (R*S tokens, all E experts' weights), takes its own S tokens and its L = E/R home
experts, runs ``moonep_experts`` forward and backward on loss = <out, w_o>, and returns its output,
gradients and loads; ``reference(case, R)`` runs ``dense_moe`` on the whole batch in one process.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from k3lab.moonep.alltoall import alltoall_step
from k3lab.moonep.dispatch import moonep_step
from k3lab.moonep.ep import _run_ffn, moonep_experts
from k3lab.moonep.naive import dense_moe

ROUTINGS = ("uniform", "zipf", "one_expert", "idle_rank", "identical")


def make_routing(kind: str, R: int, S: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """[R, S, K] int64 expert ids for R ranks of S tokens.

    kind: "uniform" (K distinct experts per token, uniformly); "zipf" (distinct, expert e drawn with
    weight 1/(e+1)^1.2 via Gumbel top-k); "one_expert" (every pair to expert 0); "idle_rank" (rank 0's
    home experts get nothing, the others uniform: the tightness case of App. E); "identical" (every token
    after the first 3 with the same scores, so the same K experts).

    Raises:
        ValueError: unknown ``kind``, or K > E.
    """
    if kind not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {kind!r}")
    if K > E:
        raise ValueError(f"K = {K} must be <= E = {E}")
    L = E // R
    scores = torch.rand(R, S, E, generator=gen)
    if kind == "zipf":
        gumbel = -torch.log(-torch.log(scores.clamp_min(1e-12)))
        scores = gumbel - 1.2 * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
    elif kind == "idle_rank":
        if E - L < K:
            raise ValueError(f"idle_rank needs E - E/R >= K, got E={E}, R={R}, K={K}")
        scores[..., :L] = -1.0
    elif kind == "identical":
        scores[:, 3:] = scores[0, 0]
    idx = scores.topk(K, dim=-1).indices
    return torch.zeros_like(idx) if kind == "one_expert" else idx


def tightness_counts(E: int, R: int, K: int, t: int = 1) -> tuple[torch.Tensor, int]:
    """App. E's tightness example: rank 0's L = E/R experts idle, the other (R-1)L experts n = K R t pairs each,
    dealt to the ranks in expert order so every rank holds exactly S*K pairs. Rank 0 then needs at least
    ceil(E(R-1)/R^2) redundant experts; the theorem allows E/R.

    Returns:
        (counts [R, E] int64, S = (R-1) L t).
    """
    L = E // R
    n, S = K * R * t, (R - 1) * L * t
    C = S * K
    seq = torch.arange(L, E).repeat_interleave(n)
    return torch.stack([torch.bincount(seq[r * C:(r + 1) * C], minlength=E) for r in range(R)]), S


@dataclass(frozen=True)
class Case:
    """One checked configuration (float32): global sizes, routing, EP mode, padding."""

    S: int = 12
    K: int = 3
    E: int = 8
    d: int = 16
    h: int = 8
    routing: str = "uniform"
    mode: str = "moonep"
    padded: bool = False
    seed: int = 0


def make_inputs(case: Case, R: int) -> dict[str, torch.Tensor]:
    """The global batch of ``case`` for R ranks (the same on every rank): x [R*S, d], topk_idx and
    topk_weight [R*S, K], pad [R*S] bool, weights w_gate, w_up [E, d, h], w_down [E, h, d], w_o [R*S, d]."""
    gen = torch.Generator().manual_seed(case.seed)
    N = R * case.S
    idx = make_routing(case.routing, R, case.S, case.K, case.E, gen).view(N, case.K)
    pad = (torch.rand(N, generator=gen) < 0.25) if case.padded else torch.zeros(N, dtype=torch.bool)
    return dict(
        x=torch.randn(N, case.d, generator=gen), topk_idx=idx, pad=pad,
        topk_weight=torch.rand(N, case.K, generator=gen) + 0.1,
        w_gate=torch.randn(case.E, case.d, case.h, generator=gen) / case.d ** 0.5,
        w_up=torch.randn(case.E, case.d, case.h, generator=gen) / case.d ** 0.5,
        w_down=torch.randn(case.E, case.h, case.d, generator=gen) / case.h ** 0.5,
        w_o=torch.randn(N, case.d, generator=gen),
    )


def reference(case: Case, R: int) -> dict:
    """One process, the whole batch through ``dense_moe`` (padding tokens: weight 0): out and gradients."""
    full = make_inputs(case, R)
    x = full["x"].clone().requires_grad_()
    tw = full["topk_weight"].clone().requires_grad_()
    ws = {n: full[n].clone().requires_grad_() for n in ("w_gate", "w_up", "w_down")}
    weight = torch.where(full["pad"][:, None], 0.0, tw)
    # Padding tokens go where moonep_experts sends them (their rank's own experts), with weight 0.
    L = case.E // R
    own = (torch.arange(R * case.S) // case.S * L)[:, None] + torch.arange(case.K) % L
    idx = torch.where(full["pad"][:, None], own, full["topk_idx"])
    out = dense_moe(x, idx, weight, ws["w_gate"], ws["w_up"], ws["w_down"], ffn=_run_ffn)
    (out * full["w_o"]).sum().backward()
    return dict(out=out.detach(), grad_x=x.grad, grad_topk_weight=tw.grad,
                grads={n: w.grad for n, w in ws.items()})


class _Experts(torch.nn.Module):
    """This rank's L home experts, cut from the global weights (``GroupedExperts``'s parameter names)."""

    def __init__(self, full: dict, rank: int, L: int):
        super().__init__()
        sl = slice(rank * L, (rank + 1) * L)
        for n in ("w_gate", "w_up", "w_down"):
            setattr(self, n, torch.nn.Parameter(full[n][sl].clone()))


def _run_slice(full: dict, sl: slice, rank: int, R: int, group, mode: str, pad: torch.Tensor | None):
    """``moonep_experts`` forward and backward (loss <out, w_o>) on rows ``sl`` of ``full`` with this rank's
    home experts: (result dict of out and gradients, x, topk_weight, experts)."""
    x = full["x"][sl].clone().requires_grad_()
    tw = full["topk_weight"][sl].clone().requires_grad_()
    experts = _Experts(full, rank, full["w_gate"].shape[0] // R)
    out = moonep_experts(x, full["topk_idx"][sl], tw, experts, group, mode=mode, pad_mask=pad)
    (out * full["w_o"][sl]).sum().backward()
    res = dict(rank=rank, out=out.detach(), grad_x=x.grad, grad_topk_weight=tw.grad,
               grads={n: getattr(experts, n).grad for n in ("w_gate", "w_up", "w_down")})
    return res, x, tw, experts


def rank_run(rank: int, R: int, group, case: Case) -> dict:
    """This rank's part of ``reference(case, R)``: out and grad slices of its tokens, gradients of its
    home experts, the rows it processed, and (MoonEP) its redundant experts and the plan's offsets."""
    full = make_inputs(case, R)
    sl = slice(rank * case.S, (rank + 1) * case.S)
    res, x, tw, experts = _run_slice(full, sl, rank, R, group, case.mode, full["pad"][sl] if case.padded else None)
    # The loads, from the unchecked steps on the same inputs (no padding: the routing as given).
    idx = full["topk_idx"][sl]
    ws = [getattr(experts, n).detach() for n in ("w_gate", "w_up", "w_down")]
    with torch.no_grad():
        if case.mode == "moonep":
            _, p = moonep_step(x.detach(), idx, tw.detach(), *ws, group, _run_ffn)
            res.update(rows=int(p.offsets[rank, -1]), redundant=p.redundant().tolist(), offsets=p.offsets,
                       slot_experts=p.slot_experts)
        else:
            _, rows = alltoall_step(x.detach(), idx, tw.detach(), *ws, group, _run_ffn)
            res.update(rows=rows)
    return res


def check_worker(rank: int, R: int, group, cases: list[Case], ep_cases: list[Case] = (), ep: int = 1) -> dict:
    """Every case in one process group (spawning is the slow part).

    Returns {"world": [``rank_run`` over the whole world per case], "ep": [``rank_run`` per ``ep_cases``
    case over this rank's ep group of ``make_mesh(dp=R // ep, ep=ep)``, its seed shifted by 1000 * its dp
    index so each ep group checks its own batch]}; each result carries its case (and ``dp`` for "ep").
    """
    from k3lab.dist import make_mesh  # noqa: PLC0415

    out = {"world": [], "ep": []}
    for case in cases:
        res = rank_run(rank, R, group, case)
        res["case"] = asdict(case)
        out["world"].append(res)
    if ep_cases:
        mesh = make_mesh(dp=R // ep, ep=ep)
        dp = mesh.get_local_rank("dp")
        for case in ep_cases:
            case = replace(case, seed=case.seed + 1000 * dp)
            res = rank_run(mesh.get_local_rank("ep"), ep, mesh["ep"].get_group(), case)
            res.update(case=asdict(case), dp=dp)
            out["ep"].append(res)
    return out


def uneven_worker(rank: int, R: int, group, sizes: list[int], case: Case = Case(mode="alltoall")) -> dict:
    """Rank r holding ``sizes[r]`` tokens of one global batch (``make_inputs`` of ``case`` with S = max(sizes),
    the first sum(sizes) tokens, cut in rank order). Returns this rank's baseline output and gradients
    (loss <out, w_o>, as ``rank_run``), and the message of the ValueError each misuse raised here: MoonEP on
    these sizes ("moonep_sizes", None when the sizes agree), and an id outside [0, E) on the last rank only
    ("bad_id")."""
    full = make_inputs(replace(case, S=max(sizes)), R)
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    res, x, tw, experts = _run_slice(full, sl, rank, R, group, "alltoall", None)
    idx = full["topk_idx"][sl]

    def error(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    res["moonep_sizes"] = error(lambda: moonep_experts(x, idx, tw, experts, group, mode="moonep"))
    wrong = idx.clone()
    if rank == R - 1 and wrong.numel():
        wrong[-1, -1] = case.E
    res["bad_id"] = error(lambda: moonep_experts(x, wrong, tw, experts, group, mode="alltoall"))
    return res


def gather_ranks(results: list[dict]) -> dict:
    """R ranks' ``rank_run`` results as one batch: out, grad_x, grad_topk_weight concatenated in rank
    order, expert gradients concatenated in expert order (rank r holds experts r*L ... r*L + L-1)."""
    cat = lambda key: torch.cat([r[key] for r in results])  # noqa: E731
    return dict(out=cat("out"), grad_x=cat("grad_x"), grad_topk_weight=cat("grad_topk_weight"),
                grads={n: torch.cat([r["grads"][n] for r in results]) for n in results[0]["grads"]})
