"""k3lab.train: flags, the loader, the checkpoint folder; on 2 gloo ranks dp=2, ep=2 (MoonEP and
all-to-all) and cp=2 reproduce one process (losses and first-step gradients), a run SIGKILLed after a
checkpoint resumes on the same losses, a checkpoint written at ep=2 resumes at dp=2 and loads in one
process; on 4 ranks dp=2 x ep=2, cp=2 x ep=2 and dp=2 x cp=2 reproduce one process."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from k3lab.dist import launch
from k3lab.testing import assert_close
from k3lab.train import (TokenLoader, TrainConfig, build_parser, latest_checkpoint, lr_at, main, parse_args,
                         train)
from k3lab.train.loader import pack_documents
from k3lab.train.loop import build_model
from k3lab.train.runner import RunResult, torchrun_command
from k3lab.train.workers import clocked_train_worker, first_step_grads, train_worker

ROOT = Path(__file__).resolve().parents[1]
# Tiny enough for 2 shared cores: k3-tiny (with the corpus's 4096-token vocabulary), 4 x 32 tokens a step.
BASE = dict(preset="k3-tiny", steps=8, batch_size=4, seq_len=32, lr=3e-3, progress=False, seed=0)


# ---------------------------------------------------------------- flags

@pytest.mark.parametrize("argv, message", [
    (["--preset", "k3-full"], "invalid choice"),
    (["--steps", "0"], "--steps must be an int >= 1"),
    (["--ep-mode", "dense"], "invalid choice"),
    (["--ckpt-every", "5"], "--ckpt-every needs --ckpt-dir"),
    (["--resume"], "--resume needs --ckpt-dir"),
    (["--lr", "nan"], "--lr must be a positive finite number"),
    (["--kill-at-step", "9", "--steps", "8"], "--kill-at-step must be an int in"),
    (["--activations", "sublayers.*=discard"], "--activations unknown activation policy 'discard'"),
    (["--activations", "sublayers.*"], "--activations expected PATTERN=POLICY"),
    (["--activations", "sublayers.1=recompute,sublayers.1=offload"],
     "--activations pattern 'sublayers.1' is given two policies, 'recompute' and 'offload'"),
    (["--log-every", "0"], "--log-every must be an int >= 1"),
    (["--cp", "0"], "--cp must be an int >= 1"),
    (["--mtp", "1", "--cp", "2"], "--mtp does not combine with --cp > 1"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be a finite number >= 0 (0: no clipping)"),
    (["--max-grad-norm", "inf"], "--max-grad-norm must be a finite number >= 0 (0: no clipping)"),
    (["--stop-after-minutes", "8"], "--stop-after-minutes needs --ckpt-dir"),
    (["--stop-after-minutes", "0", "--ckpt-dir", "build/unused"], "--stop-after-minutes must be a finite number"),
    (["--keep-checkpoints", "2"], "--keep-checkpoints needs --ckpt-dir"),
    (["--keep-checkpoints", "-1", "--ckpt-dir", "build/unused"], "--keep-checkpoints must be an int >= 0"),
    (["--lr", "1e308"], "--lr must be a positive finite number < 1"),
    (["--lr", "1"], "--lr must be a positive finite number < 1"),
    (["--seed", "20000000000000"], "--seed must be an int in [0, 4294967295]"),
    (["--seed", "-1"], "--seed must be an int in [0, 4294967295]"),
    (["--mtp", "32", "--seq-len", "32"], "--mtp must be < --seq-len 32"),
    (["--mtp", "100000"], "--mtp must be < --seq-len 128"),
    (["--attnres-buffer", "float16"], "invalid choice"),
], ids=["attnres-buffer", "preset", "steps", "ep-mode", "ckpt-every", "resume", "lr", "kill", "policy", "rule", "rule-twice", "log-every", "cp",
        "mtp-cp", "clip-negative", "clip-inf", "stop-no-ckpt", "stop-zero", "keep-no-ckpt", "keep-negative",
        "lr-overflow", "lr-one", "seed-overflow", "seed-negative", "mtp-seq-len", "mtp-huge"])
def test_bad_flags_exit_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_largest_seed_runs_and_the_data_dir_help_names_the_tokenizer():
    """--seed 20000000000000 passed the flag check and overflowed the loader's generator seed; the --data-dir
    help named shards/ only, though the folder also needs tokenizer.json."""
    TokenLoader(np.arange(100, dtype=np.uint16), 2, 8, seed=2**32 - 1).next_batch()
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 4294967295\]"):
        TokenLoader(np.arange(100, dtype=np.uint16), 2, 8, seed=2**32)
    data_dir = next(a for a in build_parser()._actions if "--data-dir" in a.option_strings)
    assert "shards/ and tokenizer.json" in data_dir.help


def test_layout_that_does_not_fit_the_world_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--dp", "2", "--no-progress"])
    assert e.value.code == 2
    assert "--dp 2 x --cp 1 x --ep 1 = 2 ranks, but 1 were launched" in capsys.readouterr().err


def test_resuming_with_another_schedule_or_a_damaged_checkpoint_is_a_usage_error(tmp_path, capsys):
    """A resume with other --steps or --lr was taken silently (the schedule jumped), one with --doc-mask
    switched too (the loss attends elsewhere); a truncated shard file ended in DCP's traceback."""
    flags = ["--batch-size", "2", "--seq-len", "16", "--no-progress", "--ckpt-dir", str(tmp_path)]
    assert main(["--steps", "2", *flags]) == 0
    capsys.readouterr()
    for argv, message in ((["--steps", "1"], "--steps 1 (saved: 2) differ"),
                          (["--steps", "2", "--lr", "0.001"], "--lr 0.001 (saved: 0.003) differ"),
                          (["--steps", "2", "--doc-mask"], "--doc-mask True (saved: False) differ")):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--resume", *flags])
        assert e.value.code == 2
        assert message in capsys.readouterr().err
    # The run had reached its last step: the resume says so instead of a summary of nothing.
    assert main(["--steps", "2", "--resume", *flags]) == 0
    assert "already reached its last step (2 of 2); nothing is left to train" in capsys.readouterr().err
    shard = max((tmp_path / "step_00000002").glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(SystemExit) as e:
        main(["--steps", "2", "--resume", *flags])
    assert e.value.code == 2
    assert "step_00000002 cannot be read (EOFError" in capsys.readouterr().err


def test_metrics_read_every_n_steps_and_activation_policies_keep_the_losses():
    # --log-every 3 reads the losses back once per window: the same losses, maxvio only where read.
    # Recomputing every sublayer in backward (the activation manager) gives the same gradients, so the
    # same losses; offload the same too; block-wise fp8 of the MoE layers' saved tensors is lossy but close.
    cfg = dict(BASE, steps=4, batch_size=2)
    plain = train(TrainConfig(**cfg))
    windowed = train(TrainConfig(**cfg, log_every=3))
    assert [r["step"] for r in windowed] == [1, 2, 3, 4]
    np.testing.assert_allclose(_losses(windowed), _losses(plain), rtol=1e-6)
    assert [r["maxvio"] is None for r in windowed] == [True, True, False, False]
    for rules, tol in (("sublayers.*=recompute", 1e-5), ("sublayers.*=offload", 1e-6), ("sublayers.[13579]=fp8", 2e-2)):
        got = _losses(train(TrainConfig(**cfg, activations=rules)))
        rel = np.abs(got - _losses(plain)) / _losses(plain)
        assert rel.max() < tol, (rules, got, _losses(plain))
    with pytest.raises(ValueError, match="--activations: patterns .* match no module"):
        train(TrainConfig(**cfg, activations="nothing.here=recompute"))
    # An MTP depth adds its weighted loss: a different, finite curve from the same start.
    mtp = _losses(train(TrainConfig(**cfg, mtp=1)))
    assert np.isfinite(mtp).all() and mtp[0] > _losses(plain)[0]


def test_attnres_options_reach_the_model_and_keep_the_curve():
    # Keeping the sublayers' inputs gives the recomputed ones' gradients; a bf16 block buffer rounds the
    # residual stream's block sums, a lossy but close curve.
    cfg = dict(BASE, steps=3, batch_size=2)
    model = build_model(TrainConfig(**cfg, attnres_buffer="bfloat16", attnres_keep_inputs=True), torch.device("cpu"))
    assert model.residual.buffer_dtype == torch.bfloat16 and model.residual.recompute_input is False
    plain = _losses(train(TrainConfig(**cfg)))
    kept = _losses(train(TrainConfig(**cfg, attnres_keep_inputs=True)))
    bf16 = _losses(train(TrainConfig(**cfg, attnres_buffer="bfloat16")))
    np.testing.assert_allclose(kept, plain, rtol=1e-5)
    rel = np.abs(bf16 - plain) / plain
    assert 0 < rel.max() < 2e-2, (bf16, plain)
    with pytest.raises(ValueError, match="--attnres-buffer must be one of"):
        TrainConfig(**cfg, attnres_buffer="float16")
    with pytest.raises(ValueError, match="--attnres-keep-inputs must be a bool"):
        TrainConfig(**cfg, attnres_keep_inputs=1)
    assert "--attnres-keep-inputs" in torchrun_command(2, attnres_keep_inputs=True)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    lrs = [lr_at(s, 200, 1.0, 0.01) for s in range(1, 201)]
    assert lrs[:2] == [0.5, 1.0]
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    assert lrs[-1] == pytest.approx(0.1)
    for args, match in (((0, 200, 1.0, 0.01), r"step must be an int in \[1, total=200\]"),
                        ((201, 200, 1.0, 0.01), r"step must be"), ((1, 0, 1.0, 0.0), "total must be an int >= 1"),
                        ((1, 10, 1.0, 2.0), r"warmup must be a fraction of the run in \[0, 1\]")):
        with pytest.raises(ValueError, match=match):
            lr_at(*args)


# ---------------------------------------------------------------- loader

def test_loader_slices_one_global_batch_and_resumes_from_its_position():
    tokens = np.arange(1000, dtype=np.uint16)
    one = TokenLoader(tokens, 6, 10, seed=3)
    two = [TokenLoader(tokens, 6, 10, r, 2, seed=3) for r in range(2)]
    for _ in range(40):  # several epochs of the 99 windows
        x, y = one.next_batch()
        parts = [loader.next_batch() for loader in two]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y[:, :-1], x[:, 1:])
    assert len({tuple(r) for r in x.tolist()}) == 6
    later = TokenLoader(tokens, 6, 10, 1, 2, seed=3)
    later.load_state_dict(two[0].state_dict())
    assert torch.equal(later.next_batch()[0], two[1].next_batch()[0])
    with pytest.raises(ValueError, match="seq_len"):
        TokenLoader(tokens, 6, 12).load_state_dict(one.state_dict())
    with pytest.raises(ValueError, match="divisible"):
        TokenLoader(tokens, 5, 10, 0, 2)


def test_pack_documents_starts_a_segment_at_each_window_and_separator():
    x = torch.tensor([[5, 0, 7, 8], [9, 9, 0, 0]])
    px, py, cu = pack_documents(x, x + 1, eot_id=0)
    assert px.shape == (1, 8) and torch.equal(py, px + 1)
    assert cu.tolist() == [0, 1, 4, 6, 7, 8]


def test_latest_checkpoint_skips_partial_saves(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    for name, complete in (("step_00000003", True), ("step_00000010", False), (".tmp-step_00000012", True),
                           ("step_7", True)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / ".metadata").write_bytes(b"")
    assert latest_checkpoint(tmp_path).name == "step_00000003"


def test_a_checkpoint_of_another_model_is_an_ordinary_error(tmp_path):
    """DCP reports a failed load as a CheckpointException, a BaseException that ``except Exception`` missed,
    with every rank's traceback: loading into a model of another shape, or reading a key the checkpoint lacks,
    is a RuntimeError naming the checkpoint, the rank and DCP's own message."""
    from k3lab.train.checkpoint import load_checkpoint, read_train_state, save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    path = save_checkpoint(tmp_path, 1, model, torch.optim.SGD(model.parameters(), lr=0.1),
                           {"step": 1})
    wider = torch.nn.Linear(4, 5)
    with pytest.raises(RuntimeError, match=rf"loading checkpoint {re.escape(str(path))} failed on rank 0: .*weight"):
        load_checkpoint(path, wider, None, {"step": 0})
    with pytest.raises(RuntimeError, match=r"failed on rank 0: RuntimeError: Missing key .*train\.nokey"):
        read_train_state(path, {"nokey": 0})
    assert read_train_state(path, {"step": 0}) == {"step": 1}
    fresh = torch.nn.Linear(4, 3)
    load_checkpoint(path, fresh, None, {"step": 0})
    assert torch.equal(fresh.weight, model.weight)


def test_keep_checkpoints_leaves_the_newest_complete_ones(tmp_path, one_thread):
    """--ckpt-every 2 --keep-checkpoints 2 over 8 steps: steps 6 and 8 remain, nothing half-deleted is left
    beside them, and an unrelated folder is untouched; without --keep-checkpoints every save stays."""
    (tmp_path / "keep" / "notes").mkdir(parents=True)
    with one_thread():
        train(TrainConfig(**BASE, ckpt_dir=str(tmp_path / "keep"), ckpt_every=2, keep_checkpoints=2))
        train(TrainConfig(**BASE, ckpt_dir=str(tmp_path / "all"), ckpt_every=2))
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == [".lock", "notes", "step_00000006", "step_00000008"]
    assert latest_checkpoint(tmp_path / "keep").name == "step_00000008"
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == [".lock"] + [f"step_{n:08d}" for n in (2, 4, 6, 8)]


def test_a_fresh_run_refuses_a_folder_holding_another_runs_checkpoints(tmp_path, capsys):
    """A fresh run into a used --ckpt-dir mixed its checkpoints with the old run's: --keep-checkpoints deleted
    the new run's own (the old ones were newer) and a later --resume continued the old run."""
    ckpt = tmp_path / "mix"
    flags = ["--batch-size", "2", "--seq-len", "16", "--no-progress", "--ckpt-dir", str(ckpt), "--ckpt-every", "1"]
    assert main([*flags, "--steps", "3"]) == 0
    capsys.readouterr()
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    with pytest.raises(SystemExit) as e:
        main([*flags, "--steps", "3", "--doc-mask", "--keep-checkpoints", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (f"--ckpt-dir {ckpt} already holds the checkpoints of a run (newest: step 3): pass --resume to continue "
            f"that run, or choose an empty folder") in err, err[-800:]
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before
    # What no run completed (a save cut short, a step folder without .metadata) does not hold the folder.
    partial = tmp_path / "partial"
    (partial / ".tmp-step_00000002").mkdir(parents=True)
    (partial / "step_00000001").mkdir()
    assert main(["--batch-size", "2", "--seq-len", "16", "--no-progress", "--ckpt-dir", str(partial), "--steps", "1"]) == 0
    assert latest_checkpoint(partial).name == "step_00000001"


@pytest.mark.parametrize("held", ["ckpt", "log"])
def test_a_second_run_into_the_same_outputs_is_refused(tmp_path, capsys, monkeypatch, held):
    """Two runs started together into one --ckpt-dir: one crashed in the other's half-written save
    (FileNotFoundError .metadata.tmp), and one --log-jsonl held both runs' records interleaved."""
    import fcntl

    ckpt, log = tmp_path / "run", tmp_path / "run.jsonl"
    ckpt.mkdir()
    lock_path = ckpt / ".lock" if held == "ckpt" else log
    flags = ["--batch-size", "2", "--seq-len", "16", "--no-progress", "--steps", "1", "--ckpt-dir", str(ckpt),
             "--log-jsonl", str(log)]
    with open(lock_path, "a") as other:  # the other run's lock
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _forbid_steps(monkeypatch)
        with pytest.raises(SystemExit) as e:
            main(flags)
        assert e.value.code == 2
        what = f"--ckpt-dir {ckpt}" if held == "ckpt" else f"--log-jsonl {log}"
        err = capsys.readouterr().err
        assert f"{what} is in use by another run (its lock {lock_path} is held)" in err, err[-800:]
    monkeypatch.undo()
    assert main(flags) == 0  # the lock went with its holder
    assert latest_checkpoint(ckpt).name == "step_00000001"


def _forbid_steps(monkeypatch):
    """Make any training step fail the test: what must stop at start-up stops before the first step."""
    from k3lab.train import loop

    def step(*a, **k):
        raise AssertionError("a step ran")

    monkeypatch.setattr(loop, "forward_backward", step)


@pytest.mark.parametrize("flag, path", [
    ("--ckpt-dir", "x" * 300), ("--log-jsonl", "x" * 300 + ".jsonl"), ("--ckpt-dir", "/proc/k3ckpt"),
    ("--log-jsonl", "/proc/k3ckpt/log.jsonl")], ids=["ckpt-long", "log-long", "ckpt-proc", "log-proc"])
def test_an_output_path_that_cannot_be_made_stops_at_start_up(flag, path, tmp_path, capsys, monkeypatch):
    """A name too long for the file system (or a folder in /proc, as root) passed the flag check: the run
    trained to its end and lost itself in a traceback at the final save (the log: at its first record)."""
    if path.startswith("/proc") and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    path = path if path.startswith("/") else str(tmp_path / path)
    _forbid_steps(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["--batch-size", "2", "--seq-len", "16", "--steps", "1", "--no-progress", flag, path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    # As root /proc passes the flag check (os.access) and its mkdir fails at start-up; otherwise the flag check.
    assert f"error: {flag}" in err and path in err and "cannot be created" in err, err[-800:]
    assert "Traceback" not in err


def test_an_expert_count_the_ep_ranks_do_not_divide_is_a_usage_error():
    """--ep 3 over the 8 experts of k3-tiny raised parallelize's ValueError with a traceback on every rank."""
    cmd = torchrun_command(3, **dict(BASE, ep=3, batch_size=6, steps=2))
    run = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert run.stderr.count("--ep 3 must divide the 8 routed experts of --preset k3-tiny") == 1, run.stderr[-3000:]
    assert "ValueError" not in run.stderr and "k3lab/train/" not in run.stderr, run.stderr[-3000:]


def test_a_diverging_run_ends_in_one_line_naming_the_step(tmp_path, monkeypatch, capsys):
    """A NaN loss, and the KDA operator's overflow error at a huge learning rate, ended in a traceback; the
    run now ends with exit status 1 and one line that names the step and a lower --lr, and no checkpoint."""
    from k3lab.kda.checks import NonFiniteError
    from k3lab.train import loop

    real = loop.forward
    calls = []

    def diverging(model, x, y, doc_mask, par=None):
        calls.append(1)
        logits, loss = real(model, x, y, doc_mask, par)
        if len(calls) == 2:
            raise NonFiniteError("q", "x is too large: q contains NaN or inf")
        return logits, loss

    flags = ["--batch-size", "2", "--seq-len", "16", "--steps", "3", "--no-progress"]
    monkeypatch.setattr(loop, "forward", diverging)
    with pytest.raises(SystemExit) as e:
        main([*flags, "--ckpt-dir", str(tmp_path), "--ckpt-every", "1", "--log-every", "2"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.search(r"error: the run diverged at step 2 \(x is too large: q contains NaN or inf\).*lower --lr", err), err
    assert latest_checkpoint(tmp_path).name == "step_00000001"

    monkeypatch.setattr(loop, "forward", lambda *a, **k: (lambda o: (o[0], o[1] * float("nan")))(real(*a, **k)))
    with pytest.raises(SystemExit) as e:
        main([*flags, "--ckpt-dir", str(tmp_path / "nan")])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the loss is nan and the gradient norm nan at step 1" in err, err
    assert "lower --lr" in err and latest_checkpoint(tmp_path / "nan") is None


# ---------------------------------------------------------------- 2 ranks

def _losses(records):
    return np.array([r["loss"] for r in records])


def _check_norms(label, records, want) -> None:
    """The logged gradient norms against one process's: Muon's update does not see a gradient's scale, so
    the norm is what checks that clipping saw every rank's shards. The first step (same weights on both
    sides) to 1e-5; later steps to 2e-3, as a gradient's norm amplifies the layouts' rounding differences in
    the weights (about 5e-4 after 3 steps, against 1e-5 in the losses)."""
    got = np.array([r["grad_norm"] for r in records])[:len(want)]
    rel = np.abs(got - want) / want
    assert rel[0] < 1e-5 and rel.max() < 2e-3, f"{label}: gradient norms {got} vs one process {want}"


def _torchrun(cfg: dict, timeout=120):
    cmd = torchrun_command(2, **cfg)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _model_from(path):
    from k3lab.train.checkpoint import load_checkpoint

    model = build_model(TrainConfig(**BASE), torch.device("cpu"))
    load_checkpoint(path, model, None, {"step": 0})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_rank_other_than_0_waits_then_exits_2_without_printing(monkeypatch, capsys):
    import k3lab.train.config as config

    waits = []
    monkeypatch.setattr(config.time, "sleep", waits.append)
    with pytest.raises(SystemExit) as e:
        parse_args(["--steps", "0"], quiet=True)
    assert e.value.code == 2 and waits == [config.QUIET_EXIT_DELAY_S] and capsys.readouterr().err == ""


def test_a_usage_error_under_torchrun_is_printed_once():
    """Every rank meets the same error, of the layout or of a flag; each printed the usage text and the message."""
    run = _torchrun(dict(BASE, dp=3), timeout=90)
    assert run.returncode != 0
    assert run.stderr.count("--dp 3 x --cp 1 x --ep 1 = 3 ranks, but 2 were launched") == 1, run.stderr[-2000:]
    cmd = torchrun_command(2, **dict(BASE, pp=2)) + ["--microbatches", "1"]
    run = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=90)
    assert run.returncode != 0
    assert run.stderr.count("--microbatches must be >= --pp 2") == 1, run.stderr[-2000:]


def test_a_batch_the_data_rows_do_not_divide_names_the_flag():
    run = _torchrun(dict(BASE, ep=2, batch_size=3), timeout=90)
    assert run.returncode != 0
    assert run.stderr.count("--batch-size 3 must be divisible by the 2 data rows (--dp 1 x --ep 2)") == 1, \
        run.stderr[-2000:]


def test_two_ranks_match_one_process_and_resume_after_sigkill(tmp_path, one_thread):
    with one_thread():
        ref_run = train(TrainConfig(**BASE))
        ref, ref_norms = _losses(ref_run), np.array([r["grad_norm"] for r in ref_run])
        ref_doc = _losses(train(TrainConfig(**BASE, doc_mask=True)))
    layouts = [dict(dp=2, ckpt_dir=str(tmp_path / "dp2")), dict(ep=2, ep_mode="moonep", ckpt_dir=str(tmp_path / "ep2")),
               dict(ep=2, ep_mode="alltoall"), dict(ep=2, doc_mask=True), dict(cp=2), dict(cp=2, doc_mask=True)]
    grad_layouts = [dict(dp=2), dict(ep=2, ep_mode="moonep"), dict(cp=2)]
    out = launch(train_worker, 2, [dict(BASE, **lay) for lay in layouts],
                 [dict(BASE, **lay) for lay in grad_layouts], timeout_s=300)[0]
    runs = out["runs"]
    # Muon's update does not see a gradient's scale, so the losses alone would miss an expert gradient
    # summed over ranks instead of averaged: the first step's gradients are compared directly.
    ref_grads = first_step_grads(TrainConfig(**BASE))
    for lay, grads in zip(grad_layouts, out["grads"]):
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert_close(f"{lay} grad {name}", ref_grads[name], g, 1e-4)
    # With --doc-mask the batch runs as one packed row with boundaries (cu_seqlens), on 2 ranks as on one.
    for lay, records in zip(layouts, runs):
        got = _losses(records)
        want = ref_doc if lay.get("doc_mask") else ref
        assert len(got) == 8
        rel = np.abs(got[:5] - want[:5]) / np.abs(want[:5])
        assert rel.max() < 1e-4, f"{lay}: losses {got} vs one process {want}"
        if not lay.get("doc_mask"):
            _check_norms(lay, records, ref_norms[:5])
        assert all(len(r["maxvio"]) == 4 and r["tokens_per_s"] > 0 and r["peak_mem_GiB"] > 0 for r in records)

    # ep=2 MoonEP, checkpoints every 3 steps, SIGKILLed after step 5: resumed from step 3, steps 4..8
    # replay the uninterrupted run's losses.
    ckpt, log = tmp_path / "killed", tmp_path / "killed.jsonl"
    cfg = dict(BASE, ep=2, ckpt_dir=str(ckpt), ckpt_every=3, log_jsonl=str(log))
    killed = _torchrun(dict(cfg, kill_at_step=5))
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr + killed.stdout
    assert latest_checkpoint(ckpt).name == "step_00000003"
    other = tmp_path / "other_layout"
    other.mkdir()
    shutil.copytree(ckpt / "step_00000003", other / "step_00000003")
    # A save killed mid-way and a step folder without metadata are never taken as the latest.
    (ckpt / ".tmp-step_00000006").mkdir()
    (ckpt / ".tmp-step_00000006" / "__0_0.distcp").write_bytes(b"partial")
    (ckpt / "step_00000007").mkdir()
    resumed = _torchrun(dict(cfg, resume=True))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [r for r in records if r["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [0, 3]
    steps = [r for r in records if r["event"] == "step"]
    first, second = steps[:5], steps[5:]
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5] and [r["step"] for r in second] == [4, 5, 6, 7, 8]
    uninterrupted = _losses(runs[1])
    np.testing.assert_allclose(_losses(first), uninterrupted[:5], rtol=0, atol=1e-6)
    np.testing.assert_allclose(_losses(second), uninterrupted[3:], rtol=0, atol=1e-6)
    assert records[-1]["event"] == "summary"

    # The checkpoint holds the optimizer state (Muon momentum, AdamW moments) and the QB biases.
    from torch.distributed.checkpoint import FileSystemReader
    keys = list(FileSystemReader(str(ckpt / "step_00000008")).read_metadata().state_dict_metadata)
    for part in ("momentum_buffer", "exp_avg", "exp_avg_sq", "router.bias", "experts.w_gate"):
        assert any(part in k for k in keys), part
    # Written at ep=2 (experts under their global ids) and at dp=2, read by one process: the same model.
    a, b = _model_from(tmp_path / "ep2" / "step_00000008"), _model_from(tmp_path / "dp2" / "step_00000008")
    # The QB biases are quantiles read off a histogram: a routing flip near a cut-off moves one by a bin.
    # Layouts differ in rounding, which AdamW's normalised steps and QB's histogram bins amplify to ~1e-2
    # in some tensors after 8 steps; experts stored under the wrong ids would be off by ~1.4.
    for k in a:
        if "experts" in k:
            assert_close(k, b[k], a[k], 2e-2)
    c = _model_from(ckpt / "step_00000008")
    assert all(torch.equal(a[k], c[k]) for k in a)

    # The ep=2 checkpoint of step 3 (model, optimizer state, loader position) resumed at dp=2: steps 4..8
    # follow the uninterrupted run as closely as the layouts agree with each other.
    relaid = _torchrun(dict(BASE, dp=2, ckpt_dir=str(other), resume=True, log_jsonl=str(tmp_path / "other.jsonl")))
    assert relaid.returncode == 0, relaid.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "other.jsonl").read_text().splitlines()]
    got = _losses([r for r in steps if r["event"] == "step"])
    assert (np.abs(got - uninterrupted[3:]) / uninterrupted[3:]).max() < 1e-4, (got, uninterrupted[3:])


def test_four_ranks_dp_ep_cp_layouts_match_one_process(one_thread):
    # dp=2 x ep=2: experts are DTensors over ep whose FSDP shards and gradient reduction run over dp.
    # cp=2 x ep=2: the experts' FSDP group is dp x cp; each row's packed tokens are cut in two (KCP, the
    # MLA latents gathered). dp=2 x cp=2 with --doc-mask: documents cross the cut.
    cfg = dict(BASE, steps=5)
    with one_thread():
        ref_run = train(TrainConfig(**cfg))
        ref, ref_norms = _losses(ref_run), np.array([r["grad_norm"] for r in ref_run])
        ref_grads = first_step_grads(TrainConfig(**cfg))
    layouts = [dict(dp=2, ep=2), dict(cp=2, ep=2), dict(dp=2, cp=2, doc_mask=True)]
    out = launch(train_worker, 4, [dict(cfg, **lay) for lay in layouts[:2]],
                 [dict(cfg, **lay) for lay in layouts], timeout_s=600)[0]
    for lay, records in zip(layouts, out["runs"]):
        got = _losses(records)
        assert (np.abs(got - ref) / np.abs(ref)).max() < 1e-4, f"{lay}: losses {got} vs one process {ref}"
        _check_norms(lay, records, ref_norms)
    doc_grads = first_step_grads(TrainConfig(**cfg, doc_mask=True))
    for lay, grads in zip(layouts, out["grads"]):
        want = doc_grads if lay.get("doc_mask") else ref_grads
        assert grads.keys() == want.keys()
        for name, g in grads.items():
            assert_close(f"{lay} grad {name}", want[name], g, 1e-4)


def test_missing_shards_are_a_usage_error_that_names_the_build_command(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--steps", "1", "--data-dir", str(tmp_path), "--no-progress"])
    assert e.value.code == 2
    assert "python -m k3lab.data build" in capsys.readouterr().err


def test_a_cp_layout_that_does_not_fit_the_world_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--dp", "1", "--cp", "2", "--no-progress"])
    assert e.value.code == 2
    assert "--dp 1 x --cp 2 x --ep 1 = 2 ranks, but 1 were launched" in capsys.readouterr().err


def test_a_nan_loss_stops_the_run_before_its_checkpoint(tmp_path, monkeypatch):
    # With the per-call value checks off, the read-back loss is where a NaN must show: no checkpoint of it.
    from k3lab.train import loop

    real = loop.forward

    def poisoned(model, x, y, doc_mask, par=None):
        logits, loss = real(model, x, y, doc_mask, par)
        return logits, loss * float("nan")

    monkeypatch.setattr(loop, "forward", poisoned)
    with pytest.raises(FloatingPointError, match="the loss is nan and the gradient norm nan at step 1"):
        train(TrainConfig(**dict(BASE, steps=2, batch_size=2, ckpt_dir=str(tmp_path), ckpt_every=1)))
    assert latest_checkpoint(tmp_path) is None


class _NanGrad(torch.autograd.Function):
    """Identity forward, NaN gradient: a bf16 backward that overflows under a finite loss."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def test_nan_gradients_under_a_finite_loss_write_no_checkpoint(tmp_path, monkeypatch):
    """The loss check passed, Muon wrote the NaN gradients into the weights, and they were saved as the latest
    checkpoint (113 of the 117 tensors non-finite). The gradient norm read back with the loss stops it."""
    from k3lab.train import loop

    real = loop.forward
    monkeypatch.setattr(loop, "forward", lambda *a, **k: (lambda out: (out[0], _NanGrad.apply(out[1])))(real(*a, **k)))
    with pytest.raises(FloatingPointError, match=r"the loss is \S+ and the gradient norm nan at step 1"):
        train(TrainConfig(**dict(BASE, steps=2, batch_size=2, ckpt_dir=str(tmp_path), ckpt_every=1)))
    assert latest_checkpoint(tmp_path) is None


def test_nonfinite_weights_under_finite_gradients_write_no_checkpoint(tmp_path, monkeypatch):
    """An optimizer step that overflows the weights (finite loss and gradient norm): the check before the
    save refuses them and names them."""
    from k3lab.optim import PerHeadMuon

    real = PerHeadMuon.step

    def overflowing(self, closure=None):
        out = real(self, closure)
        self.param_groups[0]["params"][0].data.fill_(float("inf"))
        return out

    monkeypatch.setattr(PerHeadMuon, "step", overflowing)
    with pytest.raises(FloatingPointError, match="the weights or optimizer state hold NaN or inf after step 1") as e:
        train(TrainConfig(**dict(BASE, steps=2, batch_size=2, ckpt_dir=str(tmp_path), ckpt_every=1)))
    assert latest_checkpoint(tmp_path) is None
    # The message names what went non-finite, so a long run's refusal says where to look.
    assert re.search(r"non-finite: \d+ on this rank, first \S+", str(e.value)), str(e.value)


def test_paths_and_model_settings_are_checked_before_training(tmp_path, capsys):
    """A --ckpt-dir that is a file failed after the last step (the run lost); a resume at another --preset or
    --mtp called the checkpoint damaged and advised deleting it."""
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "logs").mkdir()
    for argv, message in ((["--ckpt-dir", str(tmp_path / "file")], "--ckpt-dir must be a folder"),
                          (["--ckpt-dir", str(tmp_path / "step_00000002")], "not one of them"),
                          (["--log-jsonl", str(tmp_path / "logs")], "--log-jsonl must be a file path")):
        with pytest.raises(SystemExit):
            main([*argv, "--no-progress"])
        assert message in capsys.readouterr().err
    flags = ["--batch-size", "2", "--seq-len", "16", "--steps", "2", "--no-progress", "--ckpt-dir", str(tmp_path / "c")]
    assert main(flags) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*flags, "--resume", "--mtp", "1"])
    assert "--mtp 1 (saved: 0) differ" in capsys.readouterr().err


def test_a_path_that_cannot_be_written_is_a_usage_error_before_training(tmp_path, capsys, monkeypatch):
    """A --ckpt-dir or --log-jsonl below a file, or in a folder this process may not write, stops at the flag
    (the checkpoint is first written after the last step) and leaves nothing behind."""
    (tmp_path / "file").write_text("not a folder")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    real_access = os.access
    # Root writes into a chmod 555 folder anyway: the folder is made read-only for os.access instead.
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == read_only else real_access(p, mode))
    for flag, path, message in (("--ckpt-dir", tmp_path / "file" / "ckpt", f"{tmp_path / 'file'} is a file"),
                                ("--log-jsonl", tmp_path / "file" / "a" / "log.jsonl", f"{tmp_path / 'file'} is a file"),
                                ("--ckpt-dir", read_only / "ckpt", f"folder {read_only} is not writable"),
                                ("--log-jsonl", read_only / "log.jsonl", f"folder {read_only} is not writable"),
                                ("--ckpt-dir", read_only, "is not writable")):
        with pytest.raises(SystemExit) as e:
            parse_args([flag, str(path), "--no-progress"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"{flag} cannot be created: {message}" in err or f"{flag} {message}" in err, err[-500:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "read_only"]
    assert not any(read_only.iterdir())


def test_a_damaged_checkpoint_metadata_is_one_usage_error_line(tmp_path, capsys):
    """A .metadata that does not unpickle is named in the error; DCP's fallback tracebacks are not printed."""
    flags = ["--batch-size", "2", "--seq-len", "16", "--steps", "1", "--no-progress", "--ckpt-dir", str(tmp_path)]
    assert main(flags) == 0
    capsys.readouterr()
    meta = tmp_path / "step_00000001" / ".metadata"
    data = bytearray(meta.read_bytes())
    data[:64] = b"\0" * 64
    meta.write_bytes(bytes(data))
    with pytest.raises(SystemExit) as e:
        main([*flags, "--resume"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "step_00000001/.metadata is damaged (UnpicklingError" in err, err[-1000:]
    assert "Traceback" not in err, err[-2000:]


def test_resuming_a_checkpoint_without_a_run_setting_names_the_setting(tmp_path, capsys, monkeypatch):
    """A checkpoint that does not record a setting a resume compares (written before --max-grad-norm was
    one) was called unreadable, with the advice to delete it and resume from the one before, which lacks
    it too."""
    import k3lab.train.loop as loop

    flags = ["--batch-size", "2", "--seq-len", "16", "--steps", "1", "--no-progress", "--ckpt-dir", str(tmp_path)]
    monkeypatch.setattr(loop, "RUN_SETTINGS", tuple(k for k in loop.RUN_SETTINGS if k != "max_grad_norm"))
    assert main(flags) == 0
    monkeypatch.undo()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*flags, "--resume"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "step_00000001 does not record --max-grad-norm, which a resume compares" in err, err[-500:]
    assert "cannot be read" not in err


def test_resume_reports_a_missing_or_damaged_checkpoint(tmp_path, capsys):
    """An empty --ckpt-dir started afresh without a word; bytes damaged inside a shard loaded as NaN weights
    (DCP keeps no checksums) and failed steps later in a kernel's input check."""
    flags = ["--batch-size", "2", "--seq-len", "16", "--steps", "2", "--no-progress", "--ckpt-dir", str(tmp_path)]
    assert main([*flags, "--resume"]) == 0
    assert "--resume: no complete checkpoint in" in capsys.readouterr().err
    shard = max((tmp_path / "step_00000002").glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2 // 4 * 4
    data[middle:middle + 4096] = b"\xff" * 4096
    shard.write_bytes(bytes(data))
    with pytest.raises(SystemExit):
        main([*flags, "--resume"])
    # Bytes of a tensor load as NaN; (with another layout of the file) bytes of a pickled value fail to load.
    err = capsys.readouterr().err
    assert "holds NaN or inf weights or optimizer state (a damaged file)" in err or "cannot be read" in err, err[-500:]


def test_run_result_check_tells_a_kill_from_a_crash():
    """Torchrun exits 1 for a SIGKILLed worker and for one that raised: a chapter that took any nonzero exit
    for the kill went on to read checkpoints a crashed run never wrote."""
    steps = [{"step": 10}, {"step": 20}]
    killed = RunResult(1, steps, "", "")
    assert killed.check(last_step=20) is killed
    with pytest.raises(RuntimeError, match=r"last logged step 20, not at the kill step 30; its stderr ends with:\nboom"):
        RunResult(1, steps, "", "boom").check(last_step=30)
    with pytest.raises(RuntimeError, match="last logged step None"):
        RunResult(1, [], "", "").check(last_step=5)
    with pytest.raises(RuntimeError, match="exited with status 1"):
        RunResult(1, steps, "", "FloatingPointError").check()
    ok = RunResult(0, steps)
    assert ok.check() is ok


def test_nonfinite_names_name_parameters_and_optimizer_state():
    from k3lab.train.loop import nonfinite_names

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert nonfinite_names([model], [opt]) == "none on this rank (another rank's)"
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    opt.state[model[0].bias]["exp_avg_sq"][1] = float("inf")
    assert nonfinite_names([model], [opt]) == "2 on this rank, first 1.weight, 0.bias: exp_avg_sq"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: AdamW's CPU step counts beside CUDA weights")
def test_state_finite_takes_cpu_step_counts_beside_cuda_weights():
    """On the GPU the check before the first checkpoint stacked CUDA flags with the CPU flags of AdamW's
    step counts and raised, ending chapter 09's run at its first save."""
    from k3lab.optim import per_head_muon
    from k3lab.train.loop import state_finite

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).cuda()
    opt = per_head_muon(model, lr=1e-2)
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    opt.step()
    assert any(v.device.type == "cpu" for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    assert state_finite([model], [opt])
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert not state_finite([model], [opt])


# ---------------------------------------------------------------- --stop-after-minutes

@pytest.mark.parametrize("minutes", [0, -1.5, float("nan"), float("inf"), True, "8"])
def test_stop_after_minutes_must_be_a_positive_finite_number_with_a_checkpoint_folder(minutes, tmp_path):
    with pytest.raises(ValueError, match=r"^--stop-after-minutes must be a finite number of minutes > 0"):
        TrainConfig(**BASE, ckpt_dir=str(tmp_path), stop_after_minutes=minutes)
    with pytest.raises(ValueError, match=r"^--stop-after-minutes needs --ckpt-dir"):
        TrainConfig(**BASE, stop_after_minutes=8)


def _ticking(monkeypatch, seconds):
    """``loop.wall_clock`` replaced by a clock that advances ``seconds`` at each reading."""
    from k3lab.train import loop

    readings = iter(range(1 << 30))
    monkeypatch.setattr(loop, "wall_clock", lambda: next(readings) * seconds)


def test_a_run_out_of_time_stops_at_a_log_step_with_a_checkpoint_and_resumes_on_the_same_curve(
        tmp_path, monkeypatch, one_thread):
    """One minute's budget, a clock that advances 40 s at each reading (the start, then each --log-every 2
    step): past the budget at step 4's read-back, the run saves step 4 and returns; the same command with
    --resume continues steps 5..8 on the uninterrupted run's losses, appended to the same log, whose
    summary covers both parts."""
    from k3lab.train.metrics import summarize_log

    ckpt, log = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
    cfg = dict(BASE, log_every=2)
    with one_thread():
        uninterrupted = _losses(train(TrainConfig(**cfg)))
        _ticking(monkeypatch, 40.0)
        first = train(TrainConfig(**cfg, ckpt_dir=str(ckpt), log_jsonl=str(log), stop_after_minutes=1.0, resume=True))
        assert first.stopped_at == 4 and [r["step"] for r in first] == [1, 2, 3, 4]
        assert latest_checkpoint(ckpt).name == "step_00000004"
        # The second invocation, the same flags: its clock never reaches the budget.
        _ticking(monkeypatch, 0.0)
        flags = ["--batch-size", "4", "--seq-len", "32", "--steps", "8", "--log-every", "2", "--no-progress",
                 "--ckpt-dir", str(ckpt), "--log-jsonl", str(log), "--stop-after-minutes", "1", "--resume"]
        assert main(flags) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["event"] for r in records] == ["start", *["step"] * 4, "stop", "summary",
                                             "start", *["step"] * 4, "summary"]
    stop = records[5]
    assert stop["step"] == 4 and stop["steps"] == 8 and "stopped at step 4 of 8" in stop["message"]
    # Started with --resume, so the same command continues it.
    assert stop["message"].endswith("run the same command again to continue")
    assert records[6]["stopped_at"] == 4 and records[-1]["stopped_at"] is None
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 9))
    np.testing.assert_allclose(_losses(steps), uninterrupted, rtol=0, atol=1e-6)
    # Both parts: their stepping minutes summed, every step's loss; the resumed part's summary says so.
    run = summarize_log(log)
    parts_minutes = records[6]["train_minutes"] + records[-1]["train_minutes"]
    assert run["parts"] == 2 and run["steps"] == 8 and run["stopped_at"] is None
    assert run["train_minutes"] == pytest.approx(parts_minutes) and run["train_minutes"] > 0
    assert run["train_minutes"] == pytest.approx(sum(r["step_s"] for r in steps) / 60)
    assert list(run["losses"]) == list(range(1, 9)) and run["final_loss"] == steps[-1]["loss"]
    assert records[-1]["run_parts"] == 2 and records[-1]["run_steps"] == 8
    assert records[-1]["run_train_minutes"] == pytest.approx(parts_minutes)
    # Throughput leaves out each part's first --log-every window (steps 1-2 and 5-6), which warms up.
    timed = steps[2:4] + steps[6:]
    assert run["tokens_per_s"] == pytest.approx(np.mean([r["tokens_per_s"] for r in timed]))


def test_summarize_log_counts_a_replayed_step_once_and_starts_at_the_last_fresh_run(tmp_path):
    """A kill after step 3 with a checkpoint at step 2: step 3 logged twice, the resumed value kept; the
    minutes are each part's stepping time; an earlier run in the same file is not part of this one."""
    from k3lab.train.metrics import summarize_log

    def step(s, loss, step_s=30.0):
        return dict(event="step", step=s, loss=loss, step_s=step_s, tokens_per_s=100.0 * s, mfu=None)

    lines = [dict(event="start", resumed_from=0), step(1, 9.0), dict(event="summary"),
             dict(event="start", resumed_from=0), step(1, 5.0), step(2, 4.0), step(3, 3.5),
             dict(event="start", resumed_from=2), step(3, 3.0), step(4, 2.0, 90.0), dict(event="summary"),
             dict(event="start", resumed_from=4), dict(event="summary")]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = summarize_log(path)
    assert run["parts"] == 2 and run["steps"] == 4 and run["losses"] == {1: 5.0, 2: 4.0, 3: 3.0, 4: 2.0}
    assert run["train_minutes"] == pytest.approx((3 * 30 + 30 + 90) / 60)
    assert run["tokens_per_s"] == pytest.approx((200 + 300 + 400) / 3)  # log_every 1: each part's first step out
    with pytest.raises(ValueError, match="no start record"):
        (tmp_path / "empty.jsonl").write_text("")
        summarize_log(tmp_path / "empty.jsonl")


def test_summarize_log_drops_each_parts_first_window_by_its_own_log_every(tmp_path):
    """A resume may change --log-every: each part's first window (it compiles and warms up, every step of it
    carrying the window's rate) is cut at that part's own read-back; a part of no steps leaves no rate."""
    from k3lab.train.metrics import MetricsLog, summarize_log

    def step(s, rate):
        return dict(event="step", step=s, loss=1.0, step_s=1.0, tokens_per_s=rate, mfu=None)

    lines = [dict(event="start", resumed_from=0, log_every=1), *(step(s, 50.0 if s == 1 else 100.0) for s in range(1, 6)),
             dict(event="start", resumed_from=5, log_every=5), *(step(s, 1.0 if s <= 10 else 100.0) for s in range(6, 16))]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert summarize_log(path)["tokens_per_s"] == pytest.approx(100.0)  # steps 2-5 and 11-15
    log = MetricsLog(None, 10, 10, progress=False, log_every=5)
    assert log.summary({})["tokens_per_s"] is None


def test_two_ranks_stop_at_the_same_step_by_rank_0s_clock(tmp_path):
    """Rank 0's clock passes the one-minute budget at step 4's read-back, rank 1's never does: both stop at
    step 4 (rank 0's decision is broadcast) and the checkpoint of step 4 is complete."""
    cfg = dict(BASE, dp=2, log_every=2, ckpt_dir=str(tmp_path), stop_after_minutes=1.0)
    out = launch(clocked_train_worker, 2, cfg, [40.0, 0.0], timeout_s=240)
    assert [o["stopped_at"] for o in out] == [4, 4]
    assert [r["step"] for r in out[0]["records"]] == [1, 2, 3, 4]
    assert latest_checkpoint(tmp_path).name == "step_00000004"


def test_a_resumed_runs_summary_survives_an_unreadable_earlier_part(tmp_path, capsys):
    """The run_* fields read the whole file: a line that is not JSON inside a part (not a cut last line, which is
    skipped) leaves them out, not the run's end."""
    from k3lab.train.metrics import MetricsLog

    path = tmp_path / "m.jsonl"
    path.write_text('{"event": "start", "resumed_from": 0}\n{"event": "st\n')
    log = MetricsLog(str(path), 8, 4, progress=False)
    log.write(dict(event="step", step=5, loss=2.0, step_s=1.0, tokens_per_s=10.0, mfu=None, maxvio=None,
                   peak_mem_GiB=1.0))
    out = log.summary({})
    assert out["last_step"] == 5 and "run_parts" not in out
    err = capsys.readouterr().err
    assert "no summary over the run's parts (ValueError: " in err and "line 2 is not complete JSON" in err, err


def test_a_cut_last_line_is_skipped_and_the_next_part_starts_on_a_new_line(tmp_path):
    """A process killed mid-write leaves a cut last line; the resumed run appended its records onto it, and
    the log no longer read. The appender starts a new line; the reader skips a cut last line of a part (the
    line before a "start" record, or the file's last line) with a warning, and refuses one elsewhere."""
    from k3lab.train.metrics import MetricsLog, summarize_log

    def step(s):
        return dict(event="step", step=s, loss=10.0 - s, step_s=1.0, tokens_per_s=10.0, mfu=None, maxvio=None,
                    peak_mem_GiB=1.0)

    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(dict(event="start", resumed_from=0)) + "\n" + json.dumps(step(1)) + "\n"
                    + '{"event": "step", "step": 2, "lo')
    with pytest.warns(UserWarning, match=r"m.jsonl: line 3 is not complete JSON \(a cut last line\), skipped"):
        assert summarize_log(path)["losses"] == {1: 9.0}
    log = MetricsLog(str(path), 4, 1, progress=False)
    log.write(dict(event="start", resumed_from=1))
    for s in (2, 3, 4):
        log.write(step(s))
    log.file.close()
    lines = path.read_text().splitlines()
    assert lines[2] == '{"event": "step", "step": 2, "lo' and json.loads(lines[3])["event"] == "start"
    with pytest.warns(UserWarning, match="line 3 is not complete JSON") as caught:
        run = summarize_log(path)
    assert len(caught) == 1
    assert run["losses"] == {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0} and run["parts"] == 2
    # A line that is not JSON inside a part is damage, not a cut: no silent skip.
    lines.insert(1, '{"event": "st')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"m.jsonl: line 2 is not complete JSON and not the last line of a part"):
        summarize_log(path)


def test_process_group_takes_cuda_without_an_index_as_the_current_device(monkeypatch):
    # torch.cuda.set_device refuses a device without an index ("Expected a torch.device with a specified index");
    # a benchmark's --device cuda reaches process_group as exactly that.
    from torch.cuda._utils import _get_device_index

    from k3lab.train.loop import process_group

    chosen = []

    class Stop(Exception):
        pass

    def set_device(d):
        chosen.append(_get_device_index(d))
        raise Stop

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    for device in (torch.device("cuda"), torch.device("cuda", 1)):
        with pytest.raises(Stop), process_group(device):
            pass
    assert chosen == [3, 1]
