"""A reference shared by the AttnRes test files."""
from __future__ import annotations

import torch
import torch.nn as nn

from k3lab.attnres import block_sizes


class DoublesItsInput(nn.Module):
    """A sublayer that doubles its input in place, then applies ``inner`` to it."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, h):
        return self.inner(h.mul_(2))


def uniform_block_average(h0: torch.Tensor, sublayers, n_blocks: int) -> torch.Tensor:
    """Block AttnRes with every pseudo-query zero, written without softmax: each read is the plain
    mean of its sources (completed blocks and the running partial sum), the output the mean of all
    blocks. h0 [B, T, d] -> [B, T, d]."""
    blocks, layer = [h0], 0
    for size in block_sizes(len(sublayers), n_blocks):
        partial = None
        for _ in range(size):
            sources = blocks + ([partial] if partial is not None else [])
            v = sublayers[layer](sum(sources) / len(sources))
            partial = v if partial is None else partial + v
            layer += 1
        blocks.append(partial)
    return sum(blocks) / len(blocks)
