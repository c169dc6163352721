"""k3lab.attnres: every path (memory-efficient training, inference, the closed-form backward) against
the formula, config errors, zero-init, N = L, activation memory, and the LM integration (CPU)."""
import pytest
import torch
import torch.nn as nn

import k3lab.lm as lm
from k3lab.attnres import (AttnRes, BlockAttnRes, block_attnres_inference, block_sizes, depth_attention,
                           depth_mix, naive_attnres, naive_block_attnres, retained_bytes)
from k3lab.attnres.mix import mix_bwd_torch, mix_fwd_torch
from k3lab.testing import assert_close


class MLP(nn.Module):
    """A pre-norm sublayer: returns f(RMSNorm(h)), not added."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm, self.up, self.down = nn.RMSNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

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
    res = BlockAttnRes(16, 4, 2)
    with pytest.raises(ValueError, match="sublayers"):
        res(torch.randn(1, 3, 16), nn.ModuleList([MLP(16, 8)] * 3))
    with pytest.raises(ValueError, match="h0"):
        res(torch.randn(1, 3, 8), nn.ModuleList([MLP(8, 8)] * 4))


@pytest.mark.parametrize("path", ["naive", "memory", "inference"])
@pytest.mark.parametrize("L,N", [(6, 6), (6, 2), (7, 3)], ids=["full", "N2", "uneven"])
def test_zero_init_is_uniform_average(path, L, N):
    """With w = 0 every read is the plain mean of its sources (written here without softmax)."""
    subs, h0, _ = make(L, seed=1)
    res = BlockAttnRes(h0.shape[-1], L, N, path=path).double()
    assert torch.count_nonzero(res.queries) == 0
    blocks, layer = [h0], 0
    for size in block_sizes(L, N):
        partial = None
        for _ in range(size):
            sources = blocks + ([partial] if partial is not None else [])
            v = subs[layer](sum(sources) / len(sources))
            partial = v if partial is None else partial + v
            layer += 1
        blocks.append(partial)
    ref = sum(blocks) / len(blocks)
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


@pytest.mark.parametrize("L,N,seed", [(6, 1, 3), (6, 3, 4), (7, 7, 5), (9, 4, 6)])
def test_memory_path_matches_autograd_through_formula(L, N, seed):
    """Output and every gradient (h0, queries, sublayer weights) of the recompute path vs autograd
    through ``naive_block_attnres``, in float64."""
    subs, h0, q = make(L, seed=seed)
    g_out = torch.randn(h0.shape, dtype=h0.dtype, generator=torch.Generator().manual_seed(seed + 100))
    grads = {}
    for path in ("naive", "memory"):
        res = module((16, L, N), q, path)
        x = h0.clone().requires_grad_()
        subs.zero_grad()
        out = res(x, subs)
        (out * g_out).sum().backward()
        grads[path] = [out.detach(), x.grad, res.queries.grad] + [p.grad.clone() for p in subs.parameters()]
    for i, (ref, got) in enumerate(zip(grads["naive"], grads["memory"])):
        assert_close(f"tensor {i}", ref, got, 1e-10)


@pytest.mark.parametrize("L,N,seed", [(6, 2, 7), (8, 3, 8), (5, 5, 9)])
def test_inference_path_matches_naive_float32(L, N, seed):
    subs, h0, q = make(L, d=32, seed=seed, dtype=torch.float32, B=3, T=11)
    q = q * 3  # sharp depth weights: the online-softmax merge must rescale correctly
    with torch.no_grad():
        ref = naive_block_attnres(h0, subs, q, N)
        assert_close("inference", ref, block_attnres_inference(h0, subs, q, N), 1e-6)
        assert_close("module no_grad", ref, module((32, L, N), q, "auto", torch.float32)(h0, subs), 1e-6)


@pytest.mark.parametrize("n,with_partial", [(1, False), (3, True), (4, False)])
def test_closed_form_backward(n, with_partial):
    g = torch.Generator().manual_seed(n)
    buf = torch.randn(5, 3, 7, 12, dtype=torch.float64, generator=g) * 2
    partial = torch.randn(3, 7, 12, dtype=torch.float64, generator=g) if with_partial else None
    w = torch.randn(12, dtype=torch.float64, generator=g)
    dh = torch.randn(3, 7, 12, dtype=torch.float64, generator=g)
    srcs = [b.clone().requires_grad_() for b in buf[:n]] + ([partial.clone().requires_grad_()] if with_partial else [])
    wr = w.clone().requires_grad_()
    h_ref, _ = depth_attention(srcs, wr)
    h_ref.backward(dh)
    h, lse = mix_fwd_torch(buf, n, partial, w, 1e-6)
    assert_close("h", h_ref, h, 1e-12)
    dbuf, dpartial, dw = mix_bwd_torch(dh, buf, n, partial, w, lse, 1e-6)
    for i in range(n):
        assert_close(f"dv{i}", srcs[i].grad, dbuf[i], 1e-10)
    if with_partial:
        assert_close("dpartial", srcs[-1].grad, dpartial, 1e-10)
    if n + with_partial > 1:
        assert_close("dw", wr.grad, dw, 1e-10)
    else:
        assert torch.count_nonzero(dw) == 0  # one source: weight 1 whatever w is


def test_depth_mix_errors():
    buf = torch.randn(3, 4, 8)
    with pytest.raises(ValueError, match="backend"):
        depth_mix(torch.zeros(8), None, [buf[0]], backend="cuda")
    with pytest.raises(ValueError, match="at least one"):
        depth_mix(torch.zeros(8), None, [])
    with pytest.raises(ValueError, match="w must be"):
        depth_mix(torch.zeros(4), None, [buf[0]])
    with pytest.raises(ValueError, match="partial"):
        depth_mix(torch.zeros(8), buf[0, :2], [buf[0]])


@pytest.mark.parametrize("with_partial", [True, False])
def test_depth_mix_gradients(with_partial):
    """A stand-alone read: the accumulator/tap route delivers each block's gradient, repeated reads
    of the same blocks sum their gradients."""
    g = torch.Generator().manual_seed(21)
    blocks = [torch.randn(2, 5, 12, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3)]
    partial = torch.randn(2, 5, 12, dtype=torch.float64, generator=g).requires_grad_() if with_partial else None
    w = torch.randn(12, dtype=torch.float64, generator=g).requires_grad_()
    dh = torch.randn(2, 5, 12, dtype=torch.float64, generator=g)
    leaves = blocks + ([partial] if with_partial else []) + [w]
    h_ref, _ = depth_attention([b * 1 for b in blocks] + ([partial] if with_partial else []), w)
    ref = torch.autograd.grad((h_ref * dh).sum(), leaves)
    out = depth_mix(w, partial, blocks)
    got = torch.autograd.grad((out * dh).sum(), leaves)
    assert_close("h", h_ref, out, 1e-12)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert_close(f"grad {i}", a, b, 1e-10)


def test_activation_memory_matches_standard_residual():
    """Saved activations: memory path <= standard * 1.05 + (N + 1) d per token (the block buffer,
    including its copy of the embedding); the naive path is far above that bound."""
    torch.manual_seed(0)
    d, L, B, T = 64, 8, 2, 64
    subs = nn.ModuleList([MLP(d, 4 * d) for _ in range(L)])
    x = torch.randn(B, T, d, requires_grad=True)
    _, std = retained_bytes(lambda: lm.PreNormResidual()(x, subs).square().mean())
    for N in (2, 4, 8):
        bound = 1.05 * std + (N + 1) * d * B * T * 4
        _, ours = retained_bytes(lambda: BlockAttnRes(d, L, N, path="memory")(x, subs).square().mean())
        _, naive = retained_bytes(lambda: BlockAttnRes(d, L, N, path="naive")(x, subs).square().mean())
        assert ours <= bound, (N, ours, std)
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


def test_memory_path_frees_its_buffer(monkeypatch):
    """After backward, nothing keeps the block buffer alive (no reference cycle through the graph)."""
    import gc
    import weakref

    import k3lab.attnres.block as block

    made = []

    class Tracked(block.DepthBuffer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(block, "DepthBuffer", Tracked)
    subs, h0, q = make(6, seed=13)
    res = module((16, 6, 3), q, "memory")
    for _ in range(2):
        res(h0.clone().requires_grad_(), subs).sum().backward()
    gc.collect()
    assert len(made) == 2 and all(r() is None for r in made)


@pytest.mark.parametrize("kwargs, match", [
    (dict(eps=-1.0), "eps"), (dict(eps=float("nan")), "eps"), (dict(buffer_dtype=torch.int32), "buffer_dtype"),
], ids=["eps_negative", "eps_nan", "buffer_int"])
def test_bad_eps_and_buffer_dtype(kwargs, match):
    """eps=-1 was accepted and the forward returned NaN (rsqrt of a negative mean square)."""
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
