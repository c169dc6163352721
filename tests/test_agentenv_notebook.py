"""k3lab.agentenv.notebook: chapter 07's VM cells print a skip line where the VM tools are missing."""
from types import SimpleNamespace

import pytest

from k3lab.agentenv import notebook


def shell():
    return SimpleNamespace(input_transformers_cleanup=[])


def test_tools_present_installs_nothing(monkeypatch, capsys):
    monkeypatch.setattr(notebook, "missing_packages", lambda: [])
    sh = shell()
    assert notebook.skip_vm_cells_if_missing(sh) is True
    assert sh.input_transformers_cleanup == []
    assert "every cell below runs" in capsys.readouterr().out


def test_tools_missing_skips_only_marked_cells(monkeypatch, capsys):
    monkeypatch.setattr(notebook, "missing_packages", lambda: ["qemu-system-x86", "qemu-utils"])
    monkeypatch.setenv("K3LAB_SKIP_SYSDEPS", "1")
    sh = shell()
    assert notebook.skip_vm_cells_if_missing(sh) is False
    out = capsys.readouterr().out
    assert "qemu-system-x86 qemu-utils" in out and "K3LAB_SKIP_SYSDEPS=1" in out and "apt-get install" in out
    (skip,) = sh.input_transformers_cleanup
    vm_cell = [f"{notebook.MARKER}\n", "sb = Sandbox.create(img)\n"]
    plain = ["res = 1\n", f"{notebook.MARKER}\n"]
    assert skip(plain) == plain and skip([]) == []
    (line,) = skip(vm_cell)
    ns = {}
    exec(line, ns)
    assert capsys.readouterr().out.strip() == notebook.skipped_line(["qemu-system-x86", "qemu-utils"])
    # checking again replaces the earlier decision instead of stacking transformers
    monkeypatch.setattr(notebook, "missing_packages", lambda: [])
    assert notebook.skip_vm_cells_if_missing(sh) is True
    assert sh.input_transformers_cleanup == []


def test_bad_skip_variable_is_an_error(monkeypatch):
    monkeypatch.setenv("K3LAB_SKIP_SYSDEPS", "yes")
    with pytest.raises(ValueError, match="K3LAB_SKIP_SYSDEPS"):
        notebook.skip_vm_cells_if_missing(shell())


def test_outside_ipython_only_returns(monkeypatch):
    monkeypatch.setattr(notebook, "missing_packages", lambda: ["qemu-utils"])
    assert notebook.skip_vm_cells_if_missing() is False
