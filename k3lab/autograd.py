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


def differentiable_once(backward=None, *, create_graph: bool = True):
    """Decorate an ``autograd.Function.backward`` that autograd cannot differentiate.

    The backward runs without recording. Under ``create_graph=True`` its gradients are returned as
    they are for first-order use, but marked so that differentiating them raises RuntimeError
    ("trying to differentiate twice ..."): they hang from a node that depends on the function's saved
    tensors that require grad, so ``autograd.grad(..., inputs)`` meets it too. torch's
    ``once_differentiable`` marks them only when an incoming gradient requires grad, and from detached
    leaves: for ``grad((o * w).sum(), v, create_graph=True)`` with a constant w, a second derivative
    through the result silently missed this function's terms.

    A function that saves none of the tensors its gradients depend on (the AttnRes memory path's, which
    keep buffers instead) has nothing to hang the mark from: a second derivative with respect to its
    inputs would silently miss its terms (a penalty on dh0 gave dW 0 where the naive path gives 12.5).
    Decorated with ``create_graph=False``, its backward raises RuntimeError under ``create_graph=True``
    instead ("... does not support create_graph=True ...").

    Usable as ``@differentiable_once`` or ``@differentiable_once(create_graph=False)``.
    """
    if backward is None:
        return functools.partial(differentiable_once, create_graph=create_graph)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        name = type(ctx).__name__.removesuffix("Backward")
        if not create_graph and torch.is_grad_enabled():
            raise RuntimeError(f"{name} does not support create_graph=True: it is differentiable once and keeps no "
                               "tensors to mark its gradients with, so their second-order terms would be missing; "
                               "take gradients for second-order use through the naive reference instead")
        with torch.no_grad():
            out = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return out
        many = isinstance(out, tuple)
        outs = list(out) if many else [out]
        present = [i for i, x in enumerate(outs) if isinstance(x, torch.Tensor)]
        sources = [x for x in ctx.saved_tensors if isinstance(x, torch.Tensor) and x.requires_grad]
        marked = _RefuseSecondDerivative.apply(
            name, len(present), *(outs[i].detach().requires_grad_() for i in present), *sources)
        for i, x in zip(present, marked):
            outs[i] = x
        return tuple(outs) if many else outs[0]

    return wrapper
