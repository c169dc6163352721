"""Per-Head Muon (K3 report, Sec. 2.5) with AdamW for the rest, as one ``torch.optim.Optimizer``.

Muon (Moonlight, "Muon is Scalable for LLM Training"; ``torch.optim.Muon``) on the hidden matrices:

    B = mu B + (1 - mu) G                    (momentum, torch's lerp form; Nesterov: U = G + mu (B - G))
    O = NS5(U)                               (quintic Newton-Schulz, (3.4445, -4.7750, 2.0315), 5 steps)
    W = (1 - lr wd) W - lr 0.2 sqrt(max(A, B)) O

Per-Head Muon splits the Q/K/V projections' update along heads (row blocks of the [out, in] weight:
K rows per KDA head, Dn + Dr per MLA query head, Dn and Dv per MLA key / value head) and runs
Newton-Schulz on each block: the result equals a loop over heads, each block a separate
``torch.optim.Muon`` parameter (to bf16 rounding: blocks of one shape run as one batched Newton-Schulz,
``newton_schulz_blocks``). A stacked expert tensor [E, a, b] is orthogonalised per expert.

Learning-rate scaling: Moonlight's ``match_rms_adamw`` (torch's ``adjust_lr_fn="match_rms_adamw"``),
lr * 0.2 * sqrt(max(A, B)) with (A, B) the shape of the block orthogonalised. An orthogonalised
A x B block has RMS 1/sqrt(max(A, B)), so every block's update has RMS 0.2 lr, about AdamW's, and the
Muon and AdamW groups share one learning rate and weight decay (K3: 0.1). Scaling by the whole
matrix instead would make an MLA query head's update (192 x 1536 block of an 18432 x 1536 matrix)
3.5x larger than intended.

AdamW (``torch.optim.adam``'s functional form, decoupled decay) takes what is not a hidden matrix:
embeddings, the LM head, norms, biases, the MoE router, KDA's beta projection and gate vectors,
the short-convolution taps, the AttnRes pseudo-queries.

Gradient clipping (``max_grad_norm``) scales the raw gradients before the step, never the
orthogonalised update (whose norm is fixed by construction). Parameters that are DTensors (FSDP /
TP shards) are orthogonalised as their full logical matrix, then the local shard of the update applied.
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.nn as nn
from torch.optim.adam import adam as _adam
# torch.optim.Muon's own Newton-Schulz: the per-head path runs exactly torch's orthogonalisation.
from torch.optim._muon import _zeropower_via_newtonschulz

from k3lab.dist import local_shard

ALGORITHMS = ("muon", "adamw")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def adjusted_lr(lr: float, shape) -> float:
    """Moonlight's RMS-matching learning rate for one orthogonalised block of ``shape`` (A, B):
    lr * 0.2 * sqrt(max(A, B)) (``torch.optim.Muon``'s ``adjust_lr_fn="match_rms_adamw"``)."""
    return lr * 0.2 * math.sqrt(max(shape[0], shape[1]))


def head_blocks(model: nn.Module) -> dict[nn.Parameter, list[int]]:
    """Row blocks of every Q/K/V projection of ``model``'s KDA and Gated MLA layers.

    Returns:
        dict parameter -> list of row counts summing to its rows (one per head; MLA's ``kv_b_proj``:
        Dn key rows then Dv value rows per head).
    """
    from k3lab.kda import KDALayer
    from k3lab.mla import GatedMLA

    out = {}
    for m in model.modules():
        if isinstance(m, KDALayer):
            out[m.q_proj.weight] = [m.K] * m.H
            out[m.k_proj.weight] = [m.K] * m.H
            out[m.v_proj.weight] = [m.V] * m.HV
        elif isinstance(m, GatedMLA):
            params = dict(m.named_parameters())
            for name, blocks in m.head_blocks().items():
                out[params[name]] = blocks
    return out


def _adamw_modules(model: nn.Module) -> set[int]:
    """ids of the 2-D/3-D parameters that are not hidden matrices (they go to AdamW)."""
    from k3lab.attnres import BlockAttnRes
    from k3lab.kda import KDALayer
    from k3lab.moe import Router

    ids = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            ids.add(id(m.weight))
        elif isinstance(m, Router):
            ids.update(id(p) for p in m.parameters())
        elif isinstance(m, KDALayer):
            # beta: one write-strength logit per head, a gate rather than a hidden map.
            ids.add(id(m.b_proj.weight))
        elif isinstance(m, BlockAttnRes):
            ids.add(id(m.queries))
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        ids.add(id(head.weight))
    return ids


def split_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter, list[int] | None]], list[tuple[str, nn.Parameter]]]:
    """Sort ``model``'s trainable parameters: Muon takes nn.Linear weights and stacked expert weights
    (except the embedding, LM head, router and KDA beta projection); AdamW takes the rest.

    Returns:
        (muon [(name, param, row_blocks or None)], adamw [(name, param)]); tied parameters once.
    """
    from k3lab.moe import GroupedExperts

    blocks = head_blocks(model)
    adamw_ids = _adamw_modules(model)
    matrices = set()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            matrices.add(id(m.weight))
        elif isinstance(m, GroupedExperts):
            matrices.update(id(p) for p in (m.w_gate, m.w_up, m.w_down))
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in matrices and id(p) not in adamw_ids:
            muon.append((name, p, blocks.get(p)))
        else:
            adamw.append((name, p))
    return muon, adamw


def newton_schulz_blocks(blocks: list[torch.Tensor], ns_coefficients=NS_COEFFICIENTS, ns_steps: int = 5,
                         eps: float = 1e-7) -> list[torch.Tensor]:
    """``torch.optim.Muon``'s Newton-Schulz orthogonalisation of each 2-D block, blocks of one shape run
    together as batched matmuls (one launch per step for all heads or experts, not one per block).

    Per block X [A, B] (transposed when A > B), in bf16 as torch's:
        X <- X / max(||X||_F, eps);  5 times:  G = X X^T,  X <- a X + (b G + c G G) X

    Args:
        blocks (list[Tensor]): 2-D [A_i, B_i] updates, any float dtype.
        ns_coefficients (tuple): the quintic's (a, b, c). ns_steps (int): iterations. eps (float): norm floor.

    Returns:
        list[Tensor]: bf16 [A_i, B_i], in the order of ``blocks``. A single block goes through torch's
        own ``_zeropower_via_newtonschulz``; batched blocks agree with it to bf16 rounding (the batched
        GEMMs may round differently).

    Raises:
        ValueError: ns_steps not an int in [0, 100), ns_coefficients not three numbers, a block that is not a
            2-D tensor.
    """
    if not (isinstance(ns_steps, int) and not isinstance(ns_steps, bool) and 0 <= ns_steps < 100):
        raise ValueError(f"ns_steps must be an int in [0, 100), got {ns_steps!r}")
    for i, x in enumerate(blocks):
        if not (isinstance(x, torch.Tensor) and x.ndim == 2):
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"newton_schulz_blocks: blocks[{i}] must be a 2-D [A, B] tensor, got {got}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"ns_coefficients must be the quintic's 3 numbers (a, b, c), got {ns_coefficients!r}")
    if len(blocks) == 1:
        return [_zeropower_via_newtonschulz(blocks[0], ns_coefficients, ns_steps, eps)]
    a, b, c = ns_coefficients
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, x in enumerate(blocks):
        by_shape.setdefault(tuple(x.shape), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(blocks)
    for (A, B), idx in by_shape.items():
        X = torch.stack([blocks[i] for i in idx]).bfloat16()
        if A > B:
            X = X.transpose(1, 2)
        X = X / torch.linalg.vector_norm(X, dim=(1, 2), keepdim=True).clamp(min=eps)
        for _ in range(ns_steps):
            gram = torch.bmm(X, X.transpose(1, 2))
            X = torch.baddbmm(X, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), X, beta=a)
        if A > B:
            X = X.transpose(1, 2)
        for j, i in enumerate(idx):
            out[i] = X[j]
    return out


class PerHeadMuon(torch.optim.Optimizer):
    """Per-Head Muon and AdamW in one optimizer (K3 report, Sec. 2.5): one ``.state``, one
    ``state_dict()`` / ``load_state_dict()``, so ``torch.distributed.checkpoint`` saves and restores it
    (its ``get_optimizer_state_dict`` creates a fresh optimizer's lazy state with one lr = 0 step).

    Args:
        params: parameter groups (dicts); each has ``"algorithm"``: "muon" or "adamw". A Muon group may
            have ``"row_blocks"``: a list of row counts (one per head) for its single parameter; Muon
            parameters are 2-D [out, in] or 3-D stacks [E, a, b] (one matrix per expert). Use
            ``per_head_muon(model)`` to build them from a model.
        lr (float): learning rate of both algorithms (Muon's scaled per block, see the module docstring).
        weight_decay (float): decoupled weight decay (K3: 0.1).
        momentum (float): Muon's mu (0.95); nesterov (bool): Nesterov momentum (True).
        ns_steps (int): Newton-Schulz steps (5); ns_coefficients: the quintic's (a, b, c).
        eps (float): Newton-Schulz's norm floor (1e-7).
        betas (tuple[float, float]): AdamW's (0.9, 0.95); adamw_eps (float): AdamW's eps (1e-8).
        max_grad_norm (float | None): clip the global norm of the raw gradients to this before stepping
            (``grad_norm``: DTensor shards reduced over their meshes).

    Raises:
        ValueError: lr, weight_decay, momentum, betas, eps, adamw_eps, ns_steps, ns_coefficients or
            max_grad_norm out of range or not numbers, or nesterov not a bool, as defaults or in a param group;
            a group without a known ``"algorithm"``; a Muon parameter that is not 2-D or 3-D; row blocks that
            are not a list of positive ints summing to its rows (or set on a 3-D parameter, a group of several
            parameters or an AdamW group).

    The per-parameter state is Muon's ``momentum_buffer`` (float32 for low-precision parameters) and
    AdamW's ``step``, ``exp_avg``, ``exp_avg_sq`` (torch's names).
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, ns_coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                 betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 max_grad_norm: float | None = None):
        if max_grad_norm is not None and not (_is_number(max_grad_norm) and max_grad_norm > 0
                                              and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be None or a positive finite number, got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=ns_coefficients, eps=eps, betas=betas, adamw_eps=adamw_eps, row_blocks=None)
        _check_hyperparameters(defaults, "")
        defaults["ns_coefficients"], defaults["betas"] = tuple(ns_coefficients), tuple(betas)
        super().__init__(params, defaults)
        for i, group in enumerate(self.param_groups):
            _check_group(group, i)

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, with Muon's momentum restored in the dtype a fresh step
        gives it (float32 for a low-precision parameter; torch would cast it to the parameter's dtype).

        Raises:
            ValueError: before anything changes, when a saved group's keys differ from this optimizer's group,
                its hyperparameters fail the constructor's checks, its ``algorithm``, ``row_blocks`` or
                ``names`` differ (another model's layout), or a parameter's saved state is not the one its
                group's algorithm keeps (Muon: ``momentum_buffer``; AdamW: a 0-dim ``step``, ``exp_avg`` and
                ``exp_avg_sq``), each a floating tensor of its parameter's shape, or belongs to no parameter.
        """
        saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict must hold {len(self.param_groups)} param_groups (this optimizer's), got "
                             f"{len(saved_groups) if isinstance(saved_groups, list) else type(saved_groups).__name__}")
        params = {}
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            missing, extra = sorted(set(group) - set(saved)), sorted(set(saved) - set(group))
            if missing or extra:
                raise ValueError(f"param group {i}: the saved group lacks {missing} and has {extra} beyond this "
                                 f"optimizer's keys (a state dict of another optimizer)")
            for key in ("algorithm", "row_blocks", "names"):
                # A checkpoint may hold a tuple as a list.
                if _plain(saved.get(key)) != _plain(group.get(key)):
                    raise ValueError(f"param group {i}: the saved {key} {saved[key]!r} differs from this "
                                     f"optimizer's {group[key]!r} (a state dict of another model or grouping)")
            _check_group({**saved, "params": group["params"]}, i)
            # Saved ids map to parameters group by group, as torch maps them: ints from ``state_dict()``,
            # parameter names from torch.distributed.checkpoint's ``set_optimizer_state_dict``.
            params.update({index: (p, group["algorithm"]) for index, p in zip(saved["params"], group["params"])})
        saved_state = state_dict.get("state", {})
        if not isinstance(saved_state, dict):
            raise ValueError(f"state_dict['state'] must be a dict, got {type(saved_state).__name__}")
        for index, saved in saved_state.items():
            _check_state(index, saved, *params.get(index, (None, None)))
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            # A checkpoint may hold tuples as lists; the step keys its Newton-Schulz batches on them.
            group["ns_coefficients"], group["betas"] = tuple(group["ns_coefficients"]), tuple(group["betas"])
        # torch casts restored floating state to the parameter's dtype: Muon's momentum goes back to the dtype a
        # fresh step gives it (float32 for a low-precision parameter), from the saved tensor.
        for index, saved in saved_state.items():
            p, algorithm = params[index]
            if algorithm == "muon":
                buf = saved["momentum_buffer"]
                self.state[p]["momentum_buffer"] = buf.to(device=p.device, dtype=_momentum_dtype(p), copy=True)

    @torch.no_grad()
    def step(self, closure=None):
        """One step: clip the raw gradients (``max_grad_norm``), then Muon / AdamW per group.
        Parameters without a gradient are skipped (no state is created for them)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.max_grad_norm is not None:
            params = [p for g in self.param_groups for p in g["params"]]
            clip_grads_(params, self.max_grad_norm, grad_norm(params))
        muon = []
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                # An empty parameter (an expert stack of E = 0) has nothing to orthogonalise.
                muon += [(p, group) for p in group["params"] if p.grad is not None and p.numel() > 0]
            else:
                self._adamw(group)
        jobs = self._momentum(muon)
        # Newton-Schulz once for every block of every Muon parameter: blocks of one shape (the heads of
        # all layers' projections, the experts of all MoE layers) become one batched matmul per iteration.
        settings = {}
        for job in jobs:
            g = job[1]
            settings.setdefault((g["ns_coefficients"], g["ns_steps"], g["eps"]), []).append(job)
        # Then W <- (1 - lr wd) W - s U, one foreach call per (lr, wd, s) over all parameters: a per-parameter
        # loop would launch two small kernels per parameter (thousands per step on a K3 model).
        apply: dict[tuple, tuple[list, list]] = {}
        for (coefficients, steps, eps), group_jobs in settings.items():
            split = [self._blocks(p, update, group) for p, group, update in group_jobs]
            ns = newton_schulz_blocks([b for _, _, blocks in split for b in blocks], coefficients, steps, eps)
            for (p, group, _), (sharded, full, blocks) in zip(group_jobs, split):
                mine, ns = ns[:len(blocks)], ns[len(blocks):]
                target, update, scale = self._update(p, full, mine, sharded, group["lr"])
                targets, updates = apply.setdefault((group["lr"], group["weight_decay"], scale), ([], []))
                targets.append(target)
                updates.append(update)
        for (lr, wd, scale), (targets, updates) in apply.items():
            torch._foreach_mul_(targets, 1 - lr * wd)
            torch._foreach_add_(targets, updates, alpha=-scale)
        return loss

    def _momentum(self, muon: list) -> list:
        """Momentum for every (parameter, group) with a gradient, as foreach calls per (mu, nesterov, mesh);
        returns (p, group, update) jobs (``torch.optim.Muon``'s lerp form, module docstring)."""
        buckets: dict[tuple, list] = {}
        for p, group in muon:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=_momentum_dtype(p))
            buckets.setdefault((group["momentum"], group["nesterov"], _mesh_key(p)), []).append((p, group))
        jobs = []
        for (mu, nesterov, _), members in buckets.items():
            bufs = [self.state[p]["momentum_buffer"] for p, _ in members]
            # A restored buffer may differ in dtype from the gradient (float32 momentum, bf16 grads).
            grads = [p.grad.to(b.dtype) for (p, _), b in zip(members, bufs)]
            torch._foreach_lerp_(bufs, grads, 1 - mu)
            # Nesterov's lerp(grads, bufs, mu) as a mul and an add: DTensor registers only the in-place
            # _foreach_lerp_ (torch 2.11 raises on the out-of-place one for sharded gradients).
            updates = torch._foreach_add(torch._foreach_mul(grads, 1 - mu), bufs, alpha=mu) if nesterov else bufs
            jobs += [(p, group, u) for (p, group), u in zip(members, updates)]
        return jobs

    @staticmethod
    def _blocks(p, update, group) -> tuple[bool, torch.Tensor, list[torch.Tensor]]:
        """(sharded, the full logical update, its blocks): one per expert of a stack, one per head with
        row blocks, else the whole matrix. A DTensor's update is gathered to its full matrix."""
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:
            DTensor = None
        sharded = DTensor is not None and isinstance(p, DTensor)
        full = update.full_tensor() if sharded else update
        if p.ndim == 3:
            return sharded, full, list(full.unbind(0))
        if group["row_blocks"] is not None:
            return sharded, full, list(full.split(group["row_blocks"], dim=0))
        return sharded, full, [full]

    @staticmethod
    def _update(p, full, ns, sharded, lr) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(target, U, s) for W <- (1 - lr wd) W - s U on the tensor this rank holds: the orthogonalised
        blocks ``ns`` of ``_blocks`` reassembled over the full logical matrix with each block's
        ``adjusted_lr`` (factored out as s when the blocks share a shape, as heads and experts do; one
        block is exactly ``torch.optim.Muon``'s ``add_(O, alpha=-adjusted_lr)``), in the target's dtype."""
        shapes = {tuple(o.shape) for o in ns}
        if len(shapes) == 1:
            scale = adjusted_lr(lr, ns[0].shape)
            parts = ns
        else:
            scale = 1.0
            parts = [o.to(full.dtype) * adjusted_lr(lr, o.shape) for o in ns]
        step = parts[0].view_as(full) if len(parts) == 1 else (torch.stack(parts) if p.ndim == 3 else torch.cat(parts))
        if not sharded:
            return p, step.to(p.dtype), scale
        from torch.distributed.tensor import DTensor, Replicate  # noqa: PLC0415

        # Replicate -> the parameter's placements is a local slice (no communication).
        local = DTensor.from_local(step, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                   run_check=False).redistribute(p.device_mesh, p.placements).to_local()
        p_local = p.to_local()
        return p_local, local.to(p_local.dtype), scale

    def _adamw(self, group) -> None:
        # One foreach call per device mesh (DTensor foreach ops take tensors of one mesh).
        buckets: dict = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            b = buckets.setdefault(_mesh_key(p), ([], [], [], [], []))
            for lst, t in zip(b, (p, p.grad.to(state["exp_avg"].dtype), state["exp_avg"], state["exp_avg_sq"],
                                  state["step"])):
                lst.append(t)
        beta1, beta2 = group["betas"]
        for params, grads, exp_avgs, exp_avg_sqs, steps in buckets.values():
            _adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True, decoupled_weight_decay=True,
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=group["adamw_eps"], maximize=False)


def _check_group(group: dict, i: int) -> None:
    """ValueError unless param group ``i`` is one ``PerHeadMuon`` can step: its hyperparameters in range, a
    known algorithm, Muon parameters 2-D or 3-D, row blocks only on a Muon group's single 2-D parameter and
    summing to its rows."""
    _check_hyperparameters(group, f"param group {i}: ")
    if group.get("algorithm") not in ALGORITHMS:
        raise ValueError(f"param group {i} needs 'algorithm' in {ALGORITHMS}, got {group.get('algorithm')!r}")
    blocks = group["row_blocks"]
    if blocks is not None and group["algorithm"] != "muon":
        raise ValueError(f"param group {i}: row_blocks is for Muon groups (AdamW has no heads), got "
                         f"{blocks!r} in an AdamW group")
    if group["algorithm"] != "muon":
        return
    for p in group["params"]:
        if p.ndim not in (2, 3):
            raise ValueError(f"param group {i}: Muon takes 2-D or 3-D (stacked) parameters, got shape {list(p.shape)}")
    if blocks is not None:
        if len(group["params"]) != 1 or group["params"][0].ndim != 2:
            raise ValueError(f"param group {i}: row_blocks needs exactly one 2-D parameter")
        rows = group["params"][0].shape[0]
        if not (isinstance(blocks, (list, tuple))
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in blocks)
                and sum(blocks) == rows):
            raise ValueError(f"param group {i}: row_blocks must be a list of positive ints summing to "
                             f"the parameter's {rows} rows, got {blocks!r}")


def _momentum_dtype(p: torch.Tensor) -> torch.dtype:
    """Muon's momentum dtype for parameter ``p``: float32 for a low-precision parameter, else its own."""
    return torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype


STATE_KEYS = {"muon": {"momentum_buffer"}, "adamw": {"step", "exp_avg", "exp_avg_sq"}}


def _check_state(index, saved, p: torch.Tensor | None, algorithm: str | None) -> None:
    """ValueError unless ``saved`` is the state ``algorithm`` keeps for parameter ``p`` (saved id ``index``):
    its keys (``STATE_KEYS``), each a floating tensor of ``p``'s shape, AdamW's ``step`` 0-dim."""
    where = f"state of parameter {index!r}"
    if p is None:
        raise ValueError(f"{where}: no parameter of this optimizer has that id (a state dict of another model)")
    if not isinstance(saved, dict) or set(saved) != STATE_KEYS[algorithm]:
        got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{where}: a {algorithm} parameter keeps {sorted(STATE_KEYS[algorithm])}, got {got}")
    for name, t in saved.items():
        want = [] if name == "step" else list(p.shape)
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and list(t.shape) == want):
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} must be a floating tensor of shape {want}, got {got}")


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_hyperparameters(h: dict, where: str) -> None:
    """ValueError naming the first of ``h``'s hyperparameters (``PerHeadMuon``'s defaults or one param group)
    that is out of range, not a finite number, or of the wrong type."""
    for name, low, high, low_open in (("lr", 0, math.inf, False), ("weight_decay", 0, math.inf, False),
                                      ("momentum", 0, 1, False), ("eps", 0, math.inf, True),
                                      ("adamw_eps", 0, math.inf, True)):
        v = h[name]
        if not (_is_number(v) and math.isfinite(v) and (v > low if low_open else v >= low) and v < high):
            bounds = f"{'(' if low_open else '['}{low}, {high})"
            raise ValueError(f"{where}{name} must be a finite number in {bounds}, got {v!r}")
    if not isinstance(h["nesterov"], bool):
        raise ValueError(f"{where}nesterov must be a bool, got {h['nesterov']!r}")
    betas = h["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"{where}betas must be two numbers in [0, 1), got {betas!r}")
    if not (isinstance(h["ns_steps"], int) and not isinstance(h["ns_steps"], bool) and 1 <= h["ns_steps"] < 100):
        raise ValueError(f"{where}ns_steps must be an int in [1, 100), got {h['ns_steps']!r}")
    coefficients = h["ns_coefficients"]
    if not (isinstance(coefficients, (tuple, list)) and len(coefficients) == 3
            and all(_is_number(c) and math.isfinite(c) for c in coefficients)):
        raise ValueError(f"{where}ns_coefficients must be the quintic's 3 finite numbers (a, b, c), got {coefficients!r}")


def _mesh_key(p: torch.Tensor):
    """What foreach calls must not mix: a DTensor's device mesh (and placements), or a plain tensor's device."""
    mesh = getattr(p, "device_mesh", None)
    return (id(mesh), tuple(p.placements)) if mesh is not None else p.device


def _tensors(params, fn: str) -> list[torch.Tensor]:
    """``params`` as a list of tensors: one tensor becomes [it] (as in torch's clip_grad_norm_; iterating it
    would yield its rows, none of which has a gradient); anything else must be an iterable of tensors."""
    if isinstance(params, torch.Tensor):
        return [params]
    try:
        out = list(params)
    except TypeError:
        raise TypeError(f"{fn}: params must be a tensor or an iterable of tensors (e.g. model.parameters()), "
                        f"got {type(params).__name__}") from None
    for i, p in enumerate(out):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{fn}: params must be tensors (e.g. model.parameters(), not optimizer param groups), "
                            f"got {type(p).__name__} at position {i}")
    return out


def grad_norm(params, group=None) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params``, over every rank that holds a piece of them:

        ||g|| = sqrt(sum_p ||g_p||^2)

    DTensor gradients (FSDP shards, expert-parallel shards) are reduced over their own mesh, one foreach
    norm and one reduction per mesh, since a model under FSDP2 and EP holds gradients on two meshes; a plain
    gradient counts as a whole. Parameters without a gradient are skipped.

    Args:
        params (Tensor or iterable of Tensor): the parameters (any float dtype: each gradient's norm is
            accumulated in float32, so bf16 gradients give their exact norm, not one rounded to bf16; float64
            gradients in float64).
        group: a process group over whose ranks the squares are summed once more: pipeline stages, which
            hold disjoint parameters (None: no such sum).

    Returns:
        float32 0-dim tensor (float64 when a gradient is float64) on the first gradient's device (0 without
        gradients). No host synchronisation:
        the reduction stays on the device, so a training step can clip by it without a read-back.

    Raises:
        TypeError: ``params`` not a tensor or an iterable of tensors (e.g. optimizer param-group dicts).
    """
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    by_mesh: dict = {}
    device = None
    for p in _tensors(params, "grad_norm"):
        if p.grad is not None:
            device = p.grad.device if device is None else device
            # torch's get_total_norm returns a bf16 norm for bf16 gradients (3 significant digits): the
            # per-tensor norms are taken in float32 here instead (no float32 copy of the gradients), and in
            # float64 for float64 gradients (the foreach norm refuses to narrow them).
            dtype = torch.float64 if p.grad.dtype == torch.float64 else torch.float32
            by_mesh.setdefault((_mesh_key(p.grad), dtype), []).append(p.grad)
    squares = []
    for (_, dtype), grads in by_mesh.items():
        norms = torch._foreach_norm(grads, 2.0, dtype=dtype)
        n = torch.linalg.vector_norm(torch.stack(norms))
        if isinstance(n, DTensor):
            n = n.full_tensor()
        # Gradients on several devices (CPU-offloaded and GPU parameters): summed on the first's.
        squares.append(n.square().to(device))
    dtype = torch.float64 if any(s.dtype == torch.float64 for s in squares) else torch.float32
    total = torch.stack([s.to(dtype) for s in squares]).sum() if squares else torch.zeros((), device=device)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(total, group=group)
    return total.sqrt()


def clip_grads_(params, max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients of ``params`` in place by min(1, max_norm / (norm + 1e-6)) (``norm`` from
    ``grad_norm``): torch's ``clip_grads_with_norm_``, applied to DTensors' local shards mesh by mesh. A
    non-finite ``norm`` makes the gradients NaN, as in torch: the caller's loss check then stops the run.

    Raises:
        ValueError: ``max_norm`` not a positive finite number (a negative one would flip every gradient);
            ``norm`` not a 0-dim tensor.
        TypeError: ``params`` not a tensor or an iterable of tensors.
    """
    if not (_is_number(max_norm) and max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"clip_grads_: max_norm must be a positive finite number, got {max_norm!r}")
    if not (isinstance(norm, torch.Tensor) and norm.ndim == 0):
        got = f"shape {list(norm.shape)}" if isinstance(norm, torch.Tensor) else type(norm).__name__
        raise ValueError(f"clip_grads_: norm must be grad_norm's 0-dim tensor, got {got}")
    # detach: a norm that requires grad would otherwise give the gradients an autograd history.
    coef = (max_norm / (norm.detach() + 1e-6)).clamp(max=1.0)
    by_mesh: dict = {}
    for p in _tensors(params, "clip_grads_"):
        if p.grad is not None:
            g = p.grad
            by_mesh.setdefault((_mesh_key(g), g.dtype), []).append(local_shard(g))
    for grads in by_mesh.values():
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def per_head_muon(model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1, **kwargs) -> PerHeadMuon:
    """``PerHeadMuon`` over ``model``: one Muon group per Q/K/V projection (with its head row blocks),
    one Muon group for the other hidden matrices, AdamW groups for the rest (weight decay on 2-D
    tables such as the embedding and head, none on vectors).

    Args:
        model (nn.Module): e.g. a ``k3lab.model.K3Model`` or ``k3lab.lm.LM``.
        lr (float), weight_decay (float), **kwargs: ``PerHeadMuon``'s.

    Returns:
        PerHeadMuon; its groups carry ``"names"`` (the parameter names, for logs and tests).

    Raises:
        TypeError: model not an nn.Module (a list of parameters: build ``PerHeadMuon`` from groups instead).
        ValueError: what ``PerHeadMuon`` raises; a model without trainable parameters.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"per_head_muon: model must be an nn.Module (its parameter names choose the groups), "
                        f"got {type(model).__name__}")
    muon, adamw = split_params(model)
    if not muon and not adamw:
        raise ValueError("per_head_muon: the model has no trainable parameters")
    groups = [dict(params=[p], names=[n], algorithm="muon", row_blocks=blocks) for n, p, blocks in muon if blocks]
    rest = [(n, p) for n, p, blocks in muon if not blocks]
    if rest:
        groups.append(dict(params=[p for _, p in rest], names=[n for n, _ in rest], algorithm="muon"))
    decay = [(n, p) for n, p in adamw if p.ndim >= 2]
    no_decay = [(n, p) for n, p in adamw if p.ndim < 2]
    for members, wd in ((decay, weight_decay), (no_decay, 0.0)):
        if members:
            groups.append(dict(params=[p for _, p in members], names=[n for n, _ in members], algorithm="adamw",
                               weight_decay=wd))
    return PerHeadMuon(groups, lr=lr, weight_decay=weight_decay, **kwargs)


def muon_loop_reference(weight: torch.Tensor, blocks: list[int] | None, grads: list[torch.Tensor], lr: float,
                        weight_decay: float) -> torch.Tensor:
    """Per-Head Muon's reference: each row block of ``weight`` as its own ``torch.optim.Muon`` parameter
    (``adjust_lr_fn="match_rms_adamw"``), stepped once per gradient.

    Args:
        weight (Tensor): [rows, cols] float32 starting point (not modified).
        blocks (list[int] | None): row counts per head, summing to rows; None for one block.
        grads (list[Tensor]): one [rows, cols] gradient per step.
        lr (float), weight_decay (float): as for ``torch.optim.Muon``.

    Returns:
        Tensor [rows, cols]: the weight after ``len(grads)`` steps.
    """
    blocks = [weight.shape[0]] if blocks is None else blocks
    parts = [nn.Parameter(b.clone()) for b in weight.detach().split(blocks, dim=0)]
    opts = [torch.optim.Muon([q], lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw") for q in parts]
    for g in grads:
        for q, gb, opt in zip(parts, g.split(blocks, dim=0), opts):
            q.grad = gb.clone()
            opt.step()
    return torch.cat([q.detach() for q in parts])


def per_head_steps(weight: torch.Tensor, blocks: list[int] | None, grads: list[torch.Tensor], lr: float,
                   weight_decay: float) -> torch.Tensor:
    """``PerHeadMuon`` on one parameter with row blocks ``blocks``, stepped once per gradient: the fast
    path ``muon_loop_reference`` checks (same arguments and return)."""
    p = nn.Parameter(weight.detach().clone())
    opt = PerHeadMuon([dict(params=[p], algorithm="muon", row_blocks=blocks)], lr=lr, weight_decay=weight_decay)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def sharded_step_worker(rank: int, world_size: int, group, weight: torch.Tensor, grads: list[torch.Tensor],
                        row_blocks_options: list) -> list[torch.Tensor]:
    """A ``k3lab.dist.launch`` worker for the sharding test: for each row-block option (None or a list of
    row counts), ``weight`` [A, B] sharded by rows over the ranks as a DTensor takes one PerHeadMuon step
    per gradient in ``grads``; returns the full updated weights, one per option."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    out = []
    for row_blocks in row_blocks_options:
        p = nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
        opt = PerHeadMuon([dict(params=[p], algorithm="muon", row_blocks=row_blocks)], lr=0.01)
        for g in grads:
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            opt.step()
        out.append(p.full_tensor().detach())
    return out


def grad_norm_worker(rank: int, world_size: int, group, grads: list[torch.Tensor], max_norm: float) -> dict:
    """A ``k3lab.dist.launch`` worker for the clipping test on 4 ranks, laid out as the trainer's (pp, dp, ep)
    = (2, 1, 2) mesh: in pipeline stage s every gradient is ``grads[i] * (s + 1)``, held as under FSDP2 with
    EP: ``grads[0]`` sharded by rows over the flattened (dp, ep) batch mesh, ``grads[1]`` over the 2-D
    (dp, ep) expert mesh (columns over ep), ``grads[2]`` a plain tensor. The stages' squares are summed
    over the pp group. Returns the norm and the full clipped gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 1, world_size // 2), mesh_dim_names=("pp", "dp", "ep"))
    stage = mesh["pp"].get_local_rank()
    batch, experts = mesh["dp", "ep"]._flatten("batch"), mesh["dp", "ep"]
    mine = [g * (stage + 1) for g in grads]
    shards = [distribute_tensor(mine[0], batch, [Shard(0)]), distribute_tensor(mine[1], experts, [Shard(0), Shard(1)]),
              mine[2]]
    params = []
    for g in shards:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g
        params.append(p)
    norm = grad_norm(params, mesh["pp"].get_group())
    clip_grads_(params, max_norm, norm)
    full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    return dict(stage=stage, norm=norm, grads=full)
