"""Stable LatentMoE (K3 report, Eq. 11), the full-width MoE it replaces, and the dense FFN.

    y = Shared(x) + W_up RMSNorm( sum_{j in top-K(x)} p_j E_j(W_down x) )        LatentMoE
    y = Shared(x) +               sum_{j in top-K(x)} p_j E_j(x)                 full-width MoE

x [N, d]; the router and the shared experts read the full-width token; the routed experts run at
the latent width l (K3: d = 7168 -> l = 3584) so the bytes a token sends to its K experts are
l-wide, and W_up [l -> d] is the one depth-scaled projection of the routed path into the residual.
The routed pairs are sorted by expert and each expert projection is one grouped GEMM
(``k3lab.moe.experts``); ``MoE.reference`` runs the same layer with a loop over experts.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import math
import torch
import torch.nn as nn

from k3lab.moe.activation import ACTIVATIONS
from k3lab.moe.balance import ESTIMATORS, METHODS, Balancing, in_backward
from k3lab.moe.experts import (GROUPED_DTYPES, GatedFFN, GroupedExperts, combine_rows, depth_scaled_std,
                               dispatch_rows, group_by_expert, inverse_permutation, naive_expert_ffn, row_alignment)
from k3lab.norm import RMSNorm
from k3lab.precision import AUTOCAST_DTYPES, autocast_dtype, check_input_dtype
from k3lab.moe.router import Router, Routing, check_topk


@dataclass
class MoEConfig:
    """Shape and options of one MoE layer.

    Attributes:
        d_model (int): d, the residual width.
        n_experts (int): E routed experts.
        top_k (int): K experts per token.
        expert_hidden (int): h, each expert's hidden width.
        latent_dim (int | None): l, the routed experts' width (LatentMoE); None for a full-width MoE.
        n_shared (int): shared experts (each of hidden ``expert_hidden``), 0 for none.
        activation (str): ``"situ"`` (SiTU-GLU, K3) or ``"swiglu"``.
        renormalize (bool): renormalise the selected scores (K3: True).
        routed_scaling (float): factor on the routed weights (K3: 1.0).
        balance (str): ``"qb"``, ``"sign"``, ``"aux"`` or ``"none"``.
        estimator (str): Quantile Balancing's ``"histogram"`` or ``"exact"``.
        bins (int): histogram bins.
        sign_lr (float): the sign update's step.
        aux_coef (float): the auxiliary loss's coefficient (read by ``balance_loss``).
        n_layers (int): depth of the model the layer sits in (for the depth-scaled output init).
        init_std (float): std of the input projections.
        norm_eps (float): the latent RMSNorm's eps.

    Raises:
        ValueError: a size not a positive int, latent_dim above d_model, n_shared not an int >= 0, renormalize
            not a bool,
            top_k > n_experts, an unknown activation, balance or
            estimator, bins < 2, routed_scaling, init_std or norm_eps not a finite number > 0, sign_lr or
            aux_coef not a finite number >= 0, Quantile Balancing with top_k = n_experts.
    """

    d_model: int = 256
    n_experts: int = 16
    top_k: int = 2
    expert_hidden: int = 256
    latent_dim: int | None = None
    n_shared: int = 1
    activation: str = "situ"
    renormalize: bool = True
    routed_scaling: float = 1.0
    balance: str = "qb"
    estimator: str = "histogram"
    bins: int = 1000
    sign_lr: float = 1e-3
    aux_coef: float = 1e-2
    n_layers: int = 1
    init_std: float = 0.02
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("d_model", "n_experts", "top_k", "expert_hidden", "n_layers"):
            n = getattr(self, name)
            if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {n!r}")
        check_topk(self.n_experts, self.top_k, "MoEConfig")
        if self.latent_dim is not None and not (
                isinstance(self.latent_dim, int) and not isinstance(self.latent_dim, bool) and self.latent_dim > 0):
            raise ValueError(f"MoEConfig.latent_dim must be a positive int or None (full width), got {self.latent_dim!r}")
        if self.latent_dim is not None and self.latent_dim > self.d_model:
            raise ValueError(f"MoEConfig.latent_dim {self.latent_dim} is wider than d_model {self.d_model}: the latent "
                             f"projection narrows the token (K3: 7168 -> 3584); use latent_dim=None for full width")
        if not (isinstance(self.n_shared, int) and not isinstance(self.n_shared, bool) and self.n_shared >= 0):
            raise ValueError(f"MoEConfig.n_shared must be an int >= 0, got {self.n_shared!r}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"MoEConfig.renormalize must be a bool, got {self.renormalize!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.balance not in METHODS:
            raise ValueError(f"MoEConfig.balance must be one of {METHODS}, got {self.balance!r}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"MoEConfig.estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if not (isinstance(self.bins, int) and not isinstance(self.bins, bool) and self.bins >= 2):
            raise ValueError(f"MoEConfig.bins must be an int >= 2, got {self.bins!r}")
        for name, low, strict in (("routed_scaling", 0.0, True), ("sign_lr", 0.0, False), ("aux_coef", 0.0, False),
                                  ("init_std", 0.0, True), ("norm_eps", 0.0, True)):
            v = getattr(self, name)
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  and (v > low if strict else v >= low))
            if not ok:
                raise ValueError(f"MoEConfig.{name} must be a finite number {'>' if strict else '>='} {low}, got {v!r}")
        if self.balance == "qb" and self.top_k == self.n_experts:
            raise ValueError(f"MoEConfig: balance='qb' needs top_k < n_experts (Quantile Balancing reads each "
                             f"token's (K+1)-th score), got top_k = n_experts = {self.top_k}; use balance='none'")

    @property
    def routed_dim(self) -> int:
        """The width the routed experts run at: l, or d for a full-width MoE."""
        return self.d_model if self.latent_dim is None else self.latent_dim

    def flops_per_token(self) -> int:
        """Forward matmul FLOPs per token (2 per multiply-add), counting only the K active experts at
        their real width: router 2dE, shared 6dh per expert, latent projections 4dl, routed 6lhK."""
        d, h, K, E = self.d_model, self.expert_hidden, self.top_k, self.n_experts
        latent = 0 if self.latent_dim is None else 4 * d * self.latent_dim
        return 2 * d * E + 6 * d * h * self.n_shared + latent + 6 * self.routed_dim * h * K

    @classmethod
    def k3(cls, **overrides) -> "MoEConfig":
        """K3's MoE layer: d 7168, 896 experts, top-16, 2 shared, hidden 3072, latent 3584."""
        return replace(cls(d_model=7168, n_experts=896, top_k=16, expert_hidden=3072, latent_dim=3584,
                           n_shared=2, n_layers=93), **overrides)


class MoE(nn.Module):
    """A routed MoE layer, latent (``config.latent_dim`` set) or full width: [..., d] -> [..., d].

    ``forward(x [..., d], mask [...] bool | None) -> [..., d]`` in ``x``'s dtype; ``mask`` False marks
    padding tokens: they are computed but never counted by the balancer. In training mode (outside a
    backward recompute) the routing is counted for the bias update (``update_biases``), even under
    ``torch.no_grad()``: call ``model.eval()`` before a validation forward, or its tokens move the next bias.
    ``last_routing`` holds the latest forward's ``Routing``. With ``balance="aux"`` the auxiliary loss of the
    latest forward waits in ``balance.aux`` for ``balance_loss``; under reentrant activation checkpointing
    (``torch.utils.checkpoint(use_reentrant=True)``, whose forward runs without autograd) it has no gradient:
    use the non-reentrant form (``k3lab.memory``'s recompute is).

    Expert parallelism: with ``ep_group`` set (a process group of R ranks, e.g.
    ``make_mesh(...)["ep"].get_group()``), ``experts`` holds this rank's E/R home experts (plain tensors
    [E/R, l, h], or DTensors over the ep mesh axis whose local shard is that) and the routed pairs run
    through ``k3lab.moonep.moonep_experts`` in mode ``ep_mode`` ("moonep" or "alltoall"), the experts'
    gradients averaged over the ep group (``GroupedExperts.ep_forward``); the router, the
    balancer and the shared experts are unchanged (global expert ids); padding tokens (``mask`` False) get a
    zero routed output there. "moonep" needs the same number of tokens on every rank of the group (static
    shapes; pad with ``mask``), which the layer does not check on its hot path (a host sync per layer): a
    mismatch fails or hangs in a collective; ``moonep_experts`` with ``check_ids`` names it. ``None`` (the
    default): one process.

    Raises:
        ValueError: ``x``'s last dim is not d, ``x``'s dtype is not the parameters' outside autocast
            (``k3lab.precision.check_input_dtype``), ``mask``'s shape is not ``x``'s without d or its dtype
            not bool, or the router logits are not finite; ``reference`` with ``ep_group`` set; ``forward``
            in float32/bf16/fp16 (autocast's dtype under autocast) with ``config.routed_dim`` or
            ``config.expert_hidden`` not a multiple of 16 bytes' worth of elements (4 in float32, 8 in bf16).
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        c = self.config = config
        out_std = depth_scaled_std(c.init_std, c.n_layers)
        l = c.routed_dim
        self.router = Router(c.d_model, c.n_experts, c.top_k, c.renormalize, c.routed_scaling, c.init_std)
        self.balance = Balancing(c.balance, c.n_experts, c.top_k, c.estimator, c.bins, c.sign_lr)
        latent = c.latent_dim is not None
        self.experts = GroupedExperts(c.n_experts, l, c.expert_hidden, c.activation, c.init_std,
                                      c.init_std if latent else out_std)
        self.down = nn.Linear(c.d_model, l, bias=False) if latent else None
        self.latent_norm = RMSNorm(l, eps=c.norm_eps) if latent else None
        self.up = nn.Linear(l, c.d_model, bias=False) if latent else None
        if latent:
            nn.init.normal_(self.down.weight, std=c.init_std)
            nn.init.normal_(self.up.weight, std=out_std)
        self.shared = (GatedFFN(c.d_model, c.n_shared * c.expert_hidden, c.activation, c.init_std, out_std)
                       if c.n_shared else None)
        self.last_routing: Routing | None = None
        self.ep_group = None
        self.ep_mode = "moonep"

    def __getstate__(self) -> dict:
        # The latest routing keeps the forward's graph (a routing loss of the user's reads its scores): a copy or
        # a pickle of the layer starts without one, as a new layer does (copy.deepcopy refuses graph tensors).
        return {**super().__getstate__(), "last_routing": None}

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._forward(x, mask, reference=False)

    def reference(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The same layer with the experts run by a loop over experts (any dtype, float64 included)."""
        return self._forward(x, mask, reference=True)

    def _forward(self, x: torch.Tensor, mask: torch.Tensor | None, reference: bool) -> torch.Tensor:
        c = self.config
        if x.ndim == 0 or x.shape[-1] != c.d_model:
            raise ValueError(f"MoE: x must be [..., d={c.d_model}], got shape {list(x.shape)}")
        if mask is not None and mask.shape != x.shape[:-1]:
            raise ValueError(f"MoE: mask must have x's shape without d, {list(x.shape[:-1])}, got {list(mask.shape)}")
        if mask is not None and mask.dtype != torch.bool:
            # A 0/1 float or int mask would be read as per-token counts by the balancer (2 counts a token twice).
            raise ValueError(f"MoE: mask must be a bool tensor (False for padding), got {mask.dtype}")
        check_input_dtype("MoE", "x", x, self.router.weight.dtype)
        x2 = x.reshape(-1, c.d_model)
        routing = self.router(x2)
        # A recompute replay in backward (activation checkpointing) is not a new forward: stored, its
        # routing would hold the replayed graph, and every tensor that graph saved, until the next step.
        if not in_backward():
            self.last_routing = routing
        z = x2 if self.down is None else self.down(x2)
        if not reference:
            self._check_expert_widths(z)
        # Counted after the checks: a forward that raises leaves no counts for the next bias update.
        if self.training and not in_backward():
            self.balance.record(routing, self.router.bias, mask)
        elif self.training:
            self.balance.replay(routing, mask)
        if self.ep_group is not None:
            routed = self._expert_parallel(z, routing, mask, reference)
        else:
            order, offsets, _ = group_by_expert(routing.topk_idx, c.n_experts)
            e = self.experts
            if reference:
                token = order // c.top_k
                y = naive_expert_ffn(z[token], offsets, e.w_gate, e.w_up, e.w_down, e.activation)
                y = y * routing.topk_weight.reshape(-1)[order, None].to(y.dtype)
                # The plain form: a gather in, an accumulating scatter out, in the loop's dtype (z's).
                routed = y.new_zeros(z.shape).index_add_(0, token, y)
            else:
                # Gathers both ways: z[token]'s backward and the index_add_ above are accumulating scatters,
                # bf16 atomics on a GPU that took longer than the three grouped GEMMs together.
                inv = inverse_permutation(order)
                # Every one of the N*K rows is a pair: no padding rows to zero.
                y = e(dispatch_rows(z, order, inv, c.top_k), offsets, padded=False)
                routed = combine_rows(y, order, inv, routing.topk_weight)
        if self.up is not None:
            routed = self.up(self.latent_norm(routed))
        if self.shared is not None:
            routed = routed + self.shared(x2)
        return routed.view_as(x)

    def _check_expert_widths(self, z: torch.Tensor) -> None:
        """ValueError naming the config's fields when the grouped GEMMs cannot run the experts on z."""
        # expert_ffn's alignment in the dtype the experts run in (autocast's, else z's), named by the config's
        # fields. Checked here, not in MoEConfig: float64 runs the loop over experts, which takes any width.
        dtype = (autocast_dtype(z.device.type) if z.dtype in AUTOCAST_DTYPES else None) or z.dtype
        if dtype not in GROUPED_DTYPES:
            return
        c, align = self.config, row_alignment(dtype)
        width = "d_model" if c.latent_dim is None else "latent_dim"
        for name, v in ((width, c.routed_dim), ("expert_hidden", c.expert_hidden)):
            if v % align:
                raise ValueError(f"MoEConfig.{name} must be a multiple of {align} to run the layer in {dtype} (the "
                                 f"routed experts' grouped GEMMs need 16-byte rows), got {v}; float64 takes any width")

    # Eager under torch.compile: the MoonEP planner's Triton kernels and side stream, the exchange's collectives,
    # and FSDP's gather of the experts around ep_forward.
    @torch.compiler.disable
    def _expert_parallel(self, z: torch.Tensor, routing: Routing, mask, reference: bool) -> torch.Tensor:
        """The routed sum for z [N, l] with the experts spread over ``ep_group`` (see the class docstring)."""
        if reference:
            raise ValueError("MoE: reference() is the one-process loop; unset ep_group to use it")
        pad = None if mask is None else ~mask.reshape(-1)
        # Each rank's loss is the mean over its own tokens; the experts serve the whole ep group, so their
        # gradient is averaged over its R ranks as data parallelism averages the other weights.
        R = torch.distributed.get_world_size(self.ep_group)
        return self.experts.ep_forward(z, routing.topk_idx, routing.topk_weight, self.ep_group, self.ep_mode, pad,
                                       grad_scale=1.0 / R)

    def extra_repr(self) -> str:
        c = self.config
        kind = "full width" if c.latent_dim is None else f"latent {c.latent_dim}"
        return f"E={c.n_experts}, K={c.top_k}, {kind}, shared={c.n_shared}, balance={c.balance}"


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every ``MoE`` layer of ``model`` in module order (MTP and pipeline stages included: whatever the
    module tree holds)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def update_biases(model: nn.Module, group=None) -> list[torch.Tensor]:
    """Apply every MoE layer's bias update (call once per optimizer step, after it).

    Layers with ``balance="none"`` only reset their counts; a model without MoE layers is a no-op.
    ``group``: the data x context process group whose tokens each layer's statistics are summed over.

    Returns:
        list of [E] int64 loads, one per MoE layer, in module order.
    """
    return [m.balance.update(m.router.bias, group) for m in moe_layers(model)]


def balance_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum over the ``balance="aux"`` layers of ``aux_coef * aux loss`` from their latest counted
    forward; 0.0 when there are none. Add it to the training loss before backward."""
    terms = [m.config.aux_coef * m.balance.aux for m in moe_layers(model)
             if m.config.balance == "aux" and m.balance.aux is not None]
    return sum(terms) if terms else 0.0
