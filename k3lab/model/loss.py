"""The head and its cross-entropy in chunks of rows, without the [N, V] logits (Liger-Kernel's fused linear
cross-entropy, in PyTorch).

For hidden states h [N, d], the head's weight W [V, d] and targets t [N] (``ignore_index`` not counted):

    z_i    = W h_i                                   logits of row i, [V]
    loss   = 1/n * sum_{i counted} (logsumexp(z_i) - z_{i, t_i})          n = #counted rows (at least 1)
    g_i    = (softmax(z_i) - onehot(t_i)) / n        (0 for a row not counted)  = dloss/dz_i
    dh_i   = W^T g_i,        dW = sum_i g_i h_i^T

The forward runs over row chunks of ``chunk`` rows: each chunk's logits [chunk, V] are made, give their
share of the loss and their g, and g goes at once into dh and dW, so the full logits never exist. At K3's
vocabulary (V = 163,840) one micro-batch of 16 x 2048 tokens has logits of 5.4 G numbers: 21 GB in
float32, written and read about ten times by the plain head + ``F.cross_entropy`` (the float32 copy, the
log-softmax, its gradient, the cast back). The backward only scales the saved dh and dW by the incoming
gradient (the loss is a scalar, so that is exact), so the head's matmuls are not run twice.

The elementwise work on a chunk (log-softmax, the gather, exp, the one-hot and the scale) is one function
of the chunk's logits; ``compiled=True`` runs it under ``torch.compile``, which fuses it into a reduction
and one pass that writes g: about 6 bytes a logit in bf16 instead of about 40.
"""
from __future__ import annotations

import torch

from k3lab.autograd import differentiable_once

#: Logits per chunk (rows x V): 2^29 numbers, 1 GB in bf16 and 2 GB in float32 per temporary. At V = 163,840 that
#: is 3,276 rows: dh = g W of a chunk is a [rows, V] x [V, d] product whose output has only rows x d entries, and
#: fewer rows leave it too few output tiles to fill the GPU.
CHUNK_NUMBERS = 1 << 29


def _ce_chunk(z: torch.Tensor, t: torch.Tensor, scale: torch.Tensor, ignore_index: int):
    """(sum of the counted rows' -log softmax(z)[t], g = (softmax(z) - onehot(t)) * scale in z's dtype, 0
    on rows not counted) for one chunk's logits z [C, V] and targets t [C]; the log-softmax in float32 at
    least."""
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(z, dim=-1, dtype=acc)
    valid = t != ignore_index
    idx = torch.where(valid, t, 0).unsqueeze(1)
    nll = (-logp.gather(1, idx).squeeze(1) * valid).sum()
    # In place: eager, each float32 [C, V] temporary is a write and a read of 4 bytes a logit.
    g = logp.exp_().scatter_add_(1, idx, -valid.unsqueeze(1).to(acc)).mul_(valid.unsqueeze(1) * scale)
    return nll, g.to(z.dtype)


_compiled_chunk = None


def _chunk_fn(compiled: bool):
    global _compiled_chunk
    # Inside a caller's torch.compile the chunk is traced into that graph; a nested compiled function there
    # failed in dynamo ("an intermediate tensor 'dw' ... aliases an input or output").
    if not compiled or torch.compiler.is_compiling():
        return _ce_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_ce_chunk, dynamic=False)
    return _compiled_chunk


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, dtype, ignore_index, chunk, compiled, grad_enabled):
        N = h.shape[0]
        # needs_input_grad follows requires_grad even under no_grad, where no backward will run.
        need_h, need_w = (grad_enabled and n for n in ctx.needs_input_grad[:2])
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            count = (targets != ignore_index).sum().clamp(min=1)
            scale = 1.0 / count.to(torch.float64 if dtype == torch.float64 else torch.float32)
            fn = _chunk_fn(compiled)
            loss = torch.zeros((), dtype=scale.dtype, device=h.device)
            dh = torch.empty_like(h) if need_h else None
            dw = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if need_w else None
            for s in range(0, N, chunk):
                hc = h[s:s + chunk].to(dtype)
                nll, g = fn(hc @ w.t(), targets[s:s + chunk], scale, ignore_index)
                loss = loss + nll
                if need_h:
                    dh[s:s + chunk] = g @ w
                if need_w:
                    dw += g.t() @ hc
        ctx.weight_dtype = weight.dtype
        # h and weight are saved only so that differentiating a create_graph=True gradient raises
        # (differentiable_once): dh and dw were made in the forward and have no second-order terms. That keeps
        # h alive until the backward, as F.linear of the plain head does: N x d, beside the saved dh of that size.
        ctx.save_for_backward(dh, dw, h if need_h else None, weight if need_w else None)
        return loss * scale

    @staticmethod
    @differentiable_once
    def backward(ctx, grad):
        dh, dw, _, _ = ctx.saved_tensors
        dh = None if dh is None else dh * grad.to(dh.dtype)
        dw = None if dw is None else (dw * grad.to(dw.dtype)).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                         chunk: int | None = None, compiled: bool = False) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h @ weight.T`` against ``targets`` without forming the logits (module
    docstring): equal to ``F.cross_entropy((h @ weight.T).float(), targets, ignore_index=ignore_index)`` and its
    gradients, except that a batch with no counted target gives 0, not NaN, and that a NaN or inf in a row not
    counted makes the loss NaN (``F.cross_entropy``'s loss skips that row; its gradients are NaN either way).

    Under autocast on h's device the matmuls run in the autocast dtype (weight cast once per call), the
    log-softmax in float32; otherwise, and for float64 h (which autocast leaves alone), in h's dtype (float32 or
    float64 end to end).

    Args:
        h (Tensor): [N, d] hidden states (float), the head's input.
        weight (Tensor): [V, d], the head's weight, same device; its gradient is accumulated in float32 (or
            float64) over the chunks and returned in weight's dtype.
        targets (Tensor): [N] integer class ids in [0, V), or ``ignore_index`` (not counted).
        ignore_index (int): the id of rows that do not count.
        chunk (int | None): rows per chunk, >= 1; None: ``CHUNK_NUMBERS // V`` (at least 1).
        compiled (bool): run each chunk's elementwise part under ``torch.compile`` (fused).

    Returns:
        Tensor: scalar, float32 (float64 for float64 inputs), the mean over the counted rows.

    Raises:
        ValueError: h not [N, d] floating, weight not [V, d] with h's d, dtype or device, targets not [N]
            integer, chunk < 1, ignore_index not an int, compiled not a bool.
        RuntimeError: on differentiating a gradient taken with ``create_graph=True`` (no second derivatives).

    Targets are not range-checked here (that is a host sync; ``K3Model`` checks them with its value checks):
    an id outside [0, V) other than ``ignore_index`` fails in ``gather`` on a CPU and is undefined on a GPU.
    """
    if not (isinstance(h, torch.Tensor) and h.ndim == 2 and h.is_floating_point()):
        raise ValueError(f"h must be a floating [N, d] tensor, got "
                         f"{(h.dtype, list(h.shape)) if isinstance(h, torch.Tensor) else type(h).__name__}")
    dev = h.device.type
    # Autocast leaves float64 alone, as it does for the plain head.
    autocast = torch.is_autocast_enabled(dev) and h.dtype != torch.float64
    if not (isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.shape[1] == h.shape[1]
            and (weight.dtype == h.dtype or autocast and weight.is_floating_point())):
        raise ValueError(f"weight must be [V, {h.shape[1]}] in h's dtype {h.dtype} (any float dtype under autocast, "
                         f"unless h is float64), "
                         f"got {(weight.dtype, list(weight.shape)) if isinstance(weight, torch.Tensor) else weight!r}")
    if weight.device != h.device:
        raise ValueError(f"weight is on {weight.device}, h on {h.device}")
    if not (isinstance(targets, torch.Tensor) and targets.shape == h.shape[:1] and not targets.is_floating_point()
            and not targets.is_complex() and targets.dtype != torch.bool):
        raise ValueError(f"targets must be integer [N={h.shape[0]}], got "
                         f"{(targets.dtype, list(targets.shape)) if isinstance(targets, torch.Tensor) else targets!r}")
    V = weight.shape[0]
    if chunk is None:
        chunk = max(1, CHUNK_NUMBERS // V)
    if not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1):
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if not isinstance(compiled, bool):
        raise ValueError(f"compiled must be a bool, got {compiled!r}")
    dtype = torch.get_autocast_dtype(dev) if autocast else h.dtype
    return _LinearCrossEntropy.apply(h, weight, targets.long(), dtype, ignore_index, chunk, compiled,
                                     torch.is_grad_enabled())
