"""Let chapter 07 run on a machine without QEMU: its VM cells print that they are skipped.

The chapter calls :func:`skip_vm_cells_if_missing` once near the top. When every tool that
``k3lab.agentenv.sysdeps`` installs is on PATH it prints one line and changes nothing. When one is
missing (a GPU node without apt, or ``K3LAB_SKIP_SYSDEPS=1`` on a machine without QEMU) it prints
what is missing and how to install it, and from then on every cell whose first line is
:data:`MARKER` runs as a single printed line instead of its code; the other cells run as usual.

    from k3lab.agentenv.notebook import MARKER, skip_vm_cells_if_missing
    vm_tools = skip_vm_cells_if_missing()     # True: every cell runs

    # VM cell                                 # first line of each cell that boots or uses a VM
    sb = Sandbox.create(img)
"""
from __future__ import annotations

from k3lab.agentenv.sysdeps import SKIP_ENV, install_command, missing_packages, skip_requested

MARKER = "# VM cell"


def skipped_line(missing: list[str]) -> str:
    """What a skipped VM cell prints."""
    return f"skipped: this cell needs a VM, and {', '.join(missing)} (Debian packages) are missing here"


def make_skipper(missing: list[str]):
    """An IPython input transformer that replaces a cell starting with :data:`MARKER` by a print.

    Args:
        missing (list[str]): the missing Debian packages, named in the printed line.

    Returns:
        Callable[[list[str]], list[str]]: lines in, lines out (``input_transformers_cleanup``).
    """
    line = skipped_line(missing)

    def skip_vm_cell(lines: list[str]) -> list[str]:
        if lines and lines[0].strip() == MARKER:
            return [f"print({line!r})\n"]
        return lines

    skip_vm_cell.k3lab_vm_skipper = True
    return skip_vm_cell


def skip_vm_cells_if_missing(shell=None) -> bool:
    """Check the VM tools once; without them, make the :data:`MARKER` cells print a skip line.

    Running it again (a re-executed cell) replaces the earlier decision.

    Args:
        shell: the IPython shell to install the transformer in (default: the running one; outside
            IPython nothing is installed and only the return value tells).

    Returns:
        bool: True when every tool is present and every cell runs.

    Raises:
        ValueError: ``$K3LAB_SKIP_SYSDEPS`` is set to something other than ``0`` or ``1``.
    """
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:
            get_ipython = lambda: None  # noqa: E731
        shell = get_ipython()
    if shell is not None:
        cleanup = shell.input_transformers_cleanup
        cleanup[:] = [t for t in cleanup if not getattr(t, "k3lab_vm_skipper", False)]
    skipped_install = skip_requested()
    missing = missing_packages()
    if not missing:
        print("VM tools found (QEMU and the image tools): every cell below runs")
        return True
    why = f" ({SKIP_ENV}=1 skipped installing them)" if skipped_install else ""
    print(f"VM tools missing: {' '.join(missing)}{why}.\n"
          f"Every cell that boots or uses a VM starts with `{MARKER}` and now prints one line instead of "
          f"running;\nthe others (the committed benchmark, the memory-time model) still run. To run it all:\n"
          f"  sudo {' '.join(install_command(missing))}")
    if shell is not None:
        shell.input_transformers_cleanup.append(make_skipper(missing))
    return False
