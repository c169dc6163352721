"""Interactive explorers that cannot stall a headless run.

A chapter executed by papermill, nbval or ``python -m k3lab.book`` has no front end to draw a widget,
and nbclient has been seen to miss the kernel's reply to an ipywidgets cell until the cell's time
limit ran out (jupyter/nbclient#312). :func:`explore` therefore builds and shows an ipywidgets
explorer only when a front end is attached, and otherwise creates no widget at all: the chapter draws
the same function's figure once with plain code above the explorer, so a headless run loses nothing
but the sliders.

    from k3lab.widgets import explore
    plot_gates()                                        # the static figure every run shows
    explore(plot_gates, A_log=(-3.0, 3.0, 0.25))        # sliders in JupyterLab, one line elsewhere
"""
from __future__ import annotations

import os
from typing import Callable

# "1" forces the explorer on (a front end this module does not recognise), "0" forces it off.
FORCE_ENV = "K3LAB_WIDGETS"
# jupyter_server (JupyterLab, Notebook 7) sets this in the environment of every kernel it starts for a
# session; papermill, nbval and nbconvert start kernels without it.
SESSION_ENV = "JPY_SESSION_NAME"


def frontend_attached() -> bool:
    """Whether this kernel serves a front end that can draw widgets.

    ``$K3LAB_WIDGETS`` (``1``/``0``) decides when set; otherwise True when the kernel was started by a
    Jupyter server for a session (``$JPY_SESSION_NAME`` is set).

    Raises:
        ValueError: ``$K3LAB_WIDGETS`` is set to something other than ``0`` or ``1``.
    """
    force = os.environ.get(FORCE_ENV, "").strip()
    if force:
        if force not in ("0", "1"):
            raise ValueError(f"${FORCE_ENV} must be 0 or 1 (or unset), got {force!r}")
        return force == "1"
    return bool(os.environ.get(SESSION_ENV))


def explore(fn: Callable, **controls):
    """Sliders for ``fn`` in a live front end; nothing but a one-line note in a headless run.

    Args:
        fn (Callable): draws or prints for keyword arguments named like ``controls``.
        **controls: ipywidgets ``interactive`` abbreviations, e.g. ``A_log=(-3.0, 3.0, 0.25)`` (a
            slider), ``R=[1, 2, 4, 8]`` (a dropdown) or a widget; initial values are ``fn``'s defaults.

    Returns:
        ipywidgets.interactive | None: the displayed explorer, or None when no front end is attached
        (:func:`frontend_attached`); then ``fn`` is not called.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__} {fn!r}")
    if not frontend_attached():
        print(f"(explorer for {getattr(fn, '__name__', 'fn')}: sliders need a live front end such as "
              f"JupyterLab; not built in this headless run, set {FORCE_ENV}=1 to force)")
        return None
    import ipywidgets
    from IPython.display import display

    explorer = ipywidgets.interactive(fn, **controls)
    display(explorer)
    return explorer
