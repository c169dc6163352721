"""FlashKDA's backward: repeated and second backwards, refused double backward, the gate and q/k-norm
backward kernels, gradients of a subset of the inputs, and what the forward keeps for the backward
(saved tensors that activation checkpointing and saved-tensor hooks see, freed with the graph).

Float32 kernels (TRITON_INTERPRET=1 on CPU, set by tests/conftest.py) against ``k3lab.kda.naive_fused_kda``
in float64; the bf16 GPU check is ``python -m k3lab.bench.flash_kda --check-only``.
"""
import gc
import importlib
import weakref

import pytest
import torch
import triton
from torch.utils.checkpoint import checkpoint

from k3lab.kernels.kda import flash_kda
from k3lab.kernels.kda.chunk_bwd import kda_gate_bwd_kernel, kda_qk_norm_bwd_kernel
from k3lab.kernels.kda.utils import chunk_index
from k3lab.testing import DEVICE, FLASH_KDA_ARGS, FLASH_KDA_TOL_GRAD, assert_close


@pytest.mark.timeout(300)
def test_second_backward_through_a_retained_graph(kda_inputs, kda_reference):
    """Two backwards through a retained graph read the same saved intermediates (W, KG, QG, h, V~):
    the same gradients, both matching the float64 reference."""
    inputs = kda_inputs(1, 40, 1, 2, 16, 16, seed=5)
    ours = [x.float().to(DEVICE).requires_grad_() for x in inputs]
    ref = [x.clone().requires_grad_() for x in inputs]
    do = torch.randn(1, 40, 2, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    o, _ = flash_kda(*ours[:7], initial_state=ours[7])
    loss = (o.double().cpu() * do).sum()
    first = torch.autograd.grad(loss, ours, retain_graph=True)
    second = torch.autograd.grad(loss, ours)
    o_ref, _ = kda_reference(*ref[:7], initial_state=ref[7])
    expected = torch.autograd.grad((o_ref * do).sum(), ref)
    for name, a, b, c in zip(FLASH_KDA_ARGS, expected, first, second):
        assert_close(f"d{name} (first)", a, b.cpu(), FLASH_KDA_TOL_GRAD)
        assert_close(f"d{name} (second vs first)", b.double().cpu(), c.cpu(), 1e-12)


def test_second_derivative_is_refused(kda_inputs):
    """The backward is Triton kernels, not differentiable: differentiating a create_graph=True gradient
    silently dropped flash_kda's second-order term (as if it were linear in q). It must raise instead."""
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in kda_inputs(1, 8, 1, 1, 16, 16, seed=13))
    q.requires_grad_()
    o, _ = flash_kda(q, k, v, z, beta, A_log, dt_bias)
    (dq,) = torch.autograd.grad((o**2).sum() + (q**3).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice FlashKDAFunction"):
        dq.sum().backward()


def test_second_derivative_is_refused_for_constant_incoming_gradients(kda_inputs, kda_reference):
    """Regression: with a loss linear in o, the incoming gradient does not require grad, and
    torch's once_differentiable then returned plain tensors: the second derivative silently lacked
    flash_kda's terms (0.058401 vs the reference's 0.059186). It must raise too."""
    q, k, v, z, beta, A_log, dt_bias, _ = (x.float().to(DEVICE) for x in kda_inputs(1, 8, 1, 1, 16, 16, seed=14))
    v.requires_grad_()
    o, _ = flash_kda(q, k, v, z, beta, A_log, dt_bias)
    w = torch.randn_like(o)
    loss = (o * w).sum()
    (dv,) = torch.autograd.grad(loss, v, create_graph=True)
    assert_close("dv with create_graph", torch.autograd.grad((kda_reference(q, k, v, z, beta, A_log, dt_bias)[0] * w)
                                                             .sum(), v)[0], dv.detach(), FLASH_KDA_TOL_GRAD)
    with pytest.raises(RuntimeError, match="differentiate twice FlashKDAFunction"):
        torch.autograd.grad(loss + (dv**2).sum(), v)


@pytest.mark.parametrize("H, HV, K", [(2, 4, 48), (1, 4, 256), (1, 1, 16)])
def test_qk_norm_bwd_kernel_gpu_block(H, HV, K):
    """``kda_qk_norm_bwd_kernel`` with the GPU's 32-token blocks (the CPU launch uses 16), T = 45 (a
    partial block): the GVA sum, the L2-norm backward of scale * q / |q| and k / |k| and dbeta's
    sigmoid backward against autograd in float64."""
    T, BR = 45, 32
    NKT, BK, scale = triton.cdiv(K, 32), max(16, triton.next_power_of_2(K)), K**-0.5
    gen = torch.Generator().manual_seed(25)
    q, k, dq_hat, dk_hat = (torch.randn(T, *s, generator=gen) for s in ((H, K), (H, K), (HV, K), (HV, K)))
    beta, db = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    db_parts = torch.randn(NKT, T, HV, generator=gen)
    dq, dk, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(beta)
    args = [x.to(DEVICE) for x in (q, k, beta, dq_hat, dk_hat, db_parts, db)]
    out = [x.to(DEVICE) for x in (dq, dk, dbeta)]
    kda_qk_norm_bwd_kernel[(triton.cdiv(T, BR), H)](*args, *out, T, scale, H=H, HV=HV, K=K, NKT=NKT, BR=BR, BK=BK)
    qd, kd, bd = (x.double().requires_grad_() for x in (q, k, beta))
    norm = lambda x: x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()  # noqa: E731
    loss = ((norm(qd) * scale).repeat_interleave(HV // H, 1) * dq_hat.double()).sum() \
        + (norm(kd).repeat_interleave(HV // H, 1) * dk_hat.double()).sum() \
        + (bd.sigmoid() * (db_parts.double().sum(0) + db.double())).sum()
    loss.backward()
    for name, a, b in zip(("dq", "dk", "dbeta"), (qd, kd, bd), out):
        assert_close(name, a.grad, b.cpu(), 1e-6)


@pytest.mark.parametrize("HV, K, bias", [(4, 48, True), (2, 256, False), (1, 16, True)])
def test_gate_bwd_kernel(HV, K, bias):
    """``kda_gate_bwd_kernel`` alone against autograd in float64, on two sequences of 45 and 70 tokens
    (partial chunks): the in-chunk reverse cumsum of dG, dgx, and the gate backward (dz, dA_log, ddt_bias)."""
    lengths, lb, BKT = [45, 70], -5.0, 32
    T, NKT = sum(lengths), triton.cdiv(K, BKT)
    gen = torch.Generator().manual_seed(26)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    z, A_log, dt_bias, dG, dgx = r(T, HV, K), 0.5 * r(HV), 0.5 * r(HV * K), r(T, HV, K), r(T, HV, K)
    cu, chunk_indices, _ = chunk_index(lengths, DEVICE)
    NT = chunk_indices.shape[0]
    dz, dA_part, dbias_part = (torch.empty(*s, device=DEVICE) for s in ((T, HV, K), (NKT, NT, HV), (NT, HV, K)))
    dev = lambda x: x.float().to(DEVICE)  # noqa: E731
    kda_gate_bwd_kernel[(NKT, NT, HV)](dev(z), dev(A_log), dev(dt_bias) if bias else None, dev(dG), dev(dgx),
                                       dz, dA_part, dbias_part, cu, chunk_indices, lb, HV=HV, K=K, HAS_BIAS=bias,
                                       BT=64, BKT=BKT)
    zd, ad, biasd = (x.clone().requires_grad_() for x in (z, A_log, dt_bias))
    g = lb * torch.sigmoid(ad.exp()[:, None] * (zd + (biasd.view(HV, K) if bias else 0)))
    G = torch.cat([c.cumsum(0) for n in g.split(lengths) for c in n.split(64)])
    ((G * dG).sum() + (g * dgx).sum()).backward()
    assert_close("dz", zd.grad, dz.double().cpu(), 1e-5)
    assert_close("dA_log", ad.grad, dA_part.sum((0, 1)).double().cpu(), 1e-5)
    if bias:
        assert_close("ddt_bias", biasd.grad, dbias_part.sum(0).view(-1).double().cpu(), 1e-5)


@pytest.mark.timeout(300)
def test_backward_twice_with_retain_graph(kda_inputs):
    """Two backward passes through one graph (retain_graph) give the same gradients: nothing the
    backward updates in place is a saved tensor. K = 48 (two K tiles), GVA 2."""
    inputs = [x.float().to(DEVICE).requires_grad_() for x in kda_inputs(1, 20, 1, 2, 48, 16, seed=26)]
    o, s = flash_kda(*inputs[:7], initial_state=inputs[7], output_final_state=True)
    loss = o.pow(2).sum() + s.pow(2).sum()
    first = torch.autograd.grad(loss, inputs, retain_graph=True)
    second = torch.autograd.grad(loss, inputs)
    for name, a, b in zip(FLASH_KDA_ARGS, first, second):
        assert torch.equal(a, b), name


@pytest.mark.timeout(300)
def test_loss_on_the_final_state_only(kda_inputs, kda_reference):
    """Only the final state in the loss: the backward gets do = 0 and the state gradient alone. q never
    reaches the state, so its gradient is exactly zero (the reference has none); the rest match."""
    inputs = kda_inputs(1, 40, 1, 2, 24, 16, seed=27)
    ours = [x.float().to(DEVICE).requires_grad_() for x in inputs]
    ref = [x.clone().requires_grad_() for x in inputs]
    _, s = flash_kda(*ours[:7], initial_state=ours[7], output_final_state=True)
    _, s_ref = kda_reference(*ref[:7], initial_state=ref[7])
    s.double().pow(2).sum().backward()
    s_ref.pow(2).sum().backward()
    assert ref[0].grad is None and torch.count_nonzero(ours[0].grad) == 0
    for name, a, b in list(zip(FLASH_KDA_ARGS, ref, ours))[1:]:
        assert_close(f"d{name}", a.grad, b.grad.cpu(), 1e-4)


# The module, not the function that k3lab.kernels.kda exports under the same name.
flash_module = importlib.import_module("k3lab.kernels.kda.fused")


def leaves(inputs, want=FLASH_KDA_ARGS):
    return [x.detach().to(DEVICE, torch.float32, copy=True).requires_grad_(n in want)
            for n, x in zip(FLASH_KDA_ARGS, inputs)]


def call(*xs, cu_seqlens=None):
    return flash_kda(*xs[:7], initial_state=xs[7], output_final_state=True, cu_seqlens=cu_seqlens)


def upstream(o, s, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(o.shape, generator=gen, dtype=torch.float64),
            torch.randn(s.shape, generator=gen, dtype=torch.float64))


def loss(o, s, do, ds):
    return (o.double().cpu() * do).sum() + (s.double().cpu() * ds).sum()


@pytest.fixture
def states_made(monkeypatch):
    """Weak references to every h and V~ the state kernel's launcher returns during the test."""
    made = []
    launch = flash_module.kda_state_fwd

    def spy(*args, **kwargs):
        out = launch(*args, **kwargs)
        made.extend(weakref.ref(t) for t in out[:2] if t is not None)
        return out

    monkeypatch.setattr(flash_module, "kda_state_fwd", spy)
    return made


def alive(made):
    gc.collect()
    return [r() is not None for r in made]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_gives_the_plain_gradients(reentrant, kda_inputs):
    """torch.utils.checkpoint around flash_kda: reentrant runs the first forward without a graph (nothing
    kept) and the recompute with one; non-reentrant records twice. Either way the gradients are the
    un-checkpointed ones bit for bit (measured: 2.6e-6 vs float64 for both)."""
    inputs = kda_inputs(1, 40, 1, 2, 16, 16, seed=41)
    plain, ckpt = leaves(inputs), leaves(inputs)
    o, s = call(*plain)
    do, ds = upstream(o, s, seed=42)
    loss(o, s, do, ds).backward()
    loss(*checkpoint(call, *ckpt, use_reentrant=reentrant), do, ds).backward()
    for name, a, b in zip(FLASH_KDA_ARGS, plain, ckpt):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.timeout(120)
def test_kept_states_die_with_the_graph_and_are_not_made_without_one(states_made, kda_inputs):
    """A recording forward keeps h and V~ until its graph goes; a forward where no input requires grad
    (grad mode on) stores none and equals the no_grad forward bit for bit."""
    inputs = kda_inputs(1, 40, 1, 1, 16, 16, seed=43)
    o, s = call(*leaves(inputs))
    assert alive(states_made) == [True, True]
    del o, s
    assert alive(states_made) == [False, False]
    states_made.clear()
    o, s = call(*leaves(inputs, want=()))
    assert not o.requires_grad and states_made == []
    with torch.no_grad():
        o_ng, s_ng = call(*leaves(inputs))
    assert torch.equal(o, o_ng) and torch.equal(s, s_ng)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scope", ["checkpoint", "saved_tensors_hooks"])
def test_saved_tensor_hooks_see_everything_the_backward_keeps(scope, states_made, kda_inputs):
    """Non-reentrant checkpoint (torch's recommended mode) promises that nothing computed inside is held
    after the forward; saved_tensors_hooks (save_on_cpu, the activation manager's offload) promise
    that every tensor kept for the backward goes through pack. h and V~ must not stay alive either way
    (they did while the forward kept them as ctx attributes)."""
    xs = leaves(kda_inputs(1, 40, 1, 1, 16, 16, seed=44))
    if scope == "checkpoint":
        out = checkpoint(call, *xs, use_reentrant=False)
    else:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            out = call(*xs)
    assert out[0].requires_grad
    assert not any(alive(states_made))


@pytest.mark.timeout(120)
def test_two_forwards_one_loss_then_varlen_second_backward_with_new_upstream(kda_inputs, kda_reference):
    """Two recording forwards (varlen 7/33/5, GVA 2; the second on different inputs) in one loss,
    backward with retain_graph (both take the kept intermediates), then a second backward with new
    upstream gradients (both replay): every gradient vs float64 each time (measured <= 1.6e-6)."""
    cu = torch.tensor([0, 7, 40, 45])
    inputs = [kda_inputs(1, 45, 1, 2, 16, 16, N=3, seed=seed) for seed in (45, 46)]
    ours = [leaves(x) for x in inputs]
    refs = [[x.clone().requires_grad_() for x in xs] for xs in inputs]
    outs = [call(*xs, cu_seqlens=cu.to(DEVICE)) for xs in ours]
    outs_ref = [kda_reference(*xs[:7], initial_state=xs[7], cu_seqlens=cu) for xs in refs]
    for seed in (47, 48):
        ups = [upstream(*o, seed=seed + 10 * i) for i, o in enumerate(outs_ref)]
        grads = torch.autograd.grad(sum(loss(*o, *u) for o, u in zip(outs, ups)), ours[0] + ours[1],
                                    retain_graph=True)
        expected = torch.autograd.grad(sum(loss(*o, *u) for o, u in zip(outs_ref, ups)), refs[0] + refs[1],
                                       retain_graph=True)
        for i, (a, b) in enumerate(zip(expected, grads)):
            assert_close(f"call {i // 8} d{FLASH_KDA_ARGS[i % 8]} (upstream {seed})", a, b.cpu(), FLASH_KDA_TOL_GRAD)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("want", [("q", "z"), ("k", "beta_logits"), ("initial_state",), ("A_log", "dt_bias")],
                         ids=["q-z", "k-beta_logits", "h0", "A_log-dt_bias"])
def test_gradients_of_a_subset(want, kda_inputs, kda_run_both, assert_all_close):
    """requires_grad on some inputs only: exactly those get gradients, and they match."""
    inputs = kda_inputs(1, 40, 1, 2, 40, 16, seed=103)
    ours, ref = kda_run_both(inputs, want=want)
    assert sorted(ours) == sorted(ref) == sorted(["o", "final_state", *(f"d{n}" for n in want)])
    assert_all_close(ours, ref)


@pytest.mark.timeout(300)
def test_strided_inputs_and_expanded_output_gradients(kda_inputs, kda_reference):
    """q and k split from one fused projection, v, z and beta non-contiguous, H = 2, HV = 4, and the loss
    o.sum() + final_state.sum(): autograd hands the backward stride-0 (expanded) gradients."""
    B, T, H, HV, K, V = 1, 24, 2, 4, 24, 16
    inputs = kda_inputs(B, T, H, HV, K, V, seed=104)
    grads = []
    for dtype, device in ((torch.float32, DEVICE), (torch.float64, "cpu")):
        xs = [x.detach().to(device, dtype, copy=True).requires_grad_() for x in inputs]
        q, k = torch.cat(xs[:2], -1).split(K, -1)
        v = xs[2].transpose(1, 2).contiguous().transpose(1, 2)
        z = xs[3].transpose(2, 3).contiguous().transpose(2, 3)
        beta = torch.stack([xs[4], xs[4]], -1)[..., 0]
        assert not any(t.is_contiguous() for t in (q, k, v, z, beta))
        fn = flash_kda if dtype == torch.float32 else kda_reference
        o, s = fn(q, k, v, z, beta, *xs[5:7], initial_state=xs[7], output_final_state=True)
        (o.double().sum() + s.double().sum()).backward()
        grads.append([x.grad.cpu() for x in xs])
    for name, a, b in zip(FLASH_KDA_ARGS, grads[1], grads[0]):
        print(f"d{name}: {assert_close(f'd{name}', a, b, FLASH_KDA_TOL_GRAD):.1e}")
