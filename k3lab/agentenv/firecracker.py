"""Firecracker: a client for its HTTP API on a unix socket, and a process wrapper.

:class:`~k3lab.agentenv.fcvm.FirecrackerBackend` builds sandboxes on these where a ``firecracker``
binary and real KVM exist (see :mod:`k3lab.agentenv.host`; on these machines ``kvm_pvm`` rules it
out, so CI runs them against ``tests/fake_firecracker.py``). Request shapes follow Firecracker's
swagger (``src/firecracker/swagger/firecracker.yaml``):

    PUT   /boot-source         {"kernel_image_path", "boot_args", "initrd_path"}
    PUT   /drives/{drive_id}   {"drive_id", "path_on_host", "is_root_device", "is_read_only"}
    PUT   /machine-config      {"vcpu_count", "mem_size_mib", "smt", "track_dirty_pages"}
    PUT   /actions             {"action_type": "InstanceStart"}
    PATCH /vm                  {"state": "Paused" | "Resumed"}
    PUT   /snapshot/create     {"snapshot_type": "Full" | "Diff", "snapshot_path", "mem_file_path"}
    PUT   /snapshot/load       {"snapshot_path", "mem_backend": {"backend_type": "File",
                                "backend_path"}, "track_dirty_pages", "resume_vm"}
    GET   /                    InstanceInfo {"id", "state", "vmm_version", "app_name"}

Successful writes answer 204; errors answer 4xx/5xx with ``{"fault_message": ...}``.

Drive paths may be relative: Firecracker opens them from its working directory, and a snapshot
records them as given, so a process started in another folder resolves the same relative path to
that folder's file (what the jailer's chroot does; see :mod:`k3lab.agentenv.fcvm`).

The guest's serial console (``ttyS0``) is the process's stdin and stdout, which
:class:`FirecrackerVM` makes pipes (see :mod:`k3lab.agentenv.fcvm`); Firecracker's own log goes to
``--log-path`` (without one it is written to stdout, into the console stream).

A Diff snapshot's memory file holds only the pages dirtied since the previous snapshot (the rest
are holes); :func:`merge_diff_memory` lays it over the previous full memory file to get a
loadable full one. Note: Firecracker passes virtio-mmio devices on the kernel command line, so its
guest kernel needs ``CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`` (Debian's cloud kernel lacks it; point
``$K3LAB_FIRECRACKER_KERNEL`` at one that has it).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from k3lab.agentenv.backend import VMError, check_socket_path, copy_sparse, die_with_parent


class FirecrackerError(VMError):
    """The API answered an error (the message has the method, path, status and fault_message)."""


def _abs(name: str, path: str | os.PathLike) -> str:
    p = str(path)
    if not os.path.isabs(p):
        raise ValueError(f"{name} must be an absolute host path, got {p!r}")
    return p


def _host_path(name: str, path: str | os.PathLike) -> str:
    p = str(path)
    if not p:
        raise ValueError(f"{name} must be a host path (absolute, or relative to firecracker's working directory)")
    return p


class FirecrackerClient:
    """Synchronous client of one Firecracker process's API socket (httpx over a unix socket).

    Args:
        socket_path: the ``--api-sock`` path.
        timeout (float): seconds per request.
    """

    def __init__(self, socket_path: str | os.PathLike, timeout: float = 10.0) -> None:
        self.socket_path = str(socket_path)
        self.http = httpx.Client(transport=httpx.HTTPTransport(uds=self.socket_path),
                                 base_url="http://localhost", timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "FirecrackerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, path: str, body: dict | None = None) -> dict | None:
        try:
            r = self.http.request(method, path, json=body)
        except httpx.TransportError as e:
            raise FirecrackerError(f"{method} {path}: no answer on {self.socket_path}: {e}") from e
        if r.status_code >= 300:
            try:
                fault = r.json().get("fault_message", r.text)
            except ValueError:
                fault = r.text
            raise FirecrackerError(f"{method} {path}: HTTP {r.status_code}: {fault}")
        return r.json() if r.content else None

    def describe(self) -> dict:
        """``GET /``: InstanceInfo (``state`` is "Not started", "Running" or "Paused")."""
        return self._call("GET", "/")

    def set_boot_source(self, kernel_image_path: str, boot_args: str | None = None,
                        initrd_path: str | None = None) -> None:
        body = {"kernel_image_path": _abs("kernel_image_path", kernel_image_path)}
        if boot_args is not None:
            body["boot_args"] = boot_args
        if initrd_path is not None:
            body["initrd_path"] = _abs("initrd_path", initrd_path)
        self._call("PUT", "/boot-source", body)

    def add_drive(self, drive_id: str, path_on_host: str, is_root_device: bool,
                  is_read_only: bool = False) -> None:
        """``PUT /drives/{drive_id}``: a raw disk image (Firecracker has no qcow2). ``path_on_host``
        may be relative to firecracker's working directory."""
        if not drive_id or "/" in drive_id:
            raise ValueError(f"drive_id must be a non-empty name without '/', got {drive_id!r}")
        self._call("PUT", f"/drives/{drive_id}", {
            "drive_id": drive_id, "path_on_host": _host_path("path_on_host", path_on_host),
            "is_root_device": is_root_device, "is_read_only": is_read_only})

    def set_machine_config(self, vcpu_count: int, mem_size_mib: int, track_dirty_pages: bool = False,
                           smt: bool = False) -> None:
        """``PUT /machine-config``. ``track_dirty_pages`` is needed for Diff snapshots.

        Raises:
            ValueError: ``vcpu_count`` outside [1, 32] (odd > 1 with ``smt``), ``mem_size_mib`` < 1.
        """
        if not 1 <= vcpu_count <= 32 or (smt and vcpu_count > 1 and vcpu_count % 2):
            raise ValueError(f"vcpu_count must be in [1, 32] (1 or even with smt), got {vcpu_count}")
        if mem_size_mib < 1:
            raise ValueError(f"mem_size_mib must be >= 1, got {mem_size_mib}")
        self._call("PUT", "/machine-config", {"vcpu_count": vcpu_count, "mem_size_mib": mem_size_mib,
                                              "smt": smt, "track_dirty_pages": track_dirty_pages})

    def start(self) -> None:
        self._call("PUT", "/actions", {"action_type": "InstanceStart"})

    def pause(self) -> None:
        self._call("PATCH", "/vm", {"state": "Paused"})

    def resume(self) -> None:
        self._call("PATCH", "/vm", {"state": "Resumed"})

    def create_snapshot(self, snapshot_path: str, mem_file_path: str, diff: bool = False) -> None:
        """``PUT /snapshot/create`` (the VM must be paused). ``diff``: only pages dirtied since the
        last snapshot (needs ``track_dirty_pages``)."""
        self._call("PUT", "/snapshot/create", {
            "snapshot_type": "Diff" if diff else "Full",
            "snapshot_path": _abs("snapshot_path", snapshot_path),
            "mem_file_path": _abs("mem_file_path", mem_file_path)})

    def load_snapshot(self, snapshot_path: str, mem_file_path: str, resume: bool = True,
                      track_dirty_pages: bool = False) -> None:
        """``PUT /snapshot/load`` on a fresh process, memory from a file (mapped privately by
        Firecracker, so many VMs can share one memory file copy-on-write)."""
        self._call("PUT", "/snapshot/load", {
            "snapshot_path": _abs("snapshot_path", snapshot_path),
            "mem_backend": {"backend_type": "File", "backend_path": _abs("mem_file_path", mem_file_path)},
            "track_dirty_pages": track_dirty_pages, "resume_vm": resume})


def merge_diff_memory(full_mem: str | os.PathLike, diff_mem: str | os.PathLike,
                      out: str | os.PathLike) -> int:
    """Lay a Diff snapshot's sparse memory file over the previous full one.

    Args:
        full_mem: memory file of the previous (full) snapshot.
        diff_mem: the Diff snapshot's memory file (data = dirtied pages, holes elsewhere).
        out: where to write the merged full memory file (may equal ``full_mem`` to update in place).

    Returns:
        int: bytes taken from the diff.

    Raises:
        ValueError: the two files have different sizes (different guest memory sizes).
    """
    full_mem, diff_mem, out = Path(full_mem), Path(diff_mem), Path(out)
    size = full_mem.stat().st_size
    if diff_mem.stat().st_size != size:
        raise ValueError(f"diff_mem size {diff_mem.stat().st_size} != full_mem size {size}")
    if out != full_mem:
        copy_sparse(full_mem, out)
    copied = 0
    with open(diff_mem, "rb") as fd, open(out, "r+b") as fo:
        off = 0
        while off < size:
            try:
                start = os.lseek(fd.fileno(), off, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd.fileno(), start, os.SEEK_HOLE)
            pos = start
            while pos < end:
                n = os.copy_file_range(fd.fileno(), fo.fileno(), end - pos, pos, pos)
                if n <= 0:
                    raise OSError(f"copy_file_range returned {n}")
                pos += n
            copied += end - start
            off = end
    return copied


class FirecrackerVM:
    """One ``firecracker`` process and its API client.

    Args:
        binary (str): path of the firecracker executable.
        workdir (Path): the process's working directory (relative drive paths resolve there);
            holds the API socket, ``firecracker.log`` (Firecracker's log) and ``firecracker.err``
            (its stderr).

    Raises:
        ValueError: ``workdir`` too deep for the API socket's path.

    Attributes:
        proc (subprocess.Popen | None): the process; ``proc.stdout`` / ``proc.stdin`` are pipes
            carrying the guest's serial console (output / input).
    """

    def __init__(self, binary: str, workdir: str | os.PathLike) -> None:
        self.binary, self.workdir = binary, Path(workdir)
        self.api_sock = self.workdir / "firecracker.sock"
        check_socket_path(self.api_sock)
        self.proc: subprocess.Popen | None = None
        self.client: FirecrackerClient | None = None

    def launch(self, timeout: float = 10.0) -> FirecrackerClient:
        """Start the process (its stdin and stdout: pipes, the guest's serial console) and wait for
        its API socket.

        Raises:
            FirecrackerError: the process exited or the socket never appeared.
        """
        self.api_sock.unlink(missing_ok=True)
        # --log-path needs an existing file; Firecracker writes at its start, so keep one log per run.
        log = self.workdir / "firecracker.log"
        log.write_bytes(b"")
        err = open(self.workdir / "firecracker.err", "ab")
        self.proc = subprocess.Popen([self.binary, "--api-sock", str(self.api_sock), "--log-path", str(log)],
                                     cwd=self.workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=err, preexec_fn=die_with_parent, close_fds=True)
        err.close()
        deadline = time.monotonic() + timeout
        while not self.api_sock.exists():
            if self.proc.poll() is not None:
                raise FirecrackerError(f"firecracker exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.kill()
                raise FirecrackerError(f"no API socket at {self.api_sock} after {timeout} s")
            time.sleep(0.002)
        self.client = FirecrackerClient(self.api_sock)
        return self.client

    def boot(self, kernel: str, rootfs: str, boot_args: str, initrd: str | None = None,
             vcpus: int = 1, mem_mib: int = 128, track_dirty_pages: bool = True) -> None:
        """Configure and start a fresh VM (call after :meth:`launch`)."""
        c = self.client
        c.set_machine_config(vcpus, mem_mib, track_dirty_pages=track_dirty_pages)
        c.set_boot_source(kernel, boot_args, initrd)
        c.add_drive("rootfs", rootfs, is_root_device=True)
        c.start()

    def snapshot(self, snapshot_path: str, mem_file_path: str, diff: bool = False) -> None:
        """Pause, write the snapshot, leave paused (``resume`` to continue)."""
        self.client.pause()
        self.client.create_snapshot(snapshot_path, mem_file_path, diff=diff)

    def restore(self, snapshot_path: str, mem_file_path: str, resume: bool = True) -> None:
        """Load a snapshot into this (freshly launched) process."""
        self.client.load_snapshot(snapshot_path, mem_file_path, resume=resume, track_dirty_pages=True)

    def kill(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                pipe.close()
        self.api_sock.unlink(missing_ok=True)
