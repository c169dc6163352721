"""Triton kernels for k3lab, importable as ``k3lab.kernels`` (one subpackage per component).

On a CPU-only machine call ``k3lab.setup()`` before importing any of them: it sets
``TRITON_INTERPRET=1``, which Triton reads when a ``@triton.jit`` function is defined.
"""
