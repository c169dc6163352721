"""Packaging: every package under k3lab/ and kernels/ ships, kernels/ as k3lab.kernels; an installed
k3lab finds its data through $K3LAB_DATA_DIR and tokenises with the tokenizer it ships."""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _source_packages() -> set[str]:
    """Wheel-relative package dirs expected from the checkout: k3lab/** and kernels/** -> k3lab/kernels/**."""
    expected = set()
    for top, prefix in (("k3lab", "k3lab"), ("kernels", "k3lab/kernels")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).as_posix()
            if "__pycache__" in rel or ".ipynb_checkpoints" in rel:
                continue
            expected.add(prefix if rel == "." else f"{prefix}/{rel}")
    return expected


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Build from a copy so the checkout gets no build/ or egg-info side effects.
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".ipynb_checkpoints")
    for name in ("k3lab", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    (src / "data").mkdir()
    shutil.copy2(ROOT / "data" / "tokenizer.json", src / "data" / "tokenizer.json")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        check=True, timeout=300, capture_output=True,
    )
    (whl,) = out.glob("k3lab-*.whl")
    return whl


def test_wheel_contains_every_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    expected = _source_packages()
    assert "k3lab/kernels" in expected
    missing = expected - shipped
    assert not missing, f"packages missing from {wheel.name}: {sorted(missing)}"
    assert "k3lab/_data/tokenizer.json" in names
    assert not [n for n in names if n.endswith((".bin", ".tar.xz"))], "corpus and shards stay out of the wheel"


def test_non_editable_install_imports_kernels(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True, timeout=300, capture_output=True,
    )
    code = "import k3lab, k3lab.kernels; print(k3lab.__file__); print(k3lab.kernels.__file__)"
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True,
                         timeout=120, capture_output=True, text=True).stdout.split()
    assert all(Path(p).is_relative_to(target) for p in out), out
    assert Path(out[1]).parent == target / "k3lab" / "kernels"


INSTALLED_PROBE = """
import json, os, k3lab.data as d
out = {"file": d.__file__, "vocab": d.vocab_size(), "ids": d.load_tokenizer().encode("def f(): pass").ids}
try:
    out["train"] = int(len(d.load_split("train")))
except FileNotFoundError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_installed_wheel_finds_data_by_environment_or_names_it(wheel, tmp_path):
    """A non-editable install into a fresh venv, used from a folder outside the checkout: the tokenizer
    ships in the wheel; the shards come from $K3LAB_DATA_DIR, and without it the error names the
    variable and the build command."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, timeout=60, capture_output=True, text=True).stdout.strip()
    # torch, numpy and tokenizers come from this interpreter's site-packages, added by a .pth line
    # (the .pth files inside it, such as the checkout's editable-install hook, are not run).
    (Path(site) / "k3lab-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "K3LAB_DATA_DIR")}

    def probe(extra_env):
        done = subprocess.run([py, "-c", INSTALLED_PROBE], cwd=elsewhere, env={**env, **extra_env},
                              timeout=120, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    bare = probe({})
    assert Path(bare["file"]).is_relative_to(Path(site)), bare["file"]
    assert bare["vocab"] == 4096 and bare["ids"]
    assert "K3LAB_DATA_DIR" in bare["error"] and "python -m k3lab.data build" in bare["error"], bare["error"]

    shards = tmp_path / "mydata" / "shards"
    shards.mkdir(parents=True)
    shutil.copy2(ROOT / "data" / "tokenizer.json", tmp_path / "mydata" / "tokenizer.json")
    (shards / "train.bin").write_bytes(bytes(2 * 5))
    (shards / "manifest.json").write_text(json.dumps({"splits": {"train": {"tokens": 5}}}))
    assert probe({"K3LAB_DATA_DIR": str(tmp_path / "mydata")})["train"] == 5

    cli = subprocess.run([py, "-m", "k3lab.data", "info"], cwd=elsewhere, env=env, timeout=120,
                         capture_output=True, text=True)
    assert cli.returncode == 1 and "K3LAB_DATA_DIR" in cli.stderr, cli.stderr
