"""k3lab.kernels.attnres: the Triton depth-mixing kernels (forward and backward) against the PyTorch
closed form and the formula; on CPU they run under TRITON_INTERPRET=1 at tiny sizes."""
import pytest
import torch

import k3lab

DEVICE = k3lab.setup(verbose=False)  # sets TRITON_INTERPRET=1 before the kernels load on CPU

import torch.nn as nn  # noqa: E402

from k3lab.attnres import BlockAttnRes  # noqa: E402
from k3lab.attnres.mix import mix_bwd_torch, mix_fwd_torch  # noqa: E402
from k3lab.kernels.attnres import mix_bwd, mix_fwd  # noqa: E402
from k3lab.testing import assert_close  # noqa: E402

TOL = 1e-5 if DEVICE.type == "cpu" else 1e-4


@pytest.mark.parametrize("S,n,M,D,with_partial", [
    (4, 3, 9, 24, True),  # odd token count, D not a power of 2
    (2, 1, 5, 16, False),  # a single source
    (6, 6, 33, 40, True),
    (3, 2, 7, 8, False),
], ids=["odd", "single", "wide", "tiny"])
def test_kernel_matches_torch(S, n, M, D, with_partial):
    g = torch.Generator().manual_seed(S * 100 + M)
    buf = (torch.randn(S, M, D, generator=g) * 2).to(DEVICE)
    partial = torch.randn(M, D, generator=g).to(DEVICE) if with_partial else None
    w = torch.randn(D, generator=g).to(DEVICE)
    dh = torch.randn(M, D, generator=g).to(DEVICE)
    h, lse = mix_fwd(buf, n, partial, w, 1e-6)
    h_ref, lse_ref = mix_fwd_torch(buf, n, partial, w, 1e-6)
    assert_close("h", h_ref, h, TOL)
    assert_close("lse", lse_ref, lse, TOL)
    dbuf, dpartial, dw = mix_bwd(dh, buf, n, partial, w, lse_ref, 1e-6)
    dbuf_ref, dpartial_ref, dw_ref = mix_bwd_torch(dh, buf, n, partial, w, lse_ref, 1e-6)
    assert dbuf.shape == (n, M, D)
    assert_close("dbuf", dbuf_ref, dbuf, TOL)
    if with_partial:
        assert_close("dpartial", dpartial_ref, dpartial, TOL)
    if n + with_partial > 1:
        assert_close("dw", dw_ref, dw, TOL)


def test_kernel_accumulates_into_dacc():
    g = torch.Generator().manual_seed(9)
    buf = torch.randn(4, 10, 24, generator=g).to(DEVICE)
    partial, w = torch.randn(10, 24, generator=g).to(DEVICE), torch.randn(24, generator=g).to(DEVICE)
    dh = torch.randn(10, 24, generator=g).to(DEVICE)
    _, lse = mix_fwd_torch(buf, 3, partial, w, 1e-6)
    acc0 = torch.randn(4, 10, 24, generator=g).to(DEVICE)
    acc = acc0.clone()
    dbuf, _, _ = mix_bwd(dh, buf, 3, partial, w, lse, 1e-6, dacc=acc)
    ref, _, _ = mix_bwd_torch(dh, buf, 3, partial, w, lse, 1e-6)
    assert_close("acc[:3]", acc0[:3] + ref, acc[:3], TOL)
    assert torch.equal(acc[3], acc0[3])  # slots >= n untouched
    assert dbuf.data_ptr() == acc.data_ptr()


def test_kernel_bf16_storage():
    """bf16 sources and output, float32 math inside."""
    g = torch.Generator().manual_seed(5)
    buf = torch.randn(3, 6, 32, generator=g).to(DEVICE, torch.bfloat16)
    partial = torch.randn(6, 32, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(32, generator=g).to(DEVICE)
    h, lse = mix_fwd(buf, 2, partial, w, 1e-6)
    h_ref, lse_ref = mix_fwd_torch(buf, 2, partial, w, 1e-6)
    assert h.dtype == torch.bfloat16
    assert_close("h bf16", h_ref.float(), h.float(), 1e-2)
    assert_close("lse bf16", lse_ref, lse, 1e-5)


def test_module_bf16_buffer_close_to_float32():
    """buffer_dtype=bfloat16: same function up to bf16 rounding of the stored blocks."""
    L, N, d = 4, 2, 32
    torch.manual_seed(12)
    subs = nn.ModuleList([nn.Sequential(nn.RMSNorm(d), nn.Linear(d, d), nn.Tanh()) for _ in range(L)]).to(DEVICE)
    h0 = torch.randn(2, 5, d, device=DEVICE)
    out = {}
    for dtype in (None, torch.bfloat16):
        res = BlockAttnRes(d, L, N, path="memory", backend="triton", buffer_dtype=dtype).to(DEVICE)
        with torch.no_grad():
            res.queries.normal_(generator=torch.Generator(device=DEVICE).manual_seed(1))
        x = h0.clone().requires_grad_()
        y = res(x, subs)
        y.square().mean().backward()
        out[dtype] = (y.detach(), x.grad)
    assert out[torch.bfloat16][0].dtype == torch.float32
    assert_close("out", out[None][0], out[torch.bfloat16][0], 2e-2)
    assert_close("grad", out[None][1], out[torch.bfloat16][1], 3e-2)


def test_module_triton_backend_matches_naive():
    """BlockAttnRes memory path on the Triton backend: output and gradients vs autograd through the
    formula (float32)."""
    L, N, d = 5, 2, 16
    torch.manual_seed(11)
    subs = nn.ModuleList([nn.Sequential(nn.RMSNorm(d), nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
                          for _ in range(L)]).to(DEVICE)
    h0, q = torch.randn(1, 6, d, device=DEVICE), torch.randn(L + 1, d, device=DEVICE)
    g_out = torch.randn(h0.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = {}
    for path, backend in (("naive", None), ("memory", "triton")):
        res = BlockAttnRes(16, L, N, path=path, backend=backend).to(DEVICE)
        with torch.no_grad():
            res.queries.copy_(q)
        x = h0.clone().requires_grad_()
        subs.zero_grad()
        y = res(x, subs)
        (y * g_out).sum().backward()
        out[path] = [y.detach(), x.grad, res.queries.grad] + [p.grad.clone() for p in subs.parameters()]
    for i, (a, b) in enumerate(zip(out["naive"], out["memory"])):
        assert_close(f"tensor {i}", a, b, 10 * TOL)
