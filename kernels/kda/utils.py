"""Small Triton helpers shared by the FlashKDA kernels, and the host-side chunk index.

Layout: every per-token tensor is flattened to [T_total, heads, D] (B sequences of length T become one
packed stream with offsets b*T), so fixed-length and varlen inputs share one code path.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from k3lab.kernels import interpreting

# Chunk length C and sub-tile length: 16 is the smallest tl.dot tile and the span over which the
# lower-bounded gate keeps 1/Gamma (relative to the sub-tile's midpoint) inside bf16's range.
BT = 64
BC = 16


def warp_configs(*warps: int) -> list[triton.Config]:
    """``triton.autotune`` choices of num_warps, timed by Triton at the first launch per key (shapes and
    dtypes) on the GPU at hand: fewer warps fit more programs per SM, more warps hold fewer registers
    each (offline sm_90 compiles show the backward kernels spilling at 2 warps), and which costs more
    depends on the GPU and the grid. The first entry only under the interpreter, which has no warps
    (read at import: ``k3lab.setup()`` goes first)."""
    return [triton.Config({}, num_warps=w) for w in (warps[:1] if interpreting() else warps)]


def grid_log2(programs: int) -> int:
    """The autotuned kernels' grid size class, log2 of their program count clamped to [10, 16]: a key of
    their ``triton.autotune``, since the fastest num_warps depends on how many programs share the SMs.
    On an H200 (bf16, H16) the UT inverse and W/U kernels tuned at B1 T4096 H16 (1024 programs) took 4
    and 8 warps, tuned at B4 T8192 H16 (8192) 2 and 4; the forward at B4 T8192 H16 took 1.277 ms with
    the first choice and 1.247 with its own."""
    return min(max(max(programs, 1).bit_length() - 1, 10), 16)


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot input precision of the kernels' main products: float32 operands (float32 intermediates) use
    3 bf16 passes on the GPU (about fp32 accuracy); bf16 operands ignore it. (The UT inverse has its own:
    ``chunk_fwd.inverse_precisions``.)"""
    return "bf16x3" if dtype == torch.float32 and device.type == "cuda" else "tf32"


def state_tile(N: int, HV: int, V: int, device: torch.device) -> int:
    """V tile of the two sequential (state) kernels, one program per sequence, value head and V tile: the
    widest of 64, 32, 16 whose grid still gives about every SM a program (each program re-reads the
    chunk's [C, K] operands, so wider is better once the SMs are busy). Measured on an H200 with the
    state in two K halves, forward state: B1 T8192 H16 16 -> 0.19 ms (32: 0.20), B4 T8192 H16
    64 -> 0.31 ms (32: 0.34, 16: 0.42)."""
    bv = min(64, max(16, triton.next_power_of_2(V)))
    if device.type != "cuda":
        return bv
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    while bv > 16 and N * HV * triton.cdiv(V, bv) < 0.9 * sms:
        bv //= 2
    return bv


def state_prefetch(BV: int, stores: bool) -> bool:
    """Whether a state kernel loads each chunk's elementwise operands (the forward's U and decay, the
    backward's decay) one chunk ahead, by hand: Triton stages only loads that feed a dot, so these wait
    on the S -> V~ -> S chain each chunk. It pays where the V tile leaves registers spare: V tiles of 16,
    and of 32 when the kernel does not also write per-chunk tensors (``stores``: the training forward's
    h and V~, the backward's dh and dV~). On an H200 (bf16, K = V = 128): forward state + output
    0.871 -> 0.653 ms at B1 T32768 H16 (BV 16; 0.966 -> 0.744 storing h and V~, backward state 0.968 ->
    0.924), 0.245 -> 0.201 ms at B1 T8192 H32 (BV 32; but storing 0.278 -> 0.348, backward 0.265 ->
    0.314), 0.308 -> 0.330 ms at B4 T8192 H16 (BV 64)."""
    return BV <= (16 if stores else 32)


def launch_fitting(kernel, grid, *args, num_stages: int, **kwargs):
    """``kernel[grid](*args, num_stages=num_stages, **kwargs)``, or at the most stages below that whose
    shared memory fits the GPU. The state kernels stage [BT, K] operands per pipeline stage: on an H200
    (227 KiB per program) bf16 at K = 128 fits 3 stages, K = 256 only 1 (offline sm_90: 377 KiB at 3
    stages, 262 at 2, 57 at 1, V tile 64), and GPUs with less shared memory (an A100's 164 KiB) take
    fewer at K = 128 too. Triton raises OutOfResources before anything runs, so a refused launch has
    written nothing.

    Raises:
        triton.runtime.errors.OutOfResources: even one stage does not fit.
    """
    for stages in range(num_stages, 0, -1):
        try:
            return kernel[grid](*args, num_stages=stages, **kwargs)
        except triton.runtime.errors.OutOfResources:
            if stages == 1:
                raise


def state_half(K: int) -> int:
    """Rows of K in each of the two halves the state kernels hold their [K, BV] state in (>= 16, the
    smallest tl.dot tile; rows past K are masked)."""
    return max(16, triton.next_power_of_2(K) // 2)


@triton.jit
def chunk_span(cu_seqlens, chunk_indices, i_c, BT: tl.constexpr):
    """Entry i_c of the chunk table ([n_chunks, 2]: sequence, chunk within it) -> (first token as int64,
    tokens in the chunk, at most BT: the tail chunk of a sequence is shorter)."""
    i_n = tl.load(chunk_indices + i_c * 2)
    i_j = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_j * BT
    return t0, tl.minimum(eos - t0, BT).to(tl.int32)


@triton.jit
def sequence_span(cu_seqlens, chunk_offsets, i_n, BT: tl.constexpr):
    """Sequence i_n of the packed stream -> (first token, end token as int64, its first global chunk,
    its number of chunks): the walk of the two sequential (state) kernels."""
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    return bos, eos, c0, tl.cdiv(eos - bos, BT).to(tl.int32)


@triton.jit
def load_rows(x, t0, n_t, o_r, stride, off, o_c, n_c, CLAMP: tl.constexpr):
    """Rows t0 + o_r (columns o_c < n_c) of a [T, stride] tensor as float32.

    Rows at or past n_t read as zero, or with CLAMP as row n_t - 1 (for the cumulative gate G, whose
    padded rows equal the last valid one: padding = no decay).
    """
    if CLAMP:
        o_t = tl.minimum(o_r, n_t - 1)
        m = (o_c < n_c)[None, :] & (o_r >= 0)[:, None]
    else:
        o_t = o_r
        m = (o_r < n_t)[:, None] & (o_c < n_c)[None, :]
    p = x + t0 * stride + (o_t[:, None] * stride + off + o_c[None, :])
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@triton.jit
def store_rows(x, b_x, t0, n_t, o_r, stride, off, o_c, n_c):
    """Store a [R, C] block into rows t0 + o_r < t0 + n_t, columns o_c < n_c, cast to x's dtype."""
    m = (o_r < n_t)[:, None] & (o_c < n_c)[None, :]
    p = x + t0 * stride + (o_r[:, None] * stride + off + o_c[None, :])
    tl.store(p, b_x.to(x.dtype.element_ty), mask=m)


@triton.jit
def add_rows(x, b_x, t0, n_t, o_r, stride, off, o_c, n_c):
    """x[rows, columns] += b_x, for a block that one program owns (``load_rows`` then ``store_rows``)."""
    store_rows(x, b_x + load_rows(x, t0, n_t, o_r, stride, off, o_c, n_c, False), t0, n_t, o_r, stride, off, o_c, n_c)


@triton.jit
def load_vec(x, t0, n_t, o_r, stride, off):
    """x[t0 + o_r, off] for rows o_r < n_t (zero past n_t), as float32: one scalar per token."""
    p = x + t0 * stride + (o_r * stride + off)
    return tl.load(p, mask=o_r < n_t, other=0.0).to(tl.float32)


@triton.jit
def inverse_norm(x, t0, n_t, o_r, stride, off, K: tl.constexpr, BR: tl.constexpr, BKT: tl.constexpr):
    """1 / sqrt(sum(x^2) + 1e-6) of the BR rows t0 + o_r of a [T, stride] tensor (columns off .. off + K),
    read in tiles of BKT columns; rows past n_t give 1e3."""
    b_ss = tl.zeros([BR], tl.float32)
    for i_k in tl.static_range(triton.cdiv(K, BKT)):
        o_k = i_k * BKT + tl.arange(0, BKT)
        b_x = load_rows(x, t0, n_t, o_r, stride, off, o_k, K, False)
        b_ss += tl.sum(b_x * b_x, 1)
    return 1.0 / tl.sqrt(b_ss + 1e-6)


@triton.jit
def state_halves(i_hv, i_v, K: tl.constexpr, V: tl.constexpr, BKH: tl.constexpr, BV: tl.constexpr):
    """Where the state kernels' two halves of a value head's [K, V] state sit: (o_k1, o_k2) the K rows
    [0, BKH) and [BKH, 2 BKH), o_v the columns of V tile i_v, (o_s1, o_s2) the halves' offsets in a
    [.., HV, K, V] tensor and (m_1, m_2) their masks."""
    o_k1 = tl.arange(0, BKH)
    o_k2 = BKH + o_k1
    o_v = i_v * BV + tl.arange(0, BV)
    o_s1 = i_hv * K * V + o_k1[:, None] * V + o_v[None, :]
    m_1 = (o_k1 < K)[:, None] & (o_v < V)[None, :]
    m_2 = (o_k2 < K)[:, None] & (o_v < V)[None, :]
    return o_k1, o_k2, o_v, o_s1, o_s1 + BKH * V, m_1, m_2


@triton.jit
def chunk_decay_halves(G, t0, n_t, i_hv, o_k1, o_k2, HV: tl.constexpr, K: tl.constexpr):
    """The state kernels' per-chunk decay gamma_C = exp(G at the chunk's last row) on the state's two
    halves of K rows (o_k1, o_k2), as two [BKH] vectors."""
    o_l = n_t - 1 + tl.zeros([1], tl.int32)
    b_g1 = tl.sum(load_rows(G, t0, n_t, o_l, HV * K, i_hv * K, o_k1, K, True), 0)
    b_g2 = tl.sum(load_rows(G, t0, n_t, o_l, HV * K, i_hv * K, o_k2, K, True), 0)
    return tl.exp(b_g1), tl.exp(b_g2)


@triton.jit
def l2norm_bwd(b_x, b_dy):
    """The gradient of x for y = x / sqrt(sum(x^2) + 1e-6) along the last axis: (dy - y <dy, y>) / |x|."""
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + 1e-6)
    b_y = b_x * b_r[:, None]
    return (b_dy - b_y * tl.sum(b_dy * b_y, axis=1)[:, None]) * b_r[:, None]


@triton.jit
def exp_ftz(x):
    """e^x as 2^(x log2 e): Triton lowers that to one MUFU.EX2, which flushes results below 2^-126 to zero;
    tl.exp (the same rounding otherwise) adds a three-instruction fix-up per element for them."""
    return tl.exp2(x * 1.4426950408889634)


@triton.jit
def sigmoid_grad(x):
    """sigmoid'(x) = t / (1 + t)^2 with t = e^-|x| (the gate's and beta's backward): as s (1 - s), 1 - s
    cancels where the sigmoid saturates (gate at x ~ 12: 5.4e-3 relative in dz; beta logits at +30: 0)."""
    t = exp_ftz(-tl.abs(x))
    return t / ((1.0 + t) * (1.0 + t))


@triton.jit
def l2norm_rows(b_x):
    """x / sqrt(sum(x^2) + 1e-6) along the last axis (fla's ``l2norm``); zero rows stay zero."""
    return b_x * (1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + 1e-6))[:, None]


def chunk_index(lengths: list[int], device: torch.device, chunk: int = BT
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' tables of packed sequences, built on the host and sent in one copy. Cached per
    (lengths, device, chunk): a training loop at fixed shapes builds them once; the returned tensors
    are shared and must not be written to. The copy is a blocking one (once per shape), so a cached
    table is complete before any stream reads it; varlen calls sync anyway to read their lengths.
    They are built outside inference mode even when the first call comes from
    ``torch.inference_mode()`` (evaluation), so that later autograd calls at the same shape can save
    them for backward.

    Args:
        lengths (list[int]): the N sequence lengths (validated by the caller, all > 0).
        device (torch.device): where the tables go.
        chunk (int): chunk length C.

    Returns:
        (cu_seqlens int32 [N+1] the sequences' token offsets,
         chunk_indices int32 [NT, 2] with (sequence n, chunk j within n) per global chunk,
         chunk_offsets int32 [N+1] the first global chunk of each sequence).
    """
    with torch.inference_mode(False):
        return _chunk_tables(tuple(lengths), torch.device(device), chunk)


@functools.lru_cache(maxsize=64)
def _chunk_tables(lengths: tuple[int, ...], device: torch.device, chunk: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    counts = [triton.cdiv(n, chunk) for n in lengths]
    pairs = [x for n, c in enumerate(counts) for j in range(c) for x in (n, j)]
    cu, offsets = [0], [0]
    for n, c in zip(lengths, counts):
        cu.append(cu[-1] + n)
        offsets.append(offsets[-1] + c)
    host = torch.tensor(cu + pairs + offsets, dtype=torch.int32)
    cu_d, pairs_d, offsets_d = host.to(device).split([len(cu), len(pairs), len(offsets)])
    return cu_d, pairs_d.view(-1, 2), offsets_d
