"""``BlockAttnRes`` and ``AttnRes``: drop-in replacements for the residual stream of ``k3lab.lm.LM``.

Both follow the residual interface ``forward(h0 [B, T, d], sublayers) -> [B, T, d]`` (each sublayer
applies its own pre-norm and returns its output). Three paths compute the same function:

- "naive": ``naive_block_attnres``, autograd through the formula (stacks every read's sources and
  keeps them for backward: O(L N d) saved per token).
- "memory" (training default): ``block_attnres_train``, two-phase: once per block, one pass over
  the completed blocks gives every sublayer's inter-block part; each sublayer merges it with its
  partial sum; backward recomputes the inter-block parts and the sublayers' inputs and runs two
  batched passes per block over the blocks. Saved activations match the standard residual's up to
  the block buffer (N + 1 vectors per token), 4 bytes per token per sublayer (the lse) and the
  logits table (4 (L + 1)(N + 1) bytes per token).
- "inference" (default under ``torch.no_grad``): ``block_attnres_inference`` (two-phase, online softmax).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from k3lab.attnres.inference import block_attnres_inference
from k3lab.attnres.mix import BACKENDS
from k3lab.attnres.naive import block_sizes, check_eps, naive_block_attnres
from k3lab.attnres.train import block_attnres_train, check_buffer_dtype
from k3lab.precision import check_input_dtype

PATHS = ("auto", "naive", "memory", "inference")


class BlockAttnRes(nn.Module):
    """Block Attention Residuals (AttnRes paper, Sec. 3.2; K3 report, Sec. 2).

    The L sublayers are cut into N consecutive blocks (``naive.block_sizes``: as even as possible, or
    the sizes given). Sublayer l reads
    softmax-over-depth weighted sums of [b_0 = h0, completed blocks, partial sum of its own block];
    the output aggregates [b_0, ..., b_N] with a last query. Pseudo-queries are zero-initialised, so
    at init every read is the uniform average of its sources.

    Args:
        d_model (int): d.
        n_sublayers (int): L (for ``k3lab.lm.LM``: 2 * n_layers).
        n_blocks (int | list[int]): N in [1, L] (N = L is full AttnRes), or the N block sizes, positive
            ints summing to L (K3: 12 layers = 24 sublayers per block, the last one partial).
        eps (float): RMSNorm eps of the keys.
        path (str): "auto" (memory when autograd records, inference otherwise), "naive", "memory"
            or "inference".
        backend (str | None): mixing backend of the memory path, "torch" or "triton" (on a CPU only
            under TRITON_INTERPRET=1, i.e. after ``k3lab.setup()``); None picks "triton" for CUDA
            inputs and "torch" otherwise. The Triton kernels compute in float32: float64 inputs get
            float32 accuracy there (about 1e-6), "torch" keeps float64.
        recompute_input (bool): memory path: rebuild each sublayer's saved input h_l in backward
            (default) instead of keeping it (one more d-vector per token per sublayer, no recompute).
            Under ``torch.compile`` the inputs are kept: compile does not carry the saved-tensor
            hooks that rebuild them (with them, h0's gradient was lost).
            The memory path is differentiable once (a backward with ``create_graph=True`` raises
            RuntimeError): second-order gradients need path="naive".
        buffer_dtype (torch.dtype | None): memory path: storage dtype of the block buffer, default
            h0's; ``torch.bfloat16`` halves the bytes phase 1 moves (blocks are rounded to bf16
            when stored; sums, softmax and the partial sum stay in h0's dtype / float32).

    Attributes:
        queries (Parameter): [L + 1, d] float32, zeros at init; row L is the final aggregation's.
        sizes (list[int]): the N block sizes; n_blocks (int): N.

    Raises:
        ValueError: N < 1 or N > L, block sizes that are not positive ints summing to L, bad d/L, unknown path or backend, eps not finite and > 0,
            recompute_input not a bool, a non-float buffer_dtype; in forward, h0 not a floating-point [B, T, d]
            with d = d_model, h0 not in the queries' dtype outside autocast
            (``k3lab.precision.check_input_dtype``), len(sublayers) != L, or a sublayer returning anything but a tensor of
            h0's shape.
        RuntimeError: path="inference" called while autograd records and h0 or the queries require grad
            (that path records no gradients: a model trained through it would learn nothing).

    Example:
        >>> from torch import nn
        >>> res = BlockAttnRes(d_model=64, n_sublayers=8, n_blocks=4)
        >>> sublayers = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))
        >>> res(torch.randn(2, 10, 64), sublayers).shape
        torch.Size([2, 10, 64])
    """

    def __init__(self, d_model: int, n_sublayers: int, n_blocks, eps: float = 1e-6,
                 path: str = "auto", backend: str | None = None, recompute_input: bool = True,
                 buffer_dtype: torch.dtype | None = None):
        super().__init__()
        if not (isinstance(d_model, int) and not isinstance(d_model, bool) and d_model >= 1):
            raise ValueError(f"d_model must be a positive int, got {d_model!r}")
        if not isinstance(recompute_input, bool):
            raise ValueError(f"recompute_input must be a bool, got {recompute_input!r}")
        self.sizes = block_sizes(n_sublayers, n_blocks)
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
        check_eps(eps)
        check_buffer_dtype(buffer_dtype)
        self.d_model, self.n_sublayers, self.n_blocks, self.eps = d_model, n_sublayers, len(self.sizes), eps
        self.path, self.backend, self.recompute_input = path, backend, recompute_input
        self.buffer_dtype = buffer_dtype
        # The training path's NaN/inf check of h0 and the queries (one host sync per call); a trainer that
        # checks its inputs once turns it off (``K3Model.value_checks``).
        self.check_values = True
        self.queries = nn.Parameter(torch.zeros(n_sublayers + 1, d_model))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_sublayers={self.n_sublayers}, n_blocks={self.n_blocks}, "
                f"sizes={self.sizes}, path={self.path}")

    def _check_call(self, h0: torch.Tensor, sublayers) -> None:
        if not isinstance(h0, torch.Tensor) or h0.ndim != 3 or h0.shape[-1] != self.d_model:
            got = list(h0.shape) if isinstance(h0, torch.Tensor) else type(h0).__name__
            raise ValueError(f"h0 must be a [B, T, d={self.d_model}] tensor, got {got}")
        # The queries' dtype stands for the model's: outside autocast a mismatched h0 failed in the
        # first sublayer's matmul.
        check_input_dtype("BlockAttnRes", "h0", h0, self.queries.dtype)
        if len(sublayers) != self.n_sublayers:
            raise ValueError(f"expected {self.n_sublayers} sublayers, got {len(sublayers)}")

    def forward(self, h0: torch.Tensor, sublayers) -> torch.Tensor:
        self._check_call(h0, sublayers)
        path = self.path
        if path == "auto":
            path = "memory" if torch.is_grad_enabled() else "inference"
        elif path == "inference" and torch.is_grad_enabled() and (h0.requires_grad or self.queries.requires_grad):
            raise RuntimeError("path='inference' records no gradients: run it under torch.no_grad() or "
                               "torch.inference_mode(), or train with path='auto' or 'memory'")
        if path == "naive":
            return naive_block_attnres(h0, sublayers, self.queries, self.sizes, self.eps,
                                       check_values=self.check_values)
        if path == "inference":
            return block_attnres_inference(h0, sublayers, self.queries, self.sizes, self.eps,
                                           check_values=self.check_values)
        return block_attnres_train(h0, sublayers, self.queries, self.sizes, self.eps,
                                   self.backend or ("triton" if h0.is_cuda else "torch"), self.recompute_input,
                                   self.buffer_dtype, check_values=self.check_values)

    @torch.no_grad()
    def depth_weights(self, h0: torch.Tensor, sublayers) -> torch.Tensor:
        """Mean depth weights of every read on this input, for heatmaps.

        Returns:
            Tensor: [L + 1, N + 2] float32 on the CPU; row l holds sublayer l's weights over
            [b_0, ..., b_{n-1}] in the first n columns and its partial sum's weight in the last column
            (NaN where a read has no such source); row L is the final aggregation over b_0..b_N.
        """
        self._check_call(h0, sublayers)
        _, weights = naive_block_attnres(h0, sublayers, self.queries, self.sizes, self.eps, return_weights=True)
        out = torch.full((self.n_sublayers + 1, self.n_blocks + 2), float("nan"))
        layer = 0
        for n, size in enumerate(self.sizes, start=1):
            for k in range(size):
                out[layer, :n] = weights[layer][:n].cpu()
                if k > 0:
                    out[layer, -1] = weights[layer][n].cpu()
                layer += 1
        out[-1, : self.n_blocks + 1] = weights[-1].cpu()
        return out


class AttnRes(BlockAttnRes):
    """Full Attention Residuals (AttnRes paper, Sec. 3.1): sublayer l reads [h0, v_1, ..., v_l].

    Exactly ``BlockAttnRes`` with one sublayer per block (N = L); tested against ``naive_attnres``,
    the formula written out separately.

    Args:
        d_model (int), n_sublayers (int), eps (float), path (str), backend (str | None),
        recompute_input (bool), buffer_dtype (torch.dtype | None): as in ``BlockAttnRes``.
    """

    def __init__(self, d_model: int, n_sublayers: int, eps: float = 1e-6, path: str = "auto",
                 backend: str | None = None, recompute_input: bool = True, buffer_dtype: torch.dtype | None = None):
        super().__init__(d_model, n_sublayers, n_sublayers, eps=eps, path=path, backend=backend,
                         recompute_input=recompute_input, buffer_dtype=buffer_dtype)

