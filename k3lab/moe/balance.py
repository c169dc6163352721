"""Load balancing for the router's bias: Quantile Balancing (K3) and the two baselines.

Quantile Balancing (K3 report, Eq. 14, App. C-D). With m tokens, E experts and top-K, a balanced
layer gives each expert q = m K / E tokens. Route with top-(K+1) on s + b; each token's cutoff
alpha_i lies between its K-th and (K+1)-th biased score (k3lab takes the midpoint). Expert j takes
token i when s_ij + b_j > alpha_i, that is when r_ij = alpha_i - s_ij < b_j. So the bias that gives
expert j exactly q tokens lies between the q-th and (q+1)-th smallest r_ij over the m tokens:

    b_hat_j = midpoint of the q-th and (q+1)-th smallest r_ij      (q rounded down)
    b       = b_hat - mean(b_hat)                                   used from the NEXT step

Re-centring changes no choice: adding one constant to every bias moves every cutoff by the same
constant. Setting alpha given b, then b given alpha, is exact block-coordinate minimisation of the
dual of the balanced-assignment LP; there is no step size to tune. On a fixed batch the repeated
update settles on exact balance; on fresh batches each step balances the next one to within the
batches' difference.

At scale the m x E matrix r is never gathered: each expert keeps a histogram of r over
[min(b) - 1, max(b) + 1] (r always lies there: s in (0, 1)), accumulated over micro-batches and
summed across the data x context group by one integer all-reduce per layer per step; b_hat_j is
read where the cumulative count reaches q, interpolated linearly inside the bin, so it is within
one bin width of the exact interval.

Baselines: the auxiliary loss (Switch / DeepSeek style, E * sum_j f_j P_j, a gradient into the
router scaled by a coefficient to tune) and the sign update b_j += gamma * sign(mean load - load_j)
(DeepSeek-V3's "loss-free" balancing, a SignSGD step on the same dual, with a step size to tune).

Counting rules (each one a bug somewhere public): only training forwards count (an eval forward
changes nothing), each token once (a recompute under activation checkpointing runs inside the
backward and is skipped), padding tokens (``mask`` False) never, counts are integers, and the bias
is float32 whatever the model's dtype.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from k3lab.moe.router import Routing, check_topk

METHODS = ("none", "aux", "sign", "qb")
ESTIMATORS = ("exact", "histogram")


def balanced_rank(m: torch.Tensor | int, K: int, E: int) -> torch.Tensor | int:
    """floor(q) with q = m K / E, the balanced load of one expert (m tokens, top-K, E experts)."""
    return (m * K) // E


def quantile_bias(scores: torch.Tensor, cutoff: torch.Tensor, K: int) -> torch.Tensor:
    """Quantile Balancing's bias from one step's routing, exactly (K3 Eq. 14).

    Args:
        scores (Tensor): [m, E] unbiased router scores s (float).
        cutoff (Tensor): [m] each token's cutoff alpha_i, midway between its K-th and (K+1)-th largest
            biased scores (``route``'s ``Routing.cutoff``).
        K (int): top-k, 1 <= K < E.

    Returns:
        Tensor [E] float32: b = b_hat - mean(b_hat), b_hat_j midway between the q-th and (q+1)-th
        smallest of alpha_i - s_ij over tokens i, q = max(1, floor(m K / E)) (with m = 1, that token's r).

    Raises:
        ValueError: shapes disagree (a None cutoff included), K out of range, no tokens, or a NaN or
            infinite score or cutoff (the quantiles would ignore some and turn others into NaN; the check
            reads them back once: this is the one-process reference).
    """
    if cutoff is None:
        raise ValueError("quantile_bias: cutoff must be an [m] tensor, got None (route gives none when K = E; "
                         "Quantile Balancing needs K < E)")
    if scores.ndim != 2 or cutoff.shape != scores.shape[:1]:
        raise ValueError(f"quantile_bias: scores must be [m, E] and cutoff [m], got {list(scores.shape)} and "
                         f"{list(cutoff.shape)}")
    m, E = scores.shape
    _check_qb(E, K, m)
    for name, t in (("scores", scores), ("cutoff", cutoff)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"quantile_bias: {name} must be finite, got {int((~torch.isfinite(t)).sum())} NaN or "
                             f"infinite of {t.numel()}")
    r = cutoff.float()[:, None] - scores.float()
    q = max(1, balanced_rank(m, K, E))
    # One token (q clamped up from 0) has no (q+1)-th r: b_hat is its r, where the histogram reads it too.
    b_hat = 0.5 * (torch.kthvalue(r, q, dim=0).values + torch.kthvalue(r, min(q + 1, m), dim=0).values)
    return b_hat - b_hat.mean()


def _check_qb(E: int, K: int, m: int | None = None) -> None:
    check_topk(E, K, "Quantile Balancing")
    if K == E:
        raise ValueError(f"Quantile Balancing needs top-k K < E (it reads each token's (K+1)-th score), got K=E={E}")
    if m is not None and m < 1:
        raise ValueError("Quantile Balancing needs at least one token in the step")


def histogram_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi] = [min(b) - 1, max(b) + 1], float32 tensors: where every r = alpha - s can lie."""
    b = bias.detach().float()
    return b.min() - 1, b.max() + 1


def histogram_counts(scores: torch.Tensor, cutoff: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                     bins: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert histogram of r_ij = alpha_i - s_ij over ``bins`` equal bins of [lo, hi].

    Args:
        scores (Tensor): [m, E].  cutoff (Tensor): [m].
        lo, hi (Tensor): scalar bounds from ``histogram_range``.
        bins (int): number of bins B.
        weight (Tensor | None): [m] 0/1 per token (padding 0); default all 1.

    Returns:
        Tensor [E, B] int64 counts.
    """
    r = cutoff.detach().float()[:, None] - scores.detach().float()
    # A NaN r (a NaN token, with route's value check off) would cast to an index far outside the histogram;
    # counted in bin 0 instead, it leaves the NaN to the layer's output, where the trainer sees it.
    idx = ((r - lo) / (hi - lo) * bins).nan_to_num(nan=0.0).floor().clamp_(0, bins - 1).long()
    ones = torch.ones_like(idx) if weight is None else weight.long()[:, None].expand_as(idx)
    E = scores.shape[1]
    return torch.zeros(E, bins, dtype=torch.int64, device=scores.device).scatter_add_(1, idx.t(), ones.t())


def histogram_bias(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, K: int) -> torch.Tensor:
    """``histogram_quantile`` re-centred: Quantile Balancing's bias from the histograms, [E] float32
    (raises what ``histogram_quantile`` raises)."""
    b_hat = histogram_quantile(hist, lo, hi, K)
    return b_hat - b_hat.mean()


def histogram_quantile(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, K: int) -> torch.Tensor:
    """b_hat read from the per-expert histograms, before re-centring (no host synchronisation).

    Args:
        hist (Tensor): [E, B] int64 counts of r_ij (every row sums to the step's m tokens).
        lo, hi (Tensor): the range the histogram was built over.
        K (int): top-k, 1 <= K < E.

    Returns:
        Tensor [E] float32; b_hat_j is where expert j's cumulative count reaches q = m K / E,
        interpolated linearly inside its bin, so it lies in the bin of the ceil(q)-th smallest r_ij:
        within one bin width (hi - lo) / B of the interval [q-th, (q+1)-th smallest] of exact answers.

    Raises:
        TypeError: hist not an integer tensor.
        ValueError: hist not [E, B] with B >= 1; K out of range.
    """
    if not isinstance(hist, torch.Tensor) or hist.dtype.is_floating_point or hist.dtype.is_complex \
            or hist.dtype == torch.bool:
        got = hist.dtype if isinstance(hist, torch.Tensor) else type(hist).__name__
        raise TypeError(f"histogram_quantile: hist must be an integer tensor of counts [E, B], got {got}")
    if hist.ndim != 2 or hist.shape[1] < 1:
        raise ValueError(f"histogram_quantile: hist must be [E, B] (one row of B >= 1 bins per expert), "
                         f"got shape {list(hist.shape)}")
    E, B = hist.shape
    _check_qb(E, K)
    m = hist[0].sum()
    target = (m * K).double() / E
    cum = hist.cumsum(1)
    j = (cum < target).sum(1).clamp_(max=B - 1)
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(j))
    inside = hist.gather(1, j[:, None])[:, 0].clamp(min=1)
    # c items spread evenly over a bin: the count reaches t at t / c of the way across it.
    frac = ((target - before) / inside).float()
    return lo + (hi - lo) / B * (j.float() + frac.clamp(0, 1))


def aux_loss(scores: torch.Tensor, topk_idx: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-style load-balancing loss E * sum_j f_j P_j, f the share of pairs sent to j (no gradient),
    P_j the mean normalised score of j (the gradient's path into the router). 1 when balanced.

    Args:
        scores (Tensor): [N, E] router scores.  topk_idx (Tensor): [N, K].
        weight (Tensor | None): [N] 0/1 per token (padding 0).
    """
    N, E = scores.shape
    w = scores.new_ones(N) if weight is None else weight.to(scores.dtype)
    counts = torch.zeros(E, dtype=scores.dtype, device=scores.device).scatter_add_(
        0, topk_idx.reshape(-1), w[:, None].expand_as(topk_idx).reshape(-1))
    f = counts / counts.sum().clamp(min=1)
    P = ((scores / scores.sum(-1, keepdim=True)) * w[:, None]).sum(0) / w.sum().clamp(min=1)
    return E * (f.detach() * P).sum()


def maxvio(load: torch.Tensor) -> float:
    """max_j load_j / mean(load) - 1 (0 when perfectly balanced, and for a load of all zeros).

    Args:
        load (Tensor | Sequence[int]): [E] tokens (or pairs) per expert, any numeric dtype, >= 0.

    Returns:
        float.

    Raises:
        ValueError: ``load`` not 1-D with at least one expert, or holding a negative or non-finite count.
    """
    load = torch.as_tensor(load)
    if load.dtype == torch.bool or load.is_complex():
        raise ValueError(f"maxvio: load must be [E] counts, got a {load.dtype} tensor")
    load = load.double()
    if load.ndim != 1 or load.numel() == 0 or not bool(torch.isfinite(load).all()) or bool((load < 0).any()):
        raise ValueError(f"maxvio: load must be [E] finite counts >= 0 with E >= 1, got shape {list(load.shape)}"
                         + (f", min {load.min().item()}" if load.numel() else ""))
    return float(load.max() / load.mean() - 1) if load.sum() > 0 else 0.0


def in_backward() -> bool:
    """True inside an autograd backward pass (where activation checkpointing recomputes forwards)."""
    return torch._C._current_graph_task_id() != -1


class Balancing(nn.Module):
    """One MoE layer's balancing statistics and its bias update.

    Args:
        method (str): ``"qb"`` (Quantile Balancing), ``"sign"`` (sign update), ``"aux"`` (auxiliary
            loss; the bias stays 0) or ``"none"``.
        E (int), K (int): experts and top-k.
        estimator (str): QB's ``"histogram"`` (distributed, the default) or ``"exact"`` (one process:
            keeps every token's r, m x E floats).
        bins (int): histogram bins B.
        sign_lr (float): gamma of the sign update.

    ``record`` is called by the layer on each counted forward; ``update`` once per optimizer step.
    Buffers (not saved): ``counts`` [E] int64 pairs per expert since the last update, ``hist`` [E, B].
    """

    def __init__(self, method: str, E: int, K: int, estimator: str = "histogram", bins: int = 1000,
                 sign_lr: float = 1e-3):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"balance method must be one of {METHODS}, got {method!r}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if not (isinstance(bins, int) and not isinstance(bins, bool) and bins >= 2):
            raise ValueError(f"bins must be an int >= 2, got {bins!r}")
        if not (isinstance(sign_lr, (int, float)) and not isinstance(sign_lr, bool) and math.isfinite(sign_lr)
                and sign_lr >= 0):
            raise ValueError(f"sign_lr must be a finite number >= 0, got {sign_lr!r}")
        if method == "qb":
            _check_qb(E, K)
        self.method, self.E, self.K, self.estimator, self.bins, self.sign_lr = method, E, K, estimator, bins, sign_lr
        self.register_buffer("counts", torch.zeros(E, dtype=torch.int64), persistent=False)
        self.register_buffer("hist", torch.zeros(E, bins if method == "qb" else 0, dtype=torch.int64),
                             persistent=False)
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.aux: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        # The pending auxiliary loss keeps its forward's graph until the training loss takes it: a copy starts
        # without one, as after an update (copy.deepcopy refuses graph tensors).
        return {**super().__getstate__(), "aux": None}

    def record(self, routing: Routing, bias: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Count one forward's routing (``mask`` [N] bool, False for padding)."""
        w = None if mask is None else mask.reshape(-1).long()
        pairs = routing.topk_idx.reshape(-1)
        ones = torch.ones_like(pairs) if w is None else w[:, None].expand_as(routing.topk_idx).reshape(-1)
        self.counts.scatter_add_(0, pairs, ones)
        if self.method == "aux":
            self.aux = aux_loss(routing.scores, routing.topk_idx, w)
        if self.method != "qb":
            return
        if self.estimator == "histogram":
            lo, hi = histogram_range(bias)
            self.hist += histogram_counts(routing.scores, routing.cutoff, lo, hi, self.bins, w)
        else:
            keep = slice(None) if mask is None else mask.reshape(-1)
            self._kept.append((routing.scores.detach()[keep], routing.cutoff.detach()[keep]))

    def replay(self, routing: Routing, mask: torch.Tensor | None = None) -> None:
        """A recompute's replay of a counted forward (activation checkpointing): nothing is counted, but the
        auxiliary loss's ops run again, their result dropped, so that non-reentrant checkpoint sees the
        tensors the forward saved (without them it raised "a different number of tensors was saved")."""
        if self.method == "aux":
            aux_loss(routing.scores, routing.topk_idx, None if mask is None else mask.reshape(-1).long())

    @torch.no_grad()
    def update(self, bias: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Apply the step's bias update in place and reset the statistics.

        Args:
            bias (Tensor): the router's [E] float32 bias.
            group (ProcessGroup | None): the data x context group whose tokens share this layer (its
                counts and histograms are summed); None for one process.

        Returns:
            Tensor [E] int64: the step's load (pairs per expert, summed over ``group``).
        """
        if group is not None and self.method == "qb" and self.estimator == "exact":
            # Before the all-reduce: after it, a retry without the group would count the other ranks twice.
            raise ValueError("the exact Quantile Balancing estimator runs in one process; "
                             "use estimator='histogram' with a process group")
        if group is not None:
            # One integer all-reduce per layer: the counts ride along with the histogram.
            flat = torch.cat([self.counts, self.hist.reshape(-1)])
            dist.all_reduce(flat, group=group)
            self.counts.copy_(flat[:self.E])
            self.hist.copy_(flat[self.E:].view_as(self.hist))
        load = self.counts.clone()
        if self.method == "qb" and self.estimator == "histogram":
            # A step with no counted tokens keeps the bias; chosen on the device, so the step never
            # waits on the host.
            lo, hi = histogram_range(bias)
            bias.copy_(torch.where(load.sum() > 0, histogram_bias(self.hist, lo, hi, self.K), bias))
        elif self.method == "qb" and self._kept and load.sum() > 0:
            # The exact estimator is the one-process reference: reading the load here is fine.
            scores, cutoff = (torch.cat(t) for t in zip(*self._kept))
            bias.copy_(quantile_bias(scores, cutoff, self.K))
        elif self.method == "sign":
            mean = load.double().mean()
            bias += self.sign_lr * torch.sign(mean - load.double()).float()
        self.counts.zero_()
        self.hist.zero_()
        self._kept.clear()
        self.aux = None
        return load

