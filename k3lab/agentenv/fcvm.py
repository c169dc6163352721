"""Firecracker backend of :class:`~k3lab.agentenv.Sandbox`: a sandbox as one ``firecracker``
process, driven through :mod:`k3lab.agentenv.firecracker`'s API client.

Used when a firecracker binary, real KVM and ``$K3LAB_FIRECRACKER_KERNEL`` are found (or asked for
with ``backend="firecracker"``). Not run against a real Firecracker on the machines this was built
on (``kvm_pvm``, no KVM guests); CI drives it end to end against ``tests/fake_firecracker.py``.

The sandbox folder is the process's working directory and holds:

- ``rootfs.ext4``: the root drive, a sparse (reflink where the filesystem can) copy of the
  image's rootfs or of a snapshot's disk: Firecracker takes raw images only, no qcow2 overlays.
- ``v.sock``: the vsock device's host socket; ``firecracker.sock``: the API socket;
  ``firecracker.log``: Firecracker's output and the guest serial console.
- ``base.mem``: a hard link to the full memory image of the last snapshot or load (the base
  that the next Diff snapshot is merged onto; a link survives the snapshot folder's deletion).
- ``mem-<n>``: memory files of its own (a restore with ``cow=False``, a hibernation image),
  ``hib.vmstate``: device state while hibernated.

Per-sandbox drive and socket after a snapshot load. A snapshot records the drive's
``path_on_host`` and the vsock ``uds_path`` as configured, and ``PUT /snapshot/load`` reopens
those paths: Firecracker's ``docs/snapshotting/snapshot-support.md`` ("Loading snapshots",
Prerequisites) asks that the disk backing files and the vsock backing socket be "accessible at
the same relative paths to the new Firecracker process as they were to the original one". The
load request has no drive override (firecracker issue #4014), and patching ``/drives`` between
load and resume still has the load open the recorded file first (the parent's disk). So every
sandbox configures *relative* paths (``rootfs.ext4``, ``v.sock``) and runs its firecracker in its
own folder: a fork's process resolves the recorded paths to its own disk copy and its own socket,
as the jailer's per-VM chroot would, and the parent's files are never opened.

Snapshots and memory. ``save`` pauses, writes ``vmstate`` and ``mem`` and copies the drive: a
Full snapshot the first time, then Diff snapshots (dirty-page tracking is always on) merged onto
``base.mem`` with :func:`~k3lab.agentenv.firecracker.merge_diff_memory`, so every snapshot folder
holds a loadable full memory file. Loads use the File memory backend: Firecracker maps the file
``MAP_PRIVATE`` (pages shared until written, writes private), so forks share the snapshot's pages.

The guest agent talks over vsock port :data:`AGENT_PORT` (host side:
:meth:`~k3lab.agentenv.agent.AgentChannel.connect_vsock`), with the same protocol as QEMU's
console. Firecracker resets every open vsock connection when a snapshot is created (the
``VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`` of snapshot-support.md's vsock section; listening sockets
survive), so the host closes its connection before a snapshot and reconnects on resume. The guest
must serve the agent on that port, announcing ``@K3READY`` on every new connection; the QEMU
image of :mod:`k3lab.agentenv.image` serves ``/dev/hvc0`` only and has no vsock listener yet.
"""
from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

from k3lab.agentenv.agent import AgentChannel
from k3lab.agentenv.backend import VMBackend, VMError, console_error, copy_sparse, drop_cache, tail
from k3lab.agentenv.firecracker import FirecrackerVM, merge_diff_memory
from k3lab.agentenv.host import HostInfo
from k3lab.agentenv.image import Image

#: guest vsock port the agent listens on.
AGENT_PORT = 1024
#: kernel command line: serial console, exit on reboot/panic (Firecracker ends with the guest).
BOOT_ARGS = "console=ttyS0 reboot=k panic=1 pci=off quiet rdinit=/init"
ROOT_DRIVE = "rootfs.ext4"
VSOCK = "v.sock"
#: seconds a resumed guest has to accept the agent connection again.
RECONNECT_S = 60.0


class FirecrackerBackend(VMBackend):
    """One sandbox on Firecracker (see the module docstring for files, paths and snapshots).

    Snapshot kinds: "Full" or "Diff" (the API snapshot that produced it; a Diff's memory is
    already merged, so both load the same way).

    Raises:
        VMError: the host has no firecracker binary or no Firecracker guest kernel.
    """

    name = "firecracker"
    process = "firecracker"
    max_vcpus = 32
    snapshot_disk = "disk.ext4"

    def __init__(self, workdir: Path, image: Image, memory_mib: int, vcpus: int, host: HostInfo) -> None:
        super().__init__(workdir, image, memory_mib, vcpus, host)
        if not host.firecracker or not host.firecracker_kernel:
            raise VMError("the firecracker backend needs a firecracker binary ($K3LAB_FIRECRACKER or"
                          " PATH) and a guest kernel ($K3LAB_FIRECRACKER_KERNEL)")
        self.fc = FirecrackerVM(host.firecracker, self.workdir)
        self.base_mem = self.workdir / "base.mem"
        self.mapped: Path | None = None   # the memory file the live process maps (None: anonymous)
        self.own_mem: Path | None = None  # the sandbox's own memory file, if its state has one
        self._names = itertools.count()

    def _connect(self, deadline: float) -> None:
        self.agent = AgentChannel.connect_vsock(str(self.workdir / VSOCK), AGENT_PORT, deadline)
        self.agent.wait_for(b"@K3READY", deadline)

    def _launch(self, deadline: float) -> None:
        self.fc.launch(timeout=max(1.0, min(10.0, deadline - time.monotonic())))

    def _link_base(self, mem: Path) -> None:
        tmp = self.workdir / "base.mem.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(mem, tmp)
            os.replace(tmp, self.base_mem)
        except OSError:
            # Another filesystem (EXDEV): no base, so the next snapshot is a Full one.
            self.base_mem.unlink(missing_ok=True)

    def boot(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        copy_sparse(self.image.rootfs, self.workdir / ROOT_DRIVE)
        self._launch(deadline)
        self.fc.boot(kernel=os.path.abspath(self.host.firecracker_kernel), rootfs=ROOT_DRIVE,
                     boot_args=BOOT_ARGS, initrd=os.path.abspath(self.image.initrd), vcpus=self.vcpus,
                     mem_mib=self.memory_mib, track_dirty_pages=True, vsock_uds=VSOCK)
        self._connect(deadline)

    def _load(self, vmstate: Path, mem: Path, deadline: float) -> None:
        self._launch(deadline)
        self.fc.restore(str(vmstate), str(mem), resume=True)
        self.mapped = mem
        self._link_base(mem)
        self._connect(deadline)

    def load(self, snap: Path, kind: str, timeout: float, cow: bool) -> None:
        deadline = time.monotonic() + timeout
        copy_sparse(snap / self.snapshot_disk, self.workdir / ROOT_DRIVE)
        mem = snap / "mem"
        if not cow:
            self.own_mem = self.workdir / f"mem-{next(self._names)}"
            copy_sparse(mem, self.own_mem)
            mem = self.own_mem
        self._load(snap / "vmstate", mem, deadline)

    def _snapshot(self, vmstate: Path, mem: Path) -> str:
        """Pause and write a snapshot whose ``mem`` is a loadable full memory file."""
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        client = self.fc.client
        client.pause()
        if self.base_mem.is_file():
            diff = mem.with_name(mem.name + ".diff")
            try:
                client.create_snapshot(str(vmstate), str(diff), diff=True)
                merge_diff_memory(self.base_mem, diff, mem)
            finally:
                diff.unlink(missing_ok=True)
            kind = "Diff"
        else:
            client.create_snapshot(str(vmstate), str(mem))
            kind = "Full"
        self._link_base(mem)
        return kind

    def save(self, out: Path) -> str:
        kind = self._snapshot(out / "vmstate", out / "mem")
        copy_sparse(self.workdir / ROOT_DRIVE, out / self.snapshot_disk)
        return kind

    def pause(self) -> None:
        self.fc.client.pause()

    def resume(self) -> None:
        self.fc.client.resume()
        if self.agent is None:
            self._connect(time.monotonic() + RECONNECT_S)

    def hibernate(self) -> None:
        new = self.workdir / f"mem-{next(self._names)}"
        self._snapshot(self.workdir / "hib.vmstate", new)
        self.kill()
        if self.own_mem is not None:
            self.own_mem.unlink(missing_ok=True)  # no process maps it any more
        self.own_mem, self.mapped = new, None
        drop_cache(new)

    def wake(self, timeout: float) -> None:
        vmstate = self.workdir / "hib.vmstate"
        self._load(vmstate, self.own_mem, time.monotonic() + timeout)
        vmstate.unlink()

    def clear(self) -> None:
        for p in self.workdir.iterdir():
            if p.name in (ROOT_DRIVE, VSOCK, "hib.vmstate") or p.name.startswith(("base.mem", "mem-")):
                p.unlink(missing_ok=True)
        self.mapped = self.own_mem = None

    def kill(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        self.fc.kill()
        # A killed firecracker leaves its vsock socket file behind; a new one refuses to bind it.
        (self.workdir / VSOCK).unlink(missing_ok=True)

    def poll(self) -> int | None:
        return None if self.fc.proc is None else self.fc.proc.poll()

    @property
    def pid(self) -> int | None:
        return None if self.fc.proc is None else self.fc.proc.pid

    def memory_files(self) -> tuple[Path | None, Path | None]:
        return self.mapped, self.own_mem

    def guest_error(self) -> str | None:
        return console_error(self.workdir / "firecracker.log")

    def log_tail(self) -> str:
        return tail([self.workdir / "firecracker.log"]) or "no firecracker output"
