"""k3lab.lm: shapes, causality, learning, config validation, the training loop (tiny configs, CPU)."""
import numpy as np
import pytest
import torch
import torch.nn as nn

import k3lab.lm as lm

VOCAB = 97


def tiny(mixer: str = "kda", **kw) -> lm.LMConfig:
    return lm.LMConfig.tiny(**{**dict(vocab_size=VOCAB, d_model=32, n_heads=2, head_dim=16, max_seq_len=80,
                                      mixer=mixer), **kw})


@pytest.mark.parametrize("mixer", ["attention", "kda", "hybrid"])
def test_forward_shapes(mixer):
    torch.manual_seed(0)
    model = lm.LM(tiny(mixer, n_layers=4))
    x = torch.randint(0, VOCAB, (3, 21))
    logits, loss = model(x)
    assert logits.shape == (3, 21, VOCAB) and logits.dtype == torch.float32 and loss is None
    logits, loss = model(x, torch.randint(0, VOCAB, (3, 21)))
    assert loss.ndim == 0 and torch.isfinite(loss)
    # 4 layers -> [mixer, ffn] x 4.
    assert len(model.sublayers) == 8
    kinds = ["attention" if isinstance(s.fn, lm.CausalSelfAttention) else "kda" for s in model.sublayers[::2]]
    assert kinds == model.config.layer_mixers()


def test_hybrid_layout_is_k3s():
    assert tiny("hybrid", n_layers=9).layer_mixers() == ["kda"] * 3 + ["attention"] + ["kda"] * 3 + ["attention"] * 2


@pytest.mark.parametrize("mixer", ["attention", "kda"])
def test_causal(mixer):
    """Changing token t changes no logit before t (and does change logits at t)."""
    torch.manual_seed(1)
    model = lm.LM(tiny(mixer)).double()
    x = torch.randint(0, VOCAB, (2, 70))
    t = 41
    x2 = x.clone()
    x2[:, t] = (x[:, t] + 1) % VOCAB
    a, _ = model(x)
    b, _ = model(x2)
    assert torch.equal(a[:, :t], b[:, :t])
    assert (a[:, t:] - b[:, t:]).abs().max() > 1e-6


@pytest.mark.parametrize("mixer", ["attention", "kda"])
def test_loss_decreases_on_fixed_batch(mixer):
    torch.manual_seed(2)
    model = lm.LM(tiny(mixer))
    x, y = torch.randint(0, VOCAB, (2, 2, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Starts near ln(VOCAB) = 4.57 and memorises the batch.
    assert abs(losses[0] - np.log(VOCAB)) < 0.3
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("bad, match", [
    (dict(mixer="mamba"), "mixer"),
    (dict(d_model=0), "d_model"),
    (dict(n_layers=-1), "n_layers"),
    (dict(head_dim=15), "head_dim"),
    (dict(ffn_mult=0.0), "ffn_mult"),
    (dict(ffn_mult=float("inf")), "ffn_mult"),
    (dict(ffn_mult="2"), "ffn_mult"),
    (dict(tie_embeddings="no"), "tie_embeddings"),
    (dict(n_v_heads=3), "n_v_heads"),
    (dict(vocab_size=1.5), "vocab_size"),
], ids=["mixer", "d_model", "n_layers", "odd_head_dim", "ffn_mult", "ffn_mult_inf", "ffn_mult_str", "tie_str",
        "n_v_heads", "vocab_float"])
def test_bad_config(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny(**bad)


def test_bad_inputs():
    model = lm.LM(tiny("attention"))
    with pytest.raises(ValueError, match="idx"):
        model(torch.randint(0, VOCAB, (5,)))
    with pytest.raises(ValueError, match="targets"):
        model(torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 4)))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.randint(0, VOCAB, (1, 81)))


def test_count_params_tied_once():
    cfg = tiny("attention")
    model = lm.LM(cfg)
    assert model.head.weight is model.embed.weight
    by_hand = sum(p.numel() for n, p in model.named_parameters())  # named_parameters dedups ties
    assert lm.count_params(model) == by_hand
    assert lm.count_params(model, exclude_embedding=True) == by_hand - VOCAB * cfg.d_model


def test_residual_is_pluggable():
    """A custom residual sees h0 and the sublayer list, and its output feeds the head."""

    class Recorder(nn.Module):
        def forward(self, h0, sublayers):
            self.n = len(sublayers)
            return torch.zeros_like(h0)

    rec = Recorder()
    model = lm.LM(tiny("kda"), residual=rec)
    logits, _ = model(torch.randint(0, VOCAB, (1, 9)))
    assert rec.n == 4
    # Zero stream -> RMSNorm gives 0 -> every logit is 0.
    assert logits.abs().max() == 0
    # Default PreNormResidual is h + f(h), in order.
    h0 = torch.randn(1, 3, 4)
    subs = nn.ModuleList([nn.Identity(), nn.Identity()])
    torch.testing.assert_close(lm.PreNormResidual()(h0, subs), 4 * h0)


def test_lr_schedule():
    lrs = [lm.lr_at(s, 100, 1.0, warmup=10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_train_loop_learns_a_pattern():
    """train() on a repeating token stream: loss falls, logs are aligned, run is seeded."""
    pytest.importorskip("k3lab.data")
    stream = np.tile(np.arange(VOCAB, dtype=np.uint16), 50)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        model = lm.LM(tiny("attention"))
        runs.append(lm.train(model, steps=30, batch_size=4, seq_len=32, lr=1e-2, device="cpu", seed=5,
                             log_every=10, eval_batches=2, data=(stream, stream), progress=False))
    hist = runs[0]
    assert hist["step"] == [10, 20, 30]
    assert all(len(v) == 3 for v in hist.values())
    assert hist["val_loss"][-1] < 0.5 * np.log(VOCAB)
    assert all(t > 0 for t in hist["tokens_per_s"])
    assert runs[0]["loss"] == runs[1]["loss"] and runs[0]["val_loss"] == runs[1]["val_loss"]
    with pytest.raises(ValueError, match="steps"):
        lm.train(model, steps=0, batch_size=4, seq_len=32, lr=1e-2, device="cpu", data=(stream, stream))



@pytest.mark.parametrize("M", [2, 4])
def test_train_with_microbatches_takes_the_step_of_one_batch(M):
    """M micro-batches of B / M sequences (each loss / M, gradients accumulated) take the optimizer step of
    one batch of B: the same losses and weights, to float32 rounding, on random tokens."""
    from k3lab.testing import assert_close

    stream = np.random.default_rng(0).integers(0, VOCAB, 5000).astype(np.uint16)
    runs = []
    for m in (1, M):
        torch.manual_seed(3)
        model = lm.LM(tiny("attention"))
        hist = lm.train(model, steps=3, batch_size=4, seq_len=16, lr=1e-2, device="cpu", seed=5, log_every=1,
                        eval_batches=1, data=(stream, stream), progress=False, microbatches=m)
        runs.append((hist["loss"], torch.cat([p.detach().flatten() for p in model.parameters()])))
    (loss_one, w_one), (loss_m, w_m) = runs
    assert np.allclose(loss_one, loss_m, rtol=1e-5, atol=0), (loss_one, loss_m)
    print(f"M={M}: weights after 3 steps, rel RMS error {assert_close('weights', w_one, w_m, 1e-4):.1e}")
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match="microbatches must be a positive int dividing batch_size=4"):
            lm.train(model, steps=1, batch_size=4, seq_len=16, lr=1e-2, device="cpu", data=(stream, stream),
                     progress=False, microbatches=bad)


def test_train_with_an_optimizer_factory():
    """``optimizer`` builds the optimizer from (model, lr, weight_decay); the schedule sets every group's lr."""
    stream = np.tile(np.arange(VOCAB, dtype=np.uint16), 50)
    model = lm.LM(tiny("attention"))
    seen = []

    def sgd(m, lr, wd):
        seen.append((lr, wd))
        return torch.optim.SGD(m.parameters(), lr=lr, weight_decay=wd)

    kw = dict(steps=3, batch_size=2, seq_len=8, device="cpu", data=(stream, stream), progress=False, log_every=1)
    before = [p.detach().clone() for p in model.parameters()]
    hist = lm.train(model, lr=1e-2, weight_decay=0.05, warmup=0, optimizer=sgd, **kw)
    assert seen == [(1e-2, 0.05)] and hist["lr"][0] == pytest.approx(1e-2)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="optimizer"):
        lm.train(model, lr=1e-2, optimizer=lambda m, lr, wd: None, **kw)

def test_token_ids_out_of_range_or_not_integer():
    """Ids outside [0, vocab_size) failed deep inside (IndexError from the embedding or the loss);
    float ids with a RuntimeError from the embedding."""
    model = lm.LM(tiny("attention"))
    ok = torch.randint(0, VOCAB, (1, 5))
    for idx in (torch.tensor([[1, 2, VOCAB]]), torch.tensor([[1, -1, 2]]), ok.float()):
        with pytest.raises(ValueError, match="idx"):
            model(idx)
    with pytest.raises(ValueError, match="targets"):
        model(ok, torch.full_like(ok, VOCAB))
    with pytest.raises(ValueError, match="targets"):
        model(ok, ok.float())
    # -100 is cross_entropy's ignore index: still allowed.
    model(ok, torch.full_like(ok, -100).index_fill_(1, torch.tensor([0]), 3))


def test_train_rejects_bad_arguments_before_training():
    """eval_batches=0 raised ZeroDivisionError after the first log_every steps; lr=inf trained to NaN;
    a token stream with ids >= the model's vocab_size raised IndexError at a random step."""
    stream = np.tile(np.arange(VOCAB, dtype=np.uint16), 50)
    model = lm.LM(tiny("attention"))
    kw = dict(steps=2, batch_size=2, seq_len=8, device="cpu", data=(stream, stream), progress=False)
    with pytest.raises(ValueError, match="eval_batches"):
        lm.train(model, lr=1e-3, eval_batches=0, **kw)
    with pytest.raises(ValueError, match="lr"):
        lm.train(model, lr=float("inf"), **kw)
    # grad_clip=-1 flipped every gradient (clip_grad_norm_ scales by it): the loss rose.
    for bad in (dict(grad_clip=-1.0), dict(grad_clip=0.0), dict(weight_decay=float("nan")), dict(weight_decay=-0.1),
                dict(warmup=-1), dict(warmup=2.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            lm.train(model, lr=1e-3, **kw, **bad)
    big = stream.copy()
    big[-1] = VOCAB
    with pytest.raises(ValueError, match="vocab_size"):
        lm.train(model, lr=1e-3, **dict(kw, data=(big, stream)))
    # A negative id failed at the step that first sampled it, after the model had trained in place.
    neg = np.tile(np.arange(VOCAB, dtype=np.int64), 50)
    neg[-1] = -1
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="the val tokens hold id -1: token ids must be >= 0"):
        lm.train(model, lr=1e-3, **dict(kw, data=(stream, neg)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # grad_clip=None or "1" raised TypeError from a comparison; device="cuda" without CUDA an AssertionError.
    for bad, match in ((dict(grad_clip=None), "grad_clip"), (dict(grad_clip="1"), "grad_clip"),
                       (dict(weight_decay=None), "weight_decay")):
        with pytest.raises(ValueError, match=match):
            lm.train(model, lr=1e-3, **kw, **bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' but torch sees no CUDA device"):
            lm.train(model, lr=1e-3, **dict(kw, device="cuda"))
    # steps=True trained one step; lr="1e-3" raised TypeError; max_seconds=NaN never stopped early and -1
    # stopped after one step; data as lists raised AttributeError, one array a tuple-unpacking error.
    for bad, match in ((dict(steps=True), "steps"), (dict(lr="1e-3"), "lr"), (dict(max_seconds=float("nan")),
                       "max_seconds"), (dict(max_seconds=-1.0), "max_seconds"),
                       (dict(data=(list(stream), list(stream))), "data must be"), (dict(data=(stream,)), "data must be")):
        with pytest.raises(ValueError, match=match):
            lm.train(model, **dict(dict(kw, lr=1e-3), **bad))


@pytest.mark.parametrize("bad, match", [
    (dict(kda_gate="mamba"), "LMConfig.kda_gate must be one of"),
    (dict(kda_chunk_size=24), "LMConfig.kda_chunk_size must be an int"),
    (dict(kda_chunk_size=True), "LMConfig.kda_chunk_size must be an int"),
    (dict(rope_theta=0.0), "LMConfig.rope_theta must be a finite number > 0"),
    (dict(rope_theta=float("nan")), "LMConfig.rope_theta"),
    (dict(norm_eps=-1e-6), "LMConfig.norm_eps must be a finite number > 0"),
    (dict(norm_eps=float("nan")), "LMConfig.norm_eps"),
    (dict(init_std=float("nan")), "LMConfig.init_std must be a finite number >= 0"),
    (dict(init_std=-0.02), "LMConfig.init_std"),
    (dict(d_model=True), "LMConfig.d_model must be a positive int, got True"),
    (dict(n_v_heads=True), "LMConfig.n_v_heads"),
    (dict(n_v_heads=2.0), "LMConfig.n_v_heads"),
], ids=["gate", "chunk24", "chunk_bool", "theta0", "theta_nan", "eps_neg", "eps_nan", "std_nan", "std_neg",
        "d_model_bool", "hv_bool", "hv_float"])
def test_bad_config_more_fields(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny(**bad)


def test_empty_batch_is_a_clear_error():
    for mixer in ("kda", "attention"):
        model = lm.LM(tiny(mixer))
        with pytest.raises(ValueError, match=r"idx must be \[B, T\] with B >= 1 and T >= 1, got shape \[0, 5\]"):
            model(torch.zeros(0, 5, dtype=torch.long))


def test_ids_that_are_not_tensors_are_a_clear_error():
    """A list of ids or a 1-D tensor failed with AttributeError ('list' object has no attribute 'ndim') or
    a shape message; a list of targets with AttributeError on .shape."""
    model = lm.LM(tiny("attention"))
    x = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"idx must be \[B, T\] token ids \(a torch.Tensor\), got list"):
        model([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"idx must be \[B, T\] token ids \(a torch.Tensor\), got \[5\]"):
        model(x[0])
    with pytest.raises(ValueError, match=r"targets must have idx's shape \[2, 5\], got list"):
        model(x, x.tolist())


def test_any_integer_id_dtype_and_evaluate_needs_batches():
    """uint8/int16 ids passed the id check, then failed in nn.Embedding or cross_entropy (int32/int64
    only); evaluate on no batches raised ZeroDivisionError."""
    torch.manual_seed(0)
    model = lm.LM(tiny("attention"))
    x = torch.randint(0, VOCAB, (2, 8))
    logits, loss = model(x, x)
    for dtype in (torch.uint8, torch.int16, torch.int32):
        got_logits, got_loss = model(x.to(dtype), x.to(dtype))
        assert torch.equal(got_logits, logits) and torch.equal(got_loss, loss)
    with pytest.raises(ValueError, match="at least one"):
        lm.evaluate(model, [], amp=False)


@pytest.mark.parametrize("mixer", ["attention", "kda"])
def test_loss_is_the_mean_over_counted_targets(mixer):
    """All targets -100: loss 0 with zero gradients (the mean over no targets was 0/0 = NaN); otherwise the
    same bits as cross_entropy's mean, with and without some targets ignored."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = lm.LM(tiny(mixer))
    x, y = torch.randint(0, VOCAB, (3, 17)), torch.randint(0, VOCAB, (3, 17))
    logits, loss = model(x, torch.full_like(y, -100))
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    y[0, :5] = -100
    for targets in (y, y.clamp(min=0)):
        logits, loss = model(x, targets)
        ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        assert torch.isfinite(loss) and torch.equal(loss, ref), (loss.item(), ref.item())
