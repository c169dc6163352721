"""The fused short convolution with SiLU (``k3lab.kernels.kda.short_conv``): output, dx and dweight against
``causal_short_conv`` then ``F.silu`` in float64 at odd sizes (T < W, ragged token and channel tiles, W from 2
to 8), the argument checks, and KDALayer through it against its PyTorch path. On a CPU the kernels run under
the Triton interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3lab.kda import KDALayer
from k3lab.kda.layer import causal_short_conv
from k3lab.kernels.kda import short_conv as sc
from k3lab.kernels.kda.short_conv import short_conv_silu
from k3lab.testing import assert_close

# (B, T, C, W): T < W; one token; T past the forward's 16-token and the backward's 64-token tiles, and C past
# the 128-channel tile, neither a multiple; K3's W = 4 and the extremes 2 and 8.
SHAPES = [(2, 3, 5, 4), (1, 1, 9, 3), (2, 70, 136, 4), (3, 33, 20, 2), (1, 17, 130, 8), (2, 64, 128, 4)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def inputs(B, T, C, W, seed=0):
    """Fresh float64 x [B, T, C], weight [C, W] (K3's init scale) and upstream gradient dy [B, T, C]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    weight = torch.randn(C, W, generator=gen, dtype=torch.float64) / W**0.5
    dy = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    return x, weight, dy


def reference(x, weight, dy):
    """y, dx, dweight of silu(causal_short_conv(x, weight)) in float64."""
    x, weight = x.double().requires_grad_(), weight.double().requires_grad_()
    y = F.silu(causal_short_conv(x, weight)[0])
    dx, dw = torch.autograd.grad(y, (x, weight), dy.double())
    return y.detach(), dx, dw


def fused(x, weight, dy, device):
    """y, dx, dweight of ``short_conv_silu`` on ``device``, back on the CPU."""
    x, weight = x.to(device).requires_grad_(), weight.to(device).requires_grad_()
    y = short_conv_silu(x, weight)
    dx, dw = torch.autograd.grad(y, (x, weight), dy.to(device, y.dtype))
    return y.detach().cpu(), dx.cpu(), dw.cpu()


@pytest.mark.parametrize("B,T,C,W", SHAPES, ids=[f"B{b}-T{t}-C{c}-W{w}" for b, t, c, w in SHAPES])
def test_float32_matches_float64_reference(B, T, C, W, device):
    x, weight, dy = inputs(B, T, C, W)
    y_ref, dx_ref, dw_ref = reference(x, weight, dy)
    y, dx, dw = fused(x.float(), weight.float(), dy, device)
    assert y.dtype == dx.dtype == dw.dtype == torch.float32
    assert_close("y", y_ref, y, TOL[torch.float32])
    assert_close("dx", dx_ref, dx, TOL[torch.float32])
    assert_close("dweight", dw_ref, dw, TOL[torch.float32])
    with torch.no_grad():
        assert torch.equal(short_conv_silu(x.float().to(device), weight.float().to(device)).cpu(), y)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float64)])
@pytest.mark.parametrize("B,T,C,W", [(2, 70, 136, 4), (1, 5, 12, 8)])
def test_16_bit_inputs(B, T, C, W, x_dtype, w_dtype, device):
    """16-bit x (as under autocast), weight of any float dtype: y and dx in x's dtype, dweight in weight's,
    against the float64 reference on the same rounded inputs."""
    x, weight, dy = inputs(B, T, C, W, seed=1)
    x, weight, dy = x.to(x_dtype), weight.to(w_dtype), dy.to(x_dtype)
    y_ref, dx_ref, dw_ref = reference(x, weight, dy)
    y, dx, dw = fused(x, weight, dy, device)
    assert y.dtype == dx.dtype == x_dtype and dw.dtype == w_dtype
    assert_close("y", y_ref, y, TOL[x_dtype])
    assert_close("dx", dx_ref, dx, TOL[x_dtype])
    assert_close("dweight", dw_ref, dw, TOL[x_dtype])


def test_strided_inputs(device):
    """A non-contiguous x (a slice of a wider projection), a transposed weight and an expanded upstream
    gradient give the contiguous result."""
    x, weight, dy = inputs(2, 19, 24, 4, seed=2)
    wide = torch.randn(2, 19, 48, dtype=torch.float64)
    wide[..., ::2] = x
    y_ref, dx_ref, dw_ref = reference(x, weight, dy)
    y, dx, dw = fused(wide[..., ::2].float(), weight.T.contiguous().T.float(), dy, device)
    assert_close("y", y_ref, y, TOL[torch.float32])
    assert_close("dx", dx_ref, dx, TOL[torch.float32])
    assert_close("dweight", dw_ref, dw, TOL[torch.float32])
    # The upstream gradient of a sum is expanded ones (stride 0).
    _, dx_ref, dw_ref = reference(x, weight, torch.ones_like(x))
    x32, w32 = x.float().to(device).requires_grad_(), weight.float().to(device).requires_grad_()
    dx, dw = torch.autograd.grad(short_conv_silu(x32, w32).sum(), (x32, w32))
    assert_close("dx (dy of a sum)", dx_ref, dx.cpu(), TOL[torch.float32])
    assert_close("dweight (dy of a sum)", dw_ref, dw.cpu(), TOL[torch.float32])


def test_bad_inputs(device):
    x, w = torch.randn(2, 5, 8, device=device), torch.randn(8, 4, device=device)
    cases = [
        ((x[0], w), "x must be a \\[B, T, C\\] tensor, got \\[5, 8\\]"),
        ((x.tolist(), w), "x must be a \\[B, T, C\\] tensor, got list"),
        ((x.long(), w), "x must be float16, bfloat16 or float32, got torch.int64"),
        ((x.double(), w), "x must be float16, bfloat16 or float32, got torch.float64"),
        ((x, w[:7]), "weight must be \\[C, W\\] with C = x.shape\\[-1\\] = 8, got \\[7, 4\\]"),
        ((x, w[:, 0]), "weight must be \\[C, W\\] with C = x.shape\\[-1\\] = 8, got \\[8\\]"),
        ((x, None), "weight must be \\[C, W\\] with C = x.shape\\[-1\\] = 8, got None"),
        ((x, w[:, :1]), "weight's width W must be in \\[2, 8\\], got weight \\[8, 1\\]"),
        ((x, torch.randn(8, 9, device=device)), "weight's width W must be in \\[2, 8\\], got weight \\[8, 9\\]"),
        ((x, w.int()), "weight must be a floating-point tensor, got torch.int32"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            short_conv_silu(*args)
    if device == "cuda":
        with pytest.raises(ValueError, match="weight must be on x's device"):
            short_conv_silu(x, w.cpu())
    # The custom ops check their arguments too (they read raw pointers): layout, C and W, dy's shape.
    fwd, bwd = torch.ops.k3lab.short_conv_silu_fwd, torch.ops.k3lab.short_conv_silu_bwd
    with pytest.raises(ValueError, match="x, weight \\(and dy\\) must be contiguous"):
        fwd(x.transpose(1, 2).contiguous().transpose(1, 2), w)
    with pytest.raises(ValueError, match="must be contiguous"):
        fwd(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="weight must be \\[C, W\\] with C = x.shape\\[-1\\] = 8, got \\[16, 4\\]"):
        fwd(x, torch.randn(16, 4, device=device))
    with pytest.raises(ValueError, match="weight's width W must be in \\[2, 8\\], got weight \\[8, 12\\]"):
        fwd(x, torch.randn(8, 12, device=device))
    with pytest.raises(ValueError, match="dy must be a tensor of x's shape \\[2, 5, 8\\]"):
        bwd(x, w, x[:, :4])


def test_torch_reference_names_bad_inputs():
    """causal_short_conv (the layer's PyTorch path) failed with unpacking, broadcasting and split errors."""
    x, w = torch.randn(1, 5, 4), torch.randn(4, 4)
    cases = [
        ((torch.randn(5, 4), w), r"x must be a floating-point \[B, T, C\] tensor, got \[5, 4\]"),
        ((x.long(), w), r"x must be a floating-point \[B, T, C\] tensor, got \[1, 5, 4\] torch.int64"),
        ((x, torch.randn(3, 4)), r"weight must be a floating-point \[C, W\] with C = x.shape\[-1\] = 4 and W >= 1, got \[3, 4\]"),
        ((x, w, None, torch.tensor([0, 3, 4])), r"cu_seqlens must start at 0 and end at T=5, got 0 ... 4"),
        ((torch.randn(2, 5, 4), w, None, torch.tensor([0, 5])), r"x must be \[1, T, C\], got B = 2"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            causal_short_conv(*args)


def test_cpu_without_the_interpreter_is_named_eager_and_compiled(monkeypatch):
    """On a CPU without TRITON_INTERPRET=1 the call says to run k3lab.setup(), eager and from a compiled graph
    (where the check runs in the op, as the graph runs) alike, instead of Triton's driver error."""
    monkeypatch.setattr(sc, "interpreting", lambda: False)
    x, w = torch.randn(2, 5, 8), torch.randn(8, 4)
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1 .* call k3lab.setup\\(\\) first"):
        short_conv_silu(x, w)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1 .* call k3lab.setup\\(\\) first"):
        torch.compile(lambda a, b: short_conv_silu(a, b) + 1)(x, w)
    torch._dynamo.reset()


def make_layer(device, conv_backend, seed=0):
    torch.manual_seed(seed)
    return KDALayer(32, 2, 8, num_v_heads=4, v_head_dim=6, chunk_size=16, conv_backend=conv_backend).to(device)


def run_layer(layer, x, **kwargs):
    """The layer's output and the gradients of x and every parameter for a fixed random upstream gradient."""
    x = x.clone().requires_grad_()
    y, _ = layer(x, **kwargs)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y)
    params = [p for _, p in sorted(layer.named_parameters())]
    grads = torch.autograd.grad(y, [x, *params], dy)
    names = ["x"] + [n for n, _ in sorted(layer.named_parameters())]
    return y.detach(), dict(zip(names, grads))


@pytest.fixture
def calls(monkeypatch):
    """Counts the layer's calls of ``short_conv_silu`` (the layer imports it from the module when it runs)."""
    count = []

    def counting(*args):
        count.append(1)
        return short_conv_silu(*args)

    monkeypatch.setattr(sc, "short_conv_silu", counting)
    return count


def test_layer_fused_path_matches_torch_path(device, calls):
    """KDALayer with conv_backend="triton" (training: no cache, use_cache=False) runs the kernel for q, k, v
    and gives the PyTorch path's output and gradients of x and every parameter."""
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(3)).to(device)
    y_ref, g_ref = run_layer(make_layer(device, "torch"), x, use_cache=False)
    assert not calls
    y, g = run_layer(make_layer(device, "triton"), x, use_cache=False)
    assert len(calls) == 3
    assert_close("y", y_ref, y, 1e-5)
    for name in g_ref:
        assert_close(f"d{name}", g_ref[name], g[name], 1e-5)


def test_inside_torch_compile_without_a_graph_break(device):
    """The kernels are custom ops: ``short_conv_silu`` between two PyTorch ops compiles as one graph
    (fullgraph) and gives the eager output and gradients; a compiled KDALayer with conv_backend="triton" gives
    the PyTorch path's (its KDA operator stays eager by design)."""
    x, weight, dy = (t.float().to(device) for t in inputs(2, 21, 40, 4))

    def f(x, weight):
        return short_conv_silu(torch.sin(x), weight) * 2

    outs = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y = fn(xg, wg)
        outs.append((y.detach(), *torch.autograd.grad(y, (xg, wg), dy)))
    for name, a, b in zip(("y", "dx", "dweight"), *outs):
        assert_close(name, a, b, 1e-5)
    h = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(7)).to(device)
    y_ref, g_ref = run_layer(make_layer(device, "torch"), h, use_cache=False)
    layer = make_layer(device, "triton")
    y, g = run_layer(torch.compile(layer), h, use_cache=False)
    assert_close("y", y_ref, y, 1e-5)
    for name in g_ref:
        assert_close(f"d{name}", g_ref[name], g[name if name == "x" else f"_orig_mod.{name}"], 1e-5)


@pytest.mark.parametrize("case", ["use_cache", "cu_seqlens", "cache", "float64"])
def test_layer_keeps_torch_path_where_the_kernel_differs(case, device, calls):
    """With a state to return or start from, packed sequences or float64, conv_backend="triton" runs
    ``causal_short_conv`` and gives the "torch" result bit for bit."""
    x = torch.randn(1, 11, 32, generator=torch.Generator().manual_seed(4)).to(device)
    kwargs = dict(use_cache=case == "use_cache")
    if case == "cu_seqlens":
        kwargs["cu_seqlens"] = torch.tensor([0, 4, 11], device=device)
    layers = [make_layer(device, backend) for backend in ("torch", "triton")]
    if case == "float64":
        layers = [layer.double() for layer in layers]
        x = x.double()
    if case == "cache":
        _, cache = layers[0](x[:, :3])
        kwargs.update(cache=cache, use_cache=False)
        x = x[:, 3:]
    (y_ref, _), (y, _) = (layer(x, **kwargs) for layer in layers)
    assert not calls
    assert torch.equal(y_ref, y)


def test_layer_default_backend(device, calls):
    """conv_backend=None: the kernel on CUDA; on the CPU the PyTorch path, bit for bit, interpreter or not."""
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(6)).to(device)
    y, _ = make_layer(device, None)(x, use_cache=False)
    assert len(calls) == (3 if device == "cuda" else 0)
    if device == "cpu":
        assert torch.equal(make_layer(device, "torch")(x, use_cache=False)[0], y)
    with pytest.raises(ValueError, match="conv_backend must be one of"):
        KDALayer(32, 2, 8, conv_backend="cuda")
