"""k3lab.norm.RMSNorm: torch's RMSNorm whose weight follows a low-precision input onto the fused kernel."""
import warnings

import pytest
import torch
from torch import nn

from k3lab.norm import RMSNorm
from k3lab.testing import rel_rms_error


def _pair(d: int, seed: int):
    ours, theirs = RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
    w = 1 + 0.5 * torch.randn(d, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
    return ours, theirs


def test_float32_equals_torch_rmsnorm():
    ours, theirs = _pair(48, 0)
    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours(x), theirs(x))
    assert ours.state_dict().keys() == theirs.state_dict().keys()


def test_bf16_input_takes_the_fused_path_and_matches_float64():
    ours, _ = _pair(64, 2)
    x64 = torch.randn(4, 7, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = x64.to(torch.bfloat16).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the mismatched-dtype path warns
        y = ours(x)
    assert y.dtype == torch.bfloat16
    w64 = ours.weight.detach().double().requires_grad_()
    xr = x.detach().double().requires_grad_()
    ref = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    err = rel_rms_error(ref, y.double())
    print(f"bf16 RMSNorm vs float64: {err:.1e}")
    assert err < 8e-3
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (y.double() * g).sum().backward()
    (ref * g).sum().backward()
    assert ours.weight.grad.dtype == torch.float32
    werr, xerr = rel_rms_error(w64.grad, ours.weight.grad.double()), rel_rms_error(xr.grad, x.grad.double())
    print(f"weight grad {werr:.1e}, input grad {xerr:.1e}")
    assert werr < 2e-2 and xerr < 2e-2


def test_integer_input_is_refused_by_name():
    """An integer x reached torch's NotImplementedError from inside rms_norm."""
    with pytest.raises(ValueError, match="RMSNorm: x must be a floating-point tensor, got torch.int64"):
        RMSNorm(3)(torch.ones(2, 3, dtype=torch.long))
