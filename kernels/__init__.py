"""Triton kernels for k3lab, importable as ``k3lab.kernels`` (one subpackage per component).

On a CPU-only machine call ``k3lab.setup()`` before importing any of them: it sets
``TRITON_INTERPRET=1``, which Triton reads when a ``@triton.jit`` function is defined.
"""
import numpy
import triton


def numpy_supports_interpreter() -> bool:
    """Whether Triton 3.6's CPU interpreter runs this numpy: from numpy 2.4 on, its loops with a runtime
    bound fail inside the interpreter ("only 0-dimensional arrays can be converted to Python scalars"),
    hence the project's ``numpy<2.4`` pin."""
    return numpy.lib.NumpyVersion(numpy.__version__) < "2.4.0.dev0"  # its pre-releases too, as the pin


def interpreting() -> bool:
    """Whether Triton runs the kernels in its CPU interpreter: TRITON_INTERPRET set to 1, true, on or yes,
    as Triton reads it (``triton.knobs.runtime.interpret``)."""
    return triton.knobs.runtime.interpret


if interpreting() and not numpy_supports_interpreter():
    raise ImportError(f"k3lab's kernels under TRITON_INTERPRET=1 need numpy<2.4 (the project's pin; Triton 3.6's "
                      f"interpreter fails on newer), found numpy {numpy.__version__}: pip install 'numpy<2.4'")
