"""k3lab.data: deterministic build, manifest check, memory-mapped shards, random windows."""
import json
import shutil

import numpy as np
import pytest
import torch

from k3lab import data


@pytest.fixture(scope="module")
def tiny_data_dir(tmp_path_factory):
    """A small corpus (real stdlib-like files) with its own tokenizer and committed manifest."""
    src = tmp_path_factory.mktemp("lib")
    for i in range(25):
        (src / f"mod{i:02d}.py").write_text(f'"""Module {i}."""\n\ndef f{i}(x):\n    return x * {i} + 1  # ok\n' * 20)
    (src / "tests").mkdir()
    (src / "tests" / "test_x.py").write_text("assert True\n")
    out = tmp_path_factory.mktemp("data")
    data.write_corpus_archive(src, out / "corpus.tar.xz")
    data.build(out, retrain_tokenizer=True, vocab=300, update_manifest=True, verbose=False)
    return out


def test_select_corpus_skips_tests_non_utf8_and_caps(tmp_path):
    for rel, body in {"a.py": b"x = 1\n", "b/c.py": b"y = 2\n", "tests/t.py": b"t\n",
                      "site-packages/p.py": b"p\n", "d.py": b"\xff\xfe bad\n", "e.py": b"z" * 100}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(body)
    chosen = [p.as_posix() for p in data.select_corpus_files(tmp_path, max_bytes=50)]
    assert chosen == ["a.py", "b/c.py"]
    with pytest.raises(ValueError, match="source"):
        data.select_corpus_files(tmp_path / "nope")


def test_full_build_is_deterministic_and_matches_committed_manifest(tmp_path):
    m1 = data.build(out_dir=tmp_path / "a", verbose=False)
    m2 = data.build(out_dir=tmp_path / "b", verbose=False)
    assert m1 == m2 == json.loads((data.resolve_data_dir() / "manifest.json").read_text())
    for split in data.SPLITS:
        a = (tmp_path / "a" / f"{split}.bin").read_bytes()
        assert a == (tmp_path / "b" / f"{split}.bin").read_bytes()
        assert data._sha256(a) == m1["splits"][split]["sha256"]
        assert len(a) == 2 * m1["splits"][split]["tokens"]
    assert m1["vocab_size"] == data.vocab_size() == 4096
    assert m1["splits"]["train"]["files"] > 10 * m1["splits"]["val"]["files"] > 0


def test_retrained_tokenizer_is_deterministic(tiny_data_dir, tmp_path):
    other = tmp_path / "d"
    shutil.copytree(tiny_data_dir, other)
    data.build(other, retrain_tokenizer=True, vocab=300, verbose=False)
    assert (other / "tokenizer.json").read_bytes() == (tiny_data_dir / "tokenizer.json").read_bytes()
    assert not any("test_x" in name for name, _ in data.read_corpus(other))


def test_manifest_mismatch_is_an_error_and_writes_nothing(tiny_data_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_data_dir, bad, ignore=shutil.ignore_patterns("shards"))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["splits"]["train"]["tokens"] += 1
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match=r"(?s)splits\.train\.tokens.*--update-manifest"):
        data.build(bad, verbose=False)
    assert not (bad / "shards").exists() or not any((bad / "shards").iterdir())
    # A retrained tokenizer that does not match is not written either.
    tokenizer = (bad / "tokenizer.json").read_bytes()
    with pytest.raises(RuntimeError, match="nothing written"):
        data.build(bad, retrain_tokenizer=True, vocab=280, verbose=False)
    assert (bad / "tokenizer.json").read_bytes() == tokenizer
    (bad / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="manifest"):
        data.build(bad, verbose=False)


def test_tokenizer_round_trips_real_text():
    tok = data.load_tokenizer()
    name, text = data.read_corpus()[3]
    text = text[:4000] + "\n# non-ASCII: é, 中文, 🙂\n"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert max(ids) < data.vocab_size()
    assert 0.15 < len(ids) / len(text.encode()) < 0.6, name


@pytest.mark.parametrize("text", ["", " ", "\x00", "é", "日本語", "🙂👍🏽", "\u200b\u0301", "a" * 20000,
                                  "x = 1\r\n" * 200, "\t\tdef f():\n\tpass  "],
                         ids=["empty", "space", "nul", "latin", "cjk", "emoji", "combining", "long-line", "crlf", "tabs"])
def test_tokenizer_round_trips_odd_text(text):
    tok = data.load_tokenizer()
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text and all(0 < i < tok.get_vocab_size() for i in ids)


def test_the_literal_end_of_text_encodes_to_its_special_id():
    """As the load_tokenizer docstring says: the one text that does not round-trip by default."""
    tok = data.load_tokenizer()
    ids = tok.encode("a" + data.EOT + "b").ids
    assert 0 in ids and tok.decode(ids) == "ab" and tok.decode(ids, skip_special_tokens=False) == "a" + data.EOT + "b"


def test_load_split_is_a_uint16_memmap():
    for split in data.SPLITS:
        tokens = data.load_split(split)
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and tokens.ndim == 1
        assert tokens.max() < data.vocab_size()
        assert (tokens == data.load_tokenizer().token_to_id(data.EOT)).sum() > 0
    with pytest.raises(ValueError, match="split"):
        data.load_split("test")


def test_broken_manifest_or_empty_shard_name_the_build_command(tmp_path):
    """A corrupt manifest raised JSONDecodeError, one without the split KeyError, an empty shard
    ValueError from np.memmap; get_batch ignored a non-CUDA device."""
    (tmp_path / "train.bin").write_bytes(b"")
    for manifest in ("{not json", json.dumps({"splits": {}}), json.dumps({"splits": {"train": {"tokens": 0}}})):
        (tmp_path / "manifest.json").write_text(manifest)
        with pytest.raises(FileNotFoundError, match="k3lab.data build"):
            data.load_split("train", tmp_path)
    # A token count that is not an int >= 0 raised TypeError (null) or compared the shard's size with
    # "xx" or 3.0 bytes; a manifest that is not UTF-8 raised UnicodeDecodeError.
    for tokens in (None, "x", 1.5, -5, True):
        (tmp_path / "manifest.json").write_text(json.dumps({"splits": {"train": {"tokens": tokens}}}))
        with pytest.raises(FileNotFoundError, match=r"unreadable or has no 'train' split with a token count.*k3lab\.data build"):
            data.load_split("train", tmp_path)
    (tmp_path / "manifest.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(FileNotFoundError, match="k3lab.data build"):
        data.load_split("train", tmp_path)
    x, y = data.get_batch(np.arange(100, dtype=np.uint16), 2, 8, torch.Generator().manual_seed(0), device="meta")
    assert x.device.type == y.device.type == "meta"


def test_missing_shards_name_the_build_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m k3lab\.data build"):
        data.load_split("train", shard_dir=tmp_path)


def test_data_folder_comes_from_argument_then_environment_then_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(data.DATA_ENV, raising=False)
    assert data.resolve_data_dir() == data.CHECKOUT_DATA_DIR
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path / "env"))
    assert data.resolve_data_dir() == tmp_path / "env", "read at each call, not at import"
    assert data.resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"
    with pytest.raises(FileNotFoundError, match="token shards missing in .*env.*K3LAB_DATA_DIR"):
        data.load_split("train")
    with pytest.raises(TypeError, match="data_dir must be a path, got int 3"):
        data.resolve_data_dir(3)
    with pytest.raises(TypeError, match="shard_dir must be a path"):
        data.load_split("train", shard_dir=3)


def test_without_a_checkout_the_tokenizer_ships_and_the_rest_names_the_variable(tmp_path, monkeypatch):
    """What a wheel install sees: no data/ beside the package, the tokenizer in k3lab/_data/."""
    monkeypatch.delenv(data.DATA_ENV, raising=False)
    monkeypatch.setattr(data, "CHECKOUT_DATA_DIR", tmp_path / "site-packages" / "data")
    monkeypatch.setattr(data, "PACKAGED_DATA_DIR", tmp_path / "no-packaged-copy")
    for call in (data.resolve_data_dir, lambda: data.load_split("val"), data.read_corpus, data.vocab_size):
        with pytest.raises(FileNotFoundError, match=r"Set \$K3LAB_DATA_DIR .*`python -m k3lab\.data build`"):
            call()
    packaged = tmp_path / "_data"
    packaged.mkdir()
    shutil.copy2(data.ROOT / "data" / "tokenizer.json", packaged / "tokenizer.json")
    monkeypatch.setattr(data, "PACKAGED_DATA_DIR", packaged)
    assert data.vocab_size() == 4096
    assert data.main(["info"]) == 1


def test_get_batch_shapes_shift_and_seeding():
    tokens = data.load_split("val")
    B, T = 4, 33
    x, y = data.get_batch(tokens, B, T, torch.Generator().manual_seed(1), "cpu")
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is a real window of the split: find it and check the target is the next token
    flat = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    for row_x, row_y in zip(x, y):
        starts = (flat[: len(flat) - T] == row_x[0]).nonzero().flatten()
        assert any(torch.equal(flat[s:s + T], row_x) and torch.equal(flat[s + 1:s + T + 1], row_y)
                   for s in starts.tolist())
    x2, _ = data.get_batch(tokens, B, T, torch.Generator().manual_seed(1), "cpu")
    x3, _ = data.get_batch(tokens, B, T, torch.Generator().manual_seed(2), "cpu")
    assert torch.equal(x, x2) and not torch.equal(x, x3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=10), "seq_len"),
    (dict(seq_len=9), None),
    (dict(seq_len=0), "seq_len"),
    (dict(batch_size=0), "batch_size"),
    (dict(generator=None), "generator"),
], ids=["seq_len_eq_n", "seq_len_n_minus_1", "seq_len_0", "batch_0", "no_generator"])
def test_get_batch_bad_args(kwargs, match):
    tokens = np.arange(10, dtype=np.uint16)
    args = dict(tokens=tokens, batch_size=2, seq_len=4, generator=torch.Generator().manual_seed(0), device="cpu")
    args.update(kwargs)
    if match is None:
        x, y = data.get_batch(**args)
        assert torch.equal(x[0], torch.arange(9)) and torch.equal(y[0], torch.arange(1, 10))
    else:
        with pytest.raises(ValueError, match=match):
            data.get_batch(**args)
    with pytest.raises(ValueError, match="tokens"):
        data.get_batch(np.zeros((2, 5), dtype=np.uint16), 1, 2, torch.Generator(), "cpu")


@pytest.mark.parametrize("tokens, match", [
    (np.full(12, -3, dtype=np.int8), r"ids >= 0 .* a window holds -3 \.\. -3"),
    (np.full(12, 2 ** 63 + 5, dtype=np.uint64), r"ids >= 0 \(and within int64\)"),
    (np.zeros(0, dtype=np.uint16), "tokens holds 0 token"),
], ids=["negative-int8", "uint64-past-int64", "empty"])
def test_get_batch_refuses_ids_that_would_come_out_negative(tokens, match):
    """int8 ids -3 came out as token -3, uint64 ids past 2^63 wrapped to negative, and an empty split said
    "seq_len must be an int in [1, -1]"."""
    with pytest.raises(ValueError, match=match):
        data.get_batch(tokens, 2, 1, torch.Generator().manual_seed(0), "cpu")


@pytest.mark.parametrize("call, match", [
    (lambda: data.train_tokenizer("abc def", 300), "train_tokenizer: texts must be a list of str documents, got one str"),
    (lambda: data.encode_documents(data.load_tokenizer(), "abc"), "encode_documents: texts must be a list of str"),
    (lambda: data.encode_documents(data.load_tokenizer(), ["a", 1]), "got items of type int"),
    (lambda: data.split_files([("a", "x")], 2.5), "val_every must be an int >= 2, got 2.5"),
    (lambda: data.train_tokenizer(["abc"], 300.5), r"vocab_size must be an int in \[257, 65536\].*got 300.5"),
    (lambda: data.train_tokenizer(["abc"], "300"), r"vocab_size must be an int in \[257, 65536\].*got '300'"),
], ids=["train-on-a-str", "encode-a-str", "encode-an-int", "float-val-every", "float-vocab", "str-vocab"])
def test_text_inputs_of_the_wrong_kind_are_named(call, match):
    """A str was trained on as one document per character; encode_documents raised tokenizers' "Can't extract
    `str` to `Vec`"; a float val_every was taken; a float or str vocab_size raised TypeError."""
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=True), "batch_size must be an int, got bool True"),
    (dict(batch_size=2.0), "batch_size must be an int, got float 2.0"),
    (dict(seq_len=True), "seq_len must be an int, got bool True"),
    (dict(seq_len="4"), "seq_len must be an int, got str '4'"),
], ids=["batch_bool", "batch_float", "seq_len_bool", "seq_len_str"])
def test_get_batch_wrong_types(kwargs, match):
    args = dict(tokens=np.arange(10, dtype=np.uint16), batch_size=2, seq_len=4,
                generator=torch.Generator().manual_seed(0), device="cpu")
    with pytest.raises(TypeError, match=match):
        data.get_batch(**{**args, **kwargs})


def test_cli_errors_are_one_line(tmp_path, capsys):
    """An --out-dir that cannot be made raised a NotADirectoryError traceback from the CLI."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert data.main(["build", "--out-dir", str(blocker / "shards")]) == 1
    assert "error:" in capsys.readouterr().err


def test_a_damaged_corpus_archive_is_named(tmp_path, capsys):
    """A truncated corpus.tar.xz raised a bare EOFError from lzma."""
    (tmp_path / "corpus.tar.xz").write_bytes((data.CHECKOUT_DATA_DIR / "corpus.tar.xz").read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"corpus.tar.xz cannot be read as the corpus \(EOFError"):
        data.read_corpus(tmp_path)
    assert data.main(["build", "--data-dir", str(tmp_path)]) == 1
    assert "cannot be read as the corpus" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["build", "--data-dir", "{tmp}/missing"], "data_dir (--data-dir) {tmp}/missing is not a folder"),
    (["build", "--out-dir", "{tmp}/file/shards"], "out_dir (--out-dir) {tmp}/file/shards: {tmp}/file is a file"),
    (["select", "--source", "{tmp}", "--max-bytes", "-5"], "max_bytes (--max-bytes) must be a positive int, got -5"),
    (["select", "--source", "{tmp}", "--data-dir", "{tmp}/file"], "(select --data-dir): {tmp}/file is a file"),
], ids=["missing-data-dir", "out-dir-below-a-file", "negative-max-bytes", "select-into-a-file"])
def test_cli_errors_name_the_flag_before_any_work(tmp_path, capsys, argv, message):
    """A missing --data-dir was reported as a missing corpus ("restore it from git"), --max-bytes -5 as "no
    eligible files", and an --out-dir that cannot be made only after the whole corpus was encoded."""
    (tmp_path / "file").write_text("x")
    assert data.main([a.format(tmp=tmp_path) for a in argv]) == 1
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_vocab_size_without_retraining_is_refused(capsys):
    """--vocab-size was ignored unless the tokenizer was retrained."""
    with pytest.raises(SystemExit) as e:
        data.main(["build", "--vocab-size", "100"])
    assert e.value.code == 2
    assert "--vocab-size 100 needs --retrain-tokenizer" in capsys.readouterr().err


def test_a_corrupt_tokenizer_names_its_file_and_the_rebuild_command(tiny_data_dir, tmp_path, capsys):
    """tokenizers' bare Exception ("control character ...") came through load_tokenizer and the CLI."""
    copy = tmp_path / "data"
    shutil.copytree(tiny_data_dir, copy)
    (copy / "tokenizer.json").write_text('{"bad json')
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a readable tokenizer .*k3lab\.data build "
                                         r"--retrain-tokenizer --update-manifest") as e:
        data.load_tokenizer(copy)
    assert str(copy / "tokenizer.json") in str(e.value) and e.value.__cause__ is not None
    assert data.main(["info", "--data-dir", str(copy)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "tokenizer.json is not a readable tokenizer" in err
