"""``gather_sum``: out[n] = sum_k weight[n, k] * y[idx[n, k]], one Triton kernel (the MoE's combine, and its
dispatch's backward with no weight).

Each program owns a tile of tokens and channels and walks the K indices of its tokens: one row load of y per
(token, k), the weighted sum kept in float32 registers, one store. Torch's forms are a gather writing all N*K
rows and a reduction reading them back; under ``torch.compile`` inductor fuses them into one kernel that still
loads an index per element. Registered as the custom op ``k3lab::gather_sum`` (a fake kernel for tracing), so a
compiled region calls it in place rather than breaking its graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.kernels import interpreting

BN, BD, WARPS = 16, 128, 4


@triton.jit
def gather_sum_kernel(y, idx, w, out, N, D, K: tl.constexpr, HAS_W: tl.constexpr, BN: tl.constexpr,
                      BD: tl.constexpr):
    # y: [P, D] contiguous; idx: [N, K] int64 contiguous (rows of y); w: [N, K] float32 (unused without HAS_W);
    # out: [N, D] contiguous, y's dtype.
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_d = i_d * BD + tl.arange(0, BD)
    m_n = o_n < N
    m_nd = m_n[:, None] & (o_d < D)[None, :]
    b_acc = tl.zeros([BN, BD], dtype=tl.float32)
    for k in tl.static_range(K):
        b_i = tl.load(idx + o_n.to(tl.int64) * K + k, mask=m_n, other=0)
        b_y = tl.load(y + b_i[:, None] * D + o_d[None, :], mask=m_nd, other=0.0).to(tl.float32)
        if HAS_W:
            b_w = tl.load(w + o_n.to(tl.int64) * K + k, mask=m_n, other=0.0).to(tl.float32)
            b_acc += b_w[:, None] * b_y
        else:
            b_acc += b_y
    tl.store(out + o_n.to(tl.int64)[:, None] * D + o_d[None, :], b_acc.to(out.dtype.element_ty), mask=m_nd)


def gather_sum_torch(y: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """The same sum in PyTorch (float32 accumulation for 16-bit y), for a CPU without the interpreter."""
    N, K = idx.shape
    rows = y.index_select(0, idx.reshape(-1)).view(N, K, y.shape[1])
    wide = rows.float() if rows.dtype in (torch.bfloat16, torch.float16) else rows
    if weight is not None:
        wide = wide * weight.to(wide.dtype).unsqueeze(-1)
    out = wide.sum(1)
    # No same-dtype .to() at the end: returned from an autograd.Function's forward under torch.compile, torch
    # 2.11 gave that alias zero gradients (the MoE's routed experts and router learned nothing on a CPU).
    return out if out.dtype == y.dtype else out.to(y.dtype)


@torch.library.custom_op("k3lab::gather_sum", mutates_args=())
def _gather_sum_op(y: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    # float64 stays in PyTorch: the kernel accumulates in float32.
    if not (y.is_cuda or interpreting()) or y.dtype == torch.float64:
        return gather_sum_torch(y, idx, weight)
    y, idx = y.contiguous(), idx.contiguous()
    N, K = idx.shape
    out = y.new_empty(N, y.shape[1])
    if out.numel():
        w = weight.float().contiguous() if weight is not None else y  # y stands in: never read without HAS_W
        gather_sum_kernel[(triton.cdiv(N, BN), triton.cdiv(y.shape[1], BD))](
            y, idx, w, out, N, y.shape[1], K=K, HAS_W=weight is not None, BN=BN, BD=BD, num_warps=WARPS)
    return out


@_gather_sum_op.register_fake
def _(y, idx, weight):
    return y.new_empty(idx.shape[0], y.shape[1])


def gather_sum(y: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """out[n] = sum_k weight[n, k] * y[idx[n, k]] (weight 1 when None), accumulated in float32.

    Args:
        y (Tensor): [P, D] float32/bfloat16/float16 rows.
        idx (Tensor): [N, K] int64 row ids in [0, P) (not checked: a host sync).
        weight (Tensor | None): [N, K] floating weights.

    Returns:
        Tensor [N, D] in y's dtype (float64 y: summed in PyTorch in float64; otherwise in float32, by the kernel on
        a GPU or under TRITON_INTERPRET=1). Not differentiable itself: ``k3lab.moe.experts`` gives it a backward.

    Raises:
        ValueError: shapes or dtypes other than the above.
    """
    if not isinstance(y, torch.Tensor) or y.ndim != 2 or not y.is_floating_point():
        raise ValueError(f"gather_sum: y must be a floating-point [P, D] tensor, got "
                         f"{list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
    if not isinstance(idx, torch.Tensor) or idx.ndim != 2 or idx.dtype != torch.int64:
        raise ValueError(f"gather_sum: idx must be int64 [N, K], got "
                         f"{f'{list(idx.shape)} {idx.dtype}' if isinstance(idx, torch.Tensor) else type(idx).__name__}")
    if weight is not None and (not isinstance(weight, torch.Tensor) or weight.shape != idx.shape
                               or not weight.is_floating_point()):
        raise ValueError(f"gather_sum: weight must be a floating-point tensor of idx's shape {list(idx.shape)}, got "
                         f"{list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    return _gather_sum_op(y, idx, weight)
