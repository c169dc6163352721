"""k3lab.files: a failed or interrupted write leaves the previous file byte for byte and no temp file."""
import json
import math
import os

import pytest

from k3lab import files
from k3lab.bench import check_out
from k3lab.files import atomic_write_text, blocked_parent, write_json

OLD = b'{\n "cases": [1, 2]\n}\n'


@pytest.fixture
def old_file(tmp_path):
    path = tmp_path / "result.json"
    path.write_bytes(OLD)
    return path


def _circular():
    d = {}
    d["self"] = d
    return d


@pytest.mark.parametrize("obj, kwargs, error", [
    ({"t": object()}, {}, TypeError),
    ({"x": float("nan")}, {"allow_nan": False}, ValueError),
    ([math.inf], {"allow_nan": False}, ValueError),
    (_circular(), {}, ValueError),
], ids=["not-serialisable", "nan-strict", "inf-strict", "circular"])
def test_write_json_serialisation_error_leaves_old_file(old_file, obj, kwargs, error):
    with pytest.raises(error):
        write_json(old_file, obj, **kwargs)
    assert old_file.read_bytes() == OLD
    assert [p.name for p in old_file.parent.iterdir()] == ["result.json"]


def test_serialisation_error_creates_no_folder(tmp_path):
    with pytest.raises(TypeError):
        write_json(tmp_path / "new" / "r.json", {"s": {1, 2}})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fails", ["write", "replace", "interrupt"])
def test_failure_mid_write_leaves_old_file_and_no_temp(old_file, monkeypatch, fails):
    """The temp file is already (partly) written when the failure hits; it must not survive."""
    if fails == "write":
        real_fsync = os.fsync

        def fsync_then_fail(fd):
            real_fsync(fd)
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(os, "fsync", fsync_then_fail)
    else:
        exc = OSError(5, "I/O error") if fails == "replace" else KeyboardInterrupt()

        def replace_fails(src, dst):
            assert os.path.getsize(src) > 0
            raise exc
        monkeypatch.setattr(os, "replace", replace_fails)
    with pytest.raises((OSError, KeyboardInterrupt)):
        write_json(old_file, {"cases": [1, 2, 3]})
    monkeypatch.undo()
    assert old_file.read_bytes() == OLD
    assert [p.name for p in old_file.parent.iterdir()] == ["result.json"]


def test_text_must_be_str(old_file):
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        atomic_write_text(old_file, b"new")
    assert old_file.read_bytes() == OLD


@pytest.mark.parametrize("indent", [None, 1, 2])
def test_write_json_round_trips_and_creates_folders(tmp_path, indent):
    obj = {"cases": [{"B": 4, "T": 8192, "ms": 1.376, "fla": None}], "note": "é 中文", "nan": math.nan}
    path = tmp_path / "a" / "b" / "r.json"
    write_json(str(path), obj, indent=indent)
    text = path.read_text(encoding="utf-8")
    assert text == json.dumps(obj, indent=indent) + "\n"
    back = json.loads(text)
    assert math.isnan(back.pop("nan"))
    del obj["nan"]
    assert back == obj
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_atomic_write_text_replaces_exact_bytes(old_file):
    text = "line 1\nline 2 \u00e9\r\nno newline at end"
    atomic_write_text(old_file, text)
    assert old_file.read_bytes() == text.encode("utf-8")
    atomic_write_text(old_file.parent / "deeper" / "x.txt", "")
    assert (old_file.parent / "deeper" / "x.txt").read_bytes() == b""


def test_bytes_rejects_text_and_keeps_the_mode_of_an_ordinary_open(tmp_path):
    target = tmp_path / "x.bin"
    with pytest.raises(TypeError, match="bytes"):
        files.atomic_write_bytes(target, "not bytes")
    assert list(tmp_path.iterdir()) == []
    files.atomic_write_bytes(target, b"ok")
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"ok")
    assert target.read_bytes() == b"ok" and target.stat().st_mode == plain.stat().st_mode


def test_an_existing_files_mode_and_a_symlink_are_kept_as_open_keeps_them(tmp_path):
    """A 0755 script lost its exec bit (reset to 0644), and a symlink was replaced by a regular file while
    its target kept the old bytes."""
    script = tmp_path / "run.sh"
    script.write_bytes(b"old")
    script.chmod(0o755)
    files.atomic_write_bytes(script, b"new")
    assert script.read_bytes() == b"new" and script.stat().st_mode & 0o777 == 0o755
    target, link = tmp_path / "data" / "target.txt", tmp_path / "link.txt"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link.symlink_to(target)
    files.atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_bytes() == b"new" and link.read_bytes() == b"new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["target.txt"]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_a_folder_that_refuses_new_files_is_named_before_the_run(capsys, tmp_path):
    # /proc passes os.access's write check when run as root, yet refuses every new file.
    assert blocked_parent("/proc/result.json").startswith("folder /proc refuses new files")
    # A usage error: status 2, as argparse's (it was 1).
    for out, why in (("/proc/result.json", "folder /proc refuses new files"), (str(tmp_path), "is a folder")):
        with pytest.raises(SystemExit) as e:
            check_out(out)
        assert e.value.code == 2 and f"--out {out}: {why}" in capsys.readouterr().err


def test_a_writable_folder_passes_and_keeps_nothing(tmp_path):
    assert blocked_parent(tmp_path / "sub" / "result.json") is None
    assert list(tmp_path.iterdir()) == []
