"""Files written whole or not at all.

The project standard: bad input or an interruption loses nothing. Benchmarks rewrite their result
JSON after every case and the book runner stores notebooks in place; a process killed mid-write (a
GPU call's time limit, Ctrl-C) or content that fails to serialise must leave the previous file as it
was, never a truncated one that breaks the next reader.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: a reader sees the old file or the new one, never a mix.

    The UTF-8 bytes of ``text`` (no newline translation) go to a hidden temporary file beside ``path``
    (same folder, so same file system), are flushed to disk, then renamed over ``path`` with
    ``os.replace``, which is atomic. Missing parent folders are created. On any exception,
    KeyboardInterrupt included, the temporary file is removed and ``path`` keeps its previous bytes
    (or stays absent). Folders created before the failure stay.

    Args:
        path (str | os.PathLike): the file to write.
        text (str): its whole new content.

    Raises:
        TypeError: ``text`` is not a str (checked before anything is touched).
        UnicodeEncodeError: ``text`` holds characters UTF-8 cannot encode (lone surrogates).
        OSError: the folder cannot be created or written, or ``path`` is a directory.

    Example::

        atomic_write_text("build/html/index.html", "<h1>k3lab book</h1>\\n")
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    data = text.encode("utf-8")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique per process and thread, so concurrent writers of one path never share a temp file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, obj, indent: int | None = 1, *, allow_nan: bool = True) -> None:
    """Write ``json.dumps(obj, indent=indent, allow_nan=allow_nan)`` plus a newline to ``path`` atomically.

    ``obj`` is serialised before the file system is touched, so a serialisation error leaves ``path``
    (and its folder) exactly as it was; the write itself is :func:`atomic_write_text`. With the default
    ``allow_nan=True``, NaN and infinities are written as ``NaN`` / ``Infinity`` (not strict JSON);
    callers that want ``null`` convert them first.

    Args:
        path (str | os.PathLike): the file to write; missing parent folders are created.
        obj: anything ``json.dumps`` accepts (dict, list, str, int, float, bool, None, nested).
        indent (int | None): ``json.dumps``'s indent; None for one line.
        allow_nan (bool): False makes NaN or +-inf anywhere in ``obj`` an error.

    Raises:
        TypeError: ``obj`` holds something JSON cannot represent (a tensor, a set, a Path, ...).
        ValueError: a circular reference, or NaN / inf with ``allow_nan=False``.
        OSError: as :func:`atomic_write_text`.
    """
    atomic_write_text(path, json.dumps(obj, indent=indent, allow_nan=allow_nan) + "\n")
