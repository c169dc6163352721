"""QEMU ``microvm`` backend driven over QMP.

One :class:`QemuVM` is one QEMU process: guest RAM is a ``memory-backend-file`` (``share=on`` on
the sandbox's own file, or ``share=off`` on a snapshot's RAM file, which maps it copy-on-write),
the disk is a qcow2 overlay on a read-only backing chain, the guest agent talks over a
``virtconsole`` (``/dev/hvc0``) on a unix socket, and the kernel console goes to ``console.log``.
With ``agent_port="ttyS0"`` the agent is wired as Firecracker wires it instead: on the 8250
serial port, which is also the kernel console (kept silent with ``loglevel=0``); that is how the
image's serial-port path is tested on hosts where Firecracker cannot run.

Guest state is saved with QMP ``migrate`` to ``exec:cat > file`` (QEMU 7.2 has no ``file:``
URI) and loaded with ``-incoming defer`` + ``migrate-incoming``. With the ``x-ignore-shared``
capability the RAM of a ``share=on`` block is left out of the stream (it is already in its file),
which is what makes snapshots and forks cheap.

:class:`QemuBackend` is the :class:`~k3lab.agentenv.backend.VMBackend` that
:class:`~k3lab.agentenv.Sandbox` drives: RAM file handling, qcow2 overlays and snapshot folders.
"""
from __future__ import annotations

import json
import os
import select
import shlex
import socket
import subprocess
import time
from pathlib import Path

from k3lab.agentenv.agent import AgentChannel
from k3lab.agentenv.backend import (VMBackend, VMError, check_socket_path, console_error, copy_sparse,
                                    die_with_parent, drop_cache, tail)
from k3lab.agentenv.host import HostInfo
from k3lab.agentenv.image import Image


class QMPError(VMError):
    """QMP returned an error, closed, or timed out."""


class QMP:
    """Minimal synchronous QMP client (JSON lines over a unix socket). ``proc``: the QEMU
    process, whose exit ends the wait for the socket."""

    def __init__(self, path: str, deadline: float, proc: subprocess.Popen | None = None) -> None:
        while True:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self.sock.close()
                # QEMU refusing its command line exits at once: say so now, not at the deadline.
                if proc is not None and proc.poll() is not None:
                    raise QMPError(f"QEMU exited (status {proc.returncode}) before its QMP socket"
                                   " was up") from None
                if time.monotonic() > deadline:
                    raise QMPError(f"QMP socket {path} did not appear") from None
                time.sleep(0.002)
        self.buf = b""
        self.events: list[dict] = []
        self._read(deadline)  # greeting
        self.execute("qmp_capabilities", timeout=max(1.0, deadline - time.monotonic()))

    def _read(self, deadline: float) -> dict:
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise QMPError("QMP timed out")
            try:
                data = self.sock.recv(65536)
            except OSError as e:
                # ECONNRESET: QEMU exited with our command unread.
                raise QMPError(f"QMP connection closed (QEMU exited): {e}") from e
            if not data:
                raise QMPError("QMP connection closed (QEMU exited)")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def execute(self, cmd: str, timeout: float = 30.0, **args) -> dict | list:
        msg = {"execute": cmd}
        if args:
            msg["arguments"] = args
        try:
            self.sock.sendall(json.dumps(msg).encode() + b"\n")
        except OSError as e:
            raise QMPError(f"QMP send failed: {e}") from e
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if "event" in reply:
                self.events.append(reply)
            elif "error" in reply:
                raise QMPError(f"{cmd}: {reply['error'].get('desc')}")
            elif "return" in reply:
                return reply["return"]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _opt(value) -> str:
    """``value`` as a QEMU option value: commas doubled (QEMU's escape inside ``a=b,c=d``)."""
    return str(value).replace(",", ",,")


class QemuVM:
    """One QEMU microvm process.

    Args:
        workdir (Path): holds the sockets, logs and (for ``share=on``) the RAM file.
        image (Image): kernel and initrd (the disk is passed to :meth:`start`).
        memory_mib (int): guest RAM in MiB.
        vcpus (int): guest vCPUs.
        accel (str): "tcg" or "kvm".
        tsc_khz (int): host TSC kHz, put on the kernel command line under TCG.
        agent_port (str): the guest agent's tty: "hvc0" (a virtio console) or "ttyS0" (the
            serial port, Firecracker's console).

    Raises:
        ValueError: another ``agent_port``; ``workdir`` too deep for its unix sockets.
    """

    def __init__(self, workdir: Path, image: Image, memory_mib: int, vcpus: int, accel: str,
                 tsc_khz: int, qemu: str = "qemu-system-x86_64", agent_port: str = "hvc0") -> None:
        if agent_port not in ("hvc0", "ttyS0"):
            raise ValueError(f"agent_port must be 'hvc0' or 'ttyS0', got {agent_port!r}")
        self.agent_port = agent_port
        self.workdir, self.image = Path(workdir), image
        self.memory_mib, self.vcpus, self.accel, self.tsc_khz = memory_mib, vcpus, accel, tsc_khz
        self.qemu = qemu
        self.proc: subprocess.Popen | None = None
        self.qmp: QMP | None = None
        self.agent_path = str(self.workdir / "agent.sock")
        self.qmp_path = str(self.workdir / "qmp.sock")
        for path in (self.agent_path, self.qmp_path):
            check_socket_path(path)

    def cmdline(self, disk: Path, ram: Path, ram_shared: bool, incoming: bool) -> list[str]:
        # Paths inside comma-separated option strings go through _opt: a "," in a folder name
        # would otherwise end the value ("=" is safe in key=value form, not in "-qmp unix:...").
        append = "console=ttyS0 panic=-1 rdinit=/init 8250.nr_uarts=1"
        if self.agent_port == "hvc0":
            append += " quiet"
            agent = ["-device", "virtio-serial-device,id=vser0",
                     "-device", "virtconsole,chardev=agent,id=con0",
                     "-chardev", f"file,id=console,path={_opt(self.workdir / 'console.log')}",
                     "-serial", "chardev:console"]
        else:
            append += " loglevel=0 k3lab.agent=ttyS0"
            agent = ["-serial", "chardev:agent"]
        if self.accel == "tcg":
            append += f" tsc_early_khz={self.tsc_khz}"
        accel = "tcg,tb-size=16" if self.accel == "tcg" else "kvm"
        cmd = [self.qemu, "-M", "microvm,acpi=on,pit=off,pic=off,rtc=off", "-accel", accel,
               "-m", f"{self.memory_mib}M", "-smp", str(self.vcpus),
               "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
               "-object", f"memory-backend-file,id=mem,size={self.memory_mib}M,mem-path={_opt(ram)},"
                          f"share={'on' if ram_shared else 'off'}",
               "-machine", "memory-backend=mem",
               "-kernel", str(self.image.kernel), "-initrd", str(self.image.initrd), "-append", append,
               "-blockdev", f"driver=file,filename={_opt(disk)},node-name=file0",
               "-blockdev", "driver=qcow2,file=file0,node-name=disk0",
               "-device", "virtio-blk-device,drive=disk0,id=blk0",
               "-chardev", f"socket,id=agent,path={_opt(self.agent_path)},server=on,wait=off", *agent,
               "-chardev", f"socket,id=qmp,path={_opt(self.qmp_path)},server=on,wait=off",
               "-mon", "chardev=qmp,mode=control"]
        if self.accel == "kvm":
            cmd += ["-cpu", "host"]
        if incoming:
            cmd += ["-incoming", "defer"]
        return cmd

    def start(self, disk: Path, ram: Path, ram_shared: bool, incoming: Path | None = None,
              ignore_shared: bool = False, timeout: float = 30.0) -> None:
        """Launch QEMU. With ``incoming`` the saved state is loaded and the guest runs after it.

        Raises:
            QMPError: QEMU exited or QMP failed (the message includes QEMU's stderr tail).
        """
        for p in (self.agent_path, self.qmp_path):
            if os.path.exists(p):
                os.unlink(p)
        stderr = open(self.workdir / "qemu.log", "ab")
        self.proc = subprocess.Popen(self.cmdline(disk, ram, ram_shared, incoming is not None),
                                     stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                                     preexec_fn=die_with_parent, close_fds=True)
        stderr.close()
        deadline = time.monotonic() + timeout
        try:
            self.qmp = QMP(self.qmp_path, deadline, self.proc)
            if incoming is not None:
                self.qmp.execute("migrate-set-capabilities", capabilities=[
                    {"capability": "x-ignore-shared", "state": ignore_shared}])
                self.qmp.execute("migrate-incoming", uri=f"exec:cat {shlex.quote(str(incoming))}")
                # A state saved from a stopped guest loads as "paused": wait for the load, continue.
                while (status := self.status()) == "inmigrate":
                    if time.monotonic() > deadline:
                        raise QMPError("loading the saved state timed out")
                    time.sleep(0.001)
                if status != "running":
                    self.qmp.execute("cont")
        except QMPError as e:
            raise QMPError(f"{e}; {self.log_tail()}") from e

    def save_state(self, path: Path, ignore_shared: bool, timeout: float = 120.0) -> None:
        """Stop the guest (if running) and migrate its device state (and RAM unless
        ``ignore_shared`` and the RAM is ``share=on``) to ``path``. The guest stays paused.

        A guest that was paused when its last state was saved is still in QEMU's "postmigrate"
        state, which refuses another migration until the guest runs: it is continued and stopped
        again first (it runs for about a millisecond).

        Raises:
            QMPError: the migration failed or timed out.
        """
        if self.status() == "postmigrate":
            self.qmp.execute("cont")
        self.qmp.execute("stop")
        self.qmp.execute("migrate-set-capabilities", capabilities=[
            {"capability": "x-ignore-shared", "state": ignore_shared}])
        self.qmp.execute("migrate", uri=f"exec:cat > {shlex.quote(str(path))}")
        deadline = time.monotonic() + timeout
        while True:
            st = self.qmp.execute("query-migrate")
            status = st.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise QMPError(f"migration {status}: {st.get('error-desc', '')}; {self.log_tail()}")
            if time.monotonic() > deadline:
                raise QMPError("migration timed out")
            time.sleep(0.001)

    def status(self) -> str:
        return self.qmp.execute("query-status")["status"]

    def pause(self) -> None:
        self.qmp.execute("stop")

    def resume(self) -> None:
        self.qmp.execute("cont")

    def poll(self) -> int | None:
        """QEMU's exit code (negative = signal), or None while it runs."""
        return None if self.proc is None else self.proc.poll()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def kill(self) -> None:
        """SIGKILL QEMU and reap it (idempotent)."""
        if self.qmp is not None:
            self.qmp.close()
            self.qmp = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()

    def guest_error(self) -> str | None:
        """The first kernel panic / oops / OOM line of the guest console, if any."""
        log = self.workdir / "console.log"
        return console_error(log.read_text(errors="replace")) if log.is_file() else None

    def log_tail(self, n: int = 1500) -> str:
        return tail([self.workdir / "qemu.log", self.workdir / "console.log"], n) or "no QEMU output"


def _overlay(backing: Path, path: Path, backing_fmt: str) -> None:
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", backing_fmt, "-b",
                    str(backing), str(path)], check=True, capture_output=True)


class QemuBackend(VMBackend):
    """A sandbox on QEMU ``microvm`` (KVM where it is real, TCG otherwise).

    Files in ``workdir``: ``disk.qcow2`` (overlay on the image's rootfs or a snapshot's disk),
    ``ram`` (guest RAM, ``share=on``), ``hibernate.state``, sockets and logs. Snapshot folders
    hold ``state`` (device state), ``ram`` (kind "ram": RAM in a file, mapped copy-on-write by
    restores) or nothing (kind "stream": RAM inside ``state``, when the sandbox's own RAM was
    copy-on-write), and ``disk.qcow2``.
    """

    name = "qemu"
    process = "QEMU"
    max_vcpus = 64
    snapshot_disk = "disk.qcow2"

    def __init__(self, workdir: Path, image: Image, memory_mib: int, vcpus: int, host: HostInfo) -> None:
        super().__init__(workdir, image, memory_mib, vcpus, host)
        self.vm = QemuVM(self.workdir, image, memory_mib, vcpus, host.accel, host.tsc_khz)
        self.disk = self.workdir / "disk.qcow2"
        self.ram_path = self.workdir / "ram"
        self.ram_shared = True

    def _launch(self, ram: Path, shared: bool, incoming: Path | None, timeout: float,
                ignore_shared: bool = False) -> None:
        deadline = time.monotonic() + timeout
        self.vm.start(self.disk, ram, shared, incoming, ignore_shared=ignore_shared, timeout=timeout)
        self.agent = AgentChannel.connect_unix(self.vm.agent_path, deadline)
        if incoming is None:
            self.agent.wait_for(b"@K3READY", deadline)
        else:
            self.agent.ping(deadline)
        self.ram_path, self.ram_shared = ram, shared

    def boot(self, timeout: float) -> None:
        _overlay(self.image.rootfs, self.disk, "raw")
        self._launch(self.workdir / "ram", True, None, timeout)

    def load(self, snap: Path, kind: str, timeout: float, cow: bool) -> None:
        _overlay(snap / self.snapshot_disk, self.disk, "qcow2")
        if kind == "ram" and cow:
            self._launch(snap / "ram", False, snap / "state", timeout, ignore_shared=True)
        elif kind == "ram":
            copy_sparse(snap / "ram", self.workdir / "ram")
            self._launch(self.workdir / "ram", True, snap / "state", timeout, ignore_shared=True)
        else:
            self._launch(self.workdir / "ram", True, snap / "state", timeout, ignore_shared=False)

    def save(self, out: Path) -> str:
        kind = "ram" if self.ram_shared else "stream"
        self.vm.save_state(out / "state", ignore_shared=kind == "ram")
        if kind == "ram":
            copy_sparse(self.ram_path, out / "ram")
        copy_sparse(self.disk, out / self.snapshot_disk)
        return kind

    def pause(self) -> None:
        self.vm.pause()

    def resume(self) -> None:
        self.vm.resume()

    def hibernate(self) -> None:
        self.vm.save_state(self.workdir / "hibernate.state", ignore_shared=self.ram_shared)
        self.kill()
        if self.ram_shared:
            drop_cache(self.ram_path)

    def wake(self, timeout: float) -> None:
        state = self.workdir / "hibernate.state"
        if self.ram_shared:
            self._launch(self.ram_path, True, state, timeout, ignore_shared=True)
        else:
            # Its RAM (copy-on-write before) is in the stream; load it into a file of its own.
            self._launch(self.workdir / "ram", True, state, timeout, ignore_shared=False)
        state.unlink()

    def clear(self) -> None:
        for name in ("disk.qcow2", "ram", "hibernate.state"):
            (self.workdir / name).unlink(missing_ok=True)

    def kill(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        self.vm.kill()

    def poll(self) -> int | None:
        return self.vm.poll()

    @property
    def pid(self) -> int | None:
        return self.vm.pid

    def memory_files(self) -> tuple[Path | None, Path | None]:
        return self.ram_path, self.ram_path if self.ram_shared else None

    def guest_error(self) -> str | None:
        return self.vm.guest_error()

    def log_tail(self) -> str:
        return self.vm.log_tail()
