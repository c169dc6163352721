"""QEMU ``microvm`` backend driven over QMP.

One :class:`QemuVM` is one QEMU process: guest RAM is a ``memory-backend-file`` (``share=on`` on
the sandbox's own file, or ``share=off`` on a snapshot's RAM file, which maps it copy-on-write),
the disk is a qcow2 overlay on a read-only backing chain, the guest agent talks over a
``virtconsole`` (``/dev/hvc0``) on a unix socket, and the kernel console goes to ``console.log``.

Guest state is saved with QMP ``migrate`` to ``exec:cat > file`` (QEMU 7.2 has no ``file:``
URI) and loaded with ``-incoming defer`` + ``migrate-incoming``. With the ``x-ignore-shared``
capability the RAM of a ``share=on`` block is left out of the stream (it is already in its file),
which is what makes snapshots and forks cheap.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

from k3lab.agentenv.image import Image


class QMPError(RuntimeError):
    """QMP returned an error, closed, or timed out."""


class QMP:
    """Minimal synchronous QMP client (JSON lines over a unix socket)."""

    def __init__(self, path: str, deadline: float) -> None:
        while True:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self.sock.close()
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
            data = self.sock.recv(65536)
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


_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a QEMU whose Python parent dies is killed, never orphaned.
    _libc.prctl(1, signal.SIGKILL)


class QemuVM:
    """One QEMU microvm process.

    Args:
        workdir (Path): holds the sockets, logs and (for ``share=on``) the RAM file.
        image (Image): kernel and initrd (the disk is passed to :meth:`start`).
        memory_mib (int): guest RAM in MiB.
        vcpus (int): guest vCPUs.
        accel (str): "tcg" or "kvm".
        tsc_khz (int): host TSC kHz, put on the kernel command line under TCG.
    """

    def __init__(self, workdir: Path, image: Image, memory_mib: int, vcpus: int, accel: str,
                 tsc_khz: int, qemu: str = "qemu-system-x86_64") -> None:
        self.workdir, self.image = Path(workdir), image
        self.memory_mib, self.vcpus, self.accel, self.tsc_khz = memory_mib, vcpus, accel, tsc_khz
        self.qemu = qemu
        self.proc: subprocess.Popen | None = None
        self.qmp: QMP | None = None
        self.agent_path = str(self.workdir / "agent.sock")
        self.qmp_path = str(self.workdir / "qmp.sock")

    def cmdline(self, disk: Path, ram: Path, ram_shared: bool, incoming: bool) -> list[str]:
        append = "console=ttyS0 quiet panic=-1 rdinit=/init 8250.nr_uarts=1"
        if self.accel == "tcg":
            append += f" tsc_early_khz={self.tsc_khz}"
        accel = "tcg,tb-size=16" if self.accel == "tcg" else "kvm"
        cmd = [self.qemu, "-M", "microvm,acpi=on,pit=off,pic=off,rtc=off", "-accel", accel,
               "-m", f"{self.memory_mib}M", "-smp", str(self.vcpus),
               "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
               "-object", f"memory-backend-file,id=mem,size={self.memory_mib}M,mem-path={ram},"
                          f"share={'on' if ram_shared else 'off'}",
               "-machine", "memory-backend=mem",
               "-kernel", str(self.image.kernel), "-initrd", str(self.image.initrd), "-append", append,
               "-blockdev", f"driver=file,filename={disk},node-name=file0",
               "-blockdev", "driver=qcow2,file=file0,node-name=disk0",
               "-device", "virtio-blk-device,drive=disk0,id=blk0",
               "-device", "virtio-serial-device,id=vser0",
               "-chardev", f"socket,id=agent,path={self.agent_path},server=on,wait=off",
               "-device", "virtconsole,chardev=agent,id=con0",
               "-serial", f"file:{self.workdir / 'console.log'}",
               "-qmp", f"unix:{self.qmp_path},server=on,wait=off"]
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
                                     preexec_fn=_die_with_parent, close_fds=True)
        stderr.close()
        deadline = time.monotonic() + timeout
        try:
            self.qmp = QMP(self.qmp_path, deadline)
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

        Raises:
            QMPError: the migration failed or timed out.
        """
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
        p = self.workdir / "console.log"
        if not p.is_file():
            return None
        for line in p.read_text(errors="replace").splitlines():
            if any(k in line for k in ("Kernel panic", "Oops", "BUG:", "Out of memory")):
                return line.strip()
        return None

    def log_tail(self, n: int = 1500) -> str:
        parts = []
        for name in ("qemu.log", "console.log"):
            p = self.workdir / name
            if p.is_file():
                text = p.read_bytes()[-n:].decode(errors="replace").strip()
                if text:
                    parts.append(f"{name}: ...{text}")
        return " | ".join(parts) or "no QEMU output"
