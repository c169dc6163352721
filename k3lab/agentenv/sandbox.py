"""The :class:`Sandbox` API: a microVM with exec, files, pause/resume, hibernate/wake,
snapshot/restore, fork and destroy; and :class:`SandboxPool` for many of them.

What a sandbox isolates: its own guest kernel, memory, processes, filesystem (a qcow2 overlay) and
devices; a command in it cannot see or change the host's or another sandbox's files, memory or
processes except through a hypervisor bug. What it does NOT isolate: CPU time and host memory are
shared with no quota (no cgroup limits here), there is no network at all (no NIC), the guest sees
the host's CPU model and TSC, and under TCG (software emulation, these machines) QEMU itself is the
attack surface, which is weaker than KVM's hardware boundary. Side channels are out of scope.

Lifecycle and where the state lives (``<root>/<id>/``):

- cold boot: kernel + initrd + rootfs overlay; RAM in ``ram`` mapped ``share=on``.
- ``pause``/``resume``: QMP ``stop``/``cont``; the guest holds its memory but no CPU.
- ``snapshot``: stop, save the device state with ``x-ignore-shared`` (RAM not in the stream),
  copy the RAM file and the disk overlay into a :class:`Snapshot` folder, continue.
- ``restore``/``fork``: a QEMU that maps the snapshot's RAM file ``share=off`` (copy-on-write:
  pages are shared until written, writes stay private) on a fresh qcow2 overlay whose backing
  file is the snapshot's disk. Children never write to the snapshot, so a fork's writes cannot
  reach its parent or siblings, on disk or in memory.
- A sandbox whose RAM is copy-on-write can still be snapshotted or hibernated: then its RAM goes
  into the migration stream (slower; QEMU 7.2 has no dirty-page incremental snapshot), and the
  one that loads it gets its own ``share=on`` RAM file again.
- ``hibernate``: save state, kill QEMU, drop the RAM file from the page cache: no process, no
  memory, only files. ``wake`` starts a QEMU from them.
- ``destroy``: kill QEMU, delete the folder, release the snapshots it depended on.
"""
from __future__ import annotations

import atexit
import ctypes
import itertools
import json
import mmap
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path

from k3lab.agentenv.agent import AgentChannel, AgentClosed, AgentError, AgentTimeout, ExecResult
from k3lab.agentenv.host import HostInfo, detect_host
from k3lab.agentenv.image import Image, build_image
from k3lab.agentenv.qemu import QemuVM, QMPError

__all__ = ["Sandbox", "Snapshot", "SandboxPool", "SandboxError", "SandboxCrashed",
           "SandboxTimeout", "SandboxStateError", "default_root", "leftovers", "cleanup"]


class SandboxError(RuntimeError):
    """Base class of sandbox failures."""


class SandboxCrashed(SandboxError):
    """The VM process exited or was killed (guest panic, OOM kill, SIGKILL); the message gives the
    exit status and the tail of QEMU's and the guest console's output."""


class SandboxTimeout(SandboxError):
    """The guest agent did not answer before the host-side deadline (a hung guest)."""


class SandboxStateError(SandboxError):
    """The operation is not valid in the sandbox's current state (e.g. exec while paused)."""


_root_lock = threading.Lock()
_default_root: Path | None = None
# Strong references: a sandbox or snapshot dropped without destroy()/delete() is still cleaned up
# at interpreter exit (its QEMU dies with us anyway through PR_SET_PDEATHSIG).
_live: "set[Sandbox]" = set()
_snapshots: "set[Snapshot]" = set()
_ids = itertools.count()


def default_root() -> Path:
    """``$K3LAB_SANDBOX_ROOT``, else one ``/var/tmp/k3lab-agentenv-*`` folder per process (on disk,
    not tmpfs: RAM files live there), removed at exit."""
    global _default_root
    with _root_lock:
        if _default_root is None:
            env = os.environ.get("K3LAB_SANDBOX_ROOT")
            if env:
                _default_root = Path(env)
                _default_root.mkdir(parents=True, exist_ok=True)
            else:
                base = "/var/tmp" if os.path.isdir("/var/tmp") else None
                _default_root = Path(tempfile.mkdtemp(prefix="k3lab-agentenv-", dir=base))
                _owned_roots.append(_default_root)
        return _default_root


_owned_roots: list[Path] = []


@atexit.register
def cleanup() -> None:
    """Destroy every sandbox of this process, delete its snapshots, remove the default root if
    this process created it. Runs at interpreter exit; call it explicitly where exit handlers may
    not run (a Jupyter kernel that is killed)."""
    global _default_root
    # Sandboxes first (their QEMUs write into the folders), then snapshots, then our temp root.
    for sb in list(_live):
        sb.destroy()
    for snap in list(_snapshots):
        snap.delete()
    with _root_lock:
        for root in _owned_roots:
            shutil.rmtree(root, ignore_errors=True)
        if _default_root in _owned_roots:
            _default_root = None
        _owned_roots.clear()


def leftovers(root: str | os.PathLike, exclude: tuple[str | os.PathLike, ...] = ()) -> dict[str, list]:
    """What lives under ``root``: every file (not folders) and every host process whose command
    line mentions ``root`` (QEMU and its helpers). Files under ``exclude`` are not counted.

    Returns:
        dict: ``{"files": [Path, ...], "pids": [int, ...]}``.
    """
    root = Path(root)
    skip = [Path(e) for e in exclude]
    files = [p for p in root.rglob("*") if not p.is_dir()
             and not any(p == e or e in p.parents for e in skip)]
    pids = []
    needle = str(root).encode()
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if needle in cmd:
                pids.append(int(d))
    return {"files": files, "pids": pids}


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_kib(path: str | os.PathLike) -> int:
    """KiB of ``path`` held in the host's page cache (mmap + mincore, like util-linux fincore)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
    with open(path, "rb") as f:
        # A private mapping: ctypes needs a writable buffer to take its address; nothing is
        # written, and mincore reports the file's page-cache residency for untouched pages.
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            anchor = ctypes.c_char.from_buffer(mm)
            rc = _libc.mincore(ctypes.addressof(anchor), size, vec)
            del anchor
        finally:
            mm.close()
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
    return sum(b & 1 for b in vec) * page // 1024


def mapping_rss_kib(pid: int, path: str | os.PathLike) -> int:
    """Resident KiB of the mappings of ``path`` in process ``pid`` (from /proc/<pid>/smaps)."""
    target, total, inside = str(path), 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                inside = line.rstrip().endswith(target)
            elif inside and first == "Rss:":
                total += int(line.split()[1])
    return total


def _copy_sparse(src: Path, dst: Path) -> None:
    """Copy a file keeping its holes (SEEK_DATA/SEEK_HOLE + copy_file_range, all in the kernel)."""
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


def _drop_cache(path: Path) -> None:
    """Write back and evict a file's pages so a hibernated sandbox holds no memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _overlay(backing: Path, path: Path, backing_fmt: str) -> None:
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", backing_fmt, "-b",
                    str(backing), str(path)], check=True, capture_output=True)


class Snapshot:
    """A saved sandbox: device state, RAM file (kind "ram") or RAM in the stream (kind "stream"),
    and a copy of the disk overlay. Deleted by :meth:`delete` (or its context manager) once no
    sandbox restored from it, and no later snapshot, depends on it.

    Attributes:
        path (Path): the folder (``state``, ``ram`` for kind "ram", ``disk.qcow2``, ``meta.json``).
        kind (str): "ram" (RAM in a file, mapped copy-on-write by restores) or "stream".
        memory_mib (int), vcpus (int): the VM shape (a restore uses the same).
        image (Image): the guest image it came from.
    """

    def __init__(self, path: Path, kind: str, memory_mib: int, vcpus: int, image: Image,
                 parent: "Snapshot | None") -> None:
        self.path, self.kind, self.memory_mib, self.vcpus = path, kind, memory_mib, vcpus
        self.image, self.parent = image, parent
        self._refs = 0
        self._released = False
        self.deleted = False
        if parent is not None:
            parent._acquire()
        _snapshots.add(self)

    @property
    def disk(self) -> Path:
        return self.path / "disk.qcow2"

    def size_bytes(self) -> int:
        """Bytes on disk (allocated blocks, holes excluded)."""
        return sum(f.stat().st_blocks * 512 for f in self.path.iterdir())

    def _acquire(self) -> None:
        if self.deleted:
            raise SandboxStateError(f"snapshot {self.path} was deleted")
        self._refs += 1

    def _release(self) -> None:
        self._refs -= 1
        self._maybe_remove()

    def _maybe_remove(self) -> None:
        if self._released and self._refs <= 0 and not self.deleted:
            self.deleted = True
            _snapshots.discard(self)
            shutil.rmtree(self.path, ignore_errors=True)
            if self.parent is not None:
                self.parent._release()

    def delete(self) -> None:
        """Release the caller's handle; files go when no sandbox or snapshot depends on them."""
        self._released = True
        self._maybe_remove()

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.delete()

    def __repr__(self) -> str:
        return f"Snapshot({self.path.name}, kind={self.kind}, refs={self._refs}, deleted={self.deleted})"


class Sandbox:
    """A microVM sandbox. Build with :meth:`create` (cold boot) or :meth:`from_snapshot`.

    States: "running", "paused", "hibernated", "crashed", "destroyed". Not thread-safe: one caller
    at a time per sandbox (different sandboxes are independent processes).

    Example::

        with Sandbox.create() as sb:
            r = sb.exec("echo hi; exit 3", timeout=5)   # ExecResult(exit_code=3, stdout=b"hi\\n", ...)
            snap = sb.snapshot()
            kids = sb.fork(2)                            # two children from the exact running state
    """

    #: extra seconds the host waits beyond an exec timeout before declaring the guest hung.
    grace_s = 60.0

    def __init__(self, image: Image, memory_mib: int, vcpus: int, root: Path, host: HostInfo) -> None:
        if host.backend != "qemu":
            # The Firecracker path of this class (agent over vsock, per-child drive paths on
            # snapshot load) is not built: Firecracker cannot run on the machines this was made
            # on. Real KVM is there, so QEMU uses it.
            warnings.warn(f"{host.reason}; Sandbox drives QEMU with accel={host.accel} (the"
                          " Firecracker API client is k3lab.agentenv.firecracker)", RuntimeWarning,
                          stacklevel=3)
        self.image, self.memory_mib, self.vcpus, self.host = image, memory_mib, vcpus, host
        self.root = Path(root)
        self.id = f"sb{next(_ids)}-{uuid.uuid4().hex[:6]}"
        self.dir = self.root / self.id
        self.dir.mkdir(parents=True)
        self.vm = QemuVM(self.dir, image, memory_mib, vcpus, host.accel, host.tsc_khz)
        self.agent: AgentChannel | None = None
        self.state = "new"
        self.ram_path = self.dir / "ram"
        self.ram_shared = True
        self.base: Snapshot | None = None
        _live.add(self)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def create(cls, image: Image | None = None, memory_mib: int = 128, vcpus: int = 1,
               root: str | os.PathLike | None = None, boot_timeout: float = 180.0) -> "Sandbox":
        """Cold-boot a sandbox (~5 s under TCG, the guest's own kernel boot).

        Args:
            image (Image | None): default :func:`~k3lab.agentenv.image.build_image` (cached).
            memory_mib (int): guest RAM, 64..65536 MiB.
            vcpus (int): 1..64.
            root: folder for the sandbox's files; default :func:`default_root`.
            boot_timeout (float): seconds until the agent must say it is ready.

        Raises:
            TypeError: ``memory_mib`` or ``vcpus`` not an int (a bool is refused too).
            ValueError: ``memory_mib`` or ``vcpus`` out of range.
            SandboxCrashed: QEMU exited during boot. SandboxTimeout: the guest never got ready.
        """
        _check_vm_shape(memory_mib, vcpus)
        sb = cls(image or build_image(), memory_mib, vcpus, Path(root) if root else default_root(),
                 detect_host())
        try:
            _overlay(sb.image.rootfs, sb.disk, "raw")
            sb._launch(ram=sb.ram_path, shared=True, incoming=None, timeout=boot_timeout)
        except BaseException:
            sb.destroy()
            raise
        return sb

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, root: str | os.PathLike | None = None,
                      timeout: float = 60.0, cow: bool = True) -> "Sandbox":
        """A new running sandbox in the exact state of ``snapshot`` (disk: a copy-on-write overlay).

        Args:
            snapshot (Snapshot): what to start from.
            root: folder for the sandbox; default the snapshot's root.
            timeout (float): seconds until the restored guest must answer.
            cow (bool): map the snapshot's RAM copy-on-write (True: cheapest start and memory;
                this sandbox's own later snapshots/hibernations carry its RAM in the migration
                stream, slower) or copy the RAM file first (False: +~50 ms per 100 MiB; later
                snapshots/hibernations stay cheap).

        Raises:
            SandboxStateError: the snapshot was deleted. SandboxCrashed: the restore failed.
        """
        if snapshot.deleted:
            raise SandboxStateError(f"snapshot {snapshot.path} was deleted")
        root = Path(root) if root else snapshot.path.parent.parent
        sb = cls(snapshot.image, snapshot.memory_mib, snapshot.vcpus, root, detect_host())
        try:
            sb._start_from(snapshot, timeout, cow)
        except BaseException:
            sb.destroy()
            raise
        return sb

    @property
    def disk(self) -> Path:
        return self.dir / "disk.qcow2"

    def _launch(self, ram: Path, shared: bool, incoming: Path | None, timeout: float,
                ignore_shared: bool = False) -> None:
        deadline = time.monotonic() + timeout
        try:
            self.vm.start(self.disk, ram, shared, incoming, ignore_shared=ignore_shared, timeout=timeout)
            self.agent = AgentChannel.connect_unix(self.vm.agent_path, deadline)
            if incoming is None:
                self.agent.wait_for(b"@K3READY", deadline)
            else:
                self.agent.ping(deadline)
        except (QMPError, AgentClosed) as e:
            self._crashed(f"VM failed to start: {e}")
        except AgentTimeout as e:
            self.vm.kill()
            raise SandboxTimeout(f"sandbox {self.id} not ready within {timeout:.0f} s; {self.vm.log_tail()}") from e
        self.ram_path, self.ram_shared = ram, shared
        self.state = "running"

    def _start_from(self, snap: Snapshot, timeout: float, cow: bool = True) -> None:
        snap._acquire()
        self.base = snap
        _overlay(snap.disk, self.disk, "qcow2")
        if snap.kind == "ram" and cow:
            self._launch(snap.path / "ram", False, snap.path / "state", timeout, ignore_shared=True)
        elif snap.kind == "ram":
            _copy_sparse(snap.path / "ram", self.dir / "ram")
            self._launch(self.dir / "ram", True, snap.path / "state", timeout, ignore_shared=True)
        else:
            self._launch(self.dir / "ram", True, snap.path / "state", timeout, ignore_shared=False)

    # ---- checks -------------------------------------------------------------------------------

    def _crashed(self, what: str) -> None:
        if self.vm.proc is not None:
            try:
                self.vm.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        code = self.vm.poll()
        self.vm.kill()
        self.state = "crashed"
        how = "still running" if code is None else (f"killed by signal {-code}" if code < 0 else f"exit status {code}")
        guest = self.vm.guest_error()
        guest = f"guest: {guest}; " if guest else ""
        raise SandboxCrashed(f"sandbox {self.id} crashed ({what}; QEMU {how}); {guest}{self.vm.log_tail()}")

    def _need(self, *states: str) -> None:
        if self.state in ("running", "paused") and self.vm.poll() is not None:
            self._crashed("VM process exited")
        if self.state not in states:
            raise SandboxStateError(f"sandbox {self.id} is {self.state}; this needs {' or '.join(states)}")

    def _agent_call(self, op: str, *args, wait_s: float):
        self._need("running")
        try:
            return getattr(self.agent, op)(*args, deadline=time.monotonic() + wait_s)
        except AgentClosed as e:
            self._crashed(str(e))
        except AgentTimeout as e:
            if self.vm.poll() is not None:
                self._crashed(str(e))
            raise SandboxTimeout(f"sandbox {self.id}: guest agent silent for {wait_s:.0f} s (hung guest)") from e
        except AgentError as e:
            raise SandboxError(f"sandbox {self.id}: {e}") from e

    # ---- guest operations ---------------------------------------------------------------------

    def exec(self, cmd: str, timeout: float = 30.0) -> ExecResult:
        """Run ``sh -c cmd``-like (the text is a script for busybox sh) in the guest.

        Args:
            cmd (str): shell script text.
            timeout (float): seconds, > 0. On expiry the guest SIGKILLs the command's whole process
                group; the result has ``timed_out=True`` and exit code 137. The host is untouched.

        Returns:
            ExecResult: exit code, stdout, stderr (bytes), timed_out.

        Raises:
            TypeError: ``cmd`` not a str. ValueError: ``timeout`` <= 0. SandboxStateError: not
            running. SandboxCrashed: the VM died. SandboxTimeout: no answer ``grace_s`` after the
            timeout (hung guest).
        """
        if not isinstance(cmd, str):
            raise TypeError(f"cmd must be a str (a shell script), got {type(cmd).__name__}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        return self._agent_call("exec", cmd, timeout, wait_s=timeout + self.grace_s)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` in the guest (parent folder must exist).

        Raises:
            TypeError: ``path`` not a str, ``data`` not str/bytes-like. ValueError: ``path`` not
            absolute. SandboxError: the guest could not write it.
        """
        if not isinstance(path, str):
            raise TypeError(f"path must be a str, got {type(path).__name__}")
        # bytes(5) would silently be five NUL bytes.
        if not isinstance(data, (str, bytes, bytearray, memoryview)):
            raise TypeError(f"data must be str or bytes, got {type(data).__name__}")
        if not path.startswith("/"):
            raise ValueError(f"path must be absolute, got {path!r}")
        data = data.encode() if isinstance(data, str) else bytes(data)
        r = self._agent_call("write_file", path, data, mode, wait_s=self.grace_s + len(data) / 1e5)
        if r.exit_code != 0:
            raise SandboxError(f"write_file({path!r}) failed: {r.stderr.decode(errors='replace').strip()}")

    def read_file(self, path: str) -> bytes:
        """The bytes of ``path`` in the guest.

        Raises:
            TypeError: ``path`` not a str. FileNotFoundError: the guest cannot read it (message has
            the guest's error).
        """
        if not isinstance(path, str):
            raise TypeError(f"path must be a str, got {type(path).__name__}")
        r = self._agent_call("read_file", path, wait_s=self.grace_s)
        if r.exit_code != 0:
            raise FileNotFoundError(f"{path} in sandbox {self.id}: {r.stderr.decode(errors='replace').strip()}")
        return r.stdout

    # ---- lifecycle ----------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop the vCPUs (QMP ``stop``): no CPU use, memory kept. Idempotent."""
        self._need("running", "paused")
        if self.state == "running":
            self._qmp(self.vm.pause)
            self.state = "paused"

    def resume(self) -> None:
        """Continue a paused sandbox (QMP ``cont``). Idempotent on a running one."""
        self._need("running", "paused")
        if self.state == "paused":
            self._qmp(self.vm.resume)
            self.state = "running"

    def _qmp(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except QMPError as e:
            if self.vm.poll() is not None or "closed" in str(e):
                self._crashed(str(e))
            raise SandboxError(f"sandbox {self.id}: {e}") from e

    def snapshot(self) -> Snapshot:
        """Save the exact current state (RAM, devices, disk) without stopping the sandbox for long.

        Returns:
            Snapshot: restore it with :meth:`restore` or :meth:`from_snapshot`; call its
            ``delete()`` when done.
        """
        self._need("running", "paused")
        was_running = self.state == "running"
        kind = "ram" if self.ram_shared else "stream"
        snaps = self.root / "snapshots"
        snaps.mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".snap-", dir=snaps))
        try:
            self._qmp(self.vm.save_state, tmp / "state", ignore_shared=kind == "ram")
            self.state = "paused"
            if kind == "ram":
                _copy_sparse(self.ram_path, tmp / "ram")
            _copy_sparse(self.disk, tmp / "disk.qcow2")
            (tmp / "meta.json").write_text(json.dumps({
                "kind": kind, "memory_mib": self.memory_mib, "vcpus": self.vcpus,
                "image": self.image.digest, "from": self.id, "time": time.time()}))
            final = snaps / f"snap-{uuid.uuid4().hex[:10]}"
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        snap = Snapshot(final, kind, self.memory_mib, self.vcpus, self.image, parent=self.base)
        if was_running:
            self.resume()
        return snap

    def restore(self, snapshot: Snapshot, timeout: float = 60.0, cow: bool = True) -> None:
        """Replace this sandbox's state (memory, processes, disk) by ``snapshot``'s, in place
        (``cow`` as in :meth:`from_snapshot`)."""
        if self.state == "destroyed":
            raise SandboxStateError(f"sandbox {self.id} is destroyed")
        if snapshot.deleted:
            raise SandboxStateError(f"snapshot {snapshot.path} was deleted")
        snapshot._acquire()  # hold it while the old state goes
        try:
            self._teardown_vm()
            for name in ("disk.qcow2", "ram", "hibernate.state"):
                (self.dir / name).unlink(missing_ok=True)
            old, self.base = self.base, None
            if old is not None:
                old._release()
            self._start_from(snapshot, timeout, cow)
        finally:
            snapshot._release()

    def fork(self, n: int = 1, cow: bool = True) -> list["Sandbox"]:
        """``n`` new running sandboxes from this one's exact running state.

        Each child maps a snapshot's RAM copy-on-write and writes its own qcow2 overlay: its writes
        never reach the parent or its siblings. The parent keeps running (it is paused only while
        its state is saved). The internal snapshot goes when the last child is destroyed.
        ``cow``: as in :meth:`from_snapshot`.

        Raises:
            TypeError: ``n`` not an int. ValueError: ``n`` < 1 (both before the snapshot is taken).
        """
        _check_int("n", n)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        snap = self.snapshot()
        children: list[Sandbox] = []
        try:
            for _ in range(n):
                children.append(Sandbox.from_snapshot(snap, root=self.root, cow=cow))
        except BaseException:
            for c in children:
                c.destroy()
            raise
        finally:
            snap.delete()
        return children

    def hibernate(self) -> None:
        """Save the state to files and end the VM process: no CPU, no memory, until :meth:`wake`."""
        self._need("running", "paused")
        self._qmp(self.vm.save_state, self.dir / "hibernate.state", ignore_shared=self.ram_shared)
        self._teardown_vm()
        if self.ram_shared:
            _drop_cache(self.ram_path)
        self.state = "hibernated"

    def wake(self, timeout: float = 60.0) -> None:
        """Start a hibernated sandbox again, running, exactly where it stopped."""
        self._need("hibernated")
        state = self.dir / "hibernate.state"
        if self.ram_shared:
            self._launch(self.ram_path, True, state, timeout, ignore_shared=True)
        else:
            # Its RAM (copy-on-write before) is in the stream; load it into a file of its own.
            self._launch(self.dir / "ram", True, state, timeout, ignore_shared=False)
        state.unlink()

    def _teardown_vm(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        self.vm.kill()

    def destroy(self) -> None:
        """Kill the VM, delete every file of this sandbox, release its snapshots. Idempotent."""
        if self.state == "destroyed":
            return
        self._teardown_vm()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.base is not None:
            self.base._release()
            self.base = None
        self.state = "destroyed"
        _live.discard(self)

    # ---- introspection ------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Host process ids of this sandbox (the QEMU process), empty when hibernated/destroyed."""
        pid = self.vm.pid
        return [pid] if pid is not None and self.vm.poll() is None else []

    def memory(self) -> dict[str, int]:
        """Host memory of this sandbox in KiB.

        Returns:
            dict: ``rss`` and ``pss`` of the QEMU process (/proc/<pid>/smaps_rollup; PSS splits
            shared pages among their sharers); ``ram_mapped``: resident pages of the guest-RAM
            mapping; ``ram_file_cache``: page-cache pages of the sandbox's *own* RAM file that
            the process has not mapped (0 for copy-on-write RAM, whose file belongs to a
            snapshot; a hibernated sandbox's evicted file counts what is still cached);
            ``total`` = ``pss`` + ``ram_file_cache``.
        """
        out = {"rss": 0, "pss": 0, "ram_mapped": 0, "ram_file_cache": 0, "total": 0}
        for pid in self.pids():
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    key = line.split(":")[0]
                    if key in ("Rss", "Pss"):
                        out[key.lower()] += int(line.split()[1])
            out["ram_mapped"] = mapping_rss_kib(pid, self.ram_path)
        if self.ram_shared and self.state != "destroyed" and self.ram_path.is_file():
            out["ram_file_cache"] = max(0, resident_kib(self.ram_path) - out["ram_mapped"])
        out["total"] = out["pss"] + out["ram_file_cache"]
        return out

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"Sandbox({self.id}, {self.state}, ram={'own' if self.ram_shared else 'cow'})"


def _check_int(name: str, n) -> None:
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}")


def _check_vm_shape(memory_mib: int, vcpus: int) -> None:
    """TypeError/ValueError unless memory_mib is an int in [64, 65536] and vcpus an int in [1, 64]."""
    _check_int("memory_mib", memory_mib)
    _check_int("vcpus", vcpus)
    if not 64 <= memory_mib <= 65536:
        raise ValueError(f"memory_mib must be in [64, 65536] MiB, got {memory_mib}")
    if not 1 <= vcpus <= 64:
        raise ValueError(f"vcpus must be in [1, 64], got {vcpus}")


class SandboxPool:
    """Many sandboxes from one booted base: the pool cold-boots once, snapshots the fresh guest,
    and every :meth:`create` is a copy-on-write restore of that snapshot (~0.4 s under TCG
    instead of ~5 s).

    Args:
        image (Image | None), memory_mib (int), vcpus (int), root: as :meth:`Sandbox.create`.
        cow (bool): as in :meth:`Sandbox.from_snapshot` (True: members share the base's RAM pages).
        base (Snapshot | None): start members from this snapshot instead of booting a guest; the
            pool takes over the handle (``close`` deletes it).

    Raises:
        TypeError, ValueError: ``memory_mib`` or ``vcpus`` as in :meth:`Sandbox.create`, checked here
            rather than at the first boot.
    """

    def __init__(self, image: Image | None = None, memory_mib: int = 128, vcpus: int = 1,
                 root: str | os.PathLike | None = None, cow: bool = True,
                 base: Snapshot | None = None) -> None:
        _check_vm_shape(memory_mib, vcpus)
        self.image, self.memory_mib, self.vcpus, self.cow = image, memory_mib, vcpus, cow
        if base is not None and root is None:
            root = base.path.parent.parent
        self.root = Path(root) if root else default_root()
        self.sandboxes: list[Sandbox] = []
        self._base: Snapshot | None = base

    @property
    def base(self) -> Snapshot:
        """The snapshot of a freshly booted guest (boots it on first use)."""
        if self._base is None or self._base.deleted:
            with Sandbox.create(self.image, self.memory_mib, self.vcpus, root=self.root) as sb:
                self._base = sb.snapshot()
        return self._base

    def create(self, cow: bool | None = None) -> Sandbox:
        """A new running member restored from :attr:`base` (``cow`` defaults to the pool's)."""
        sb = Sandbox.from_snapshot(self.base, root=self.root, cow=self.cow if cow is None else cow)
        self.sandboxes.append(sb)
        return sb

    def create_many(self, n: int) -> list[Sandbox]:
        _check_int("n", n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return [self.create() for _ in range(n)]

    def adopt(self, sandboxes: list[Sandbox]) -> list[Sandbox]:
        """Let the pool destroy these too (e.g. forks of pool members) on :meth:`close`."""
        self.sandboxes.extend(sandboxes)
        return sandboxes

    def live(self) -> list[Sandbox]:
        self.sandboxes = [s for s in self.sandboxes if s.state != "destroyed"]
        return list(self.sandboxes)

    def close(self) -> None:
        """Destroy every sandbox of the pool and delete the base snapshot."""
        for sb in self.sandboxes:
            sb.destroy()
        self.sandboxes.clear()
        if self._base is not None:
            self._base.delete()
            self._base = None

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.live())
