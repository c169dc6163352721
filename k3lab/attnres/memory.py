"""How much activation memory a forward pass leaves alive for backward, on any device (CPU too).

``torch.cuda.max_memory_allocated`` answers this on a GPU; on the CPU there is no allocator
counter, so ``retained_bytes`` watches every tensor storage created while ``fn`` runs (through a
``TorchDispatchMode``) and sums the bytes of those still alive when it returns: what the autograd
graph saved, plus ``fn``'s outputs.
"""
from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StorageWatcher(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: dict[int, tuple[weakref.ref, int]] = {}
        self.older: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A storage first met as an input existed before the call (a parameter, an input, or a
        # view of one): remember it so that views of it are never counted as new.
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                key = s.data_ptr()
                if key not in self.seen or self.seen[key][0]() is None:
                    self.seen.pop(key, None)
                    self.older[key] = weakref.ref(s)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                key = s.data_ptr()
                if key in self.older and self.older[key]() is not None:
                    continue
                if key not in self.seen or self.seen[key][0]() is None:
                    self.seen[key] = (weakref.ref(s), s.nbytes())
        return out


def retained_bytes(fn) -> tuple[object, int]:
    """Run ``fn()`` and measure the memory it leaves alive.

    Args:
        fn (callable): no arguments; typically ``lambda: model(x, y)[1]`` (a forward with autograd).

    Returns:
        (result, bytes): ``fn()``'s result and the total bytes of tensor storages created during the
        call that are still alive afterwards (saved activations plus the result). Storages that
        existed before (parameters, inputs) are not counted.
    """
    watcher = _StorageWatcher()
    with watcher:
        result = fn()
    gc.collect()
    alive = sum(nbytes for ref, nbytes in watcher.seen.values() if ref() is not None)
    return result, alive
