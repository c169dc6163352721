"""Packaging: every package under k3lab/ and kernels/ ships, kernels/ as k3lab.kernels."""
import os
import shutil
import subprocess
import sys
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
