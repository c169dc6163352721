"""Autocast lookups and the input checks shared by the layers (``MoE``, ``GatedMLA``, ``BlockAttnRes``, KDA).

A layer whose parameters are in one dtype takes input in that dtype, or in any of float32/bfloat16/float16
while ``torch.autocast`` is on for the input's device (autocast then casts both sides of each matmul; it
leaves float64 alone). Anything else used to fail deep inside a matmul with torch's "expected m1 and m2 to
have the same dtype"; ``check_input_dtype`` says which argument and what to do before any work is done.
Both read only dtypes and autocast state: no host synchronisation.
"""
from __future__ import annotations

import torch

# The dtypes autocast casts between; float64 tensors pass through it unchanged.
AUTOCAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def shape_of(x) -> str:
    """A tensor's shape as "[B, T, ...]" for error messages; "None", or the type name of anything else."""
    if x is None:
        return "None"
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def widen(x: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 -> float32; float32 and float64 unchanged (where a layer computes in at least float32)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """autocast's dtype on ``device_type`` ("cpu", "cuda", ...) when autocast is on there, else None.

    The meta device has no autocast (torch's lookup raises for it): None there, so a forward on meta
    tensors propagates the parameters' dtype.
    """
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def check_input_dtype(who: str, name: str, x: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse an input ``x`` whose dtype differs from the module's parameter ``dtype`` outside autocast.

    Args:
        who (str): the module, for the message ("MoE"). name (str): the argument ("x", "h0").
        x (Tensor): the input, any shape. dtype (torch.dtype): the module's parameter dtype.

    Raises:
        ValueError: ``x`` is not floating point (token ids, a mask: the remedies below would suggest casting
            the module to an integer dtype); ``x.dtype != dtype`` and autocast is off on x's device, or either
            dtype is one autocast does not cast (float64): names both dtypes and the two remedies
            (``torch.autocast`` or ``.to``).
    """
    if not x.is_floating_point():
        raise ValueError(f"{who}: {name} must be a floating-point tensor (the module's parameters are {dtype}), "
                         f"got {x.dtype}")
    if x.dtype == dtype:
        return
    if autocast_dtype(x.device.type) is not None and x.dtype in AUTOCAST_DTYPES and dtype in AUTOCAST_DTYPES:
        return
    raise ValueError(f"{who}: {name} is {x.dtype} but the module's parameters are {dtype}; run it under "
                     f"torch.autocast (float32/bfloat16/float16) or make them agree with .to(dtype): "
                     f"{name}.to({dtype}) or module.to({x.dtype})")
