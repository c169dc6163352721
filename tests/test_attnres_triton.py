"""k3lab.kernels.attnres: the Triton two-phase kernels (phase 1 and merge, forward and backward)
against the PyTorch closed forms, and BlockAttnRes on the Triton backend against the formula; on CPU
they run under TRITON_INTERPRET=1 at tiny sizes."""
import pytest
import torch

import k3lab

DEVICE = k3lab.setup(verbose=False)  # sets TRITON_INTERPRET=1 before the kernels load on CPU

import torch.nn as nn  # noqa: E402

from k3lab.attnres import BlockAttnRes, naive_block_attnres  # noqa: E402
from k3lab.attnres.mix import (block_scores, merge_bwd_torch, merge_fwd_torch, phase1_bwd_torch,  # noqa: E402
                               phase1_fwd_torch, store_block_torch)
from k3lab.kernels.attnres import merge_bwd, merge_fwd, phase1_bwd, phase1_fwd, store_block  # noqa: E402
from k3lab.norm import RMSNorm  # noqa: E402
from k3lab.testing import assert_close  # noqa: E402


TOL = 1e-5 if DEVICE.type == "cpu" else 1e-4


def randn(*shape, g, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("S,n,M,D", [
    (3, 2, 9, 24),  # two query groups (the interpreter's G = 2), the second half empty; D not a power of 2
    (1, 4, 7, 16),  # the final aggregation: one query, no merges
    (5, 3, 5, 40),
    (2, 1, 3, 8),  # block 0: the embedding only
], ids=["groups", "final", "wide", "block0"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_phase1_kernels_match_torch(S, n, M, D, accumulate):
    g = torch.Generator().manual_seed(S * 100 + M)
    buf, W = randn(5, M, D, g=g, scale=2), randn(S, D, g=g)
    h, o, lse = phase1_fwd(buf, n, W, 1e-6)
    h_ref, o_ref, lse_ref = phase1_fwd_torch(buf, n, W, 1e-6)
    assert_close("h", h_ref, h, TOL)
    assert_close("lse", lse_ref, lse, TOL)
    assert (o is None) == (S == 1)
    if S > 1:
        assert_close("o", o_ref, o, TOL)
    dh = randn(M, D, g=g)
    dO, delta = (randn(S - 1, M, D, g=g), randn(S, M, g=g)) if S > 1 else (None, None)
    acc0 = randn(5, M, D, g=g)
    acc, acc_ref = acc0.clone(), acc0.clone()
    dW = phase1_bwd(buf, n, W, lse, h, dh, dO, delta, 1e-6, acc, accumulate)  # each backend with its own lse, h
    dW_ref = phase1_bwd_torch(buf, n, W, lse_ref, h_ref, dh, dO, delta, 1e-6, acc_ref, accumulate)
    assert_close("dacc", acc_ref[:n], acc[:n], TOL)
    assert_close("dW", dW_ref, dW, TOL)
    assert torch.equal(acc[n:], acc0[n:])  # slots >= n untouched


@pytest.mark.parametrize("form", ["read_p", "prev_plus_v", "v_only"])
def test_merge_kernels_match_torch(form):
    g = torch.Generator().manual_seed(7)
    M, D = 11, 24
    p, o, prev = randn(M, D, g=g), randn(M, D, g=g), randn(M, D, g=g)
    v, lse, w = randn(M, D, g=g, dtype=torch.bfloat16), randn(M, g=g), randn(D, g=g)
    kw = {"read_p": dict(p=p), "prev_plus_v": dict(p=None, prev=prev, v=v),
          "v_only": dict(p=None, v=v, dtype=torch.float32)}[form]
    (p_t, h_t), (p_r, h_r) = (f(o=o, lse=lse, w=w, eps=1e-6, **kw) for f in (merge_fwd, merge_fwd_torch))
    assert p_t.dtype == h_t.dtype == torch.float32
    assert_close("p", p_r, p_t, 0.0)
    assert_close("h", h_r, h_t, TOL)
    dh, dp_in = randn(M, D, g=g), randn(M, D, g=g) if form != "v_only" else None
    slots = [(torch.empty(M, D, device=DEVICE), torch.empty(M, device=DEVICE)) for _ in range(2)]
    need_dp = form != "v_only"  # p = v: its gradient is only wanted as v's (bf16)
    out_t = merge_bwd(dh, dp_in, p_r, o, lse, w, 1e-6, *slots[0], v_dtype=torch.bfloat16, need_dp=need_dp)
    out_r = merge_bwd_torch(dh, dp_in, p_r, o, lse, w, 1e-6, *slots[1], v_dtype=torch.bfloat16, need_dp=need_dp)
    assert (out_t[0] is None) == (out_r[0] is None) == (not need_dp)
    for name, a, b in zip(("dp", "dv", "dw"), out_r, out_t):
        if a is None:
            continue
        assert a.dtype == b.dtype
        assert_close(name, a.float(), b.float(), 1e-2 if name == "dv" else TOL)
    assert_close("dO", slots[1][0], slots[0][0], TOL)
    assert_close("delta", slots[1][1], slots[0][1], TOL)


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["a_plus_b", "a_only", "scores_only"])
def test_store_block_matches_torch(form, dst_dtype):
    """The slot a + b (float32 sum, rounded to the buffer's dtype) and its logits for Q queries, written
    into a strided table column; D not a multiple of the kernel's channel step, Q not a power of 2."""
    g = torch.Generator().manual_seed(21)
    B, T, D, Q = 2, 9, 40, 5
    a = randn(B, T, D, g=g, scale=2, dtype=dst_dtype if form == "scores_only" else torch.float32)
    b = randn(B, T, D, g=g, dtype=torch.bfloat16) if form == "a_plus_b" else None
    W = randn(Q, D, g=g)
    out = []
    for f in (store_block, store_block_torch):
        dst = a if form == "scores_only" else torch.full((B, T, D), float("nan"), dtype=dst_dtype, device=DEVICE)
        table = torch.full((Q, 3, B, T), float("nan"), device=DEVICE)
        rstd = torch.full((3, B, T), float("nan"), device=DEVICE)
        f(dst, a, b, W, 1e-6, table[:, 1], rstd[1])
        out.append((dst, table, rstd))
    (dst_t, table_t, rstd_t), (dst_r, table_r, rstd_r) = out
    # The interpreter rounds float32 -> bf16 by truncation (one ulp off torch's round-to-nearest).
    interp_bf16 = DEVICE.type == "cpu" and dst_dtype == torch.bfloat16 and form != "scores_only"
    assert_close("slot", dst_r.float(), dst_t.float(), 1e-2 if interp_bf16 else 0.0)
    if interp_bf16:
        dst_r, table_r, rstd_r = dst_t, table_r.clone(), rstd_r.clone()
        store_block_torch(dst_t, dst_t, None, W, 1e-6, table_r[:, 1], rstd_r[1])  # the logits of the kernel's slot
    assert_close("scores", table_r[:, 1], table_t[:, 1], TOL)
    assert_close("rstd", dst_r.float().pow(2).mean(-1).add(1e-6).rsqrt(), rstd_t[1], TOL)
    assert_close("rstd vs torch", rstd_r[1], rstd_t[1], TOL)
    assert rstd_t[[0, 2]].isnan().all()
    assert_close("scores vs block_scores", block_scores(dst_r[None], 1, W, 1e-6)[:, 0], table_t[:, 1], TOL)
    assert table_t[:, [0, 2]].isnan().all()  # the other columns untouched


def test_phase1_bwd_takes_the_tables():
    """Logits and r passed as slices of the training path's tables give what the blocks give (both
    backends); tables that differ from the blocks' are used as given, alike; bad tables raise."""
    g = torch.Generator().manual_seed(23)
    S, n, B, T, D = 3, 3, 2, 5, 24
    buf, W = randn(4, B, T, D, g=g, scale=2), randn(S, D, g=g)
    table = torch.full((S + 2, 4, B, T), float("nan"), device=DEVICE)
    rstd = torch.full((4, B, T), float("nan"), device=DEVICE)
    for i in range(n):
        store_block(buf[i], buf[i], None, torch.cat([randn(2, D, g=g), W]), 1e-6, table[:, i], rstd[i])
    dh, dO, delta = randn(B, T, D, g=g), randn(S - 1, B, T, D, g=g), randn(S, B, T, g=g)

    def run(f, **tables):
        # lse and h from the forward with the same logits, as in training
        h, _, lse = phase1_fwd_torch(buf, n, W, 1e-6, scores=tables.get("scores"))
        acc = torch.zeros(4, B, T, D, device=DEVICE)
        return acc[:n], f(buf, n, W, lse, h, dh, dO, delta, 1e-6, acc, False, **tables)

    given = dict(scores=table[2:, :n], rstd=rstd[:n])
    other = dict(scores=randn(S, n, B, T, g=g), rstd=randn(n, B, T, g=g).abs() + 0.5)
    for f in (phase1_bwd, phase1_bwd_torch):
        for name, a, b in zip(("dacc", "dW"), run(f), run(f, **given)):
            assert_close(f"{f.__name__} {name}", a, b, TOL)
    for name, a, b in zip(("dacc", "dW"), run(phase1_bwd_torch, **other), run(phase1_bwd, **other)):
        assert_close(f"other tables {name}", a, b, TOL)
    for f in (phase1_bwd, phase1_bwd_torch):
        with pytest.raises(ValueError, match="rstd must be"):
            run(f, scores=given["scores"], rstd=rstd[:n - 1])
        with pytest.raises(ValueError, match="one dtype"):
            run(f, scores=given["scores"], rstd=rstd[:n].double())
        with pytest.raises(ValueError, match="one dtype"):
            run(f, scores=given["scores"].bfloat16(), rstd=rstd[:n].bfloat16())
        # One table alone was dropped silently (both formed from the blocks): the forward used it.
        for one in ("scores", "rstd"):
            with pytest.raises(ValueError, match="given together"):
                run(f, **{one: other[one]})
    for store in (store_block, store_block_torch):
        with pytest.raises(ValueError, match="scores must be float32"):
            store(buf[0], buf[0], None, W, 1e-6, table[:S, 0].bfloat16(), rstd[0].bfloat16())


def test_phase1_fwd_takes_the_tables_logits():
    """Logits passed as a slice of a [queries, slots, B, T] table (as the training path does) give what
    logits formed from the blocks give; logits that differ from the blocks' are used as given."""
    g = torch.Generator().manual_seed(22)
    S, n, B, T, D = 3, 3, 2, 5, 24
    buf, W = randn(4, B, T, D, g=g, scale=2), randn(S, D, g=g)
    table = torch.full((S + 2, 4, B, T), float("nan"), device=DEVICE)
    for i in range(n):
        store_block(buf[i], buf[i], None, torch.cat([randn(2, D, g=g), W]), 1e-6, table[:, i])
    scores = table[2:, :n]
    for f in (phase1_fwd, phase1_fwd_torch):
        assert_close(f"{f.__name__} h", f(buf, n, W, 1e-6)[0], f(buf, n, W, 1e-6, scores=scores)[0], TOL)
    other = randn(S, n, B, T, g=g)
    ours, ref = phase1_fwd(buf, n, W, 1e-6, scores=other), phase1_fwd_torch(buf, n, W, 1e-6, scores=other)
    for name, a, b in zip(("h", "o", "lse"), ref, ours):
        assert_close(name, a, b, TOL)
    with pytest.raises(ValueError, match="scores must be"):
        phase1_fwd(buf, n, W, 1e-6, scores=other[:, :2])


def test_phase1_bf16_storage():
    """bf16 blocks in, bf16 o out (h float32), float32 math inside."""
    g = torch.Generator().manual_seed(5)
    buf, W = randn(3, 6, 32, g=g, dtype=torch.bfloat16), randn(3, 32, g=g)
    h, o, lse = phase1_fwd(buf, 2, W, 1e-6, h_dtype=torch.float32, o_dtype=torch.bfloat16)
    h_ref, o_ref, lse_ref = phase1_fwd_torch(buf, 2, W, 1e-6, h_dtype=torch.float32, o_dtype=torch.bfloat16)
    assert h.dtype == torch.float32 and o.dtype == torch.bfloat16
    assert_close("h", h_ref, h, TOL)
    assert_close("o bf16", o_ref.float(), o.float(), 1e-2)
    assert_close("lse", lse_ref, lse, TOL)


def sublayers(L, d, seed):
    torch.manual_seed(seed)
    return nn.ModuleList([nn.Sequential(RMSNorm(d), nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
                          for _ in range(L)]).to(DEVICE)


@pytest.mark.parametrize("N", [1, 2, 3, 5])
def test_module_triton_backend_matches_naive(N):
    """BlockAttnRes two-phase path on the Triton backend: output and gradients vs autograd through
    the formula (float32; L = 5 is not a multiple of N = 2, 3)."""
    L, d = 5, 16
    subs = sublayers(L, d, 11)
    g = torch.Generator().manual_seed(3)
    h0, q, g_out = randn(1, 6, d, g=g), randn(L + 1, d, g=g), randn(1, 6, d, g=g)
    out = {}
    for path, backend in (("naive", None), ("memory", "triton")):
        res = BlockAttnRes(d, L, N, path=path, backend=backend).to(DEVICE)
        with torch.no_grad():
            res.queries.copy_(q)
        x = h0.clone().requires_grad_()
        subs.zero_grad()
        y = res(x, subs)
        (y * g_out).sum().backward()
        out[path] = [y.detach(), x.grad, res.queries.grad] + [p.grad.clone() for p in subs.parameters()]
    errs = [assert_close(f"tensor {i}", a, b, 10 * TOL) for i, (a, b) in enumerate(zip(out["naive"], out["memory"]))]
    print(f"N={N} triton float32: out {errs[0]:.1e}, dh0 {errs[1]:.1e}, dqueries {errs[2]:.1e}, "
          f"params {max(errs[3:]):.1e}")


@pytest.mark.parametrize("change", ["output", "sublayer_input"])
def test_module_triton_output_changed_in_place(change, doubles_its_input):
    """Changing the output in place after forward (legal: no node saves it), or a sublayer changing its
    input in place before using it, leaves the gradients those of the formula doing the same (the
    second gave wrong ones silently: the input was rebuilt for backward as it was before the change)."""
    L, N, d = 4, 2, 8
    subs = sublayers(L, d, 5)
    if change == "sublayer_input":
        subs = nn.ModuleList(doubles_its_input(s) for s in subs)
    g = torch.Generator().manual_seed(6)
    h0, q = randn(2, 3, d, g=g), randn(L + 1, d, g=g)
    grads = {}
    for path in ("naive", "memory"):
        res = BlockAttnRes(d, L, N, path=path, backend="triton").to(DEVICE)
        with torch.no_grad():
            res.queries.copy_(q)
        x = h0.clone().requires_grad_()
        y = res(x, subs)
        if change == "output":
            y.mul_(2).add_(1)
        y.pow(2).sum().backward()
        grads[path] = (x.grad, res.queries.grad)
    for name, a, b in zip(("dh0", "dqueries"), grads["naive"], grads["memory"]):
        assert_close(name, a, b, 10 * TOL)


def test_phase1_bwd_takes_strided_gradients():
    """dO and delta as views (not contiguous) give what their contiguous copies give."""
    g = torch.Generator().manual_seed(9)
    S, n, M, D = 3, 2, 5, 16
    buf, W = randn(3, M, D, g=g), randn(S, D, g=g)
    h, _, lse = phase1_fwd(buf, n, W, 1e-6)
    dh, dO, delta = randn(M, D, g=g), randn(M, S - 1, D, g=g).transpose(0, 1), randn(M, S, g=g).t()
    accs = [torch.zeros(n, M, D, device=DEVICE) for _ in range(2)]
    dW = [phase1_bwd(buf, n, W, lse, h, dh, a, b, 1e-6, acc) for (a, b), acc in
          zip(((dO, delta), (dO.contiguous(), delta.contiguous())), accs)]
    assert torch.equal(accs[0], accs[1]) and torch.equal(dW[0], dW[1])


def test_merge_bwd_checks_its_slots():
    g = torch.Generator().manual_seed(8)
    p, o, dh, dO = (randn(5, 8, g=g) for _ in range(4))
    lse, w = randn(5, g=g), randn(8, g=g)
    with pytest.raises(ValueError, match="delta"):
        merge_bwd(dh, None, p, o, lse, w, 1e-6, dO, torch.empty(3, device=DEVICE))


def test_lse_and_w_shapes_are_checked():
    """The kernels index lse by token and w by channel: a smaller w gave NaN, a one-element lse finite
    garbage, a transposed lse a wrong result, all silently (read out of bounds); phase 1's backward
    ran on an lse of the wrong shape. ValueError now, as the PyTorch versions raise."""
    g = torch.Generator().manual_seed(10)
    buf, W = randn(4, 2, 5, 32, g=g), randn(3, 32, g=g)
    h, o, lse = phase1_fwd(buf, 2, W, 1e-6)
    p, w = randn(2, 5, 32, g=g), randn(32, g=g)
    for bad_lse, bad_w in ((lse[1], randn(4, g=g)), (randn(1, g=g), w), (lse[1].T.contiguous(), w)):
        with pytest.raises(ValueError, match="lse must be"):
            merge_fwd(p, o[0], bad_lse, bad_w, 1e-6)
        with pytest.raises(ValueError, match="lse must be"):
            merge_bwd(p, None, p, o[0], bad_lse, bad_w, 1e-6, torch.empty_like(p), torch.empty(2, 5, device=DEVICE))
    dh, dO, delta = randn(2, 5, 32, g=g), randn(2, 2, 5, 32, g=g), randn(3, 2, 5, g=g)
    with pytest.raises(ValueError, match="lse must be"):
        phase1_bwd(buf, 2, W, lse[:, :, 0].contiguous(), h, dh, dO, delta, 1e-6,
                   torch.zeros(2, 2, 5, 32, device=DEVICE))


def test_argument_errors_and_layouts():
    """Found by a new user's review: each of these ran silently (a float64 table refused by the Triton
    store, a transposed p read as contiguous, a float64 lse read as garbage, b ignored, the PyTorch
    closed forms broadcasting or slicing bad shapes)."""
    g = torch.Generator().manual_seed(30)
    L, N, d = 4, 2, 12
    subs = sublayers(L, d, 3).double()
    h0, q = randn(1, 5, d, g=g, dtype=torch.float64), randn(L + 1, d, g=g, dtype=torch.float64)
    out = BlockAttnRes(d, L, N, path="memory", backend="triton").to(DEVICE, torch.float64)
    with torch.no_grad():
        out.queries.copy_(q)
    assert_close("float64 on the Triton backend", naive_block_attnres(h0, subs, q, N), out(h0, subs), 1e-5)
    p, o, w = randn(20, 6, g=g).t(), randn(6, 20, g=g), randn(20, g=g)
    lse = randn(6, g=g)
    assert_close("transposed p", merge_fwd_torch(p, o, lse, w, 1e-6)[1], merge_fwd(p, o, lse, w, 1e-6)[1], TOL)
    with pytest.raises(ValueError, match="lse must be float32"):
        merge_fwd(p, o, lse.double(), w, 1e-6)
    buf, W = randn(3, 4, d, g=g), randn(2, d, g=g)
    block = buf[0]
    for f in (store_block, store_block_torch):
        with pytest.raises(ValueError, match="b must be None"):
            f(block, block, buf[1], W, 1e-6, torch.empty(2, 4, device=DEVICE))
        # Aliased outputs: r written over a logits row, or the tables over the block being read.
        table = torch.empty(3, 4, device=DEVICE)
        with pytest.raises(ValueError, match="rstd must not overlap scores"):
            f(block, block, None, W, 1e-6, table[:2], table[0])
        with pytest.raises(ValueError, match="scores must not overlap dst"):
            f(block, block, None, W, 1e-6, block[:2, :4], torch.empty(4, device=DEVICE))
        with pytest.raises(ValueError, match="scores must not overlap W"):
            f(torch.empty_like(block), block, None, W, 1e-6, W[:, :4])
        with pytest.raises(ValueError, match="dst must not overlap a"):  # a shifted by one token
            f(buf.view(-1, d)[1:5], buf.view(-1, d)[:4], None, W, 1e-6, torch.empty(2, 4, device=DEVICE))
        dst = torch.empty_like(block)
        f(dst, block, buf[1], W, 1e-6, table[:2], table[2])  # disjoint rows of one table are fine
        assert_close("store with one table", block + buf[1], dst, 0.0)
        f(buf[0], buf[0], None, W, 1e-6, table[:2])  # the same view twice: logits of a stored block
    for f in (phase1_fwd, phase1_fwd_torch):
        for n in (0, 4, -1):
            with pytest.raises(ValueError, match="n must be"):
                f(buf, n, W, 1e-6)
        with pytest.raises(ValueError, match="scores must be"):
            f(buf, 2, W, 1e-6, scores=randn(2, 1, 4, g=g))
    for f in (merge_fwd, merge_fwd_torch):
        with pytest.raises(ValueError, match="lse must be"):
            f(o, o, randn(6, 1, g=g), w, 1e-6)
        with pytest.raises(ValueError, match="prev must be"):
            f(None, o, lse, w, 1e-6, prev=randn(1, 20, g=g), v=o)


def test_module_triton_zero_init_is_uniform_average(uniform_block_average):
    L, N, d = 5, 2, 8
    subs = sublayers(L, d, 2)
    h0 = randn(1, 3, d, g=torch.Generator().manual_seed(2))
    res = BlockAttnRes(d, L, N, path="memory", backend="triton").to(DEVICE)
    assert_close("uniform triton", uniform_block_average(h0, subs, N), res(h0, subs), TOL)


def test_module_bf16_buffer_close_to_float32():
    """buffer_dtype=bfloat16: same function up to bf16 rounding of the stored blocks."""
    L, N, d = 4, 2, 32
    torch.manual_seed(12)
    subs = nn.ModuleList([nn.Sequential(RMSNorm(d), nn.Linear(d, d), nn.Tanh()) for _ in range(L)]).to(DEVICE)
    # Drawn on the CPU: the same inputs on every device (CUDA's generator draws other numbers).
    h0 = randn(2, 5, d, g=torch.Generator().manual_seed(12))
    out = {}
    for dtype in (None, torch.bfloat16):
        res = BlockAttnRes(d, L, N, path="memory", backend="triton", buffer_dtype=dtype).to(DEVICE)
        with torch.no_grad():
            res.queries.copy_(randn(L + 1, d, g=torch.Generator().manual_seed(1)))
        x = h0.clone().requires_grad_()
        y = res(x, subs)
        y.square().mean().backward()
        out[dtype] = (y.detach(), x.grad)
    assert out[torch.bfloat16][0].dtype == torch.float32
    assert_close("out", out[None][0], out[torch.bfloat16][0], 2e-2)
    assert_close("grad", out[None][1], out[torch.bfloat16][1], 3e-2)
    with torch.no_grad():
        assert_close("naive", naive_block_attnres(h0, subs, res.queries, N), out[None][0], TOL)
