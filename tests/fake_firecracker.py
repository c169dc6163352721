#!/usr/bin/env python3
"""A fake ``firecracker`` executable for CI (no KVM here): Firecracker's API subset on
``--api-sock`` and a stand-in guest whose agent serves the serial console on stdin/stdout.

It exercises the HOST-SIDE control path of :mod:`k3lab.agentenv.fcvm` (which API calls, in which
state, with which paths; snapshot files; the serial console on the process's pipes; the agent
protocol). There is no VM, no guest kernel and no isolation: the "guest" is a folder on the host
and its commands run on the host. Standard library only.

API, validated the way Firecracker does (errors answer 400 ``{"fault_message": ...}``):

- States: "Not started" -> (``PUT /actions`` InstanceStart | ``PUT /snapshot/load``) ->
  "Running" <-> "Paused" (``PATCH /vm``).
- ``/machine-config``, ``/boot-source``, ``/drives/{id}`` only before the start; the kernel,
  initrd and drive files must exist when configured. Relative paths resolve against the working
  directory.
- ``/snapshot/create`` only while Paused; ``Diff`` only with dirty-page tracking.
- ``/snapshot/load`` only on a fresh process with nothing configured; unknown body fields are
  refused; the memory backend must be a ``File`` of the recorded size; the recorded drive paths
  must exist (resolved against the working directory). A failed load ends the process, as
  Firecracker does.
- ``--log-path`` must name an existing file; the log goes there, nothing but the serial console
  goes to stdout.

Guest model: a private folder ``.fake-fc-*/guest`` in the working directory is the guest's file
namespace (guest path ``/a/b`` is ``<guest>/a/b``). The drive file is a tar of every guest file
except ``/tmp`` (its disk), read at start and rewritten after every agent request (writes reach
the disk at once); ``/tmp`` lives in memory only. Guest memory is a tar of the whole folder: a
memory file is ``mem_size_mib`` MiB with ``MAGIC``, the tar's length and the tar at offset 0 (the
rest a hole); a Diff memory file holds only the 4 KiB pages that changed since the last snapshot
or load.

Serial console and agent: as Firecracker's UART, stdin is the guest's input and stdout its output,
made non-blocking, and output that a full pipe refuses is lost (counted in the log), so a host
that lets more than a pipe's worth pile up loses data here too. Shortly after boot the guest
prints some boot noise and ``\n@K3READY\n``; after a load it prints nothing (its agent carries
on). The agent speaks k3lab's protocol (:mod:`k3lab.agentenv.agent`: ping / exec / write / read,
payloads and replies in acknowledged chunks, md5 sums, the end-of-command marker): ``exec`` runs
the script with ``sh`` on the host with the guest folder as working directory and ``$GUEST_ROOT``
set (so tests use guest-relative paths in commands), with stdout and stderr in files of its own,
and kills the command's process group when it returns unless asked to keep background processes,
and at its timeout. The uid argument is ignored (everything runs as the test's user) and
``limits`` only records the values (it reports the "rlimit" mechanism and enforces nothing). A
paused guest answers nothing until resumed.

Every API request is appended to ``<api-sock>.requests.jsonl`` as ``[method, path, body]``.
"""
from __future__ import annotations

import base64
import ctypes
import hashlib
import io
import json
import os
import signal
import socketserver
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler

PAGE = 4096
MAGIC = b"FAKEMEM1"
#: the agent protocol's chunk size (k3lab.agentenv.agent.CHUNK).
CHUNK = 32768
BOOT_DELAY_S = 0.05
BOOT_NOISE = b"[    0.000000] Linux version 6.1.0-fake\r\nk3init: insmod virtio_console failed\r\n"
PRE_BOOT = ("/machine-config", "/boot-source")


class Fault(Exception):
    """An API error: 400 with this fault_message."""


class LoadFailed(Fault):
    """A snapshot load that failed after it began: Firecracker ends the process."""


def resolve(path: str) -> str:
    """A host path as Firecracker opens it: relative to the working directory."""
    return os.path.abspath(path)


def _pdeathsig() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


class Guest:
    """The stand-in guest: files in a folder, an agent on the serial console (stdin/stdout)."""

    def __init__(self, log) -> None:
        self.priv = tempfile.mkdtemp(prefix=".fake-fc-", dir=os.getcwd())
        self.root = os.path.join(self.priv, "guest")
        os.mkdir(self.root)
        self.drive: str | None = None
        self.running = threading.Event()
        self.lock = threading.Lock()
        self.baseline: bytes | None = None
        self.log = log
        self.next: bytes | None = None
        self.limits = ["256", "65536"]
        os.set_blocking(1, False)

    # -- files -----------------------------------------------------------------------------------
    def path(self, guest_path: str) -> str:
        p = os.path.normpath(os.path.join(self.root, guest_path.lstrip("/")))
        if p != self.root and not p.startswith(self.root + os.sep):
            raise PermissionError(f"{guest_path}: outside the guest")
        return p

    def _tar(self, with_tmp: bool) -> bytes:
        buf = io.BytesIO()

        def keep(info):
            return None if not with_tmp and (info.name == "./tmp" or info.name.startswith("./tmp/")) else info

        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.add(self.root, arcname=".", filter=keep)
        return buf.getvalue()

    def _untar(self, data: bytes) -> None:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            tar.extractall(self.root, filter="tar")

    def boot_from_drive(self) -> None:
        with open(self.drive, "rb") as f:
            data = f.read()
        if data:
            self._untar(data)
        os.makedirs(self.path("/tmp"), exist_ok=True)

    def sync_disk(self) -> None:
        with open(self.drive, "r+b") as f:
            data = self._tar(with_tmp=False)
            f.write(data)
            f.truncate(len(data))

    # -- memory ----------------------------------------------------------------------------------
    def memory_blob(self) -> bytes:
        tar = self._tar(with_tmp=True)
        return MAGIC + len(tar).to_bytes(8, "little") + tar

    def write_memory(self, path: str, size: int, diff: bool) -> None:
        blob = self.memory_blob()
        if len(blob) > size:
            raise Fault("guest memory image larger than mem_size_mib")
        with open(path, "wb") as f:
            f.truncate(size)
            if not diff or self.baseline is None:
                f.write(blob)
            else:
                old = self.baseline
                for i in range(0, max(len(blob), len(old)), PAGE):
                    page = blob[i:i + PAGE].ljust(PAGE, b"\0")
                    if page != old[i:i + PAGE].ljust(PAGE, b"\0"):
                        f.seek(i)
                        f.write(page)
        self.baseline = blob

    def load_memory(self, path: str) -> None:
        with open(path, "rb") as f:
            head = f.read(16)
            if head[:8] != MAGIC:
                raise LoadFailed(f"{path} is not a full memory file (a Diff must be merged first)")
            blob = head + f.read(int.from_bytes(head[8:], "little"))
        try:
            self._untar(blob[16:])
        except tarfile.TarError as e:
            raise LoadFailed(f"{path}: corrupt guest memory ({e})") from None
        self.baseline = blob

    # -- the serial console and the agent --------------------------------------------------------
    def serial_out(self, data: bytes) -> None:
        """Guest output to stdout; what a full pipe refuses is lost, as Firecracker's UART loses it."""
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(1, view):]
            except BlockingIOError:
                self.log.write(f"serial: {len(view)} bytes lost (stdout full)\n")
                return

    def start_agent(self, boot: bool) -> None:
        threading.Thread(target=self._agent, args=(boot,), daemon=True).start()

    def _agent(self, boot: bool) -> None:
        inp = sys.stdin.buffer
        if boot:
            time.sleep(BOOT_DELAY_S)
            self.running.wait()
            self.serial_out(BOOT_NOISE + b"\n@K3READY\n")
        while True:
            line, self.next = self.next or inp.readline(), None
            if not line:
                return
            words = line.decode(errors="replace").split()
            if len(words) < 4:
                continue
            rid, op, n, md5, *args = words
            payload = self._recv(inp, rid, int(n))
            self.running.wait()
            with self.lock:
                rc, out, err, timed_out, got = self._op(op, args, payload, md5)
            if op == "exec":
                self.serial_out(f"\n@K3D {rid}\n".encode())
            self._reply(inp, rid, rc, timed_out, got, out, err)

    def _recv(self, inp, rid: str, n: int) -> bytes:
        data = b""
        while len(data) < n:
            if data:
                self.running.wait()
                self.serial_out(f"\n@K3A {rid}\n".encode())
            data += inp.read(min(CHUNK, n - len(data)))
        return data

    def _reply(self, inp, rid: str, rc: int, timed_out: bool, got: str, out: bytes, err: bytes) -> None:
        sums = " ".join(hashlib.md5(b).hexdigest() for b in (out, err))
        self.serial_out(f"\n@K3 {rid} {rc} {int(timed_out)} {got} {sums}\n".encode())
        body = base64.b64encode(out) + b"\n" + base64.b64encode(err)
        for i in range(0, len(body) + 1, CHUNK):
            part = body[i:i + CHUNK]
            if len(part) < CHUNK:
                self.serial_out(part + f"\n@K3END {rid}\n".encode())
                return
            self.serial_out(part + f"\n@K3C {rid}\n".encode())
            line = inp.readline()
            if line.split() != [rid.encode(), b"ack"]:
                self.next = line  # the host gave up on this reply: that is its next request
                return

    def _op(self, op: str, args: list[str], payload: bytes, md5: str) -> tuple[int, bytes, bytes, bool, str]:
        if op == "ping":
            return 0, b"", b"", False, "-"
        if op == "exec":
            got = hashlib.md5(payload).hexdigest()
            if got != md5:
                return 1, b"", b"fake agent: the command arrived damaged", False, got
            result = *self._exec(payload, float(args[0]), args[2] == "1"), got
        elif op in ("write", "read"):
            path = base64.b64decode(args[0]).decode()
            try:
                if op == "read":
                    with open(self.path(path), "rb") as fh:
                        return 0, fh.read(), b"", False, "-"
                with open(self.path(path), "wb") as fh:
                    fh.write(payload)
                os.chmod(self.path(path), int(args[1], 8))
                with open(self.path(path), "rb") as fh:
                    result = 0, b"", b"", False, hashlib.md5(fh.read()).hexdigest()
            except OSError as e:
                result = 1, b"", f"{op} {path}: {e.strerror}".encode(), False, "-"
        elif op == "limits":
            self.limits = [new if new != "-" else old for new, old in zip(args, self.limits)]
            return 0, f"rlimit {self.limits[0]} {self.limits[1]} -".encode(), b"", False, "-"
        else:
            return 2, b"", f"unknown op {op}".encode(), False, "-"
        self.sync_disk()
        return result

    def _exec(self, script: bytes, timeout: float, keep: bool) -> tuple[int, bytes, bytes, bool]:
        # Files of this command's own: what it leaves running never writes into a later one's.
        cmd, out, err = (os.path.join(self.priv, n) for n in ("cmd", "o", "e"))
        for name in (out, err):
            if os.path.exists(name):
                os.unlink(name)
        with open(cmd, "wb") as fc:
            fc.write(script)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.path("/root"),
               "GUEST_ROOT": self.root}
        with open(out, "wb") as fo, open(err, "wb") as fe:
            p = subprocess.Popen(["/bin/sh", cmd], cwd=self.root, env=env, stdin=subprocess.DEVNULL,
                                 stdout=fo, stderr=fe, start_new_session=True, preexec_fn=_pdeathsig)
        timed_out = False
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        if timed_out or not keep:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if timed_out:
            p.wait()
            rc = 137
        elif rc < 0:
            rc = 128 - rc
        with open(out, "rb") as fo, open(err, "rb") as fe:
            return rc, fo.read(), fe.read(), timed_out


class VMM:
    """The API state machine."""

    def __init__(self, log) -> None:
        self.state = "Not started"
        self.configured = False
        self.machine = {"vcpu_count": 1, "mem_size_mib": 128, "smt": False, "track_dirty_pages": False}
        self.boot_source: dict | None = None
        self.drives: dict[str, dict] = {}
        self.guest = Guest(log)

    def handle(self, method: str, path: str, body) -> dict | None:
        if method in ("PUT", "PATCH") and not isinstance(body, dict):
            raise Fault("the request needs a JSON object body")
        if method == "GET" and path == "/":
            return {"id": "anonymous-instance", "state": self.state, "vmm_version": "1.9.0-fake",
                    "app_name": "Firecracker"}
        if method == "PATCH" and path == "/vm":
            return self._patch_vm(body)
        if method == "PUT" and (path in PRE_BOOT or path.startswith("/drives/")):
            return self._configure(path, body)
        if method == "PUT" and path == "/actions":
            return self._start(body)
        if method == "PUT" and path == "/snapshot/create":
            return self._create(body)
        if method == "PUT" and path == "/snapshot/load":
            return self._load(body)
        raise Fault(f"Invalid request method and/or path: {method} {path}")

    def _patch_vm(self, body) -> None:
        if self.state == "Not started":
            raise Fault("The requested operation is not supported before starting the microVM.")
        if body not in ({"state": "Paused"}, {"state": "Resumed"}):
            raise Fault(f"Invalid VM state: {body}")
        if body["state"] == "Paused":
            with self.guest.lock:
                self.guest.running.clear()
            self.state = "Paused"
        else:
            self.state = "Running"
            self.guest.running.set()

    def _configure(self, path: str, body) -> None:
        if self.state != "Not started":
            raise Fault("The update operation is not allowed after boot.")
        if not isinstance(body, dict):
            raise Fault("missing body")
        if path == "/machine-config":
            if not 1 <= body.get("vcpu_count", 0) <= 32 or body.get("mem_size_mib", 0) < 1:
                raise Fault(f"Invalid machine configuration: {body}")
            self.machine.update(body)
        elif path == "/boot-source":
            for key in ("kernel_image_path", "initrd_path"):
                if key in body and not os.path.isfile(resolve(body[key])):
                    raise Fault(f"The {key} file cannot be opened: {body[key]}")
            if "kernel_image_path" not in body:
                raise Fault("missing kernel_image_path")
            self.boot_source = body
        else:
            drive_id = path.split("/", 2)[2]
            if body.get("drive_id") != drive_id:
                raise Fault("The id from the path does not match the id from the body")
            if not os.path.isfile(resolve(body.get("path_on_host", ""))):
                raise Fault(f"Unable to open the block device backing file {body.get('path_on_host')}:"
                            " No such file or directory")
            self.drives[drive_id] = body
        self.configured = True

    def _start(self, body) -> None:
        if body != {"action_type": "InstanceStart"} or self.state != "Not started":
            raise Fault("The requested operation is not supported after starting the microVM.")
        if self.boot_source is None:
            raise Fault("Cannot start microvm without kernel configuration.")
        roots = [d for d in self.drives.values() if d.get("is_root_device")]
        if len(roots) != 1:
            raise Fault("Cannot start microvm without exactly one root block device.")
        self.guest.drive = resolve(roots[0]["path_on_host"])
        self.guest.boot_from_drive()
        self.state = "Running"
        self.guest.running.set()
        self.guest.start_agent(boot=True)

    def _create(self, body) -> None:
        if self.state != "Paused":
            raise Fault("Create snapshot error: the microVM must be paused")
        extra = set(body) - {"snapshot_type", "snapshot_path", "mem_file_path"}
        if extra or not body.get("snapshot_path") or not body.get("mem_file_path"):
            raise Fault(f"Invalid snapshot request: {body}")
        diff = body.get("snapshot_type", "Full") == "Diff"
        if diff and not self.machine["track_dirty_pages"]:
            raise Fault("Diff snapshots are not allowed on uVMs with dirty page tracking disabled.")
        self.guest.sync_disk()
        state = {"fake_firecracker_vmstate": 1, "machine_config": self.machine,
                 "boot_source": self.boot_source, "drives": self.drives}
        with open(resolve(body["snapshot_path"]), "w") as f:
            json.dump(state, f)
        self.guest.write_memory(resolve(body["mem_file_path"]), self.machine["mem_size_mib"] << 20, diff)

    def _load(self, body) -> None:
        if self.state != "Not started" or self.configured:
            raise Fault("Loading a microVM snapshot not allowed after configuring boot-specific resources.")
        allowed = {"snapshot_path", "mem_file_path", "mem_backend", "track_dirty_pages",
                   "enable_diff_snapshots", "resume_vm"}
        if set(body) - allowed:
            raise Fault(f"unknown field(s) {sorted(set(body) - allowed)}")
        if ("mem_file_path" in body) == ("mem_backend" in body):
            raise Fault("exactly one of mem_file_path and mem_backend is required")
        backend = body.get("mem_backend") or {"backend_type": "File", "backend_path": body["mem_file_path"]}
        if backend.get("backend_type") != "File":
            raise Fault(f"this fake supports the File memory backend only, got {backend}")
        try:
            with open(resolve(body["snapshot_path"])) as f:
                state = json.load(f)
            assert state["fake_firecracker_vmstate"] == 1
        except (OSError, ValueError, KeyError, AssertionError) as e:
            raise LoadFailed(f"Load snapshot error: cannot read the microVM state: {e}") from None
        mem = resolve(backend["backend_path"])
        size = state["machine_config"]["mem_size_mib"] << 20
        if not os.path.isfile(mem) or os.path.getsize(mem) != size:
            raise LoadFailed(f"Load snapshot error: memory file {mem} missing or not {size} bytes")
        roots = [d for d in state["drives"].values() if d.get("is_root_device")]
        for d in state["drives"].values():
            if not os.path.isfile(resolve(d["path_on_host"])):
                raise LoadFailed(f"Load snapshot error: Block: backing file {d['path_on_host']}:"
                                 " No such file or directory")
        tracking = bool(body.get("track_dirty_pages") or body.get("enable_diff_snapshots"))
        self.machine = dict(state["machine_config"], track_dirty_pages=tracking)
        self.boot_source, self.drives = state["boot_source"], state["drives"]
        self.guest.drive = resolve(roots[0]["path_on_host"])
        self.guest.load_memory(mem)
        self.state = "Paused"
        if body.get("resume_vm"):
            self.state = "Running"
            self.guest.running.set()
        self.guest.start_agent(boot=False)


def main() -> None:
    sock = sys.argv[sys.argv.index("--api-sock") + 1]
    requests = open(sock + ".requests.jsonl", "a", buffering=1)
    log_path = sys.argv[sys.argv.index("--log-path") + 1] if "--log-path" in sys.argv else None
    if log_path is None or not os.path.isfile(log_path):
        sys.exit(f"fake firecracker: --log-path must name an existing file, got {log_path!r}")
    log = open(log_path, "a", buffering=1)
    log.write("Running Firecracker v1.9.0-fake\n")
    vmm = VMM(log)
    api_lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _reply(self, code: int, body=None) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(code)
            if data:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self) -> None:
            n = int(self.headers.get("Content-Length", 0))
            try:
                body = json.loads(self.rfile.read(n)) if n else None
            except ValueError:
                return self._reply(400, {"fault_message": "invalid JSON body"})
            requests.write(json.dumps([self.command, self.path, body]) + "\n")
            with api_lock:
                try:
                    out = vmm.handle(self.command, self.path, body)
                except Fault as e:
                    self._reply(400, {"fault_message": str(e)})
                    if isinstance(e, LoadFailed):
                        self.wfile.flush()
                        os._exit(1)  # Firecracker ends the process after a failed load
                    return
            self._reply(200 if out is not None else 204, out)

        do_GET = do_PUT = do_PATCH = _handle

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    Server(sock, Handler).serve_forever()


if __name__ == "__main__":
    main()
