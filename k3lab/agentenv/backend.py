"""The internal interface between :class:`~k3lab.agentenv.Sandbox` and a hypervisor, and the file
helpers the backends share.

A backend object is one sandbox's VM in one folder (``workdir``): it boots from the image, loads
a snapshot folder, pauses/resumes, saves a snapshot folder, hibernates/wakes, and holds the
connected guest agent channel in :attr:`VMBackend.agent`. :class:`Sandbox` keeps the state
machine, snapshot reference counts and error reporting, and never looks inside a backend.
Implementations: :class:`~k3lab.agentenv.qemu.QemuBackend` and
:class:`~k3lab.agentenv.fcvm.FirecrackerBackend`.
"""
from __future__ import annotations

import ctypes
import os
import signal
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from k3lab.agentenv.agent import AgentChannel
from k3lab.agentenv.host import HostInfo
from k3lab.agentenv.image import Image


class VMError(RuntimeError):
    """The hypervisor's control channel failed: an error answer, a closed socket or a timeout."""


class VMBackend(ABC):
    """One sandbox's VM. Every start method returns with the guest agent connected and ready.

    Args:
        workdir (Path): the sandbox's own folder (exists, empty).
        image (Image): the guest image.
        memory_mib (int), vcpus (int): the VM shape (already range-checked).
        host (HostInfo): what :func:`~k3lab.agentenv.host.detect_host` found.

    Attributes:
        name (str): "qemu" or "firecracker".
        process (str): the VM process's name in messages ("QEMU", "firecracker").
        max_vcpus (int): the most vCPUs this hypervisor takes.
        snapshot_disk (str): file name of the disk copy inside a snapshot folder.
        agent (AgentChannel | None): the connected agent, None while the VM is not running.
        ram_shared (bool): guest RAM writes go to a file of the sandbox's own (QEMU ``share=on``).

    Start methods raise :class:`VMError` or an :class:`~k3lab.agentenv.agent.AgentError`; the
    others raise :class:`VMError`.
    """

    name: ClassVar[str]
    process: ClassVar[str]
    max_vcpus: ClassVar[int]
    snapshot_disk: ClassVar[str]

    def __init__(self, workdir: Path, image: Image, memory_mib: int, vcpus: int, host: HostInfo) -> None:
        self.workdir, self.image, self.host = Path(workdir), image, host
        self.memory_mib, self.vcpus = memory_mib, vcpus
        self.agent: AgentChannel | None = None
        self.ram_shared = False

    @abstractmethod
    def boot(self, timeout: float) -> None:
        """Cold-boot from the image."""

    @abstractmethod
    def load(self, snap: Path, kind: str, timeout: float, cow: bool) -> None:
        """Start running from a snapshot folder written by :meth:`save` (of this backend).
        ``cow``: map the snapshot's memory copy-on-write (True) or copy it first."""

    @abstractmethod
    def save(self, out: Path) -> str:
        """Write a complete snapshot (device state, memory, a disk copy) into the existing empty
        folder ``out``; the VM is left paused. Returns the snapshot's kind (backend-specific)."""

    @abstractmethod
    def pause(self) -> None:
        """Stop the vCPUs (memory kept)."""

    @abstractmethod
    def resume(self) -> None:
        """Continue after :meth:`pause` or :meth:`save`; the agent is connected on return."""

    @abstractmethod
    def hibernate(self) -> None:
        """Save the state into ``workdir``, end the VM process, drop its memory from the page cache."""

    @abstractmethod
    def wake(self, timeout: float) -> None:
        """Start again from :meth:`hibernate`'s files."""

    @abstractmethod
    def clear(self) -> None:
        """Delete the VM's disk and memory files (the VM must be killed), before a :meth:`load`."""

    @abstractmethod
    def kill(self) -> None:
        """Close the agent, SIGKILL and reap the VM process. Idempotent."""

    @abstractmethod
    def poll(self) -> int | None:
        """The VM process's exit status (negative: killed by that signal), None while it runs."""

    @property
    @abstractmethod
    def pid(self) -> int | None:
        """Host pid of the VM process (None before the first start)."""

    @abstractmethod
    def memory_files(self) -> tuple[Path | None, Path | None]:
        """(the guest-memory file the process maps, or None; a memory file of the sandbox's own
        whose page cache counts as its memory, or None)."""

    @abstractmethod
    def guest_error(self) -> str | None:
        """The first kernel panic / oops / OOM line of the guest console, if any."""

    @abstractmethod
    def log_tail(self) -> str:
        """The end of the hypervisor's and the guest console's output, for error messages."""


_libc = ctypes.CDLL(None, use_errno=True)

#: the longest unix socket path Linux takes (``sun_path`` is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107


def check_socket_path(path: str | os.PathLike) -> None:
    """Raise ValueError when ``path`` is too long for a unix socket (the sandbox root is too deep);
    otherwise the bind or connect fails later with a bare OSError."""
    n = len(os.fsencode(path))
    if n > MAX_SOCKET_PATH:
        raise ValueError(f"root is too deep: the VM's socket {path} would be {n} bytes, a unix socket"
                         f" path takes at most {MAX_SOCKET_PATH}; use a shorter root")


def die_with_parent() -> None:
    """``preexec_fn`` for VM processes: PR_SET_PDEATHSIG, so a VM whose Python parent dies is
    killed, never orphaned."""
    _libc.prctl(1, signal.SIGKILL)


def copy_sparse(src: Path, dst: Path) -> None:
    """Copy a file keeping its holes (SEEK_DATA/SEEK_HOLE + copy_file_range, all in the kernel;
    a reflink where the filesystem supports it)."""
    size = src.stat().st_size
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fdi, fdo = fi.fileno(), fo.fileno()
        off = 0
        while off < size:
            try:
                start = os.lseek(fdi, off, os.SEEK_DATA)
            except OSError:
                break  # only a hole is left
            end = os.lseek(fdi, start, os.SEEK_HOLE)
            pos = start
            while pos < end:
                n = os.copy_file_range(fdi, fdo, end - pos, pos, pos)
                if n <= 0:
                    raise OSError(f"copy_file_range returned {n} copying {src}")
                pos += n
            off = end
        os.ftruncate(fdo, size)


def drop_cache(path: Path) -> None:
    """Write back and evict a file's pages so a hibernated sandbox holds no memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def console_error(text: str) -> str | None:
    """The first kernel panic / oops / OOM line of guest console text, if any."""
    for line in text.splitlines():
        if any(k in line for k in ("Kernel panic", "Oops", "BUG:", "Out of memory")):
            return line.strip()
    return None


def tail(paths: list[Path], n: int = 1500) -> str:
    """The last ``n`` bytes of each non-empty file, joined: ``"name: ...text | name: ..."``."""
    parts = []
    for p in paths:
        if p.is_file():
            text = p.read_bytes()[-n:].decode(errors="replace").strip()
            if text:
                parts.append(f"{p.name}: ...{text}")
    return " | ".join(parts)
