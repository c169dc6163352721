"""Install the system packages the sandboxes need, or say exactly how.

Run ``python -m k3lab.agentenv.sysdeps`` (``make test`` and ``make book`` do). Tools checked,
with the Debian package providing each:

    qemu-system-x86_64  qemu-system-x86   the VMM (microvm machine, TCG or KVM)
    qemu-img            qemu-utils        qcow2 overlays
    mkfs.ext4           e2fsprogs         the rootfs (mkfs.ext4 -d, no root needed)
    lz4                 lz4               decompressing Debian's LZ4 kernel image
    dpkg-deb / apt-get  dpkg / apt        unpacking and fetching the kernel and busybox .debs

When something is missing: as root with apt-get, says what it is about to install and runs
``apt-get install -y --no-install-recommends`` (with one ``apt-get update`` if the first attempt
fails); otherwise exits with status 1 printing the command to run. ``--check`` only reports (status 1
when something is missing). ``K3LAB_SKIP_SYSDEPS=1`` skips the step (status 0, installing nothing):
chapter 07 and the VM tests then need the tools from elsewhere.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

TOOLS = {
    "qemu-system-x86_64": "qemu-system-x86",
    "qemu-img": "qemu-utils",
    "mkfs.ext4": "e2fsprogs",
    "lz4": "lz4",
    "dpkg-deb": "dpkg",
    "apt-get": "apt",
}


SKIP_ENV = "K3LAB_SKIP_SYSDEPS"


def skip_requested() -> bool:
    """Whether ``$K3LAB_SKIP_SYSDEPS`` asks to skip installing (``1``; unset, empty or ``0``: no).

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(SKIP_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"${SKIP_ENV} must be 0 or 1 (or unset), got {value!r}")
    return value == "1"


def missing_packages() -> list[str]:
    """Debian packages whose tool is not on PATH (also searching /sbin and /usr/sbin)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool, path=path) is None})


def install_command(pkgs: list[str]) -> list[str]:
    return ["apt-get", "install", "-y", "--no-install-recommends", *pkgs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3lab.agentenv.sysdeps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only report; exit 1 if anything is missing")
    args = p.parse_args(argv)
    try:
        skip = skip_requested()
    except ValueError as e:
        print(f"agentenv sysdeps: {e}", file=sys.stderr)
        return 2
    pkgs = missing_packages()
    if not pkgs:
        print("agentenv sysdeps: all present (" + ", ".join(TOOLS) + ")")
        return 0
    cmd = install_command(pkgs)
    if skip and not args.check:
        print(f"agentenv sysdeps: skipped ({SKIP_ENV}=1); missing {' '.join(pkgs)}, which chapter 07 and "
              f"the VM tests need (install them with: sudo {' '.join(cmd)})")
        return 0
    can_install = os.geteuid() == 0 and shutil.which("apt-get") is not None
    if args.check or not can_install:
        why = "--check" if args.check else "not root or no apt-get"
        print(f"agentenv sysdeps: missing {' '.join(pkgs)} ({why}). Run:\n  sudo {' '.join(cmd)}",
              file=sys.stderr)
        return 1
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"agentenv sysdeps: installing system packages as root: {' '.join(cmd)} "
          f"(set {SKIP_ENV}=1 to skip)", flush=True)
    if subprocess.run(cmd, env=env).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, check=False)
        if subprocess.run(cmd, env=env).returncode != 0:
            print(f"agentenv sysdeps: `{' '.join(cmd)}` failed", file=sys.stderr)
            return 1
    still = missing_packages()
    if still:
        print(f"agentenv sysdeps: still missing after install: {' '.join(still)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
