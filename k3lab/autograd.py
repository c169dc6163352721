"""``differentiable_once``: the backward decorator of k3lab's fused autograd functions."""
from __future__ import annotations

import functools

import torch


class _RefuseSecondDerivative(torch.autograd.Function):
    """Passes its first ``n`` inputs through; the others only connect it to the graph. Differentiating
    through it raises."""

    @staticmethod
    def forward(ctx, name, n, *xs):
        ctx.name = name
        return tuple(x.view_as(x) for x in xs[:n])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(f"trying to differentiate twice {ctx.name}, which is differentiable once (its "
                           "backward is fused kernels or writes shared buffers in place); take second "
                           "derivatives through the naive reference instead")


def differentiable_once(backward):
    """Decorate an ``autograd.Function.backward`` that autograd cannot differentiate.

    The backward runs without recording. Under ``create_graph=True`` its gradients are returned as
    they are for first-order use, but marked so that differentiating them raises RuntimeError
    ("trying to differentiate twice ..."): they hang from a node that depends on the function's saved
    tensors that require grad, so ``autograd.grad(..., inputs)`` meets it too (a function that saves
    none, like the AttnRes memory path's, leaves ``autograd.grad`` to report its inputs unused). torch's
    ``once_differentiable`` marks them only when an incoming gradient requires grad, and from detached
    leaves: for ``grad((o * w).sum(), v, create_graph=True)`` with a constant w, a second derivative
    through the result silently missed this function's terms.
    """

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            out = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return out
        many = isinstance(out, tuple)
        outs = list(out) if many else [out]
        present = [i for i, x in enumerate(outs) if isinstance(x, torch.Tensor)]
        sources = [x for x in ctx.saved_tensors if isinstance(x, torch.Tensor) and x.requires_grad]
        name = type(ctx).__name__.removesuffix("Backward")
        marked = _RefuseSecondDerivative.apply(
            name, len(present), *(outs[i].detach().requires_grad_() for i in present), *sources)
        for i, x in zip(present, marked):
            outs[i] = x
        return tuple(outs) if many else outs[0]

    return wrapper
