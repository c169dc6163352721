"""k3lab.kernels.moe: the fused SiTU-GLU / SwiGLU kernel against the PyTorch expression in float64,
forward and backward; on CPU it runs under TRITON_INTERPRET=1 at tiny sizes."""
import pytest
import torch

import k3lab

DEVICE = k3lab.setup(verbose=False)  # sets TRITON_INTERPRET=1 before the kernels load on CPU

from k3lab.kernels.moe import fused_glu, fused_glu_packed, gather_sum  # noqa: E402
from k3lab.moe.activation import glu  # noqa: E402
from k3lab.testing import assert_close  # noqa: E402


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_fused_glu_matches_the_expression(activation, dtype, tol):
    g = torch.Generator().manual_seed(0)
    # Large magnitudes on purpose: both tanh branches saturate (|a| > 4, |u| > 25) in many entries.
    a = (20 * torch.randn(33, 70, generator=g)).to(DEVICE, dtype).requires_grad_()
    u = (60 * torch.randn(33, 70, generator=g)).to(DEVICE, dtype).requires_grad_()
    d_out = torch.randn(33, 70, generator=g).to(DEVICE, dtype)
    y = fused_glu(a, u, activation)
    (y.float() * d_out.float()).sum().backward()
    a64, u64 = a.detach().cpu().double().requires_grad_(), u.detach().cpu().double().requires_grad_()
    y64 = glu(a64, u64, activation)
    (y64 * d_out.double().cpu()).sum().backward()
    assert y.dtype == dtype
    assert_close("out", y64, y.cpu(), tol)
    assert_close("da", a64.grad, a.grad.cpu(), tol)
    assert_close("du", u64.grad, u.grad.cpu(), tol)


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_packed_glu_matches_the_expression_on_its_halves(activation, dtype, tol):
    g = torch.Generator().manual_seed(1)
    h = 24
    scale = torch.cat([torch.full((h,), 20.0), torch.full((h,), 60.0)])  # both tanh branches saturate
    au = (scale * torch.randn(9, 5, 2 * h, generator=g)).to(DEVICE, dtype).requires_grad_()
    d_out = torch.randn(9, 5, h, generator=g).to(DEVICE, dtype)
    y = fused_glu_packed(au, activation)
    (y.float() * d_out.float()).sum().backward()
    au64 = au.detach().cpu().double().requires_grad_()
    y64 = glu(au64[..., :h], au64[..., h:], activation)
    (y64 * d_out.double().cpu()).sum().backward()
    assert y.shape == (9, 5, h) and y.dtype == dtype and au.grad.shape == au.shape
    assert_close("out", y64, y.cpu(), tol)
    assert_close("d_au", au64.grad, au.grad.cpu(), tol)
    with pytest.raises(ValueError, match=r"au must be \[\.\.\., 2h\]"):
        fused_glu_packed(au.detach()[..., 1:])


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "plain"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_gather_sum_matches_float64_with_repeated_rows_and_ragged_tiles(weighted, dtype, tol):
    g = torch.Generator().manual_seed(2)
    N, K, P, D = 37, 3, 50, 150  # N and D not multiples of the tile; rows repeat across tokens
    y = torch.randn(P, D, generator=g).to(DEVICE, dtype)
    idx = torch.randint(0, P, (N, K), generator=g).to(DEVICE)
    idx[0] = 7
    w = torch.rand(N, K, generator=g).to(DEVICE) if weighted else None
    out = gather_sum(y, idx, w)
    ref = y.cpu().double()[idx.cpu()]
    ref = (ref * w.cpu().double()[..., None]).sum(1) if weighted else ref.sum(1)
    assert out.dtype == dtype and out.shape == (N, D)
    assert_close("gather_sum", ref, out.cpu(), tol)
    compiled = torch.compile(lambda a, i, b: 2 * gather_sum(a, i, b), fullgraph=True)
    assert torch.equal(compiled(y, idx, w), 2 * out)


def test_gather_sum_names_a_bad_argument():
    y, idx = torch.randn(5, 4, device=DEVICE), torch.zeros(3, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"y must be a floating-point \[P, D\]"):
        gather_sum(y[0], idx)
    with pytest.raises(ValueError, match=r"idx must be int64 \[N, K\], got \[3, 2\] torch.int32"):
        gather_sum(y, idx.int())
    with pytest.raises(ValueError, match=r"weight must be a floating-point tensor of idx's shape \[3, 2\]"):
        gather_sum(y, idx, torch.ones(3, device=DEVICE))


def test_fused_glu_rejects_bad_input():
    a = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="same|share"):
        fused_glu(a, a[:, :4])
    with pytest.raises(ValueError, match="activation"):
        fused_glu(a, a, "silu")


COMPILE_GLU = """
from sm90_compile import compile_sm90
from k3lab.kernels.moe import glu
for situ in (True, False):
    for dt in ("*bf16", "*fp32"):
        io = dict(a_ptr=dt, u_ptr=dt, n="i64", h="i64", stride="i64", beta1="fp32", beta2="fp32")
        const = dict(SITU=situ, BLOCK=glu.BLOCK)
        print(compile_sm90(glu.glu_fwd_kernel, dict(io, o_ptr=dt), const))
        print(compile_sm90(glu.glu_bwd_kernel, dict(io, do_ptr=dt, da_ptr=dt, du_ptr=dt), const))
from k3lab.kernels.moe import gather
for weighted in (True, False):
    print(compile_sm90(gather.gather_sum_kernel, dict(y="*bf16", idx="*i64", w="*fp32", out="*bf16", N="i32",
                                                      D="i32:16"),
                       dict(K=8, HAS_W=weighted, BN=gather.BN, BD=gather.BD), num_warps=gather.WARPS))
"""


def test_glu_kernels_compile_for_sm90(compile_sm90_lines):
    """The interpreter accepts code the GPU compiler refuses: compile the GLU and gather kernels for the H200 (Triton's
    front end and the wheel's ptxas, no GPU needed) in a process without TRITON_INTERPRET."""
    lines = compile_sm90_lines(COMPILE_GLU)
    assert len(lines) == 10 and all("STACK:0" in line for line in lines), lines
