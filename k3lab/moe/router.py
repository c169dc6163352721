"""K3's router: sigmoid scores, top-k on the biased scores, weights from the unbiased ones.

    s = sigmoid(W_r x)                              [N, E] float32, on the full-width token
    experts_i = top-K of (s_i + b)                  b [E]: the balancing bias, float32, no gradient
    p_ij = s_ij / sum_{j' in experts_i} s_ij'       renormalised selected scores (times a routed scale)

The bias only chooses; it never enters the weights. Weights are gathered from ``s`` at the chosen
experts, never recovered as ``(s + b) - b``: with logits near -18 (s ~ 1e-8) and a bias of 12, the
float32 sum rounds s away and the weight comes out 0. Without the renormalisation, the weights of
a token whose selected scores are all tiny are tiny too, and its gradients huge after any
normalisation downstream.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3lab.precision import check_input_dtype


@dataclass
class Routing:
    """One batch's routing decision.

    Attributes:
        scores (Tensor): [N, E] float32, s = sigmoid(logits) (differentiable).
        topk_idx (Tensor): [N, K] int64 chosen experts, in descending order of ``s + b``.
        topk_weight (Tensor): [N, K] float32 weights p (differentiable through the logits, as ``scores``).
        cutoff (Tensor | None): [N] float32, Quantile Balancing's alpha_i: midway between each token's
            K-th and (K+1)-th largest biased scores (no gradient); None when K = E.
    """

    scores: torch.Tensor
    topk_idx: torch.Tensor
    topk_weight: torch.Tensor
    cutoff: torch.Tensor | None


def check_topk(E: int, K: int, who: str = "router") -> None:
    """ValueError unless E >= 1 and 1 <= K <= E (ints)."""
    for name, n in (("E", E), ("K", K)):
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            raise ValueError(f"{who}: {name} must be a positive int, got {n!r}")
    if K > E:
        raise ValueError(f"{who}: top-k K={K} exceeds the number of experts E={E}")


def check_routed_scaling(routed_scaling: float, who: str = "route") -> None:
    """ValueError unless routed_scaling is a finite number > 0 (a bool is not one)."""
    if not (isinstance(routed_scaling, (int, float)) and not isinstance(routed_scaling, bool)
            and math.isfinite(routed_scaling) and routed_scaling > 0):
        raise ValueError(f"{who}: routed_scaling must be a finite number > 0, got {routed_scaling!r}")


def route(logits: torch.Tensor, bias: torch.Tensor, K: int, renormalize: bool = True,
          routed_scaling: float = 1.0, check_values: bool = True) -> Routing:
    """Route N tokens over E experts from router logits (K3 report, Eq. 13).

    Args:
        logits (Tensor): [N, E] router logits W_r x, any float dtype (scored in float32).
        bias (Tensor): [E] balancing bias b, used for the choice only (detached).
        K (int): top-k, 1 <= K <= E.
        renormalize (bool): divide the selected scores by their sum (K3: True).
        routed_scaling (float): a constant factor > 0 on the weights (K3: 1.0).
        check_values (bool): reject NaN/inf logits or bias (one host sync; a trainer that checks its batch
            once passes False and sees a NaN in its loss instead).

    Returns:
        Routing: see its attributes.

    Raises:
        TypeError: logits not a floating-point tensor.
        ValueError: bad shapes, K out of range, routed_scaling not a finite number > 0, or a NaN/inf logit or bias with ``check_values`` (reported
            before it can spread).
    """
    if not (isinstance(logits, torch.Tensor) and logits.is_floating_point()):
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"route: logits must be a floating-point tensor [N, E], got {got}")
    if logits.ndim != 2:
        raise ValueError(f"route: logits must be [N, E], got shape {list(logits.shape)}")
    N, E = logits.shape
    check_topk(E, K, "route")
    check_routed_scaling(routed_scaling)
    if not isinstance(bias, torch.Tensor) or bias.shape != (E,):
        got = f"shape {list(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"route: bias must be a tensor [E={E}], got {got}")
    if check_values:
        # One host sync for both: a NaN bias would win every top-k (topk ranks NaN highest).
        finite = torch.stack([torch.isfinite(logits).all(), torch.isfinite(bias).all()]).tolist()
        if not finite[0]:
            raise ValueError("route: the router logits hold NaN or inf (check the input x and the router weight)")
        if not finite[1]:
            raise ValueError("route: the balancing bias holds NaN or inf (check the bias update)")
    scores = torch.sigmoid(logits.float())
    biased = scores.detach() + bias.detach().float()
    # One top-(K+1) gives the K choices and Quantile Balancing's cutoff alpha_i together.
    vals, idx = torch.topk(biased, min(K + 1, E), dim=-1)
    topk_idx = idx[:, :K]
    # Any alpha_i between the K-th and (K+1)-th biased score is a valid dual price; the midpoint (not
    # the (K+1)-th itself) lets the repeated update settle on exact balance instead of stalling ~2% off.
    cutoff = 0.5 * (vals[:, K - 1] + vals[:, K]) if K < E else None
    weight = scores.gather(1, topk_idx)
    if renormalize:
        total = weight.sum(-1, keepdim=True)
        # Where every selected s underflows float32 (logits below about -87: the sum is subnormal or 0), the
        # ratio or its gradient is 0/0 or inf; there the same weights come as a softmax of log s.
        normal = total >= torch.finfo(torch.float32).tiny
        stable = torch.softmax(F.logsigmoid(logits.float().gather(1, topk_idx)), dim=-1)
        weight = torch.where(normal, weight / torch.where(normal, total, 1.0), stable)
    return Routing(scores, topk_idx, weight * routed_scaling, cutoff)


class Router(nn.Module):
    """``route`` with its weight W_r [E, d] and bias b [E].

    Args:
        d (int): token width (the full width: K3's router reads x, not the latent).
        E (int): experts.  K (int): top-k.
        renormalize (bool), routed_scaling (float): as in ``route``.
        init_std (float): std of W_r.

    The bias is a float32 buffer (saved in the state dict, no gradient) and stays float32 when the
    module is cast (``model.to(torch.bfloat16)``): bf16 has 8 bits of mantissa, too few for the
    small steps a balancer takes. The logits W_r x are one matmul in the autocast dtype under autocast
    (bf16 in the trainer: about 1e-3 of rounding, which can swap a token's
    expert at a near-tie against the float32 logits); the scores, the choice and the weights are float32
    from there (``route``). Run the router outside autocast for float32 logits.
    """

    def __init__(self, d: int, E: int, K: int, renormalize: bool = True, routed_scaling: float = 1.0,
                 init_std: float = 0.02):
        super().__init__()
        if not (isinstance(d, int) and not isinstance(d, bool) and d > 0):
            raise ValueError(f"Router: d must be a positive int, got {d!r}")
        check_topk(E, K, "Router")
        check_routed_scaling(routed_scaling, "Router")
        self.E, self.K, self.renormalize, self.routed_scaling = E, K, renormalize, routed_scaling
        self.weight = nn.Parameter(torch.randn(E, d) * init_std)
        self.register_buffer("bias", torch.zeros(E, dtype=torch.float32))
        # route's NaN/inf check (one host sync per call); ``K3Model.value_checks`` turns it off.
        self.check_values = True

    def _apply(self, fn, recurse=True):
        bias = self.bias
        super()._apply(fn, recurse)
        self.bias = bias.to(device=self.weight.device)
        return self

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, d] -> Routing (see ``route``).

        Raises:
            ValueError: x not [N, d], its dtype not the weight's outside autocast, or what ``route`` raises.
        """
        d = self.weight.shape[1]
        if x.ndim != 2 or x.shape[1] != d:
            raise ValueError(f"Router: x must be [N, d={d}], got shape {list(x.shape)}")
        check_input_dtype("Router", "x", x, self.weight.dtype)
        return route(x @ self.weight.t(), self.bias, self.K, self.renormalize, self.routed_scaling,
                     self.check_values)
