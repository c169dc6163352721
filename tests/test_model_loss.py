"""``k3lab.model.loss.linear_cross_entropy``: the head's cross-entropy in row chunks equals ``F.cross_entropy`` of
the full logits (value and gradients), and ``K3Model.forward(return_logits=False)`` equals the logits path."""
import pytest
import torch
import torch.nn.functional as F

from k3lab.model import K3Config, K3Model
from k3lab.model.loss import linear_cross_entropy
from k3lab.testing import rel_rms_error


def _inputs(N=37, d=16, V=50, dtype=torch.float64, seed=0, ignored=5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, dtype=dtype, generator=g).requires_grad_()
    w = torch.randn(V, d, dtype=dtype, generator=g).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[::ignored] = -100
    return h, w, t


def _grads(loss_fn, h, w, t, scale=2.5):
    h.grad = w.grad = None
    loss = loss_fn(h, w, t)
    (loss * scale).backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


def _reference(h, w, t):
    return F.cross_entropy(F.linear(h, w).float() if h.dtype != torch.float64 else h @ w.t(), t)


@pytest.mark.parametrize("chunk", [1, 7, 37, None])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_equals_full_logits_cross_entropy(chunk, dtype):
    h, w, t = _inputs(dtype=dtype)
    ref = _grads(_reference, h, w, t)
    got = _grads(lambda *a: linear_cross_entropy(*a, chunk=chunk), h, w, t)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    errs = [float((got[0] - ref[0]).abs() / ref[0].abs())] + [rel_rms_error(a, b) for a, b in zip(got[1:], ref[1:])]
    print(f"{dtype} chunk={chunk}: loss, dh, dW relative errors {errs}")
    assert max(errs) < tol
    assert got[0].dtype == dtype and got[2].dtype == dtype


def test_bf16_autocast_matches_the_autocast_head():
    """Under autocast the matmuls run in bf16 and the log-softmax in float32, as the plain head + .float() does;
    the weight gradient comes back in the weight's float32."""
    h, w, t = _inputs(N=64, d=32, V=300, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(_reference, h, w, t)
        got = _grads(lambda *a: linear_cross_entropy(*a, chunk=10), h, w, t)
    errs = [float((got[0] - ref[0]).abs() / ref[0])] + [rel_rms_error(a, b) for a, b in zip(got[1:], ref[1:])]
    print(f"bf16 autocast: loss, dh, dW relative errors {errs}")
    assert errs[0] < 1e-5 and max(errs[1:]) < 2e-2
    assert got[2].dtype == torch.float32


def test_no_counted_target_gives_zero_loss_and_gradients():
    h, w, t = _inputs(N=9)
    t[:] = -100
    loss, dh, dw = _grads(lambda *a: linear_cross_entropy(*a, chunk=4), h, w, t)
    assert loss.item() == 0.0 and not dh.any() and not dw.any()


def test_no_grad_returns_the_loss_only():
    h, w, t = _inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t)
    assert not loss.requires_grad
    assert torch.allclose(loss, _reference(h, w, t).detach(), rtol=1e-12)


def test_compiled_chunk_equals_eager():
    h, w, t = _inputs(N=40, d=8, V=64, dtype=torch.float32)
    eager = _grads(lambda *a: linear_cross_entropy(*a, chunk=16), h, w, t)
    compiled = _grads(lambda *a: linear_cross_entropy(*a, chunk=16, compiled=True), h, w, t)
    errs = [rel_rms_error(a, b) for a, b in zip(compiled, eager)]
    print("compiled vs eager: loss, dh, dW relative errors", errs)
    assert max(errs) < 1e-5


@pytest.mark.parametrize("bad, match", [
    (dict(h=torch.randn(2, 3, 4)), "h must be a floating"),
    (dict(h=torch.ones(4, 3, dtype=torch.long)), "h must be a floating"),
    (dict(weight=torch.randn(5, 4)), r"weight must be \[V, 3\]"),
    (dict(weight=torch.randn(5, 3, dtype=torch.float64)), "weight must be"),
    (dict(targets=torch.zeros(4)), "targets must be integer"),
    (dict(targets=torch.zeros(3, dtype=torch.long)), r"targets must be integer \[N=4\]"),
    (dict(chunk=0), "chunk must be"),
    (dict(ignore_index=None), "ignore_index must be an int"),
    (dict(ignore_index=0.5), "ignore_index must be an int"),
    (dict(ignore_index=True), "ignore_index must be an int"),
    (dict(compiled="yes"), "compiled must be a bool"),
])
def test_bad_input_is_named(bad, match):
    args = dict(h=torch.randn(4, 3), weight=torch.randn(5, 3), targets=torch.zeros(4, dtype=torch.long)) | bad
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(**args)


@pytest.mark.parametrize("mtp", [0, 2])
def test_model_loss_without_logits_equals_the_logits_path(mtp):
    torch.manual_seed(0)
    model = K3Model(K3Config.preset("k3-tiny", num_nextn_predict_layers=mtp))
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    tgt = idx.roll(-1, 1)
    tgt[0, :5] = -100

    def run(return_logits):
        model.zero_grad(set_to_none=True)
        logits, loss = model(idx, tgt, return_logits=return_logits)
        loss.backward()
        return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    logits, ref, ref_g = run(True)
    none, got, got_g = run(False)
    assert logits is not None and none is None
    worst = max(rel_rms_error(got_g[n], ref_g[n]) for n in ref_g)
    print(f"mtp={mtp}: loss {got.item():.6f} vs {ref.item():.6f}, worst gradient relative RMS error {worst:.1e}")
    assert got_g.keys() == ref_g.keys()
    assert abs(got - ref) / ref < 1e-6 and worst < 1e-4


def test_model_return_logits_false_needs_targets():
    model = K3Model(K3Config.preset("k3-tiny"))
    with pytest.raises(ValueError, match="return_logits=False needs targets"):
        model(torch.zeros(1, 4, dtype=torch.long), return_logits=False)
    with pytest.raises(ValueError, match="return_logits must be a bool"):
        model(torch.zeros(1, 4, dtype=torch.long), return_logits="no")


def test_second_derivative_is_refused():
    """The gradients are computed in the forward, so a create_graph=True gradient has no second-order terms
    through h and the weight: differentiating it again lost them without a word (h.grad stayed None). It must
    raise instead."""
    h, w, t = _inputs()
    s = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    (dh,) = torch.autograd.grad(linear_cross_entropy(h, w, t, chunk=7) * s, h, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice _LinearCrossEntropy"):
        (dh**2).sum().backward()


@pytest.mark.parametrize("compiled", [False, True])
def test_inside_torch_compile(compiled):
    """A module calling it under torch.compile: with the chunk's own compile inside, dynamo failed with
    InternalTorchDynamoError ("an intermediate tensor 'dw' ... aliases an input or output")."""
    h, w, t = _inputs(N=23, d=8, V=11, dtype=torch.float32)
    lin = torch.nn.Linear(8, 8)

    def loss_fn(h, w, t):
        return linear_cross_entropy(torch.tanh(lin(h)), w, t, chunk=5, compiled=compiled)

    ref = _grads(lambda h, w, t: _reference(torch.tanh(lin(h)), w, t), h, w, t)
    got = _grads(torch.compile(loss_fn), h, w, t)
    torch._dynamo.reset()
    errs = [rel_rms_error(a, b) for a, b in zip(got, ref)]
    print(f"torch.compile around it, compiled={compiled}: loss, dh, dW relative errors {errs}")
    assert max(errs) < 1e-5


def test_float64_under_autocast_stays_float64():
    """Autocast leaves float64 alone (the plain head of a float64 model stays float64 under it); the chunked
    loss cast h and the weight to bf16 and returned float32, 1e-2 away from the logits path."""
    h, w, t = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(_reference, h, w, t)
        got = _grads(lambda *a: linear_cross_entropy(*a, chunk=7), h, w, t)
    errs = [float((got[0] - ref[0]).abs() / ref[0])] + [rel_rms_error(a, b) for a, b in zip(got[1:], ref[1:])]
    print(f"float64 under bf16 autocast: loss, dh, dW relative errors {errs}")
    assert got[0].dtype == torch.float64 and max(errs) < 1e-12
