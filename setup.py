"""Package discovery for k3lab (metadata lives in pyproject.toml).

`kernels/` is a top-level folder shipped as `k3lab.kernels`. setuptools' `packages.find` does not
follow a `package-dir` mapping into subpackages, so every package is listed here: all of `k3lab/`
plus each `kernels/<name>/` as `k3lab.kernels.<name>`. Adding `kernels/kda/__init__.py` or
`k3lab/kcp/__init__.py` needs no edit to this file.

The committed tokenizer `data/tokenizer.json` ships as `k3lab/_data/tokenizer.json` (a data-only
folder mapped like `kernels/`), so an installed k3lab tokenises without a checkout; the corpus and the
shards stay out of the wheel (`k3lab.data` finds them through `$K3LAB_DATA_DIR`).
"""
from setuptools import find_packages, setup

kernel_packages = ["k3lab.kernels"] + [
    f"k3lab.kernels.{name}" for name in find_packages(where="kernels")
]

setup(
    packages=find_packages(include=["k3lab", "k3lab.*"]) + kernel_packages + ["k3lab._data"],
    package_dir={"k3lab.kernels": "kernels", "k3lab._data": "data"},
    package_data={"k3lab._data": ["tokenizer.json"]},
)
