"""Files written whole or not at all.

The project standard: bad input or an interruption loses nothing. Benchmarks rewrite their result
JSON after every case and the book runner stores notebooks in place; a process killed mid-write (a
GPU call's time limit, Ctrl-C) or content that fails to serialise must leave the previous file as it
was, never a truncated one that breaks the next reader.
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one step: a reader sees the old file or the new one, never a mix.

    ``data`` goes to a hidden temporary file beside ``path`` (same folder, so same file system; a unique
    name, so concurrent writers never share one), with the mode an ordinary ``open()`` would give (an
    existing file's own mode, else 0666 less the umask), is flushed to disk, then renamed over ``path``
    with ``os.replace``, which is atomic. A symbolic link is written through, as ``open()`` would: its
    target is replaced and the link stays. Missing parent folders are created. On any exception, KeyboardInterrupt included, the temporary file is removed
    and ``path`` keeps its previous bytes (or stays absent). Folders created before the failure stay.

    Args:
        path (str | os.PathLike): the file to write.
        data (bytes): its whole new content.

    Raises:
        TypeError: ``data`` is not bytes (checked before anything is touched).
        OSError: the folder cannot be created or written, or ``path`` is a directory.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; give the file the mode an ordinary open() would.
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """``atomic_write_bytes`` of the UTF-8 bytes of ``text`` (no newline translation).

    Args:
        path (str | os.PathLike): the file to write.
        text (str): its whole new content.

    Raises:
        TypeError: ``text`` is not a str (checked before anything is touched).
        UnicodeEncodeError: ``text`` holds characters UTF-8 cannot encode (lone surrogates).
        OSError: as ``atomic_write_bytes``.

    Example::

        atomic_write_text("build/html/index.html", "<h1>k3lab book</h1>\\n")
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    atomic_write_bytes(path, text.encode("utf-8"))


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


def blocked_parent(path: str | os.PathLike) -> str | None:
    """Why the folder of ``path`` (a file or folder to be written later; missing folders are made then)
    could not be made or written, or None: its nearest existing ancestor is a file, or a folder this
    process may not write. For checks at the start of a run whose output is first written at its end.
    """
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a folder"
    if not os.access(parent, os.W_OK):
        return f"folder {parent} is not writable"
    try:
        # Permission bits are not the whole answer: /proc and read-only mounts refuse what os.access allows.
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        return f"folder {parent} refuses new files ({e.strerror})"
    return None
