"""`k3lab.setup()`: the first code cell of every notebook."""
from __future__ import annotations

import importlib.util
import numbers
import os
import platform
import random
import sys
from pathlib import Path

PROFILES = ("cpu", "gpu")


def _checkout_root(start: Path) -> Path | None:
    for d in (start, *start.parents):
        pyproject = d / "pyproject.toml"
        if pyproject.is_file() and 'name = "k3lab"' in pyproject.read_text():
            return d
    return None


def setup(seed: int = 0, profile: str | None = None, verbose: bool = True):
    """Prepare a session: seeds, device, Triton interpreter (whenever the session runs on the CPU), versions.

    Args:
        seed (int): in [0, 2**32); seeds Python's, NumPy's and torch's generators.
        profile (str | None): "cpu" or "gpu". "gpu" requires CUDA; None picks CUDA when present.
        verbose (bool): print versions and the chosen device.

    Returns:
        torch.device: ``cuda`` when used, else ``cpu``.

    Raises:
        TypeError: ``seed`` is not an int (a bool is refused too).
        ValueError: ``seed`` not in [0, 2**32) (NumPy's range); ``profile`` is not "cpu", "gpu" or None.
        RuntimeError: ``profile="gpu"`` without CUDA; triton or a k3lab kernel module was imported
            before ``setup()`` when the session runs on the CPU (no CUDA, or ``profile="cpu"``: the
            interpreter flag would come too late); or the
            imported k3lab is not the one in the checkout the session runs from.
    """
    # Checked before any generator is seeded: NumPy refuses what Python's random.seed accepts.
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    seed = int(seed)  # random.seed refuses NumPy ints
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    if profile not in (*PROFILES, None):
        raise ValueError(f"profile must be one of {PROFILES} or None, got {profile!r}")
    import numpy as np
    import torch

    use_cuda = torch.cuda.is_available() and profile != "cpu"
    if profile == "gpu" and not use_cuda:
        raise RuntimeError("profile='gpu' but torch.cuda.is_available() is False")
    if not use_cuda:
        # The CPU profile runs the kernels on CPU tensors, under the interpreter, on a GPU machine too.
        # Triton reads TRITON_INTERPRET when a @triton.jit function is defined, so it must be set
        # before any kernel module is imported.
        # Triton's own jit helpers are defined when triton is imported (by the user, or through e.g.
        # torch._dynamo): once compiled mode is chosen, kernels fail inside the interpreter.
        early = next((m for m in sorted(sys.modules) if m == "triton" or m.startswith("k3lab.kernels.")), None)
        # Triton is imported by then, so asking it how it reads TRITON_INTERPRET costs nothing.
        if early and not importlib.import_module("k3lab.kernels").interpreting():
            raise RuntimeError(
                f"{early} was imported before k3lab.setup() on the CPU: restart the "
                "kernel and call k3lab.setup() first (or set TRITON_INTERPRET=1 before importing it) "
                "so Triton's interpreter is on before any kernel is defined"
            )
        os.environ["TRITON_INTERPRET"] = "1"

    import k3lab

    root = _checkout_root(Path.cwd().resolve())
    if root is not None:
        # k3lab.kernels is mapped from the top-level kernels/ by the install, not found beside k3lab/:
        # a clone run with another checkout's install gets that checkout's kernels.
        kernels = importlib.util.find_spec("k3lab.kernels")
        found = {"k3lab": Path(k3lab.__file__).resolve().parent,
                 "k3lab.kernels": Path(kernels.origin).resolve().parent if kernels and kernels.origin else None}
        for name, folder in (("k3lab", "k3lab"), ("k3lab.kernels", "kernels")):
            if found[name] != (root / folder).resolve():
                raise RuntimeError(
                    f"the imported {name} lives in {found[name]}, not in this checkout ({root}); "
                    f"run `pip install -e {root}` (or `make book`, which does it) in this environment"
                )

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    device = torch.device("cuda" if use_cuda else "cpu")
    if verbose:
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "not installed"
        name = torch.cuda.get_device_name() if use_cuda else platform.processor() or "cpu"
        print(
            f"k3lab {k3lab.__version__} | python {platform.python_version()} | torch {torch.__version__}"
            f" | triton {triton_version} | numpy {np.__version__}"
        )
        print(f"device: {device} ({name}) | seed {seed}"
              + (" | TRITON_INTERPRET=1" if device.type == "cpu" else ""))
    return device
