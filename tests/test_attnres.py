"""k3lab.attnres: every path (two-phase training, inference, the closed-form backward) against the
formula, config errors, zero-init, N = L, activation memory, and the LM integration (CPU)."""
import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import k3lab.lm as lm
from k3lab.attnres import (AttnRes, BlockAttnRes, block_attnres_inference, block_attnres_stage, block_attnres_train,
                           block_sizes, depth_attention, naive_attnres, naive_block_attnres, retained_bytes)
from k3lab.attnres.mix import merge_bwd_torch, merge_fwd_torch, phase1_bwd_torch, phase1_fwd_torch
from k3lab.norm import RMSNorm
from k3lab.testing import assert_close, rel_rms_error



class MLP(nn.Module):
    """A pre-norm sublayer: returns f(RMSNorm(h)), not added."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm, self.up, self.down = RMSNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, h):
        return self.down(torch.tanh(self.up(self.norm(h))))


def make(L, d=16, seed=0, dtype=torch.float64, B=2, T=5):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    subs = nn.ModuleList([MLP(d, 2 * d) for _ in range(L)]).to(dtype)
    h0 = torch.randn(B, T, d, generator=g, dtype=dtype)
    queries = torch.randn(L + 1, d, generator=g, dtype=dtype)
    return subs, h0, queries


def module(cls_args, queries, path, dtype=torch.float64):
    res = BlockAttnRes(*cls_args, path=path).to(dtype)
    with torch.no_grad():
        res.queries.copy_(queries)
    return res


def test_block_sizes_and_config_errors():
    assert block_sizes(10, 4) == [3, 3, 2, 2] and block_sizes(6, 6) == [1] * 6 and block_sizes(5, 1) == [5]
    for n_blocks in (0, -1, 9):
        with pytest.raises(ValueError, match="n_blocks"):
            BlockAttnRes(16, 8, n_blocks)
        subs, h0, q = make(8)
        with pytest.raises(ValueError, match="n_blocks"):
            naive_block_attnres(h0, subs, q, n_blocks)
    with pytest.raises(ValueError, match="n_sublayers"):
        BlockAttnRes(16, 0, 1)
    with pytest.raises(ValueError, match="path"):
        BlockAttnRes(16, 4, 2, path="fast")
    subs, h0, q = make(4)
    with pytest.raises(ValueError, match="queries"):
        block_attnres_inference(h0, subs, q[:4], 2)
    with pytest.raises(ValueError, match="queries"):
        naive_attnres(h0, subs, q[:, :8])
    for bad in (dict(d_model=True), dict(recompute_input="no")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BlockAttnRes(**dict(dict(d_model=16, n_sublayers=4, n_blocks=2), **bad))
    res = BlockAttnRes(16, 4, 2)
    with pytest.raises(ValueError, match="sublayers"):
        res(torch.randn(1, 3, 16), nn.ModuleList([MLP(16, 8)] * 3))
    with pytest.raises(ValueError, match="h0"):
        res(torch.randn(1, 3, 8), nn.ModuleList([MLP(8, 8)] * 4))


@pytest.mark.parametrize("path", ["naive", "memory", "inference"])
@pytest.mark.parametrize("bad", ["pooled", "wider", "none"])
def test_sublayer_output_shape_is_checked(path, bad):
    """Regression: a sublayer returning [B, 1, d] was broadcast silently by the memory and
    inference paths; a wrong width or None failed deep inside the mixing."""
    subs, h0, q = make(4, seed=43)
    outputs = {"pooled": lambda h: h.mean(1, keepdim=True), "wider": lambda h: torch.cat([h, h[..., :1]], -1),
               "none": lambda h: None}
    sublayers = list(subs[:2]) + [outputs[bad]] + list(subs[3:])
    res = module((16, 4, 2), q, path)
    with pytest.raises(ValueError, match=r"sublayer 2 must return a tensor of its input's shape \[2, 5, 16\]"), \
            torch.set_grad_enabled(path != "inference"):
        res(h0.clone().requires_grad_(path == "memory"), sublayers)


@pytest.mark.parametrize("entry", [naive_block_attnres, block_attnres_train, block_attnres_inference])
def test_functional_entry_points_check_sublayer_outputs(entry):
    """Regression: block_attnres_train, given a sublayer returning [B, 1, d], resized a slot of
    its block buffer (a deprecation warning) and read rows never written: garbage that changed from
    call to call. The functional entry points check outputs as the module does."""
    subs, h0, q = make(2, seed=44)
    with pytest.raises(ValueError, match=r"sublayer 1 must return a tensor of its input's shape \[2, 5, 16\]"):
        entry(h0, [subs[0], lambda h: h[:, :1] * 2], q, 1)


def test_memory_path_under_inference_mode():
    """path="memory" raised "Inference tensors do not track version counter" under
    torch.inference_mode (its saved-tensor bookkeeping read h._version); it now runs as under no_grad."""
    subs, h0, q = make(5, seed=45)
    res = module((16, 5, 2), q, "memory")
    with torch.no_grad():
        ref = naive_block_attnres(h0, subs, q, 2)
    with torch.inference_mode():
        out = res(h0, subs)
    assert_close("memory path under inference_mode", ref, out, 1e-12)


def test_explicit_inference_path_refuses_to_drop_gradients():
    """path="inference" with autograd recording returned an output that did not require grad: a
    model trained that way learned nothing, without a word."""
    subs, h0, q = make(4, seed=46)
    res = module((16, 4, 2), q, "inference")
    with pytest.raises(RuntimeError, match="path='inference' records no gradients"):
        res(h0, subs)
    with torch.no_grad():
        assert_close("inference under no_grad", naive_block_attnres(h0, subs, q, 2), res(h0, subs), 1e-12)


def test_call_errors_name_the_argument():
    """depth_weights blamed queries for a wrong sublayer count; an h0 that is not a tensor raised
    AttributeError."""
    subs, h0, q = make(5, seed=47)
    res = module((16, 5, 2), q, "naive")
    with pytest.raises(ValueError, match="expected 5 sublayers, got 2"):
        res.depth_weights(h0, subs[:2])
    with pytest.raises(ValueError, match=r"h0 must be a \[B, T, d=16\] tensor, got list"):
        res(h0.tolist(), subs)


@pytest.mark.parametrize("path", ["naive", "memory", "inference"])
@pytest.mark.parametrize("shape", [(2, 0, 16), (0, 5, 16)], ids=["T0", "B0"])
def test_an_empty_batch_gives_an_empty_output_on_every_path(path, shape):
    """The value check took the inf-norm of an empty h0, which raises ("does not have an identity")."""
    subs = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
    res = BlockAttnRes(16, 6, 3, path=path)
    h0 = torch.randn(*shape, requires_grad=path != "inference")
    with torch.set_grad_enabled(path != "inference"):
        out = res(h0, subs)
    assert out.shape == shape
    if path != "inference":
        out.sum().backward()
        assert h0.grad.shape == shape and torch.equal(res.queries.grad, torch.zeros_like(res.queries))


@pytest.mark.parametrize("path", ["naive", "memory", "inference"])
@pytest.mark.parametrize("L,N", [(6, 6), (6, 2), (7, 3)], ids=["full", "N2", "uneven"])
def test_zero_init_is_uniform_average(path, L, N, uniform_block_average):
    """With w = 0 every read is the plain mean of its sources (written here without softmax)."""
    subs, h0, _ = make(L, seed=1)
    res = BlockAttnRes(h0.shape[-1], L, N, path=path).double()
    assert torch.count_nonzero(res.queries) == 0
    ref = uniform_block_average(h0, subs, N)
    with torch.set_grad_enabled(path == "memory"):
        assert_close(f"uniform {path}", ref, res(h0, subs), 1e-12)


@pytest.mark.parametrize("path", ["naive", "memory", "inference"])
def test_n_equals_l_is_full_attnres(path):
    L = 6
    subs, h0, q = make(L, seed=2)
    ref = naive_attnres(h0, subs, q)
    assert_close("naive block N=L", ref, naive_block_attnres(h0, subs, q, L), 1e-12)
    with torch.set_grad_enabled(path == "memory"):
        assert_close(f"BlockAttnRes(N=L) {path}", ref, module((16, L, L), q, path)(h0, subs), 1e-12)
        res = AttnRes(16, L, path=path).double()
        with torch.no_grad():
            res.queries.copy_(q)
        assert_close(f"AttnRes {path}", ref, res(h0, subs), 1e-12)
    # And N < L is a different function.
    assert (naive_block_attnres(h0, subs, q, 2) - ref).abs().max() > 1e-3


def grads_of(subs, h0, q, N, path, g_out, backend=None):
    """Output and gradients (h0, queries, every sublayer parameter) of one forward/backward."""
    res = BlockAttnRes(h0.shape[-1], len(subs), N, path=path, backend=backend).to(h0.dtype)
    with torch.no_grad():
        res.queries.copy_(q)
    x = h0.clone().requires_grad_()
    subs.zero_grad()
    out = res(x, subs)
    (out * g_out).sum().backward()
    return [out.detach(), x.grad, res.queries.grad] + [p.grad.clone() for p in subs.parameters()]


@pytest.mark.parametrize("L,N,seed", [(7, 1, 3), (7, 2, 4), (7, 3, 5), (7, 7, 6), (9, 4, 7)],
                         ids=["N1", "N2", "N3", "N=L", "N4_L9"])
def test_two_phase_matches_autograd_through_formula(L, N, seed):
    """Output and every gradient (h0, queries, sublayer weights) of the two-phase training path vs
    autograd through ``naive_block_attnres``, in float64 (L not a multiple of N)."""
    subs, h0, q = make(L, seed=seed)
    g_out = torch.randn(h0.shape, dtype=h0.dtype, generator=torch.Generator().manual_seed(seed + 100))
    ref, got = (grads_of(subs, h0, q, N, path, g_out) for path in ("naive", "memory"))
    errs = [assert_close(f"tensor {i}", a, b, 1e-10) for i, (a, b) in enumerate(zip(ref, got))]
    print(f"L={L} N={N} float64: out {errs[0]:.1e}, dh0 {errs[1]:.1e}, dqueries {errs[2]:.1e}, "
          f"max over sublayer params {max(errs[3:]):.1e}")


@pytest.mark.parametrize("L,N", [(7, 2), (7, 3), (6, 6)])
def test_two_phase_float32(L, N):
    """float32: the output equals the naive path's to 1e-6; the gradients are as close to the
    float64 truth as the naive path's own float32 gradients are (both about 1e-6: the sublayers'
    float32 rounding, which no path removes, is what separates two float32 runs). Each tensor is held
    to twice the naive path's largest error over all tensors, its float32 noise level: one tensor's
    naive error can be small by luck (on one CPU 6.1e-7 against the two-phase 1.3e-6, with one thread
    3.3e-7 against 1.2e-6, where both paths' largest errors are about 2e-6), so a per-tensor ratio
    passes on some machines and fails on others."""
    subs, h0, q = make(L, seed=L * 10 + N)
    g_out = torch.randn(h0.shape, dtype=h0.dtype, generator=torch.Generator().manual_seed(1))
    truth = grads_of(subs, h0, q, N, "naive", g_out)
    subs32 = subs.float()
    naive, ours = (grads_of(subs32, h0.float(), q.float(), N, path, g_out.float()) for path in ("naive", "memory"))
    print(f"L={L} N={N} float32: out vs naive {assert_close('out', naive[0], ours[0], 1e-6):.1e}")
    e_naive = [rel_rms_error(t, a) for t, a in zip(truth, naive)]
    e_ours = [rel_rms_error(t, b) for t, b in zip(truth, ours)]
    worst = max(range(len(e_ours)), key=e_ours.__getitem__)
    assert e_ours[worst] <= 2 * max(e_naive), (worst, e_ours[worst], max(e_naive))
    print(f"  vs float64 truth, max over tensors: naive {max(e_naive):.1e}, two-phase {max(e_ours):.1e}")


@settings(max_examples=12, deadline=None)
@given(L=st.integers(1, 9), data=st.data(), B=st.integers(1, 2), T=st.integers(1, 4), d=st.sampled_from([3, 5, 8]))
def test_two_phase_random_shapes(L, data, B, T, d):
    N = data.draw(st.integers(1, L), label="N")
    subs, h0, q = make(L, d=d, seed=L + 10 * N, B=B, T=T)
    g_out = torch.randn(h0.shape, dtype=h0.dtype, generator=torch.Generator().manual_seed(2))
    for i, (a, b) in enumerate(zip(*(grads_of(subs, h0, q, N, path, g_out) for path in ("naive", "memory")))):
        assert_close(f"L={L} N={N} B={B} T={T} d={d} tensor {i}", a, b, 1e-10)


def test_two_phase_double_backward_with_retained_graph():
    """A second backward through the same graph gives the same gradients again (the accumulator is
    rewritten, not added to, by the first read backward meets)."""
    subs, h0, q = make(7, seed=31)
    res = module((16, 7, 3), q, "memory")
    x = h0.clone().requires_grad_()
    out = res(x, subs)
    first = torch.autograd.grad(out.square().sum(), [x, res.queries], retain_graph=True)
    second = torch.autograd.grad(out.square().sum(), [x, res.queries])
    for a, b in zip(first, second):
        assert torch.equal(a, b)



@pytest.mark.parametrize("path", ["naive", "memory", "inference"])
def test_explicit_block_sizes(path):
    """Block sizes given explicitly (K3: 12-layer blocks, the last partial): every path equals the formula
    with the same sizes, the values and gradients; sizes equal to the even split give the count's function."""
    assert block_sizes(10, [4, 4, 2]) == [4, 4, 2] and block_sizes(10, (10,)) == [10]
    for bad in ([4, 4], [4, 0, 6], [4, 4, 2.0], [], [5, True, 4]):
        with pytest.raises(ValueError, match="n_blocks"):
            block_sizes(10, bad)
        with pytest.raises(ValueError, match="n_blocks"):
            BlockAttnRes(16, 10, bad)
    L, sizes = 9, [4, 4, 1]
    subs, h0, q = make(L, seed=11)
    res = module((16, L, sizes), q, path)
    assert res.sizes == sizes and res.n_blocks == 3
    g_out = torch.randn_like(h0)
    with torch.set_grad_enabled(path != "inference"):
        ref = naive_block_attnres(h0, subs, q, sizes)
        assert_close(f"explicit sizes {path}", ref, res(h0, subs), 1e-12)
    assert (ref - naive_block_attnres(h0, subs, q, 3)).abs().max() > 1e-6, "[4, 4, 1] is not the even split"
    assert_close("even sizes == count", naive_block_attnres(h0, subs, q, 3), naive_block_attnres(h0, subs, q, [3, 3, 3]),
                 0.0)
    if path == "memory":
        for a, b in zip(grads_of(subs, h0, q, sizes, "memory", g_out), grads_of(subs, h0, q, sizes, "naive", g_out)):
            assert_close("explicit sizes gradients", b, a, 1e-10)
    weights = res.depth_weights(h0, subs)
    assert weights.shape == (L + 1, len(sizes) + 2)

def test_bool_block_counts_are_refused():
    """n_blocks=True (or n_sublayers=True) was taken as 1: a bool is an int to isinstance."""
    with pytest.raises(ValueError, match="n_blocks"):
        BlockAttnRes(16, 4, True)
    with pytest.raises(ValueError, match="n_sublayers"):
        AttnRes(16, True)
    with pytest.raises(ValueError, match="n_blocks"):
        block_sizes(4, True)


def test_depth_attention_names_bad_sources_and_queries():
    """An empty list raised IndexError, a w of the wrong width torch's matmul RuntimeError."""
    v = [torch.randn(2, 3, 4, dtype=torch.float64) for _ in range(3)]
    for sources, w, match in (([], torch.randn(4), "sources must be a non-empty list"),
                              (v, torch.randn(5), r"w must be a floating-point \[d=4\] tensor, got \[5\]"),
                              (v + [torch.randn(2, 3, 5)], torch.randn(4), "sources must share one shape"),
                              (v, torch.ones(4, dtype=torch.long), "w must be a floating-point")):
        with pytest.raises(ValueError, match=match):
            depth_attention(sources, w)


def test_memory_path_refuses_create_graph():
    """autograd.grad(..., create_graph=True) through the memory path once failed with "modified by an
    inplace operation", then returned first-order gradients whose second derivatives silently missed the
    path's terms where nothing connected them to the graph (a penalty on dh0 gave dW 0 where the naive
    path gives a nonzero value). The path keeps no tensors to trace a second derivative through, so a
    create_graph=True backward now raises, with a constant or a differentiable incoming gradient; the
    naive path is twice differentiable."""
    subs, h0, q = make(6, seed=41)
    res = module((16, 6, 3), q, "naive")
    x = h0.clone().requires_grad_()
    (gx,) = torch.autograd.grad(res(x, subs).square().sum(), x, create_graph=True)
    (dq,) = torch.autograd.grad(gx.square().sum(), res.queries)
    assert dq.abs().max() > 0
    w = torch.randn_like(h0)
    for loss in (lambda o: o.square().sum(), lambda o: (o * w).sum()):
        res = module((16, 6, 3), q, "memory")
        x = h0.clone().requires_grad_()
        with pytest.raises(RuntimeError, match="does not support create_graph=True"):
            torch.autograd.grad(loss(res(x, subs)), x, create_graph=True)
        # A first-order backward through the same module still works.
        (gx,) = torch.autograd.grad(loss(res(x, subs)), x)
        assert torch.isfinite(gx).all()


def test_two_phase_under_autocast_stores_o_in_bf16():
    """bf16 autocast: the inter-block parts o_k are stored in bf16 (sums, softmax and the partial
    sums stay float32). With sublayers that autocast leaves in float32 (torch's own RMSNorm: k3lab's casts
    its output for the matmuls that follow it), that rounding is the only difference from the float32 run:
    visible, and within bf16's precision."""
    torch.manual_seed(41)
    L, d = 6, 32
    subs = nn.ModuleList([nn.Sequential(nn.RMSNorm(d), nn.Tanh()) for _ in range(L)])
    h0, q = torch.randn(2, 8, d), torch.randn(L + 1, d)
    g_out = torch.randn(h0.shape, generator=torch.Generator().manual_seed(4))
    ref = grads_of(subs, h0, q, 2, "memory", g_out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = grads_of(subs, h0, q, 2, "memory", g_out)
    assert got[0].dtype == torch.float32
    for i, (a, b) in enumerate(zip(ref[:3], got[:3])):
        err = assert_close(f"autocast tensor {i}", a, b, 1e-2)
        assert err > 1e-5, f"tensor {i}: no bf16 rounding seen ({err:.1e})"


@pytest.mark.parametrize("L,N,seed", [(6, 2, 7), (8, 3, 8), (5, 5, 9)])
def test_inference_path_matches_naive_float32(L, N, seed):
    subs, h0, q = make(L, d=32, seed=seed, dtype=torch.float32, B=3, T=11)
    q = q * 3  # sharp depth weights: the online-softmax merge must rescale correctly
    with torch.no_grad():
        ref = naive_block_attnres(h0, subs, q, N)
        assert_close("inference", ref, block_attnres_inference(h0, subs, q, N), 1e-6)
        assert_close("module no_grad", ref, module((32, L, N), q, "auto", torch.float32)(h0, subs), 1e-6)


@pytest.mark.parametrize("S,n", [(1, 1), (3, 2), (4, 4)])
def test_closed_forms_match_autograd(S, n):
    """Phase 1 and the merge, forward and backward, against autograd through ``depth_attention``
    (float64): sublayer k > 0 of the block reads blocks[:n] + [p_k], sublayer 0 blocks[:n] only."""
    g = torch.Generator().manual_seed(10 * S + n)
    kw = dict(dtype=torch.float64, generator=g)
    buf = torch.randn(5, 3, 7, 12, **kw) * 2
    W, P = torch.randn(S, 12, **kw), torch.randn(S, 3, 7, 12, **kw)
    dH = torch.randn(S, 3, 7, 12, **kw)
    leaves = [b.clone().requires_grad_() for b in buf[:n]] + [W.clone().requires_grad_(), P.clone().requires_grad_()]
    loss = 0
    for k in range(S):
        sources = leaves[:n] + ([leaves[-1][k]] if k else [])
        loss = loss + (depth_attention(sources, leaves[n][k])[0] * dH[k]).sum()
    ref = torch.autograd.grad(loss, leaves, allow_unused=True)

    h0, o, lse = phase1_fwd_torch(buf, n, W, 1e-6)
    hs = [h0] + [merge_fwd_torch(P[k], o[k - 1], lse[k], W[k], 1e-6)[1] for k in range(1, S)]
    for k in range(S):
        assert_close(f"h{k}", depth_attention(list(buf[:n]) + ([P[k]] if k else []), W[k])[0], hs[k], 1e-12)
    dO, delta = (torch.empty(S - 1, 3, 7, 12, dtype=torch.float64), torch.zeros(S, 3, 7, dtype=torch.float64)) \
        if S > 1 else (None, None)
    dP, dW = torch.zeros_like(P), torch.zeros_like(W)
    for k in range(1, S):
        dP[k], _, dW[k] = merge_bwd_torch(dH[k], None, P[k], o[k - 1], lse[k], W[k], 1e-6, dO[k - 1], delta[k])
    dacc = torch.randn(5, 3, 7, 12, **kw)
    dacc0 = dacc.clone()
    dW += phase1_bwd_torch(buf, n, W, lse, h0, dH[0], dO, delta, 1e-6, dacc, accumulate=True)
    for i in range(n):
        assert_close(f"db{i}", ref[i], dacc[i] - dacc0[i], 1e-10)
    assert torch.equal(dacc[n:], dacc0[n:])
    assert_close("dW", ref[n], dW, 1e-10)
    if S > 1:
        assert_close("dP", ref[n + 1][1:], dP[1:], 1e-10)


def test_train_path_errors():
    subs, h0, q = make(4)
    with pytest.raises(ValueError, match="backend"):
        block_attnres_train(h0, subs, q, 2, backend="cuda")
    with pytest.raises(ValueError, match="queries"):
        block_attnres_train(h0, subs, q[:3], 2)
    with pytest.raises(ValueError, match="n_blocks"):
        block_attnres_train(h0, subs, q, 5)
    with pytest.raises(ValueError, match="exactly one"):
        merge_fwd_torch(None, h0, h0[..., 0], q[0], 1e-6)
    # Regressions: an integer h0 reached the first sublayer, a list of queries gave an AttributeError.
    with pytest.raises(ValueError, match="h0 must be a floating-point tensor"):
        block_attnres_train(h0.long(), subs, q, 2)
    with pytest.raises(ValueError, match="queries must be a torch.Tensor, got list"):
        naive_attnres(h0, subs, q.tolist())


@pytest.mark.parametrize("case", ["output", "sublayer_input"])
def test_memory_path_allows_in_place_changes_as_the_naive_path_does(case, doubles_its_input):
    """Regression: on the torch backend, changing the output (or a sublayer changing its input)
    in place raised "Output 0 of _Phase1 is a view", where the naive path allows it; and once allowed, a
    sublayer's input changed in place was rebuilt for backward as it was before the change (wrong
    gradients, silently; the Triton backend did that already). Values and gradients must match the
    naive path's with the same in-place change."""
    subs, h0, q = make(5, seed=61)
    if case == "sublayer_input":
        subs = nn.ModuleList(doubles_its_input(s) for s in subs)
    g_out = torch.randn(h0.shape, dtype=h0.dtype, generator=torch.Generator().manual_seed(62))
    results = []
    for path in ("naive", "memory"):
        res, x = module((16, 5, 2), q, path), h0.clone().requires_grad_()
        subs.zero_grad()
        out = res(x, subs)
        if case == "output":
            out.mul_(3)
        (out * g_out).sum().backward()
        results.append([out.detach(), x.grad, res.queries.grad] + [p.grad.clone() for p in subs.parameters()])
    for i, (a, b) in enumerate(zip(*results)):
        assert_close(f"{case} tensor {i}", a, b, 1e-10)


class ChangesASavedOutput(nn.Module):
    """A sublayer that doubles tanh's output in place after tanh saved it for its backward."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, h):
        return torch.tanh(self.inner(h)).mul_(2)


@pytest.mark.parametrize("path", ["naive", "memory"])
def test_a_changed_saved_tensor_is_refused_on_every_path(path):
    """Autograd refuses a backward through a saved tensor changed in place since; under the memory
    path's saved-tensor hooks autograd does not check, so the hooks do (else wrong gradients)."""
    subs, h0, q = make(3, seed=63)
    subs = nn.ModuleList(ChangesASavedOutput(s) for s in subs)
    out = module((16, 3, 2), q, path)(h0.clone().requires_grad_(), subs)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_activation_memory_matches_standard_residual():
    """Saved activations: two-phase path <= standard * 1.05 + (N + 1) d per token (the block buffer,
    including its copy of the embedding); in fact standard + ~2 d-vectors per token whatever N is
    (the inter-block parts o_k are recomputed, not kept), plus the logits table ((L + 1)(N + 1) floats
    per token: 2 d-vectors' worth here at N = 8 with d = 64, 0.2 at d = 2048). The naive path is far
    above the bound."""
    torch.manual_seed(0)
    d, L, B, T = 64, 8, 2, 64
    subs = nn.ModuleList([MLP(d, 4 * d) for _ in range(L)])
    x = torch.randn(B, T, d, requires_grad=True)
    unit = d * B * T * 4
    _, std = retained_bytes(lambda: lm.PreNormResidual()(x, subs).square().mean())
    for N in (1, 3, 8):
        bound = 1.05 * std + (N + 1) * unit
        _, ours = retained_bytes(lambda: BlockAttnRes(d, L, N, path="memory")(x, subs).square().mean())
        _, naive = retained_bytes(lambda: BlockAttnRes(d, L, N, path="naive")(x, subs).square().mean())
        print(f"N={N}: two-phase {(ours - std) / unit:+.2f} d-vectors/token over standard "
              f"(bound {(bound - std) / unit:+.2f}), naive {(naive - std) / unit:+.2f}")
        table = (L + 1) * (N + 1) * B * T * 4
        assert ours <= bound and ours <= std + 2.5 * unit + table, (N, ours, std)
        assert naive > bound, (N, naive, std)


def test_retained_bytes_counts_saved_tensors():
    x = torch.randn(1000, requires_grad=True)
    _, n = retained_bytes(lambda: x.sin())  # sin keeps x (existing, not counted) and returns 4000 bytes
    assert n == 4000
    _, n = retained_bytes(lambda: x.exp().sin())  # exp's output is saved by sin (and by exp)
    assert n == 8000


def test_lm_integration_trains_and_matches_naive():
    """BlockAttnRes inside k3lab.lm.LM: same loss and gradients as the naive path, and a few AdamW
    steps lower the loss on a fixed batch."""
    torch.manual_seed(0)
    cfg = lm.LMConfig.tiny(vocab_size=61, d_model=32, n_layers=3, n_heads=2, head_dim=16, max_seq_len=32,
                           mixer="attention")
    model = lm.LM(cfg, residual=BlockAttnRes(32, 6, 3)).double()
    with torch.no_grad():
        model.residual.queries.normal_()
    x, y = torch.randint(0, 61, (2, 12)), torch.randint(0, 61, (2, 12))
    results = {}
    for path in ("naive", "memory"):
        model.residual.path = path
        model.zero_grad()
        loss = model(x, y)[1]
        loss.backward()
        results[path] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    for i, (a, b) in enumerate(zip(results["naive"], results["memory"])):
        assert_close(f"lm tensor {i}", a, b, 1e-10)
    model.residual.path = "auto"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = model(x, y)[1].item()
    for _ in range(5):
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    assert model(x, y)[1].item() < first - 0.1


@pytest.fixture
def buffers_made(monkeypatch):
    """Weak references to every DepthBuffer the memory path makes while the test runs."""
    import weakref

    import k3lab.attnres.train as train

    made = []

    class Tracked(train.DepthBuffer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(train, "DepthBuffer", Tracked)
    return made


def test_memory_path_frees_its_buffer(buffers_made):
    """After backward, nothing keeps the block buffer alive (no reference cycle through the graph)."""
    import gc

    subs, h0, q = make(6, seed=13)
    res = module((16, 6, 3), q, "memory")
    for _ in range(2):
        res(h0.clone().requires_grad_(), subs).sum().backward()
    gc.collect()
    assert len(buffers_made) == 2 and all(r() is None for r in buffers_made)


@pytest.mark.parametrize("backward", ["none", "retain_graph"])
def test_memory_path_frees_its_graph(buffers_made, backward):
    """A forward whose graph is dropped without backward (evaluation with grad on) or after a
    retain_graph backward leaves nothing alive: no saved tensor references its own node."""
    import gc
    import weakref

    subs, h0, q = make(6, seed=14)
    res = module((16, 6, 3), q, "memory")
    y = res(h0.clone().requires_grad_(), subs)
    if backward == "retain_graph":
        y.sum().backward(retain_graph=True)
    out = weakref.ref(y)
    del y
    gc.collect()
    assert out() is None and len(buffers_made) == 1 and buffers_made[0]() is None


def test_phase1_backward_checks_its_gradients():
    g = torch.Generator().manual_seed(4)
    buf, W = torch.randn(4, 6, 12, generator=g, dtype=torch.float64), torch.randn(3, 12, generator=g, dtype=torch.float64)
    h, o, lse = phase1_fwd_torch(buf, 3, W, 1e-6)
    dh, dO, delta = torch.randn_like(h), torch.randn_like(o), torch.randn_like(lse)
    acc = torch.zeros_like(buf)
    for args, match in (((h, dh, dO, None), "exactly when S > 1"), ((h[:1], dh, dO, delta), "h and dh"),
                        ((h, dh, dO[:1], delta), "dO must be"), ((h, dh, dO, delta[1:]), "delta")):
        with pytest.raises(ValueError, match=match):
            phase1_bwd_torch(buf, 3, W, lse, *args, 1e-6, acc)


def test_train_entry_point_checks_buffer_dtype():
    subs = [nn.Linear(8, 8) for _ in range(2)]
    with pytest.raises(ValueError, match="buffer_dtype"):
        block_attnres_train(torch.randn(1, 3, 8), subs, torch.randn(3, 8), 1, buffer_dtype=torch.int32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(eps=-1.0), "eps"), (dict(eps=float("nan")), "eps"), (dict(buffer_dtype=torch.int32), "buffer_dtype"),
    (dict(buffer_dtype="bfloat16"), "buffer_dtype"), (dict(eps=True), "eps"),
], ids=["eps_negative", "eps_nan", "buffer_int", "buffer_str", "eps_bool"])
def test_bad_eps_and_buffer_dtype(kwargs, match):
    """eps=-1 was accepted and the forward returned NaN (rsqrt of a negative mean square);
    buffer_dtype="bfloat16" failed with an AttributeError; eps=True passed as 1."""
    with pytest.raises(ValueError, match=match):
        BlockAttnRes(8, 4, 2, **kwargs)
    with pytest.raises(ValueError, match=match):
        AttnRes(8, 4, **kwargs)


def test_bench_attnres_help_names_the_module(capsys):
    """--help printed `usage: attnres.py`; it must show how the bench is run."""
    from k3lab.bench import attnres as bench

    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m k3lab.bench.attnres "), out[:80]
    # The description is the docstring's whole first paragraph, not its first line.
    assert "overhead of Block AttnRes over the standard residual." in " ".join(out.split())


@pytest.mark.parametrize("entry", ["naive", "train", "inference"])
def test_functional_entry_points_check_eps(entry):
    """Regression: the functions behind BlockAttnRes took eps=-1 and returned NaN."""
    from k3lab.attnres import block_attnres_inference, block_attnres_train, naive_block_attnres

    subs, h0, q = make(4, seed=44)
    fn = {"naive": naive_block_attnres, "train": block_attnres_train, "inference": block_attnres_inference}[entry]
    with pytest.raises(ValueError, match="eps must be a finite number > 0, got -1"):
        fn(h0, subs, q, 2, -1.0)
    # eps = 0 gave NaN outputs and gradients wherever a source vector was zero.
    with pytest.raises(ValueError, match="eps must be a finite number > 0, got 0.0"):
        fn(h0, subs, q, 2, 0.0)


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_torch_compile_keeps_every_gradient(compile_backend):
    """Under torch.compile the memory path's saved-tensor hooks were not carried through: h0's gradient
    came back None (and an embedding's before it None or wrong), with no error. Compiled, the path keeps
    its inputs instead; every gradient equals eager's."""
    torch.manual_seed(0)
    d = 16
    subs = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
    res, emb = BlockAttnRes(d, 4, 2), nn.Linear(d, d)
    with torch.no_grad():
        res.queries.normal_()
    x0 = torch.randn(2, 5, d)
    params = [res.queries, emb.weight, *subs.parameters()]

    def grads(fn):
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        fn(x).backward()
        return [x.grad] + [p.grad for p in params]

    def loss(x):
        return res(emb(x) + x, subs).sum()

    ref = grads(loss)
    torch._dynamo.reset()
    for i, (a, b) in enumerate(zip(grads(torch.compile(loss, backend=compile_backend)), ref)):
        assert a is not None, i
        assert_close(f"grad {i}", b, a, 1e-6)


def test_torch_backend_with_a_peaked_depth_softmax():
    """Regression: with pseudo-queries of scale 10 (a peaked softmax over depth) the memory
    path's "torch" backend, which formed phase 1's weights as exp(s - lse) (summing to 1 only up to
    lse's rounding) and delta_0 from h, lost 30x in float64 against the formula; and a read of one
    source, whose query gradient is exactly 0, got noise (4e-6 in float32)."""
    d, L, N = 16, 6, 2
    torch.manual_seed(0)
    subs64 = nn.ModuleList(nn.Linear(d, d) for _ in range(L)).double()
    g = torch.Generator().manual_seed(1)
    q = 10 * torch.randn(L + 1, d, generator=g, dtype=torch.float64)
    x0, dy = (torch.randn(2, 4, d, generator=g, dtype=torch.float64) for _ in range(2))

    def grads(path, dtype):
        subs = copy.deepcopy(subs64).to(dtype)
        res = BlockAttnRes(d, L, N, path=path, backend=None if path == "naive" else "torch").to(dtype)
        with torch.no_grad():
            res.queries.copy_(q)
        x = x0.to(dtype, copy=True).requires_grad_()
        (res(x, subs) * dy.to(dtype)).sum().backward()
        return x.grad, res.queries.grad

    ref = grads("naive", torch.float64)
    # Before: dx 9.0e-14, dq 2.9e-12; after: 7.5e-15, 4.7e-13 (the formula's own float64 rounding).
    for name, got, want, tol in zip(("dx", "dq"), grads("memory", torch.float64), ref, (3e-14, 1.5e-12)):
        print(f"float64 {name}: {assert_close(name, want, got, tol):.1e}")
    dq32 = grads("memory", torch.float32)[1]
    assert torch.count_nonzero(dq32[0]) == 0


ENTRIES = {
    "naive": lambda h0, subs, q, **kw: naive_block_attnres(h0, subs, q, 2, **kw),
    "full": lambda h0, subs, q, **kw: naive_attnres(h0, subs, q, **kw),
    "inference": lambda h0, subs, q, **kw: block_attnres_inference(h0, subs, q, 2, **kw),
    "train": lambda h0, subs, q, **kw: block_attnres_train(h0, subs, q, 2, **kw),
}


@pytest.mark.parametrize("entry", ENTRIES, ids=list(ENTRIES))
@pytest.mark.parametrize("name", ["h0", "queries"])
def test_non_finite_inputs_raise_naming_them(entry, name):
    """A NaN in h0 or queries came out of every path as a NaN output, where KDA rejects it."""
    subs, h0, queries = make(4)
    bad = dict(h0=h0, queries=queries)
    bad[name] = bad[name].clone().index_fill(0, torch.tensor([1]), float("nan"))
    with pytest.raises(ValueError, match=rf"^{name} contains NaN or inf$"):
        ENTRIES[entry](bad["h0"], subs, bad["queries"])
    # check_values=False skips the check (and its host sync): the NaN goes through.
    assert ENTRIES[entry](bad["h0"], subs, bad["queries"], check_values=False).isnan().any()


@pytest.mark.parametrize("path", ["naive", "memory", "inference"])
def test_module_rejects_nan_h0(path):
    subs, h0, queries = make(4)
    res = module((16, 4, 2), queries, path)
    bad = h0.index_fill(1, torch.tensor([2]), float("inf"))
    with torch.set_grad_enabled(path != "inference"):
        with pytest.raises(ValueError, match=r"^h0 contains NaN or inf$"):
            res(bad, subs)
        # Switched off (the trainer's hot path: no host sync), every path lets it through.
        res.check_values = False
        assert not res(bad, subs).isfinite().all()


@pytest.mark.parametrize("entry", ENTRIES, ids=list(ENTRIES))
def test_h0_beyond_rmsnorm_range_raises(entry):
    """float32 h0 of 1e30: RMSNorm's mean square overflowed, the keys came out 0 and the depth softmax
    uniform, a finite and wrong output. Large but in-range h0 (1e15) still matches float64."""
    subs, h0, queries = make(4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^h0 is too large: max \|h0\| = .*overflows float32 beyond .*\(d=16\)"):
        ENTRIES[entry](h0 * 1e30, subs, queries)
    subs64 = copy.deepcopy(subs).double()
    with torch.no_grad():
        reference = ENTRIES["full" if entry == "full" else "naive"]
        ref = reference(h0.double() * 1e15, subs64, queries.double())
        assert_close("h0 * 1e15", ref, ENTRIES[entry](h0 * 1e15, subs, queries).double(), 1e-5)


@pytest.mark.parametrize("entry", [*ENTRIES, "stage"])
def test_queries_whose_logits_overflow_raise(entry):
    """float32 queries up to 1e38 at d = 16: a logit w^T RMSNorm(v) overflowed to inf and every path returned
    NaN without a word. Queries up to 1e30 (logits near 1e31, a one-hot softmax) still match float64."""
    subs, h0, queries = make(4, dtype=torch.float32)
    queries = queries / queries.abs().max()
    run = (lambda h, s, q: block_attnres_stage(h[None], s, q, 2, 0, 4)) if entry == "stage" else ENTRIES[entry]
    with pytest.raises(ValueError, match=r"^queries are too large: max \|queries\| = .*overflows float32 beyond "
                                         r"finfo.max / d = 2.13e\+37 \(d=16\)"):
        run(h0, subs, queries * 1e38)
    with torch.no_grad():
        ref = run(h0.double(), copy.deepcopy(subs).double(), queries.double() * 1e30)
        assert_close("queries * 1e30", ref, run(h0, subs, queries * 1e30).double(), 1e-5)


@pytest.mark.parametrize("path", ["naive", "memory", "inference"])
def test_an_h0_dtype_other_than_the_queries_is_refused_outside_autocast(path, check_dtype_guard):
    """A bf16 h0 with a float32 model failed in the first sublayer's matmul with torch's "same dtype"
    error; under autocast it is the training path and runs."""
    subs, h0, q = make(4, dtype=torch.float32)
    res = module((16, 4, 2), q, path, dtype=torch.float32)
    with torch.set_grad_enabled(path != "inference"):
        check_dtype_guard("BlockAttnRes", "h0", lambda x: res(x, subs), h0)
