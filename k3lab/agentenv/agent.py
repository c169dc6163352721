"""Host side of the guest agent protocol (the guest side is ``image.AGENT_SH``).

The channel is a byte stream to a tty in the guest: QEMU's virtio console ``/dev/hvc0`` (a unix
socket on the host, :meth:`AgentChannel.connect_unix`) or the serial port ``/dev/ttyS0``
(Firecracker's only console, wired to the firecracker process's stdin/stdout,
:meth:`AgentChannel.from_pipes`). One request at a time:

- request: ``"<id> <op> <n> <md5> <args...>\\n"`` then ``n`` raw payload bytes, ``md5`` their
  md5 (``-`` without a payload). ``ping``; ``exec`` (payload: the script; args: the timeout in
  seconds, the uid to run as (0 or :data:`USER_UID`), 1 to keep background processes else 0);
  ``write`` (payload: the file; args: base64 path, octal mode, owner uid); ``read`` (args: base64
  path); ``limits`` (args: the process limit and the memory limit in KiB, ``-`` to keep one;
  stdout: ``"<cgroup|rlimit> <pids> <memory KiB> <memory in use KiB or ->"``). The payload goes
  in chunks of :data:`CHUNK` bytes; after each chunk but the last the host waits for the guest's
  ``"\\n@K3A <id>\\n"`` (it has read the chunk).
- exec only: ``"\\n@K3D <id>\\n"`` as soon as the command has ended or been killed, before the
  reply is built: the host's proof that the agent is alive (its deadline is the command's timeout
  plus a grace period; the reply then has :data:`IDLE_S` per chunk).
- reply: ``"\\n@K3 <id> <rc> <timed_out> <md5_in> <md5_out> <md5_err>\\n"``, then
  ``base64(stdout) "\\n" base64(stderr)`` in chunks of :data:`CHUNK` bytes: a chunk that ends with
  ``"\\n@K3C <id>\\n"`` is followed by more once the host answers ``"<id> ack\\n"``; the last ends
  with ``"\\n@K3END <id>\\n"``. ``md5_in`` is the md5 of the payload as the guest received it
  (exec) or of the file it wrote (write); ``-`` otherwise; ``!`` when the guest could not build
  the reply (the output filled the command's output space, or does not fit in the guest's
  ``/run``): stderr says why and the host raises.

Why the flow control: neither hypervisor buffers a console. QEMU's ``virtconsole`` drops guest
output that the host socket cannot take at once (``hw/char/virtio-console.c``, ``flush_buf``:
console ports are never throttled, the unwritten rest of a short write is lost); Firecracker's
serial writes to a non-blocking stdout and loses the bytes a full pipe refuses (firecracker PRs
#2381, #2461); and a guest UART's receive side drops bytes once the tty's buffers are full. A host
that is descheduled on a loaded box for a moment was enough to lose the middle of a 150 KB read.
With at most one chunk (32 KiB) in flight each way, below the 64 KiB pipe, the ~200 KiB socket
buffer and the guest tty's buffers, no buffer overflows however slowly either side reads. The md5
sums end to end and the exact chunk lengths turn any damage that remains into an
:class:`AgentCorrupt` error rather than wrong data.

Markers start with ``"\\n@"``, which base64 never contains, so the parser skips anything else on
the channel: console noise, or a stale reply to a request the host gave up on (the guest drops a
half-sent reply when the next request arrives instead of an ack).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import select
import socket
import time
from dataclasses import dataclass

#: payload and reply chunk size in bytes (the most either side has in flight).
CHUNK = 32768
#: bytes of the most recent channel traffic kept for crash reports (a serial port is also the
#: guest's kernel console).
RECENT = 8192
#: uid of the guest's unprivileged user ("user", home /home/user) that commands run as by default.
USER_UID = 1000
#: seconds a reply may stall between two chunks once the guest has started it.
IDLE_S = 60.0

_HEADER = re.compile(rb"\n@K3 (\d+) (-?\d+) ([01]) (\S+) (\S+) (\S+)\n")
_READY = b"\n@K3READY\n"


class AgentError(RuntimeError):
    """The agent channel failed or did not answer in time."""


class AgentClosed(AgentError):
    """The channel reached EOF (the VM process is gone)."""


class AgentTimeout(AgentError):
    """No reply before the host-side deadline (the guest is hung or far too slow).

    Attributes:
        ended (bool): the guest had said the command ended (``@K3D``) and then stalled in its reply.
    """

    ended = False


class AgentCorrupt(AgentError):
    """A transfer arrived damaged: a checksum or chunk length does not match."""


@dataclass(frozen=True)
class ExecResult:
    """Result of :meth:`Sandbox.exec`.

    Attributes:
        exit_code (int): the command's exit status; 137 when SIGKILLed (the timeout, or the OOM
            killer at the sandbox's memory limit: stderr then ends with the agent's note saying so).
        stdout (bytes), stderr (bytes): everything the command wrote until it returned.
        timed_out (bool): the guest-side timeout fired and SIGKILLed the command's whole tree.
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        return self.stdout.decode(errors="replace")


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


class AgentChannel:
    """A byte stream to the guest agent (see the module docstring for the protocol).

    Args:
        rfd (int), wfd (int): file descriptors to read from and write to (the same for a socket);
            made non-blocking.
        owned (tuple): objects closed by :meth:`close` (the socket, or the two pipes).

    Attributes:
        recent (bytearray): the last :data:`RECENT` bytes received.
    """

    def __init__(self, rfd: int, wfd: int, owned: tuple = ()) -> None:
        self.rfd, self.wfd, self._owned = rfd, wfd, owned
        for fd in {rfd, wfd}:
            os.set_blocking(fd, False)
        self.buf = b""
        self.next_id = 1
        self.recent = bytearray()
        self._broken: str | None = None

    @classmethod
    def from_socket(cls, sock: socket.socket) -> "AgentChannel":
        return cls(sock.fileno(), sock.fileno(), (sock,))

    @classmethod
    def from_pipes(cls, stdout, stdin) -> "AgentChannel":
        """The serial console of a VM process: its ``stdout`` to read, its ``stdin`` to write."""
        return cls(stdout.fileno(), stdin.fileno(), (stdout, stdin))

    @classmethod
    def connect_unix(cls, path: str, deadline: float) -> "AgentChannel":
        """Connect to a unix socket, retrying until it exists or ``deadline`` (time.monotonic)."""
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                return cls.from_socket(s)
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if time.monotonic() > deadline:
                    raise AgentTimeout(f"agent socket {path} did not appear") from None
                time.sleep(0.002)

    def close(self) -> None:
        for obj in self._owned:
            try:
                obj.close()
            except OSError:
                pass
        self._owned = ()
        self.rfd = self.wfd = -1

    def _recv(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.rfd], [], [], left)[0]:
            raise AgentTimeout("no reply from the guest agent before the deadline")
        try:
            data = os.read(self.rfd, 1 << 20)
        except BlockingIOError:
            return
        except OSError as e:
            raise AgentClosed(f"agent channel error: {e}") from e
        if not data:
            raise AgentClosed("agent channel closed (EOF)")
        self.buf += data
        self.recent += data
        del self.recent[:-RECENT]

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [self.wfd], [], left)[1]:
                raise AgentTimeout("the guest agent took no input before the deadline")
            try:
                view = view[os.write(self.wfd, view):]
            except BlockingIOError:
                continue
            except OSError as e:
                raise AgentClosed(f"agent channel error on send: {e}") from e

    def wait_for(self, marker: bytes, deadline: float) -> None:
        """Read until ``marker`` appears (e.g. the boot banner ``@K3READY``); drop what precedes it."""
        while (i := self.buf.find(marker)) < 0:
            self._recv(deadline)
        self.buf = self.buf[i + len(marker):]

    def _more(self, rid: int, op: str, deadline: float) -> None:
        """Read more of the reply to ``rid``; a restart banner in between means it is lost."""
        if _READY in self.buf:
            # k3init restarts a dead agent, which announces itself: the request is lost.
            self.buf = self.buf.split(_READY)[-1]
            raise AgentError(f"the guest agent restarted during request {rid} ({op}): the"
                             " command killed it or its shell; its result is lost")
        self._recv(deadline)

    def _payload(self, rid: int, op: str, line: bytes, payload: bytes, deadline: float) -> None:
        ack = f"\n@K3A {rid}\n".encode()
        try:
            self._send(line + payload[:CHUNK], deadline)
            for i in range(CHUNK, len(payload), CHUNK):
                while (j := self.buf.find(ack)) < 0:
                    self._more(rid, op, deadline)
                self.buf = self.buf[j + len(ack):]
                self._send(payload[i:i + CHUNK], deadline)
        except AgentTimeout:
            # The guest still expects the rest of the payload: later requests would be read as it.
            self._broken = (f"request {rid} ({op}) was cut off inside its payload; the agent channel"
                            " is out of step (restore or destroy the sandbox)")
            raise

    def _reply(self, rid: int, op: str, deadline: float, idle_s: float | None) -> tuple[re.Match, bytes]:
        """Read the reply to ``rid``. With ``idle_s`` (exec) the guest's end-of-command marker
        counts as its answer by ``deadline``; from then on each piece has ``idle_s`` seconds."""
        done = f"\n@K3D {rid}\n".encode()
        ended = False

        def more() -> None:
            nonlocal deadline
            try:
                self._more(rid, op, deadline)
            except AgentTimeout as e:
                e.ended = ended
                raise
            if ended:
                deadline = time.monotonic() + idle_s

        while (m := _HEADER.search(self.buf)) is None or int(m.group(1)) != rid:
            if m is not None:
                # A reply to an earlier request that timed out on the host: skip it.
                self.buf = self.buf[m.end():]
                continue
            if idle_s is not None and not ended and (i := self.buf.find(done)) >= 0:
                self.buf = self.buf[i + len(done):]
                ended, deadline = True, time.monotonic() + idle_s
                continue
            more()
        ended = ended or idle_s is not None
        if ended:
            deadline = time.monotonic() + idle_s
        self.buf = self.buf[m.end():]
        more_mark, end = f"\n@K3C {rid}\n".encode(), f"\n@K3END {rid}\n".encode()
        parts = []
        while True:
            i, j = self.buf.find(more_mark), self.buf.find(end)
            if i >= 0 and (j < 0 or i < j):
                part, self.buf = self.buf[:i], self.buf[i + len(more_mark):]
                if len(part) != CHUNK:
                    raise AgentCorrupt(f"reply to request {rid} ({op}): a chunk of {len(part)} bytes,"
                                       f" expected {CHUNK}: bytes were lost on the way")
                parts.append(part)
                self._send(f"{rid} ack\n".encode(), deadline)
            elif j >= 0:
                part, self.buf = self.buf[:j], self.buf[j + len(end):]
                if len(part) > CHUNK:
                    raise AgentCorrupt(f"reply to request {rid} ({op}): a last chunk of {len(part)}"
                                       f" bytes, more than {CHUNK}")
                parts.append(part)
                return m, b"".join(parts)
            else:
                more()

    def request(self, op: str, args: list[str], payload: bytes, deadline: float,
                idle_s: float | None = None) -> ExecResult:
        """Send one request with its ``payload`` and read the reply.

        Args:
            deadline (float): time.monotonic() by which the payload must be sent and the reply
                (with ``idle_s``: the end-of-command marker or the reply header) have arrived.
            idle_s (float | None): exec: once the command has ended, the reply may take any
                time as long as no piece of it stalls longer than this.

        Raises:
            AgentClosed, AgentTimeout: the channel closed or the deadline passed. AgentCorrupt:
            the payload reached the guest damaged, or the reply reached the host damaged.
            AgentError: the agent restarted meanwhile, an earlier request was cut off inside its
            payload, or the guest could not build the reply (``!``).
        """
        if self._broken:
            raise AgentError(self._broken)
        rid = self.next_id
        self.next_id += 1
        sent_md5 = _md5(payload) if op in ("exec", "write") else "-"
        line = f"{rid} {op} {len(payload)} {sent_md5} {' '.join(args)}\n".encode()
        self._payload(rid, op, line, payload, deadline)
        m, body = self._reply(rid, op, deadline, idle_s)
        got_md5, out_md5, err_md5 = (g.decode() for g in m.group(4, 5, 6))
        if got_md5 not in ("-", "!", sent_md5):
            raise AgentCorrupt(f"request {rid} ({op}): the guest got a payload with md5 {got_md5},"
                               f" the host sent {len(payload)} bytes with md5 {sent_md5}")
        out_b64, sep, err_b64 = body.partition(b"\n")
        try:
            out = base64.b64decode(out_b64, validate=True)
            err = base64.b64decode(err_b64, validate=True)
        except binascii.Error as e:
            raise AgentCorrupt(f"reply to request {rid} ({op}) is not base64 ({e})") from None
        if not sep or _md5(out) != out_md5 or _md5(err) != err_md5:
            raise AgentCorrupt(f"reply to request {rid} ({op}) damaged on the way: {len(out)} bytes"
                               f" of stdout with md5 {_md5(out)} (guest: {out_md5}), {len(err)} of"
                               f" stderr with md5 {_md5(err)} (guest: {err_md5})")
        if got_md5 == "!":
            raise AgentError(f"request {rid} ({op}) failed in the guest: {err.decode(errors='replace').strip()}")
        return ExecResult(exit_code=int(m.group(2)), stdout=out, stderr=err, timed_out=m.group(3) == b"1")

    def ping(self, deadline: float) -> None:
        self.request("ping", [], b"", deadline)

    def exec(self, cmd: str, timeout: float, deadline: float, root: bool = False,
             keep_background: bool = False, idle_s: float = IDLE_S) -> ExecResult:
        """Run ``cmd`` (as root or :data:`USER_UID`); ``deadline``: by when the guest must say
        that it ended (the timeout plus a grace period); then the reply has ``idle_s`` per piece."""
        args = [f"{timeout:.3f}", "0" if root else str(USER_UID), "1" if keep_background else "0"]
        return self.request("exec", args, cmd.encode(), deadline, idle_s=idle_s)

    def write_file(self, path: str, data: bytes, mode: int, deadline: float, root: bool = False) -> ExecResult:
        """Write ``path`` owned by root or by :data:`USER_UID`."""
        args = [base64.b64encode(path.encode()).decode(), f"{mode:o}", "0" if root else str(USER_UID)]
        return self.request("write", args, data, deadline)

    def read_file(self, path: str, deadline: float) -> ExecResult:
        return self.request("read", [base64.b64encode(path.encode()).decode()], b"", deadline)

    def limits(self, max_pids: int | None, memory_kib: int | None, deadline: float) -> ExecResult:
        args = ["-" if max_pids is None else str(max_pids), "-" if memory_kib is None else str(memory_kib)]
        return self.request("limits", args, b"", deadline)
