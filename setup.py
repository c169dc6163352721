"""Package discovery for k3lab (metadata lives in pyproject.toml).

`kernels/` is a top-level folder shipped as `k3lab.kernels`. setuptools' `packages.find` does not
follow a `package-dir` mapping into subpackages, so every package is listed here: all of `k3lab/`
plus each `kernels/<name>/` as `k3lab.kernels.<name>`. Adding `kernels/kda/__init__.py` or
`k3lab/kcp/__init__.py` needs no edit to this file.
"""
from setuptools import find_packages, setup

kernel_packages = ["k3lab.kernels"] + [
    f"k3lab.kernels.{name}" for name in find_packages(where="kernels")
]

setup(
    packages=find_packages(include=["k3lab", "k3lab.*"]) + kernel_packages,
    package_dir={"k3lab.kernels": "kernels"},
)
