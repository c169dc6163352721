"""The book's real training text: CPython 3.11 standard-library sources, a byte-level BPE, token shards.

Commands (run from the repository root)::

    python -m k3lab.data build                      # data/corpus.tar.xz -> data/shards/{train,val}.bin
    python -m k3lab.data build --retrain-tokenizer --update-manifest   # new data/tokenizer.json
    python -m k3lab.data select --source /path/to/lib/python3.11       # re-make data/corpus.tar.xz
    python -m k3lab.data info                       # what is built, tokens per split

Where the data are: a ``data_dir`` (or ``shard_dir``) argument, else ``$K3LAB_DATA_DIR``, else the
checkout's ``data/`` (k3lab run from its checkout or installed editable). A wheel installed with
``pip install .`` has no ``data/`` beside it: it ships the committed tokenizer, so
:func:`load_tokenizer` and :func:`vocab_size` work anywhere, and the corpus and shard functions raise an
error that names ``$K3LAB_DATA_DIR`` and the build command.

``build`` is deterministic: it reads the committed corpus (sorted members), puts every 20th file into
``val``, encodes each file with the committed ``data/tokenizer.json`` followed by ``<|endoftext|>``,
writes uint16 shards (tmp file + rename) and a manifest with a sha256 per shard, and checks that
manifest against the committed ``data/manifest.json``. ``data/README.md`` says what the corpus is.

API used by the book and by ``k3lab.lm``::

    tokens = load_split("train")               # np.memmap uint16 [n_tokens]
    x, y = get_batch(tokens, 8, 128, torch.Generator().manual_seed(0), "cpu")   # int64 [8, 128]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch

from k3lab.files import atomic_write_bytes, blocked_parent

ROOT = Path(__file__).resolve().parents[1]
DATA_ENV = "K3LAB_DATA_DIR"
# Exists when k3lab runs from its checkout; a wheel's site-packages has no data/ folder.
CHECKOUT_DATA_DIR = ROOT / "data"
# setup.py ships data/tokenizer.json here in the wheel (the checkout has no such folder).
PACKAGED_DATA_DIR = Path(__file__).resolve().parent / "_data"
SPLITS = ("train", "val")
EOT = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 4096
VAL_EVERY = 20
MAX_CORPUS_BYTES = 8_000_000
CORPUS_PREFIX = "Lib"
# Generated tables (encodings/, pydoc_data/), legacy or GUI-demo packages, tests and third-party code.
SKIP_DIRS = ("test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data",
             "idlelib", "turtledemo", "lib2to3", "distutils")
BUILD_COMMAND = "python -m k3lab.data build"


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data folder: ``data_dir`` when given, else ``$K3LAB_DATA_DIR``, else the checkout's ``data/``.

    Raises:
        TypeError: ``data_dir`` is not a path.
        FileNotFoundError: nothing given and k3lab runs without its checkout (installed from a wheel);
            the message names ``$K3LAB_DATA_DIR`` and the command that builds the shards.
    """
    if data_dir is not None:
        if not isinstance(data_dir, (str, os.PathLike)):
            raise TypeError(f"data_dir must be a path, got {type(data_dir).__name__} {data_dir!r}")
        return Path(data_dir)
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env)
    if (CHECKOUT_DATA_DIR / "manifest.json").is_file():
        return CHECKOUT_DATA_DIR
    raise FileNotFoundError(
        f"no k3lab data folder: this k3lab ({ROOT}) is installed without its checkout. Set ${DATA_ENV} "
        f"to a k3lab checkout's data/ folder (or pass data_dir=/shard_dir=) after building the shards "
        f"there with `{BUILD_COMMAND}` (or `make data`) from the checkout's root")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


# ---------------------------------------------------------------------------------------------
# Corpus selection (run once by a maintainer; the result is committed)
# ---------------------------------------------------------------------------------------------

def select_corpus_files(source: Path, max_bytes: int = MAX_CORPUS_BYTES) -> list[Path]:
    """The deterministic subset of a CPython ``Lib/`` tree that forms the corpus.

    Rule: every ``*.py`` file in sorted relative-path order, skipping the folders in ``SKIP_DIRS``
    (tests, site-packages, generated tables, legacy and GUI demos) and ``config-*``; files that are
    not UTF-8 are skipped; stop before the first file that would take the total past ``max_bytes``.

    Raises:
        ValueError: ``source`` is not a directory or holds no eligible file, or ``max_bytes`` is not a
            positive int (``--max-bytes``).
    """
    if not (isinstance(max_bytes, int) and not isinstance(max_bytes, bool) and max_bytes > 0):
        raise ValueError(f"max_bytes (--max-bytes) must be a positive int, got {max_bytes!r}")
    source = Path(source)
    if not source.is_dir():
        raise ValueError(f"source must be a directory (a CPython Lib/ tree), got {source}")
    chosen, total = [], 0
    for path in sorted(source.rglob("*.py"), key=lambda p: p.relative_to(source).as_posix()):
        rel = path.relative_to(source)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if total + len(data) > max_bytes:
            break
        chosen.append(rel)
        total += len(data)
    if not chosen:
        raise ValueError(f"no eligible *.py files under {source}")
    return chosen


def write_corpus_archive(source: Path, out: Path, max_bytes: int = MAX_CORPUS_BYTES) -> dict:
    """Pack :func:`select_corpus_files` into a reproducible ``.tar.xz`` (fixed mtimes, owners, order).

    Raises:
        ValueError: as :func:`select_corpus_files`, or ``out``'s folder (``select --data-dir``) cannot be made
            or written (checked before the files are read).
    """
    problem = blocked_parent(out)
    if problem is not None:
        raise ValueError(f"{out} (select --data-dir): {problem}")
    files = select_corpus_files(source, max_bytes)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", format=tarfile.GNU_FORMAT) as tar:
        for rel in files:
            data = (Path(source) / rel).read_bytes()
            info = tarfile.TarInfo(f"{CORPUS_PREFIX}/{rel.as_posix()}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    atomic_write_bytes(Path(out), buf.getvalue())
    return {"files": len(files), "bytes": sum((Path(source) / r).stat().st_size for r in files),
            "archive_bytes": len(buf.getvalue())}


def read_corpus(data_dir: Path | None = None) -> list[tuple[str, str]]:
    """The committed corpus as ``(path, text)`` pairs in sorted path order.

    Args:
        data_dir (Path | None): default :func:`resolve_data_dir`.

    Raises:
        FileNotFoundError: ``data_dir/corpus.tar.xz`` is missing, or no data folder is known.
        ValueError: the archive is damaged, or one of its files is not UTF-8 (``select`` keeps only UTF-8
            files, so the archive was not made by it).
    """
    archive = resolve_data_dir(data_dir) / "corpus.tar.xz"
    if not archive.is_file():
        raise FileNotFoundError(f"{archive} is missing (it is committed to git: restore it)")
    files = []
    try:
        with tarfile.open(archive, mode="r:xz") as tar:
            for member in tar.getmembers():
                if member.isfile():
                    files.append((member.name, tar.extractfile(member).read().decode("utf-8")))
    except (tarfile.TarError, EOFError, lzma.LZMAError, UnicodeDecodeError) as e:
        raise ValueError(f"{archive} cannot be read as the corpus ({type(e).__name__}: {e}); restore it from git "
                         f"or re-make it with `python -m k3lab.data select`") from e
    return sorted(files)


def split_files(files: list[tuple[str, str]], val_every: int = VAL_EVERY) -> dict[str, list[str]]:
    """Split by file: the i-th file (0-based, sorted) goes to ``val`` when ``i % val_every == val_every - 1``.

    Raises:
        ValueError: ``val_every`` not an int >= 2.
    """
    if not (isinstance(val_every, int) and not isinstance(val_every, bool) and val_every >= 2):
        raise ValueError(f"val_every must be an int >= 2, got {val_every!r}")
    out = {"train": [], "val": []}
    for i, (_, text) in enumerate(files):
        out["val" if i % val_every == val_every - 1 else "train"].append(text)
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def _check_texts(who: str, texts) -> list[str]:
    """``texts`` as a list (an iterator is read once), or ValueError unless it holds str documents only."""
    if isinstance(texts, (str, bytes)):
        raise ValueError(f"{who}: texts must be a list of str documents, got one {type(texts).__name__}")
    texts = list(texts)
    bad = sorted({type(t).__name__ for t in texts if not isinstance(t, str)})
    if bad:
        raise ValueError(f"{who}: texts must be a list of str documents, got items of type {', '.join(bad)}")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train a byte-level BPE (GPT-2 style pre-tokenisation, ``<|endoftext|>`` = id 0).

    Args:
        texts (list[str]): training documents.
        vocab_size (int): final vocabulary size, 257 <= vocab_size <= 65536 (ids must fit uint16).

    Returns:
        tokenizers.Tokenizer

    Raises:
        ValueError: ``vocab_size`` out of range, ``texts`` empty, a str (it would train on its characters as
            documents) or holding anything but str.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = _check_texts("train_tokenizer", texts)

    if not (isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and 257 <= vocab_size <= 65536):
        raise ValueError(f"vocab_size must be an int in [257, 65536] (uint16 ids, 256 bytes + EOT), got {vocab_size!r}")
    if not texts:
        raise ValueError("texts must hold at least one document")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _tokenizer_path(data_dir: Path | None) -> Path:
    try:
        return resolve_data_dir(data_dir) / "tokenizer.json"
    except FileNotFoundError:
        if (PACKAGED_DATA_DIR / "tokenizer.json").is_file():
            return PACKAGED_DATA_DIR / "tokenizer.json"
        raise


def load_tokenizer(data_dir: Path | None = None):
    """The committed byte-level BPE tokenizer (``data/tokenizer.json``).

    Args:
        data_dir (Path | None): default :func:`resolve_data_dir`, else the copy shipped in the wheel.

    Returns:
        tokenizers.Tokenizer: ``encode(text).ids`` and ``decode(ids)`` round-trip any UTF-8 text (empty,
        non-ASCII, long lines) except the literal ``<|endoftext|>``: it encodes to the special id 0, which
        ``decode`` drops unless ``skip_special_tokens=False``.

    Raises:
        FileNotFoundError: the tokenizer file is missing.
        ValueError: the tokenizer file does not parse (the message names it and how to restore it).
    """
    from tokenizers import Tokenizer

    path = _tokenizer_path(data_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: restore it from git or run "
                                f"`{BUILD_COMMAND} --retrain-tokenizer --update-manifest`")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001  (tokenizers raises a bare Exception for any file it cannot parse)
        raise ValueError(f"{path} is not a readable tokenizer ({e}): restore it from git or run "
                         f"`{BUILD_COMMAND} --retrain-tokenizer --update-manifest`") from e


def vocab_size(data_dir: Path | None = None) -> int:
    """Vocabulary size of the committed tokenizer (4096 by default), EOT included."""
    return load_tokenizer(data_dir).get_vocab_size()


def encode_documents(tok, texts: list[str]) -> np.ndarray:
    """Encode documents, each followed by ``<|endoftext|>``; returns uint16 [n_tokens].

    Raises:
        ValueError: ``texts`` a str or holding anything but str; the tokenizer has no ``<|endoftext|>`` or a
            vocabulary past uint16.
    """
    texts = _check_texts("encode_documents", texts)
    eot = tok.token_to_id(EOT)
    if eot is None:
        raise ValueError(f"tokenizer has no {EOT} token")
    if tok.get_vocab_size() > 65536:
        raise ValueError(f"vocab size {tok.get_vocab_size()} does not fit uint16")
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype="<u2")


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------

def build(
    data_dir: Path | None = None,
    out_dir: Path | None = None,
    retrain_tokenizer: bool = False,
    vocab: int = DEFAULT_VOCAB_SIZE,
    update_manifest: bool = False,
    verbose: bool = True,
) -> dict:
    """Build ``out_dir/{train,val}.bin`` and ``out_dir/manifest.json`` from the committed corpus.

    Args:
        data_dir (Path | None): holds ``corpus.tar.xz``, ``tokenizer.json`` and ``manifest.json``;
            default :func:`resolve_data_dir`.
        out_dir (Path | None): where shards go; default ``data_dir/shards``.
        retrain_tokenizer (bool): retrain the BPE on the train split and overwrite ``tokenizer.json``.
        vocab (int): vocabulary size when retraining.
        update_manifest (bool): write the new manifest to ``data_dir/manifest.json`` instead of
            checking against it.

    Returns:
        dict: the manifest (corpus and tokenizer sha256, per split: file, tokens, bytes, files, sha256).

    Raises:
        FileNotFoundError: no data folder is known, ``data_dir`` is not a folder, or the corpus, the tokenizer
            (without ``retrain_tokenizer``) or the committed manifest (without ``update_manifest``) is missing.
        ValueError: the tokenizer (without ``retrain_tokenizer``) does not parse; ``out_dir`` cannot be made
            or written (checked before the corpus is encoded).
        RuntimeError: the built shards differ from the committed manifest; nothing is written then
            (a retrained tokenizer included).
    """
    data_dir = resolve_data_dir(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data_dir (--data-dir) {data_dir} is not a folder")
    out_dir = Path(out_dir) if out_dir is not None else data_dir / "shards"
    problem = blocked_parent(out_dir / "manifest.json")
    if problem is not None:
        raise ValueError(f"out_dir (--out-dir) {out_dir}: {problem}")
    files = read_corpus(data_dir)
    splits = split_files(files)
    if retrain_tokenizer:
        # Kept in memory until the manifest check passes: a failed build changes no file.
        tok_bytes = train_tokenizer(splits["train"], vocab).to_str(pretty=True).encode()
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tok_bytes.decode())
    else:
        tok = load_tokenizer(data_dir)
        tok_bytes = (data_dir / "tokenizer.json").read_bytes()

    manifest = {
        "corpus": "corpus.tar.xz",
        "corpus_sha256": _sha256((data_dir / "corpus.tar.xz").read_bytes()),
        "tokenizer_sha256": _sha256(tok_bytes),
        "vocab_size": tok.get_vocab_size(),
        "dtype": "uint16 little-endian",
        "val_every": VAL_EVERY,
        "splits": {},
    }
    arrays = {}
    for split in SPLITS:
        arr = encode_documents(tok, splits[split])
        arrays[split] = arr
        manifest["splits"][split] = {
            "file": f"{split}.bin",
            "files": len(splits[split]),
            "bytes": sum(len(t.encode()) for t in splits[split]),
            "tokens": int(arr.size),
            "sha256": _sha256(arr.tobytes()),
        }

    committed = data_dir / "manifest.json"
    if not update_manifest:
        if not committed.is_file():
            raise FileNotFoundError(f"{committed} is missing: restore it from git, or run "
                                    f"`{BUILD_COMMAND} --update-manifest` to write a new one")
        expected = json.loads(committed.read_text())
        if expected != manifest:
            diffs = _manifest_diff(expected, manifest)
            raise RuntimeError(
                f"the built shards do not match the committed {committed} (nothing written):\n  "
                + "\n  ".join(diffs)
                + f"\nIf the corpus or tokenizer changed on purpose, run `{BUILD_COMMAND} --update-manifest`."
            )
    if retrain_tokenizer:
        atomic_write_bytes(data_dir / "tokenizer.json", tok_bytes)
        if verbose:
            print(f"trained tokenizer: vocab {tok.get_vocab_size()} -> {data_dir / 'tokenizer.json'}")
    if update_manifest:
        atomic_write_bytes(committed, _json_bytes(manifest))
    for split in SPLITS:
        atomic_write_bytes(out_dir / f"{split}.bin", arrays[split].tobytes())
    # Written last: its presence means both shards are complete (the Makefile's stamp).
    atomic_write_bytes(out_dir / "manifest.json", _json_bytes(manifest))
    if verbose:
        for split, info in manifest["splits"].items():
            print(f"{split:5s}: {info['files']:4d} files, {info['bytes']:>9,d} bytes -> "
                  f"{info['tokens']:>9,d} tokens ({info['tokens'] / info['bytes']:.3f} tokens/byte) "
                  f"sha256 {info['sha256'][:12]}")
        print(f"shards in {out_dir} match {committed}")
    return manifest


def _manifest_diff(expected: dict, got: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(expected) | set(got)):
        a, b = expected.get(key), got.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _manifest_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: committed {a!r}, built {b!r}")
    return out


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def load_split(split: str, shard_dir: Path | None = None) -> np.memmap:
    """Memory-map one token split.

    Args:
        split (str): "train" or "val".
        shard_dir (Path | None): default ``shards/`` of :func:`resolve_data_dir`.

    Returns:
        np.memmap: uint16 [n_tokens], read-only; documents separated by ``<|endoftext|>`` (id 0).

    Raises:
        ValueError: ``split`` is not "train" or "val".
        FileNotFoundError: no data folder is known, or the shards are missing, empty or incomplete, or
            their manifest unreadable; the message names the build command.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if shard_dir is not None and not isinstance(shard_dir, (str, os.PathLike)):
        raise TypeError(f"shard_dir must be a path, got {type(shard_dir).__name__} {shard_dir!r}")
    shard_dir = Path(shard_dir) if shard_dir is not None else resolve_data_dir() / "shards"
    manifest_path, path = shard_dir / "manifest.json", shard_dir / f"{split}.bin"
    if not manifest_path.is_file() or not path.is_file():
        raise FileNotFoundError(f"token shards missing in {shard_dir} ({path.name} or manifest.json): "
                                f"run `{BUILD_COMMAND}` from the repository root (or `make data`); "
                                f"${DATA_ENV} or shard_dir= points at shards elsewhere")
    try:
        tokens = json.loads(manifest_path.read_text())["splits"][split]["tokens"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        tokens = None
    # A count that is not an int >= 0 (null, "x", 1.5) failed with TypeError or an odd size message.
    if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0):
        raise FileNotFoundError(f"{manifest_path} is unreadable or has no '{split}' split with a token count: "
                                f"rebuild with `{BUILD_COMMAND}`")
    if tokens == 0:
        raise FileNotFoundError(f"{path} holds no tokens: rebuild with `{BUILD_COMMAND}`")
    if path.stat().st_size != 2 * tokens:
        raise FileNotFoundError(f"{path} holds {path.stat().st_size} bytes, the manifest says {2 * tokens}: "
                                f"rebuild with `{BUILD_COMMAND}`")
    return np.memmap(path, dtype="<u2", mode="r")


def get_batch(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows for next-token prediction.

    Args:
        tokens (np.ndarray): 1-D integer tokens [n] (e.g. :func:`load_split`'s memmap).
        batch_size (int): B >= 1.
        seq_len (int): T, 1 <= T < n.
        generator (torch.Generator): CPU generator that draws the window starts (seeded -> reproducible).
        device: where x and y go.

    Returns:
        (x, y): int64 [B, T] each, ``y[:, t] == x[:, t + 1]`` within a window (targets shifted by one).

    Raises:
        TypeError: ``batch_size`` or ``seq_len`` not an int (a bool is refused too).
        ValueError: ``tokens`` not 1-D integer or shorter than 2, ``batch_size`` < 1, ``seq_len`` < 1 or
            ``seq_len >= n``, ``generator`` not a CPU torch.Generator, a drawn window holding a negative id
            (or a uint64 id past int64).
    """
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D integer np.ndarray, got {type(tokens).__name__} "
                         f"{getattr(tokens, 'dtype', '')} shape {getattr(tokens, 'shape', '')}")
    for name, n in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
            raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if len(tokens) < 2:
        raise ValueError(f"tokens holds {len(tokens)} token(s); a window needs at least 2 (an input and its target)")
    if not 1 <= seq_len < len(tokens):
        raise ValueError(f"seq_len must be an int in [1, {len(tokens) - 1}] (split length {len(tokens)} "
                         f"needs seq_len + 1 tokens per window), got {seq_len!r}")
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise ValueError(f"generator must be a CPU torch.Generator, got {generator!r}")
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator).numpy()
    window = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)])
    # Checked on the window drawn (not the whole split): a negative id, or a uint64 past int64, would come out
    # as a negative token id.
    if window.min() < 0 or int(window.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"tokens must be ids >= 0 (and within int64); a window holds {window.min()} .. {window.max()}")
    xy = torch.from_numpy(window.astype(np.int64))
    x, y = xy[:, :-1], xy[:, 1:]
    device = torch.device(device)
    if device.type == "cuda":
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))
    return x.contiguous().to(device), y.contiguous().to(device)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3lab.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = build_parser = sub.add_parser("build", help="build data/shards/{train,val}.bin and check them against "
                                                    "data/manifest.json")
    p.add_argument("--data-dir", type=Path, default=None,
                   help=f"folder with corpus.tar.xz, tokenizer.json, manifest.json (default ${DATA_ENV}, else the "
                        f"checkout's data/)")
    p.add_argument("--out-dir", type=Path, default=None, help="where the shards go (default shards/ in the data folder)")
    p.add_argument("--retrain-tokenizer", action="store_true", help="retrain the BPE and overwrite tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"vocabulary size of the retrained BPE (default {DEFAULT_VOCAB_SIZE}; needs "
                        f"--retrain-tokenizer)")
    p.add_argument("--update-manifest", action="store_true", help="write data/manifest.json instead of checking it")
    p = sub.add_parser("select", help="re-make data/corpus.tar.xz from a CPython Lib/ folder")
    p.add_argument("--source", type=Path, required=True, help="e.g. /root/.pyenv/versions/3.11.7/lib/python3.11")
    p.add_argument("--data-dir", type=Path, default=None,
                   help=f"where corpus.tar.xz goes (default ${DATA_ENV}, else the checkout's data/)")
    p.add_argument("--max-bytes", type=int, default=MAX_CORPUS_BYTES, help="cap on the selected text")
    p = sub.add_parser("info", help="print the built shards' token counts")
    p.add_argument("--data-dir", type=Path, default=None,
                   help=f"folder with shards/ (default ${DATA_ENV}, else the checkout's data/)")
    args = parser.parse_args(argv)
    # Without retraining, the committed tokenizer.json fixes the vocabulary: a size would be ignored.
    if args.cmd == "build" and args.vocab_size is not None and not args.retrain_tokenizer:
        build_parser.error(f"--vocab-size {args.vocab_size} needs --retrain-tokenizer (the committed "
                           f"tokenizer.json fixes the vocabulary)")

    try:
        data_dir = resolve_data_dir(args.data_dir)
        if args.cmd == "build":
            vocab = DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size
            build(data_dir, args.out_dir, args.retrain_tokenizer, vocab, args.update_manifest)
        elif args.cmd == "select":
            info = write_corpus_archive(args.source, data_dir / "corpus.tar.xz", args.max_bytes)
            print(f"{info['files']} files, {info['bytes']:,d} bytes -> {data_dir / 'corpus.tar.xz'} "
                  f"({info['archive_bytes']:,d} bytes)")
        else:
            for split in SPLITS:
                tokens = load_split(split, data_dir / "shards")
                print(f"{split}: {len(tokens):,d} tokens")
            print(f"vocab size: {vocab_size(data_dir)}")
    except (OSError, RuntimeError, ValueError) as e:  # OSError: missing files, an --out-dir that cannot be made
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
