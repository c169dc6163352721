"""The :class:`Sandbox` API: a microVM with exec, files, pause/resume, hibernate/wake,
snapshot/restore, fork and destroy; and :class:`SandboxPool` for many of them.

Backends (one :class:`Sandbox` class and API for both; the hypervisor-specific code sits behind
:class:`~k3lab.agentenv.backend.VMBackend`):

- ``"qemu"`` (:class:`~k3lab.agentenv.qemu.QemuBackend`): QEMU ``microvm`` over QMP, KVM where
  it is real, TCG (software emulation) otherwise; the default on these machines.
- ``"firecracker"`` (:class:`~k3lab.agentenv.fcvm.FirecrackerBackend`): used when a firecracker
  binary, real KVM and a Firecracker guest kernel are found (:func:`~k3lab.agentenv.host.detect_host`
  says which and why); tested against a fake firecracker in CI, not run on a real one here.

What a sandbox isolates: its own guest kernel, memory, processes, filesystem (a per-sandbox disk:
a qcow2 overlay or a raw copy) and devices; a command in it cannot see or change the host's or
another sandbox's files, memory or processes except through a hypervisor bug. What it does NOT
isolate: CPU time and host memory are shared with no quota on the host (the guest's RAM is the
VM's size; host-side cgroups are not set here), there is no network at all (no NIC), the guest
sees the host's CPU model and TSC, and under TCG (software emulation, these machines) QEMU itself
is the attack surface, which is weaker than KVM's hardware boundary. Side channels are out of scope.

Inside the guest, commands are hostile by assumption (see ``docs/agentenv.md``):

- each :meth:`Sandbox.exec` runs as the unprivileged ``user`` (uid 1000, home ``/home/user``)
  unless ``root=True``, in a new session, in a cgroup of its own under the sandbox's cgroup
  (cgroup v2 in the guest: a process limit and a memory limit for all commands together, see
  :meth:`Sandbox.limits`; rlimits of ``user`` where the guest kernel has no cgroup v2);
- its stdout and stderr are files of its own (a tmpfs per command, a quarter of guest RAM): what
  it leaves running can never write into another command's output or exit code;
- when it returns its whole tree is killed (``cgroup.kill``, so ``setsid`` daemons too) unless
  ``keep_background=True``; at its timeout the whole tree is killed regardless;
- a guest agent that does not answer within :attr:`Sandbox.grace_s` of the deadline makes the
  sandbox "unhealthy": later calls fail at once, :meth:`Sandbox.restore` and
  :meth:`Sandbox.destroy` still work.

Lifecycle (files under ``<root>/<id>/``; the backends' docstrings give their layouts):

- cold boot: kernel + initrd + a disk of the sandbox's own from the image's rootfs.
- ``pause``/``resume``: the vCPUs stop and continue; the guest holds its memory but no CPU.
- ``snapshot``: pause, save device state, memory and a disk copy into a :class:`Snapshot`
  folder, continue.
- ``restore``/``fork``: a new VM process that maps the snapshot's memory file copy-on-write
  (pages shared until written, writes private) on a disk of its own made from the snapshot's.
  Children never write to the snapshot, so a fork's writes cannot reach its parent or siblings,
  on disk or in memory.
- ``hibernate``: save the state to files, end the VM process, drop the memory file from the page
  cache: no process, no memory, only files. ``wake`` starts a VM process from them.
- ``destroy``: kill the VM, delete the folder, release the snapshots it depended on.
"""
from __future__ import annotations

import atexit
import ctypes
import itertools
import json
import mmap
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path

from k3lab.agentenv.agent import AgentClosed, AgentError, AgentTimeout, ExecResult
from k3lab.agentenv.backend import VMBackend, VMError
from k3lab.agentenv.fcvm import FirecrackerBackend
from k3lab.agentenv.host import HostInfo, detect_host
from k3lab.agentenv.image import Image, build_image
from k3lab.agentenv.qemu import QemuBackend

__all__ = ["Sandbox", "Snapshot", "SandboxPool", "SandboxError", "SandboxCrashed",
           "SandboxTimeout", "SandboxStateError", "default_root", "leftovers", "cleanup"]


class SandboxError(RuntimeError):
    """Base class of sandbox failures."""


class SandboxCrashed(SandboxError):
    """The VM process exited or was killed (guest panic, OOM kill, SIGKILL); the message gives the
    exit status and the tail of the hypervisor's and the guest console's output."""


class SandboxTimeout(SandboxError):
    """The guest agent did not answer before the host-side deadline (a hung guest)."""


class SandboxStateError(SandboxError):
    """The operation is not valid in the sandbox's current state (e.g. exec while paused, any
    call on an unhealthy sandbox, an exec that :meth:`Sandbox.destroy` ended)."""


_root_lock = threading.Lock()
_default_root: Path | None = None
# Strong references: a sandbox or snapshot dropped without destroy()/delete() is still cleaned up
# at interpreter exit (its VM process dies with us anyway through PR_SET_PDEATHSIG).

#: backend name -> implementation.
BACKENDS: dict[str, type[VMBackend]] = {"qemu": QemuBackend, "firecracker": FirecrackerBackend}
_live: "set[Sandbox]" = set()
_snapshots: "set[Snapshot]" = set()
_ids = itertools.count()
#: the longest exec timeout in seconds (~3 years); larger ones overflow the host's select().
MAX_TIMEOUT_S = 1e8
#: characters of a command quoted in error messages.
QUOTE_CHARS = 60


def _quote(cmd: str) -> str:
    """A command as error messages name it: its first :data:`QUOTE_CHARS` characters, repr'd."""
    return repr(cmd if len(cmd) <= QUOTE_CHARS else cmd[:QUOTE_CHARS] + "...")


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
    # Sandboxes first (their VMs write into the folders), then snapshots, then our temp root.
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
    line mentions ``root`` (QEMU, firecracker and their helpers). Files under ``exclude`` are not
    counted.

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


class Snapshot:
    """A saved sandbox: device state, memory, a copy of the disk, ``meta.json``. Deleted by
    :meth:`delete` (or its context manager) once no sandbox restored from it, and no later
    snapshot, depends on it. Restored only by the backend that wrote it.

    Attributes:
        path (Path): the folder.
        backend (str): "qemu" or "firecracker".
        kind (str): qemu: "ram" (RAM in a file, mapped copy-on-write by restores) or "stream"
            (RAM inside the device state); firecracker: "Full" or "Diff" (a Diff's memory is
            already merged onto its base, so both restore the same way).
        memory_mib (int), vcpus (int): the VM shape (a restore uses the same).
        image (Image): the guest image it came from.
    """

    def __init__(self, path: Path, backend: str, kind: str, memory_mib: int, vcpus: int, image: Image,
                 parent: "Snapshot | None") -> None:
        self.path, self.backend, self.kind = path, backend, kind
        self.memory_mib, self.vcpus = memory_mib, vcpus
        self.image, self.parent = image, parent
        self._refs = 0
        self._released = False
        self.deleted = False
        if parent is not None:
            parent._acquire()
        _snapshots.add(self)

    @property
    def disk(self) -> Path:
        """The disk copy in the folder."""
        return self.path / BACKENDS[self.backend].snapshot_disk

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
        """Release the caller's handle; files go when no sandbox or snapshot depends on them. Until
        then the snapshot still restores and forks; ``deleted`` turns True (and they raise
        SandboxStateError) when the files are gone."""
        self._released = True
        self._maybe_remove()

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.delete()

    def __repr__(self) -> str:
        return (f"Snapshot({self.path.name}, {self.backend}, kind={self.kind}, refs={self._refs},"
                f" deleted={self.deleted})")


class Sandbox:
    """A microVM sandbox. Build with :meth:`create` (cold boot) or :meth:`from_snapshot`.

    States: "running", "paused", "hibernated", "unhealthy" (the guest agent stopped answering:
    only :meth:`restore` and :meth:`destroy` work), "crashed", "destroyed". Not thread-safe: one
    caller at a time per sandbox (different sandboxes are independent processes), except that
    :meth:`destroy` may be called from another thread during a call, which it ends.

    Attributes:
        backend (str): "qemu" or "firecracker".
        vm (VMBackend): the hypervisor side (internal).

    Example::

        with Sandbox.create() as sb:
            r = sb.exec("echo hi; exit 3", timeout=5)   # ExecResult(exit_code=3, stdout=b"hi\\n", ...)
            snap = sb.snapshot()
            kids = sb.fork(2)                            # two children from the exact running state
    """

    #: seconds the host waits beyond an exec's timeout for the guest agent to say the command
    #: ended (it kills the command's tree at the timeout and says so within about a second under
    #: TCG); past that the sandbox is "unhealthy".
    grace_s = 5.0
    #: seconds a file transfer, or an exec's reply once the command has ended, may stall.
    transfer_s = 60.0

    def __init__(self, backend: str, image: Image, memory_mib: int, vcpus: int, root: Path,
                 host: HostInfo) -> None:
        self.backend, self.image, self.memory_mib, self.vcpus, self.host = backend, image, memory_mib, vcpus, host
        self.root = Path(root).absolute()
        self.id = f"sb{next(_ids)}-{uuid.uuid4().hex[:6]}"
        self.dir = self.root / self.id
        self.dir.mkdir(parents=True)
        self.state = "new"
        self.base: Snapshot | None = None
        self._unhealthy = ""  # why, while state == "unhealthy"
        self._call: str | None = None  # the guest call in flight, as messages name it
        self._call_done = threading.Event()
        self._call_done.set()
        self._destroying = False
        _live.add(self)
        try:
            self.vm: VMBackend = BACKENDS[backend](self.dir, image, memory_mib, vcpus, host)
        except BaseException:
            self.vm = None
            self.destroy()
            raise

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def create(cls, image: Image | None = None, memory_mib: int = 128, vcpus: int = 1,
               root: str | os.PathLike | None = None, boot_timeout: float = 180.0,
               backend: str | None = None) -> "Sandbox":
        """Cold-boot a sandbox (~5 s under TCG, the guest's own kernel boot).

        Args:
            image (Image | None): default :func:`~k3lab.agentenv.image.build_image` (cached).
            memory_mib (int): guest RAM, 64..65536 MiB.
            vcpus (int): 1..64 (1..32 on firecracker).
            root: folder for the sandbox's files; default :func:`default_root`.
            boot_timeout (float): seconds until the agent must say it is ready.
            backend (str | None): "qemu", "firecracker", or None: the one
                :func:`~k3lab.agentenv.host.detect_host` picks (its ``reason`` says why).

        Raises:
            TypeError: ``memory_mib`` or ``vcpus`` not an int (a bool is refused too), ``image`` not
                an Image or None, ``boot_timeout`` not a number.
            ValueError: ``memory_mib`` or ``vcpus`` out of range, ``boot_timeout`` not in (0, 1e8] s,
                ``backend`` not one of the names,
                ``root`` so deep that the VM's unix sockets would exceed 107 bytes.
            SandboxError: ``backend="firecracker"`` on a host without a firecracker binary, real
                KVM and ``$K3LAB_FIRECRACKER_KERNEL``; the qemu backend without qemu-system-x86_64
                and qemu-img on PATH.
            SandboxCrashed: the VM exited during boot. SandboxTimeout: the guest never got ready.
        """
        _check_vm_shape(memory_mib, vcpus)
        _check_timeout("boot_timeout", boot_timeout)
        _check_backend_name(backend)
        if image is not None and not isinstance(image, Image):
            raise TypeError(f"image must be an Image (from build_image) or None, got {image!r}")
        host = detect_host()
        name = _pick_backend(backend, host)
        if vcpus > BACKENDS[name].max_vcpus:
            raise ValueError(f"vcpus must be in [1, {BACKENDS[name].max_vcpus}] on {name}, got {vcpus}")
        sb = cls(name, image or build_image(), memory_mib, vcpus, Path(root) if root else default_root(), host)
        try:
            sb._start(sb.vm.boot, boot_timeout)
        except BaseException:
            sb.destroy()
            raise
        return sb

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, root: str | os.PathLike | None = None,
                      timeout: float = 60.0, cow: bool = True) -> "Sandbox":
        """A new running sandbox in the exact state of ``snapshot``, on the snapshot's backend,
        with a disk of its own made from the snapshot's.

        Args:
            snapshot (Snapshot): what to start from.
            root: folder for the sandbox; default the snapshot's root.
            timeout (float): seconds until the restored guest must answer.
            cow (bool): map the snapshot's memory file copy-on-write (True: cheapest start and
                memory) or copy it first (False: +~50 ms per 100 MiB; on qemu, this sandbox's own
                later snapshots/hibernations stay cheap: with True they carry its RAM in the
                migration stream, slower; on firecracker, the sandbox then maps no snapshot file).

        Raises:
            SandboxStateError: the snapshot was deleted. SandboxError: the snapshot's backend is
            not usable on this host. SandboxCrashed: the restore failed. ValueError: ``root`` too
            deep (as in :meth:`create`), ``timeout`` not in (0, 1e8] s. TypeError: ``snapshot`` not a
            Snapshot, ``timeout`` not a number.
        """
        _check_snapshot(snapshot)
        _check_timeout("timeout", timeout)
        if snapshot.deleted:
            raise SandboxStateError(f"snapshot {snapshot.path} was deleted")
        root = Path(root) if root else snapshot.path.parent.parent
        host = detect_host()
        sb = cls(_pick_backend(snapshot.backend, host), snapshot.image, snapshot.memory_mib,
                 snapshot.vcpus, root, host)
        try:
            sb._start_from(snapshot, timeout, cow)
        except BaseException:
            sb.destroy()
            raise
        return sb

    @property
    def ram_shared(self) -> bool:
        """Guest RAM writes go to a file of the sandbox's own (qemu ``share=on``; never on
        firecracker, whose memory is anonymous or a private mapping)."""
        return self.vm.ram_shared

    def _start(self, fn, timeout: float) -> None:
        """Run a backend start method (boot/load/wake); the sandbox is running after it."""
        try:
            fn(timeout)
        except (VMError, AgentClosed) as e:
            self._crashed(f"VM failed to start: {e}")
        except AgentError as e:
            self.vm.kill()
            raise SandboxTimeout(f"sandbox {self.id} not ready within {timeout:.0f} s ({e});"
                                 f" {self.vm.log_tail()}") from e
        except BaseException:
            # Any other failure (an interrupt) must not leave a VM process that nothing tracks.
            self.vm.kill()
            raise
        self.state = "running"

    def _start_from(self, snap: Snapshot, timeout: float, cow: bool = True) -> None:
        snap._acquire()
        self.base = snap
        self._start(lambda t: self.vm.load(snap.path, snap.kind, t, cow), timeout)

    # ---- checks -------------------------------------------------------------------------------

    def _crashed(self, what: str) -> None:
        if self._call is not None:
            what = f"{what}; during {self._call}"
        if self.vm.pid is not None:
            deadline = time.monotonic() + 5.0
            while self.vm.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
        code = self.vm.poll()
        self.vm.kill()
        self.state = "crashed"
        how = "still running" if code is None else (f"killed by signal {-code}" if code < 0 else f"exit status {code}")
        guest = self.vm.guest_error()
        guest = f"guest: {guest}; " if guest else ""
        raise SandboxCrashed(f"sandbox {self.id} crashed ({what}; {self.vm.process} {how});"
                             f" {guest}{self.vm.log_tail()}")

    def _need(self, *states: str, what: str = "") -> None:
        if self.state in ("running", "paused", "unhealthy") and self.vm.poll() is not None:
            self._crashed(f"VM process exited before {what}" if what else "VM process exited")
        if self.state not in states:
            call = f" ({what})" if what else ""
            if self.state == "unhealthy":
                raise SandboxStateError(f"sandbox {self.id} is unhealthy{call}: {self._unhealthy};"
                                        " restore a snapshot or destroy it")
            raise SandboxStateError(f"sandbox {self.id} is {self.state}{call}; this needs {' or '.join(states)}")

    def _agent_call(self, what: str, op: str, *args, deadline: float, **kw):
        """Call the guest agent's ``op``; ``what`` names the call in every error."""
        self._need("running", what=what)
        self._call = what
        self._call_done.clear()
        try:
            return getattr(self.vm.agent, op)(*args, deadline=deadline, **kw)
        except AgentError as e:
            if self._destroying or self.state == "destroyed":
                raise SandboxStateError(f"sandbox {self.id} was destroyed during {what}") from None
            if isinstance(e, AgentClosed) or self.vm.poll() is not None:
                self._crashed(str(e))
            if isinstance(e, AgentTimeout):
                late = time.monotonic() - deadline
                why = (f"the guest agent stalled in its reply to {what}" if e.ended else
                       f"no answer from the guest agent to {what} {late:.1f} s after its deadline")
                self.state, self._unhealthy = "unhealthy", f"{why} (guest wedged)"
                raise SandboxTimeout(f"sandbox {self.id}: {why}: the guest is wedged; the sandbox is"
                                     " now unhealthy (restore a snapshot or destroy it)") from e
            raise SandboxError(f"sandbox {self.id}: {what}: {e}") from e
        finally:
            self._call = None
            self._call_done.set()

    def _control(self, fn, *args):
        """Run a backend control call; a dead VM process becomes SandboxCrashed."""
        try:
            return fn(*args)
        except (VMError, AgentError) as e:
            # A closed control socket (QMP "closed", Firecracker "no answer") means a dying VM even
            # before its exit is visible to poll().
            if (self.vm.poll() is not None or isinstance(e, AgentClosed) or "closed" in str(e)
                    or "no answer" in str(e)):
                self._crashed(str(e))
            if isinstance(e, AgentTimeout):
                raise SandboxTimeout(f"sandbox {self.id}: {e}") from e
            raise SandboxError(f"sandbox {self.id}: {e}") from e

    # ---- guest operations ---------------------------------------------------------------------

    def exec(self, cmd: str, timeout: float = 30.0, root: bool = False,
             keep_background: bool = False) -> ExecResult:
        """Run ``cmd`` (a script for busybox sh) in the guest, in a new session and a cgroup of
        its own, with stdin ``/dev/null`` and stdout/stderr in files of its own.

        Args:
            cmd (str): shell script text.
            timeout (float): seconds, in (0, 1e8]. On expiry the guest SIGKILLs the command's whole
                tree (its cgroup, daemons that left its session too); the result has
                ``timed_out=True`` and exit code 137, within about a second of the timeout.
            root (bool): run as root (cwd ``/root``); default the unprivileged ``user`` (uid 1000,
                cwd and ``$HOME`` ``/home/user``). Both are under the sandbox's :meth:`limits`.
            keep_background (bool): leave the processes the command started running after it
                returns (a server); their writes to the command's stdout/stderr go to that
                command's own files (gone from view once it returned, capped with them), never into
                a later command's. Default: the whole tree is killed when the command returns.

        Returns:
            ExecResult: exit code (137 when killed: timeout, or out of memory, which stderr then
            names), stdout, stderr (bytes), timed_out.

        Raises:
            TypeError: ``cmd`` not a str, ``timeout`` not an int or float (a bool is refused),
                ``root`` or ``keep_background`` not a bool.
            ValueError: ``timeout`` not in (0, 1e8] (inf and nan too: the host's wait needs a
                deadline).
            SandboxStateError: not running (unhealthy included), or :meth:`destroy` ended it
                (the message says the sandbox was destroyed during this command).
            SandboxCrashed: the VM died.
            SandboxTimeout: the guest agent did not say the command ended within
                :attr:`grace_s` (5 s) after ``timeout`` (a wedged guest), or its reply then stalled
                :attr:`transfer_s`; the sandbox is "unhealthy" from then on.
            SandboxError: the command or its output arrived damaged (md5 or chunk length
                mismatch; a damaged command is not run), or its output filled its cap (a quarter
                of guest RAM for stdout and stderr together: ~23 MB at 128 MiB), or the reply does
                not fit in the guest's ``/run``.

        Every error message names the sandbox and the command (its first 60 characters).
        """
        if not isinstance(cmd, str):
            raise TypeError(f"cmd must be a str (a shell script), got {type(cmd).__name__}")
        # The guest's shell would drop the NUL and run another command.
        if "\0" in cmd:
            raise ValueError(f"cmd must not contain a NUL character, got {cmd[:60]!r}")
        _check_timeout("timeout", timeout)
        for name, flag in (("root", root), ("keep_background", keep_background)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        deadline = time.monotonic() + timeout + self.grace_s + len(cmd) / 1e5
        return self._agent_call(f"exec {_quote(cmd)}", "exec", cmd, timeout, deadline=deadline, root=root,
                                keep_background=keep_background, idle_s=self.transfer_s)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644, root: bool = False) -> None:
        """Write ``data`` to ``path`` in the guest (parent folder must exist), as root.

        Args:
            path (str): absolute guest path, no NUL character.
            data (bytes | str): the contents (str is UTF-8 encoded).
            mode (int): permission bits, 0..0o7777.
            root (bool): the file is owned by root; default by the unprivileged ``user`` that
                :meth:`exec` runs as, so its commands can change it.

        Raises:
            TypeError: ``path`` not a str, ``data`` not str/bytes-like, ``mode`` not an int.
            ValueError: ``path`` not absolute or with a NUL, ``mode`` out of range. SandboxError:
            the guest could not write it, or the file it wrote differs from ``data`` (md5 mismatch).
            SandboxStateError, SandboxCrashed, SandboxTimeout: as in :meth:`exec`.
        """
        _check_guest_path(path)
        # bytes(5) would silently be five NUL bytes.
        if not isinstance(data, (str, bytes, bytearray, memoryview)):
            raise TypeError(f"data must be str or bytes, got {type(data).__name__}")
        if not path.startswith("/"):
            raise ValueError(f"path must be absolute, got {path!r}")
        _check_int("mode", mode)
        if not 0 <= mode <= 0o7777:
            raise ValueError(f"mode must be permission bits in [0, 0o7777], got {mode:#o}")
        if not isinstance(root, bool):
            raise TypeError(f"root must be a bool, got {root!r}")
        data = data.encode() if isinstance(data, str) else bytes(data)
        what = f"write_file({path!r})"
        r = self._agent_call(what, "write_file", path, data, mode, root=root,
                             deadline=time.monotonic() + self.transfer_s + len(data) / 1e5)
        if r.exit_code != 0:
            raise SandboxError(f"sandbox {self.id}: {what} failed: {r.stderr.decode(errors='replace').strip()}")

    def read_file(self, path: str) -> bytes:
        """The bytes of ``path`` in the guest (read as root).

        Raises:
            TypeError: ``path`` not a str. ValueError: ``path`` has a NUL. FileNotFoundError: the
            guest cannot read it (message has the guest's error). SandboxError: the file arrived
            damaged (md5 mismatch) or does not fit in the guest's ``/run`` (as in :meth:`exec`).
            SandboxStateError, SandboxCrashed, SandboxTimeout: as in :meth:`exec`.
        """
        _check_guest_path(path)
        what = f"read_file({path!r})"
        r = self._agent_call(what, "read_file", path, deadline=time.monotonic() + self.transfer_s)
        if r.exit_code != 0:
            raise FileNotFoundError(f"{path} in sandbox {self.id}: {r.stderr.decode(errors='replace').strip()}")
        return r.stdout

    def limits(self, max_pids: int | None = None, memory_mib: int | None = None) -> dict:
        """Set (the arguments given) and report the limits on everything :meth:`exec` runs in
        this sandbox, all commands together: at most ``max_pids`` processes and ``memory_mib``
        MiB of memory (their tmpfs files included). Defaults at boot: 256 processes, three
        quarters of the guest's RAM. A fork bomb then fails to fork past the limit; a memory hog
        is OOM-killed inside its command (exit 137, stderr says so); the agent stays out of both.
        Snapshots, restores and forks carry the limits.

        Args:
            max_pids (int | None): 1..4194304 processes; None keeps the current value.
            memory_mib (int | None): MiB, >= 1; None keeps the current value.

        Returns:
            dict: ``mechanism`` ("cgroup": cgroup v2 in the guest; "rlimit": the guest kernel
            has none, so ``max_pids`` is RLIMIT_NPROC of ``user`` and ``memory_mib`` RLIMIT_AS of
            each of its processes, and root commands are not limited), ``max_pids``,
            ``memory_mib`` (float), ``memory_used_mib`` (float, cgroup only, else None).

        Raises:
            TypeError: an argument not an int (or None). ValueError: out of range.
            SandboxError: the guest refused the value. SandboxStateError, SandboxCrashed,
            SandboxTimeout: as in :meth:`exec`.
        """
        for name, v, hi in (("max_pids", max_pids, 4194304), ("memory_mib", memory_mib, 1 << 30)):
            if v is not None:
                _check_int(name, v)
                if not 1 <= v <= hi:
                    raise ValueError(f"{name} must be in [1, {hi}], got {v}")
        what = f"limits(max_pids={max_pids}, memory_mib={memory_mib})"
        r = self._agent_call(what, "limits", max_pids, None if memory_mib is None else memory_mib * 1024,
                             deadline=time.monotonic() + self.transfer_s)
        if r.exit_code != 0:
            raise SandboxError(f"sandbox {self.id}: {what} failed: {r.stderr.decode(errors='replace').strip()}")
        mech, pids, mem_kib, used = r.text.split()
        return {"mechanism": mech, "max_pids": int(pids), "memory_mib": int(mem_kib) / 1024,
                "memory_used_mib": None if used == "-" else int(used) / 1024}

    # ---- lifecycle ----------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop the vCPUs (QMP ``stop``, Firecracker ``PATCH /vm Paused``): no CPU use, memory
        kept. Idempotent."""
        self._need("running", "paused")
        if self.state == "running":
            self._control(self.vm.pause)
            self.state = "paused"

    def resume(self) -> None:
        """Continue a paused sandbox. Idempotent on a running one."""
        self._need("running", "paused")
        if self.state == "paused":
            self._control(self.vm.resume)
            self.state = "running"

    def snapshot(self) -> Snapshot:
        """Save the exact current state (RAM, devices, disk) without stopping the sandbox for long.

        Returns:
            Snapshot: restore it with :meth:`restore` or :meth:`from_snapshot`; call its
            ``delete()`` when done.
        """
        self._need("running", "paused")
        was_running = self.state == "running"
        snaps = self.root / "snapshots"
        snaps.mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".snap-", dir=snaps))
        try:
            self.state = "paused"  # save() leaves the VM paused, also when it fails midway
            kind = self._control(self.vm.save, tmp)
            (tmp / "meta.json").write_text(json.dumps({
                "backend": self.backend, "kind": kind, "memory_mib": self.memory_mib, "vcpus": self.vcpus,
                "image": self.image.digest, "from": self.id, "time": time.time()}))
            final = snaps / f"snap-{uuid.uuid4().hex[:10]}"
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        snap = Snapshot(final, self.backend, kind, self.memory_mib, self.vcpus, self.image, parent=self.base)
        if was_running:
            self.resume()
        return snap

    def restore(self, snapshot: Snapshot, timeout: float = 60.0, cow: bool = True) -> None:
        """Replace this sandbox's state (memory, processes, disk) by ``snapshot``'s, in place
        (``cow`` as in :meth:`from_snapshot`).

        Raises:
            SandboxStateError: this sandbox is destroyed or the snapshot deleted. SandboxError:
            the snapshot comes from the other backend or a VM of another shape (memory_mib,
            vcpus). TypeError/ValueError: ``snapshot`` not a Snapshot, ``timeout`` not a number in
            (0, 1e8] s. All checked before this sandbox's state is touched.
        """
        _check_snapshot(snapshot)
        _check_timeout("timeout", timeout)
        if self.state == "destroyed":
            raise SandboxStateError(f"sandbox {self.id} is destroyed (restore)")
        if snapshot.deleted:
            raise SandboxStateError(f"snapshot {snapshot.path} was deleted")
        if snapshot.backend != self.backend:
            raise SandboxError(f"snapshot {snapshot.path.name} is a {snapshot.backend} snapshot; sandbox"
                               f" {self.id} runs on {self.backend} (use Sandbox.from_snapshot)")
        if (snapshot.memory_mib, snapshot.vcpus) != (self.memory_mib, self.vcpus):
            raise SandboxError(f"snapshot {snapshot.path.name} is of a VM with memory_mib={snapshot.memory_mib},"
                               f" vcpus={snapshot.vcpus}; sandbox {self.id} has memory_mib={self.memory_mib},"
                               f" vcpus={self.vcpus} (use Sandbox.from_snapshot)")
        snapshot._acquire()  # hold it while the old state goes
        try:
            self.vm.kill()
            self.vm.clear()
            old, self.base = self.base, None
            if old is not None:
                old._release()
            self._start_from(snapshot, timeout, cow)
        finally:
            snapshot._release()

    def fork(self, n: int = 1, cow: bool = True) -> list["Sandbox"]:
        """``n`` new running sandboxes from this one's exact running state.

        Each child maps a snapshot's memory copy-on-write and writes a disk of its own (a qcow2
        overlay; a raw copy on firecracker): its writes never reach the parent or its siblings.
        The parent keeps running (it is paused only while its state is saved). The internal
        snapshot goes when the last child is destroyed. ``cow``: as in :meth:`from_snapshot`.

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
        self._control(self.vm.hibernate)
        self.state = "hibernated"

    def wake(self, timeout: float = 60.0) -> None:
        """Start a hibernated sandbox again, running, exactly where it stopped.

        Raises:
            SandboxStateError: not hibernated. TypeError/ValueError: ``timeout`` not a number in (0, 1e8] s
            (before anything starts). SandboxCrashed / SandboxTimeout: as in :meth:`create`.
        """
        self._need("hibernated")
        _check_timeout("timeout", timeout)
        self._start(self.vm.wake, timeout)

    def destroy(self) -> None:
        """Kill the VM, delete every file of this sandbox, release its snapshots. Idempotent.

        Works in every state, unhealthy included. Called from another thread while a call
        (:meth:`exec`, a file transfer) is in flight, it kills the VM process first, waits up to
        10 s for that call to end (it raises SandboxStateError: "sandbox ... was destroyed
        during exec '...'"), then cleans up."""
        if self.state == "destroyed":
            return
        self._destroying = True
        if self.vm is not None and not self._call_done.is_set():
            # The channel stays open until the call has seen the VM's end: closing its descriptor
            # under a select() in another thread could hand the number to an unrelated file.
            pid = self.vm.pid
            if pid is not None and self.vm.poll() is None:
                os.kill(pid, signal.SIGKILL)
            self._call_done.wait(10.0)
        if self.vm is not None:
            self.vm.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.base is not None:
            self.base._release()
            self.base = None
        self.state = "destroyed"
        self._destroying = False
        _live.discard(self)

    # ---- introspection ------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Host process ids of this sandbox (the VM process), empty when hibernated/destroyed."""
        pid = self.vm.pid
        return [pid] if pid is not None and self.vm.poll() is None else []

    def memory(self) -> dict[str, int]:
        """Host memory of this sandbox in KiB.

        Returns:
            dict: ``rss`` and ``pss`` of the VM process (/proc/<pid>/smaps_rollup; PSS splits
            shared pages among their sharers); ``ram_mapped``: resident pages of the mapping of
            the guest-memory file (0 for anonymous memory: a freshly booted firecracker guest);
            ``ram_file_cache``: page-cache pages of the sandbox's *own* memory file that the
            process has not mapped (0 when its memory file belongs to a snapshot; a hibernated
            sandbox's evicted file counts what is still cached); ``total`` = ``pss`` +
            ``ram_file_cache``.
        """
        out = {"rss": 0, "pss": 0, "ram_mapped": 0, "ram_file_cache": 0, "total": 0}
        mapped, own = self.vm.memory_files() if self.state != "destroyed" else (None, None)
        for pid in self.pids():
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    key = line.split(":")[0]
                    if key in ("Rss", "Pss"):
                        out[key.lower()] += int(line.split()[1])
            if mapped is not None:
                out["ram_mapped"] = mapping_rss_kib(pid, mapped)
        if own is not None and own.is_file():
            out["ram_file_cache"] = max(0, resident_kib(own) - out["ram_mapped"])
        out["total"] = out["pss"] + out["ram_file_cache"]
        return out

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"Sandbox({self.id}, {self.backend}, {self.state})"


def _check_int(name: str, n) -> None:
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}")


def _check_guest_path(path) -> None:
    if not isinstance(path, str):
        raise TypeError(f"path must be a str, got {type(path).__name__}")
    # The guest's shell would drop the NUL and use another file.
    if "\0" in path:
        raise ValueError(f"path must not contain a NUL character, got {path!r}")


def _check_timeout(name: str, t) -> None:
    """TypeError/ValueError unless ``t`` is a number of seconds in (0, MAX_TIMEOUT_S]: checked before a VM
    starts or a sandbox's state is touched (a NaN one left a QEMU running, 0 a sandbox that could not wake)."""
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {t!r}")
    if not 0 < t <= MAX_TIMEOUT_S:
        raise ValueError(f"{name} must be > 0 and <= {MAX_TIMEOUT_S:g} seconds, got {t}")


def _check_snapshot(snapshot) -> None:
    if not isinstance(snapshot, Snapshot):
        raise TypeError(f"snapshot must be a Snapshot (from Sandbox.snapshot), got {type(snapshot).__name__}")


def _check_vm_shape(memory_mib: int, vcpus: int) -> None:
    """TypeError/ValueError unless memory_mib is an int in [64, 65536] and vcpus an int in [1, 64]."""
    _check_int("memory_mib", memory_mib)
    _check_int("vcpus", vcpus)
    if not 64 <= memory_mib <= 65536:
        raise ValueError(f"memory_mib must be in [64, 65536] MiB, got {memory_mib}")
    if not 1 <= vcpus <= 64:
        raise ValueError(f"vcpus must be in [1, 64], got {vcpus}")


def _check_backend_name(backend) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None (detect), 'qemu' or 'firecracker', got {backend!r}")


def _pick_backend(backend: str | None, host: HostInfo) -> str:
    """The backend to use: ``host.backend`` for None; "firecracker" only where the host has it; "qemu"
    only with qemu-system-x86_64 and qemu-img on PATH (without them it failed on a bare
    FileNotFoundError for qemu-img)."""
    if backend == "firecracker" and host.backend != "firecracker":
        raise SandboxError("backend='firecracker' needs a firecracker binary ($K3LAB_FIRECRACKER or"
                           " PATH), real KVM and a guest kernel in $K3LAB_FIRECRACKER_KERNEL; this"
                           f" host: {host.reason}")
    name = backend or host.backend
    if name == "qemu" and (host.qemu is None or shutil.which("qemu-img") is None):
        raise SandboxError("the qemu backend needs qemu-system-x86_64 and qemu-img on PATH (`python -m"
                           f" k3lab.agentenv.sysdeps` installs them); this host: {host.reason}")
    return name


class SandboxPool:
    """Many sandboxes from one booted base: the pool cold-boots once, snapshots the fresh guest,
    and every :meth:`create` is a copy-on-write restore of that snapshot (~0.4 s under TCG
    instead of ~5 s).

    Args:
        image (Image | None), memory_mib (int), vcpus (int), root, backend (str | None): as
            :meth:`Sandbox.create` (members of a given ``base`` run on the base's backend).
        cow (bool): as in :meth:`Sandbox.from_snapshot` (True: members share the base's RAM pages).
        base (Snapshot | None): start members from this snapshot instead of booting a guest; the
            pool takes over the handle (``close`` deletes it).

    Raises:
        TypeError, ValueError: ``memory_mib``, ``vcpus`` or ``backend`` as in :meth:`Sandbox.create`,
            checked here rather than at the first boot.
    """

    def __init__(self, image: Image | None = None, memory_mib: int = 128, vcpus: int = 1,
                 root: str | os.PathLike | None = None, cow: bool = True,
                 base: Snapshot | None = None, backend: str | None = None) -> None:
        _check_vm_shape(memory_mib, vcpus)
        _check_backend_name(backend)
        self.image, self.memory_mib, self.vcpus, self.cow = image, memory_mib, vcpus, cow
        self.backend = backend
        if base is not None and root is None:
            root = base.path.parent.parent
        self.root = Path(root) if root else default_root()
        self.sandboxes: list[Sandbox] = []
        self._base: Snapshot | None = base

    @property
    def base(self) -> Snapshot:
        """The snapshot of a freshly booted guest (boots it on first use)."""
        if self._base is None or self._base.deleted:
            with Sandbox.create(self.image, self.memory_mib, self.vcpus, root=self.root,
                                backend=self.backend) as sb:
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
