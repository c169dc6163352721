"""Host side of the guest agent protocol (the guest side is ``image.AGENT_SH``).

Requests are single lines ``"<id> <op> <args>"``; replies are framed as
``"\\n@K3 <id> <rc> <timed_out>\\n" <out_b64> "\\n" <err_b64> "\\n@K3END <id>\\n"``; '@' and newlines
are not base64 characters, so the markers are unambiguous, and the parser skips anything else on
the channel (a stale reply to a request the host gave up on). The transport is any stream socket:
QEMU's virtconsole chardev (:meth:`AgentChannel.connect_unix`) or a Firecracker guest vsock port
(:meth:`AgentChannel.connect_vsock`).
"""
from __future__ import annotations

import base64
import re
import select
import socket
import time
from dataclasses import dataclass

_HEADER = re.compile(rb"\n@K3 (\d+) (-?\d+) ([01])\n")


class AgentError(RuntimeError):
    """The agent channel closed or did not answer in time."""


class AgentClosed(AgentError):
    """The channel reached EOF (the VM process is gone)."""


class AgentTimeout(AgentError):
    """No reply before the host-side deadline (the guest is hung or far too slow)."""


@dataclass(frozen=True)
class ExecResult:
    """Result of :meth:`Sandbox.exec`.

    Attributes:
        exit_code (int): the command's exit status; 137 when the timeout killed it.
        stdout (bytes), stderr (bytes): everything the command wrote.
        timed_out (bool): the guest-side timeout fired and SIGKILLed the command's process group.
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


class AgentChannel:
    """A connected stream socket to the guest agent (QEMU's virtconsole, Firecracker's vsock)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.next_id = 1

    @classmethod
    def connect_unix(cls, path: str, deadline: float) -> "AgentChannel":
        """Connect to a unix socket, retrying until it exists or ``deadline`` (time.monotonic)."""
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                return cls(s)
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if time.monotonic() > deadline:
                    raise AgentTimeout(f"agent socket {path} did not appear") from None
                time.sleep(0.002)

    @classmethod
    def connect_vsock(cls, uds_path: str, port: int, deadline: float) -> "AgentChannel":
        """Connect to a guest vsock port through Firecracker's host-side unix socket.

        Firecracker's vsock device (``docs/vsock.md``, host-initiated connections): the host
        connects to the device's ``uds_path``, writes ``CONNECT <port>\\n`` and reads
        ``OK <host_port>\\n``; then the stream is the guest connection. While nothing listens on
        ``port`` in the guest (still booting), Firecracker closes the connection instead; this
        retries until ``deadline`` (time.monotonic). Bytes after the OK line stay in :attr:`buf`.

        Raises:
            AgentTimeout: no ``OK`` before the deadline. AgentError: an answer other than ``OK``.
        """
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            got = b""
            try:
                s.connect(uds_path)
                s.sendall(f"CONNECT {port}\n".encode())
                while b"\n" not in got:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([s], [], [], left)[0]:
                        break
                    data = s.recv(4096)
                    if not data:
                        break
                    got += data
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError):
                pass
            line, _, rest = got.partition(b"\n")
            if line.startswith(b"OK "):
                ch = cls(s)
                ch.buf = rest
                return ch
            s.close()
            if line:
                raise AgentError(f"vsock {uds_path} port {port}: unexpected handshake answer {line[:80]!r}")
            if time.monotonic() > deadline:
                raise AgentTimeout(f"vsock {uds_path}: nothing accepted port {port} before the deadline")
            time.sleep(0.005)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _recv(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AgentTimeout("no reply from the guest agent before the deadline")
        ready, _, _ = select.select([self.sock], [], [], left)
        if not ready:
            raise AgentTimeout("no reply from the guest agent before the deadline")
        try:
            data = self.sock.recv(1 << 20)
        except OSError as e:
            raise AgentClosed(f"agent channel error: {e}") from e
        if not data:
            raise AgentClosed("agent channel closed (EOF)")
        self.buf += data

    def wait_for(self, marker: bytes, deadline: float) -> None:
        """Read until ``marker`` appears (e.g. the boot banner ``@K3READY``); drop what precedes it."""
        while (i := self.buf.find(marker)) < 0:
            self._recv(deadline)
        self.buf = self.buf[i + len(marker):]

    def request(self, op: str, args: list[str], payload: bytes, deadline: float) -> ExecResult:
        """Send one request (plus raw ``payload`` bytes after the line) and read its reply."""
        rid = self.next_id
        self.next_id += 1
        line = f"{rid} {op} {' '.join(args)}\n".encode()
        try:
            self.sock.sendall(line + payload)
        except OSError as e:
            raise AgentClosed(f"agent channel error on send: {e}") from e
        while True:
            if b"\n@K3READY\n" in self.buf:
                # k3init restarts a dead agent, which announces itself: the request is lost.
                self.buf = self.buf.split(b"\n@K3READY\n")[-1]
                raise AgentError(f"the guest agent restarted during request {rid} ({op}): the"
                                 " command killed it or its shell; its result is lost")
            m = _HEADER.search(self.buf)
            if m is None or int(m.group(1)) != rid:
                if m is not None:
                    # A reply to an earlier request that timed out on the host: skip it.
                    self.buf = self.buf[m.end():]
                    continue
                self._recv(deadline)
                continue
            end = f"\n@K3END {rid}\n".encode()
            while (j := self.buf.find(end, m.end())) < 0:
                self._recv(deadline)
            body = self.buf[m.end():j]
            self.buf = self.buf[j + len(end):]
            out, sep, err = body.partition(b"\n")
            if not sep:
                raise AgentError(f"malformed reply frame for request {rid}")
            return ExecResult(exit_code=int(m.group(2)), stdout=base64.b64decode(out),
                              stderr=base64.b64decode(err), timed_out=m.group(3) == b"1")

    def ping(self, deadline: float) -> None:
        self.request("ping", [], b"", deadline)

    def exec(self, cmd: str, timeout: float, deadline: float) -> ExecResult:
        arg = base64.b64encode(cmd.encode()).decode()
        return self.request("exec", [arg, f"{timeout:.3f}"], b"", deadline)

    def write_file(self, path: str, data: bytes, mode: int, deadline: float) -> ExecResult:
        enc = base64.b64encode(data)
        args = [base64.b64encode(path.encode()).decode(), str(len(enc)), f"{mode:o}"]
        return self.request("write", args, enc, deadline)

    def read_file(self, path: str, deadline: float) -> ExecResult:
        return self.request("read", [base64.b64encode(path.encode()).decode()], b"", deadline)
