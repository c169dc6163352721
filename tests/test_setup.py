"""k3lab.setup(): argument checks happen before any generator is seeded; on CPU, Triton's interpreter is on
before any kernel is defined."""
import os
import random
import subprocess
import sys

import pytest
import torch

import k3lab


@pytest.mark.parametrize("seed, exc, match", [
    (-1, ValueError, r"seed must be in \[0, 2\*\*32\), got -1"),
    (2**40, ValueError, r"seed must be in \[0, 2\*\*32\), got 1099511627776"),
    (True, TypeError, "seed must be an int, got bool"),
    (1.5, TypeError, "seed must be an int, got float"),
], ids=["negative", "too_big", "bool", "float"])
def test_bad_seed_rejected_before_seeding(seed, exc, match):
    random.seed(123)
    before = random.getstate()
    with pytest.raises(exc, match=match):
        k3lab.setup(seed=seed, profile="cpu", verbose=False)
    assert random.getstate() == before  # Python's generator was not seeded


def test_numpy_int_seed_accepted():
    import numpy as np

    assert k3lab.setup(seed=np.int64(3), profile="cpu", verbose=False).type == "cpu"


def run_fresh(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python without TRITON_INTERPRET set (as a new notebook kernel starts)."""
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is the CPU path")
@pytest.mark.parametrize("first, named", [("triton", "triton"), ("torch._dynamo", "triton"),
                                          ("k3lab.kernels.kda", "k3lab.kernels.kda")])
def test_triton_imported_before_setup_is_refused(first, named):
    """On CPU, Triton must run interpreted from its first import: once triton (directly, through
    torch._dynamo, or through a k3lab kernel module) is imported without TRITON_INTERPRET=1, setup()
    refuses with an error naming the module, instead of letting the first kernel call fail inside the
    interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    run = run_fresh(f"import {first}, k3lab\n"
                    "try:\n"
                    "    k3lab.setup(verbose=False)\n"
                    "except RuntimeError as e:\n"
                    "    print(e)\n")
    assert run.returncode == 0, run.stderr[-600:]
    assert f"{named} was imported before k3lab.setup()" in run.stdout, run.stdout


def test_the_cpu_profile_interprets_the_kernels_on_a_gpu_machine_too():
    """Where CUDA is present, the CPU profile's kernel cells still hand CPU tensors to the kernels: the
    interpreter must be on for it (CUDA faked present here; before, only a machine without CUDA got it)."""
    run = run_fresh("import os, torch\n"
                    "torch.cuda.is_available = lambda: True\n"
                    "import k3lab\n"
                    "print(k3lab.setup(profile='cpu', verbose=False), os.environ.get('TRITON_INTERPRET'))\n")
    assert run.returncode == 0, run.stderr[-600:]
    assert run.stdout.split() == ["cpu", "1"], run.stdout


@pytest.mark.parametrize("version, refused", [("2.4.0", True), ("2.3.5", False)])
def test_kernels_under_the_interpreter_refuse_a_numpy_it_cannot_run(version, refused):
    """Triton 3.6's interpreter fails inside runtime-bound loops from numpy 2.4 on ("only 0-dimensional
    arrays ..."): importing the kernels under TRITON_INTERPRET=1 with such a numpy names the pin instead."""
    run = run_fresh(f"import os, numpy\nnumpy.__version__ = {version!r}\nos.environ['TRITON_INTERPRET'] = '1'\n"
                    "try:\n    import k3lab.kernels\nexcept ImportError as e:\n    print(e)\n")
    assert run.returncode == 0, run.stderr[-600:]
    assert ("need numpy<2.4" in run.stdout and f"found numpy {version}" in run.stdout) == refused, run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is the CPU path")
def test_setup_first_then_kernels_run():
    """The order the notebooks use (setup, then kernel imports) works in a fresh process: one small
    flash_kda call on CPU gives finite outputs."""
    run = run_fresh("import torch, k3lab\n"
                    "k3lab.setup(verbose=False)\n"
                    "from k3lab.kernels.kda import flash_kda\n"
                    "g = torch.Generator().manual_seed(0)\n"
                    "x = torch.randn(1, 20, 1, 16, generator=g)\n"
                    "o, _ = flash_kda(x, x, x, x, torch.randn(1, 20, 1, generator=g), torch.zeros(1), torch.zeros(16))\n"
                    "assert torch.isfinite(o).all()\n")
    assert run.returncode == 0, run.stderr[-600:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is the CPU path")
def test_interpreter_flag_is_read_as_triton_reads_it():
    """TRITON_INTERPRET=true turns Triton's interpreter on as 1 does; flash_kda used to refuse to run then
    ("needs TRITON_INTERPRET=1"), and setup() to call triton imported too early."""
    run = run_fresh("import os\nos.environ['TRITON_INTERPRET'] = 'true'\n"
                    "import torch, triton, k3lab\n"
                    "k3lab.setup(verbose=False)\n"
                    "from k3lab.kernels.kda import flash_kda\n"
                    "x = torch.randn(1, 20, 1, 16, generator=torch.Generator().manual_seed(0))\n"
                    "o, _ = flash_kda(x, x, x, x, x[..., 0], torch.zeros(1), torch.zeros(16))\n"
                    "assert torch.isfinite(o).all()\n")
    assert run.returncode == 0, run.stderr[-600:]


def test_kernels_from_another_checkout_are_refused(monkeypatch, tmp_path):
    """A fresh user's case: a clone run with PYTHONPATH on the clone but another checkout's editable
    install imported k3lab from the clone and k3lab.kernels (mapped by the install) from the other
    checkout, silently."""
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    root = Path(k3lab.__file__).resolve().parent.parent
    other = tmp_path / "other" / "kernels" / "__init__.py"
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "k3lab.kernels":
            return importlib.machinery.ModuleSpec(name, None, origin=str(other))
        return real_find_spec(name, *args)

    monkeypatch.chdir(root)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    expected = f"the imported k3lab.kernels lives in {other.parent}, not in this checkout"
    with pytest.raises(RuntimeError, match=expected):
        k3lab.setup(verbose=False)
