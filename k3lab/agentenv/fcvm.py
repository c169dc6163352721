"""Firecracker backend of :class:`~k3lab.agentenv.Sandbox`: a sandbox as one ``firecracker``
process, driven through :mod:`k3lab.agentenv.firecracker`'s API client.

Used when a firecracker binary, real KVM and ``$K3LAB_FIRECRACKER_KERNEL`` are found (or asked for
with ``backend="firecracker"``). Not run against a real Firecracker on the machines this was built
on (``kvm_pvm``, no KVM guests); CI drives it end to end against ``tests/fake_firecracker.py``.

The sandbox folder is the process's working directory and holds:

- ``rootfs.ext4``: the root drive, a sparse (reflink where the filesystem can) copy of the
  image's rootfs or of a snapshot's disk: Firecracker takes raw images only, no qcow2 overlays.
- ``firecracker.sock``: the API socket; ``firecracker.log``: Firecracker's log (``--log-path``);
  ``firecracker.err``: its stderr.
- ``base.mem``: a hard link to the full memory image of the last snapshot or load (the base
  that the next Diff snapshot is merged onto; a link survives the snapshot folder's deletion).
- ``mem-<n>``: memory files of its own (a restore with ``cow=False``, a hibernation image),
  ``hib.vmstate``: device state while hibernated.

The guest agent runs on the serial port. Firecracker's only console is an emulated 8250 UART
(``ttyS0``) whose input is the firecracker process's stdin and whose output is its stdout
(``src/vmm/src/device_manager/mod.rs``, ``setup_serial_device``: ``SerialOut::Stdout`` and
``std::io::stdin()``; stdin is polled when it is a tty or a FIFO, ``devices/legacy/serial.rs``).
Both are pipes here, and the agent's protocol (:mod:`k3lab.agentenv.agent`) rides on them with
the same framing as QEMU's virtio console. The boot arguments name the agent's tty
(``k3lab.agent=ttyS0``, read by the image's init) and keep the kernel's log off it:
``console=ttyS0`` gives userspace a ``/dev/console``, and ``loglevel=0`` keeps every kernel
message off the port, even the emergency ones (a soft-lockup report on a loaded host would
otherwise land inside a reply) and a panic's (``console_verbose()`` leaves a zero log level
alone): a crashed guest shows as the firecracker process's exit (``panic=1``, ``reboot=k``).
Firecracker's own log goes to ``firecracker.log``; without ``--log-path`` it would be written to
stdout, into the agent's stream (``src/vmm/src/logger/logging.rs``).

Serial flow control. Firecracker makes stdout non-blocking and drops the bytes a full pipe refuses
(counted in the ``uart.missed_write_count`` metric; firecracker PRs #2381, #2461); it reads stdin
only as far as the UART's 64-byte FIFO has room, and the guest's 8250 driver queues what it
receives in the tty's buffers. The agent protocol keeps one 32 KiB chunk in flight per direction,
acknowledged before the next, so neither the 64 KiB pipe nor the guest tty overflows.

Across snapshots. The serial device is not part of a snapshot: ``PUT /snapshot/load`` builds a
fresh one on the new process's stdin/stdout and re-enables its receive interrupt
(``DeviceManager::restore`` and ``emulate_serial_init`` in ``device_manager/mod.rs``; firecracker
PR #2879, "Set RDA bit in serial after restore"). So a restored, forked or woken sandbox's agent
is reached through the new process's pipes, picking up inside the guest exactly where it was (the
host pings it; no boot banner). A snapshot taken while the guest is still transmitting can leave
the restored UART silent (the driver waits for a transmit interrupt that the fresh device never
raises: firecracker PR #5730); snapshots here are taken between agent requests, once the whole
reply has reached the host, when the guest's transmitter is idle. The pause/create/resume of a
live sandbox does not touch the serial port, so its agent channel carries on.

Per-sandbox drive after a snapshot load. A snapshot records the drive's ``path_on_host`` as
configured, and ``PUT /snapshot/load`` reopens that path: Firecracker's
``docs/snapshotting/snapshot-support.md`` ("Loading snapshots", Prerequisites) asks that the disk
backing files be "accessible at the same relative paths to the new Firecracker process as they
were to the original one". The load request has no drive override (firecracker issue #4014), and
patching ``/drives`` between load and resume still has the load open the recorded file first (the
parent's disk). So every sandbox configures the *relative* path ``rootfs.ext4`` and runs its
firecracker in its own folder: a fork's process resolves it to its own disk copy, as the jailer's
per-VM chroot would, and the parent's files are never opened.

Snapshots and memory. ``save`` pauses, writes ``vmstate`` and ``mem`` and copies the drive: a
Full snapshot the first time, then Diff snapshots (dirty-page tracking is always on) merged onto
``base.mem`` with :func:`~k3lab.agentenv.firecracker.merge_diff_memory`, so every snapshot folder
holds a loadable full memory file. Loads use the File memory backend: Firecracker maps the file
``MAP_PRIVATE`` (pages shared until written, writes private), so forks share the snapshot's pages.
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

#: kernel command line: the agent on the serial port, the kernel's log kept off it; exit on
#: reboot/panic (Firecracker ends with the guest).
BOOT_ARGS = "console=ttyS0 loglevel=0 reboot=k panic=1 pci=off rdinit=/init k3lab.agent=ttyS0"
ROOT_DRIVE = "rootfs.ext4"


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
        self.console = b""  # the end of the serial traffic of the last process, for crash reports

    def _launch(self, deadline: float) -> None:
        self.fc.launch(timeout=max(1.0, min(10.0, deadline - time.monotonic())))
        self.agent = AgentChannel.from_pipes(self.fc.proc.stdout, self.fc.proc.stdin)

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
                     mem_mib=self.memory_mib, track_dirty_pages=True)
        self.agent.wait_for(b"@K3READY", deadline)

    def _load(self, vmstate: Path, mem: Path, deadline: float) -> None:
        self._launch(deadline)
        self.fc.restore(str(vmstate), str(mem), resume=True)
        self.mapped = mem
        self._link_base(mem)
        self.agent.ping(deadline)

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
            if p.name in (ROOT_DRIVE, "hib.vmstate") or p.name.startswith(("base.mem", "mem-")):
                p.unlink(missing_ok=True)
        self.mapped = self.own_mem = None

    def kill(self) -> None:
        if self.agent is not None:
            self.console = bytes(self.agent.recent)
            self.agent.close()
            self.agent = None
        self.fc.kill()

    def poll(self) -> int | None:
        return None if self.fc.proc is None else self.fc.proc.poll()

    @property
    def pid(self) -> int | None:
        return None if self.fc.proc is None else self.fc.proc.pid

    def memory_files(self) -> tuple[Path | None, Path | None]:
        return self.mapped, self.own_mem

    def _console_text(self) -> str:
        return (bytes(self.agent.recent) if self.agent is not None else self.console).decode(errors="replace")

    def guest_error(self) -> str | None:
        return console_error(self._console_text())

    def log_tail(self) -> str:
        parts = [tail([self.workdir / "firecracker.log", self.workdir / "firecracker.err"])]
        if console := self._console_text()[-1500:].strip():
            parts.append(f"serial console: ...{console}")
        return " | ".join(p for p in parts if p) or "no firecracker output"
