"""Repository-wide pytest hooks: chapter 07's notebook check is skipped, not failed, where its VM tools
were deliberately left out (``K3LAB_SKIP_SYSDEPS=1`` and a tool missing), as the VM tests in
``tests/test_agentenv.py`` are. The chapter itself then runs and says which cells it skipped, but its
stored outputs come from a run with QEMU, so nbval could only report those cells as changed."""
from pathlib import Path

import pytest

VM_CHAPTER = "07_agentenv.ipynb"


def pytest_collection_modifyitems(config, items):
    vm_items = [item for item in items if Path(str(item.fspath)).name == VM_CHAPTER]
    if not vm_items:
        return
    from k3lab.agentenv import sysdeps

    missing = sysdeps.missing_packages()
    if not (sysdeps.skip_requested() and missing):
        return
    mark = pytest.mark.skip(reason=f"{sysdeps.SKIP_ENV}=1 and {', '.join(missing)} missing: "
                                   f"{VM_CHAPTER}'s stored outputs need QEMU")
    for item in vm_items:
        item.add_marker(mark)
