"""k3lab.kernels.moe: the fused SiTU-GLU / SwiGLU kernel against the PyTorch expression in float64,
forward and backward; on CPU it runs under TRITON_INTERPRET=1 at tiny sizes."""
import pytest
import torch

import k3lab

DEVICE = k3lab.setup(verbose=False)  # sets TRITON_INTERPRET=1 before the kernels load on CPU

from k3lab.kernels.moe import fused_glu, fused_glu_packed  # noqa: E402
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
"""


def test_glu_kernels_compile_for_sm90(compile_sm90_lines):
    """The interpreter accepts code the GPU compiler refuses: compile both kernels for the H200 (Triton's
    front end and the wheel's ptxas, no GPU needed) in a process without TRITON_INTERPRET."""
    lines = compile_sm90_lines(COMPILE_GLU)
    assert len(lines) == 8 and all("STACK:0" in line for line in lines), lines
