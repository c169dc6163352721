"""AgentEnv pieces that need no VM: host decision, image build/verify, kernel extraction, sysdeps,
the agent protocol parser."""
from __future__ import annotations

import base64
import gzip
import hashlib
import lzma
import os
import select
import shutil
import socket
import threading
import time

import pytest

from k3lab.agentenv import host, image, sysdeps
from k3lab.agentenv.agent import (CHUNK, AgentChannel, AgentClosed, AgentCorrupt, AgentError,
                                  AgentTimeout)


@pytest.mark.parametrize("case,expect", [
    (dict(kvm_device=True, kvm_pvm=True, hw_virt=False, qemu="/q", firecracker=None, firecracker_kernel=None),
     ("qemu", "tcg", "kvm_pvm detected: KVM guests cannot boot here, using qemu/TCG")),
    (dict(kvm_device=True, kvm_pvm=False, hw_virt=True, qemu="/q", firecracker=None, firecracker_kernel=None),
     ("qemu", "kvm", "real KVM (vmx/svm, /dev/kvm); no firecracker binary, using qemu/KVM")),
    (dict(kvm_device=True, kvm_pvm=False, hw_virt=True, qemu="/q", firecracker="/fc", firecracker_kernel="/k"),
     ("firecracker", "kvm", "real KVM (vmx/svm, /dev/kvm); firecracker at /fc: using firecracker")),
    (dict(kvm_device=False, kvm_pvm=False, hw_virt=True, qemu="/q", firecracker="/fc", firecracker_kernel="/k"),
     ("qemu", "tcg", "no usable /dev/kvm, using qemu/TCG")),
    (dict(kvm_device=True, kvm_pvm=False, hw_virt=False, qemu="/q", firecracker=None, firecracker_kernel=None),
     ("qemu", "tcg", "/dev/kvm present but no vmx/svm CPU flags: KVM guests cannot boot here, using qemu/TCG")),
], ids=["kvm_pvm", "real-kvm", "firecracker", "no-kvm", "no-vmx"])
def test_host_decision(case, expect):
    assert host.decide(**case) == expect


def test_this_host_is_detected():
    h = host.detect_host()
    assert h.backend in ("qemu", "firecracker") and h.accel in ("tcg", "kvm") and h.reason
    if h.kvm_pvm:
        assert h.accel == "tcg" and "kvm_pvm" in h.reason
    assert host.tsc_khz("cpu MHz\t\t: 2599.998\n") == 2599998


def test_extract_vmlinux_finds_the_elf():
    elf = b"\x7fELF" + os.urandom(5000)
    for comp in (gzip.compress, lambda d: lzma.compress(d, format=lzma.FORMAT_XZ)):
        blob = os.urandom(700) + comp(elf) + os.urandom(300)
        assert image.extract_vmlinux(blob) == elf
    with pytest.raises(image.ImageError, match="no compressed ELF"):
        image.extract_vmlinux(os.urandom(2000) + gzip.compress(b"not an elf"))


def test_image_cached_checksummed_and_tamper_detected(tmp_path):
    img = image.build_image()  # cached: no rebuild, checksums verified on load
    assert img.kernel.read_bytes()[:4] == b"\x7fELF"
    assert gzip.decompress(img.initrd.read_bytes())[:6] == b"070701"  # cpio newc
    again = image.build_image()
    assert again.digest == img.digest and again.root == img.root
    copy = tmp_path / "img"
    shutil.copytree(img.root, copy)
    os.chmod(copy / "initrd.gz", 0o644)
    with open(copy / "initrd.gz", "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(image.ImageError, match="checksum mismatch"):
        image._load(copy)


def test_sysdeps_reports_missing_with_the_command(monkeypatch, capsys):
    if not sysdeps.skip_requested():
        assert sysdeps.missing_packages() == []  # make test ran sysdeps first
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sysdeps.shutil, "which", lambda *a, **k: None)
    assert "qemu-system-x86" in sysdeps.missing_packages()
    assert sysdeps.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "apt-get install -y --no-install-recommends" in err and "qemu-utils" in err


def test_sysdeps_skip_variable_installs_nothing(monkeypatch, capsys):
    monkeypatch.setattr(sysdeps, "missing_packages", lambda: ["qemu-system-x86"])
    monkeypatch.setattr(sysdeps.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    monkeypatch.setenv("K3LAB_SKIP_SYSDEPS", "1")
    assert sysdeps.main([]) == 0
    out = capsys.readouterr().out
    assert "skipped (K3LAB_SKIP_SYSDEPS=1)" in out and "qemu-system-x86" in out and "chapter 07" in out
    assert sysdeps.main(["--check"]) == 1, "--check still reports what is missing"
    monkeypatch.setenv("K3LAB_SKIP_SYSDEPS", "yes")
    assert sysdeps.main([]) == 2
    assert "$K3LAB_SKIP_SYSDEPS must be 0 or 1" in capsys.readouterr().err


def _reply(rid: int, out: bytes, err: bytes = b"", rc: int = 0, got: str = "-") -> list[bytes]:
    """The guest's frames for a reply: header, then chunks (all but the last wait for an ack)."""
    body = base64.b64encode(out) + b"\n" + base64.b64encode(err)
    sums = " ".join(hashlib.md5(b).hexdigest() for b in (out, err))
    head = f"\n@K3 {rid} {rc} 0 {got} {sums}\n".encode()
    parts = [body[i:i + CHUNK] for i in range(0, len(body) + 1, CHUNK)]
    frames = [p + f"\n@K3C {rid}\n".encode() for p in parts[:-1]]
    frames.append(parts[-1] + f"\n@K3END {rid}\n".encode())
    return [head + frames[0], *frames[1:]]


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += sock.recv(n - len(data))
    return data


def test_agent_parser_skips_stale_replies_and_detects_eof():
    host_end, guest_end = socket.socketpair()
    ch = AgentChannel.from_socket(host_end)
    ch.next_id = 2
    # a stale reply to request 1 (given up on), console noise, then the reply to request 2
    guest_end.sendall(b"".join(_reply(1, b"foo")) + b"noise\n")
    out, err = b"payload\x00\xff", b"err"
    guest_end.sendall(_reply(2, out, err, rc=5)[0].replace(b"\n@K3 2 5 0", b"\n@K3 2 5 1"))
    r = ch.request("read", ["x"], b"", deadline=time.monotonic() + 5)
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (5, out, err, True)
    assert guest_end.recv(100) == b"2 read 0 - x\n"
    with pytest.raises(AgentTimeout):
        ch.ping(deadline=time.monotonic() + 0.2)
    guest_end.sendall(b"\n@K3READY\n")
    with pytest.raises(AgentError, match="restarted"):
        ch.ping(deadline=time.monotonic() + 5)
    guest_end.close()
    with pytest.raises(AgentClosed):
        ch.ping(deadline=time.monotonic() + 5)


def test_agent_chunks_both_ways_with_acks_and_checksums():
    """Payloads and replies go in CHUNK-byte pieces, the next only after the other side's ack, so
    a slow reader never has more than one chunk in flight; every byte value passes."""
    host_end, guest_end = socket.socketpair()
    ch = AgentChannel.from_socket(host_end)
    data = bytes(range(256)) * 300  # 76800 bytes: three payload chunks
    md5 = hashlib.md5(data).hexdigest()
    result = {}
    t = threading.Thread(target=lambda: result.update(r=ch.write_file("/f", data, 0o600, time.monotonic() + 10)))
    t.start()
    line = f"1 write {len(data)} {md5} {base64.b64encode(b'/f').decode()} 600 1000\n".encode()
    got = _recv_exactly(guest_end, len(line) + CHUNK)
    assert got[:len(line)] == line
    time.sleep(0.1)
    guest_end.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing more until the guest acknowledges
        guest_end.recv(1)
    guest_end.setblocking(True)
    for _ in range(2):
        guest_end.sendall(b"\n@K3A 1\n")
        got += _recv_exactly(guest_end, min(CHUNK, len(data) + len(line) - len(got)))
    assert got[len(line):] == data
    guest_end.sendall(_reply(1, b"", got=md5)[0])
    t.join(10)
    assert result["r"].exit_code == 0
    # a reply of three chunks: the host acknowledges each full one, then checks the md5 sums
    out = bytes(range(256)) * 200
    frames = _reply(2, out)
    assert len(frames) == 3
    result.clear()
    t = threading.Thread(target=lambda: result.update(r=ch.read_file("/f", time.monotonic() + 10)))
    t.start()
    assert guest_end.recv(100).startswith(b"2 read 0 - ")
    for frame in frames[:-1]:
        guest_end.sendall(frame)
        assert _recv_exactly(guest_end, 6) == b"2 ack\n"
    guest_end.sendall(frames[-1])
    t.join(10)
    assert result["r"].stdout == out


@pytest.mark.parametrize("damage,match", [
    ("short chunk", r"request 1 \(exec\): a chunk of 32764 bytes, expected 32768: bytes were lost"),
    ("md5 out", r"reply to request 1 \(exec\) damaged on the way: 60000 bytes of stdout with md5"),
    ("payload md5", r"request 1 \(exec\): the guest got a payload with md5 0{32}, the host sent 4 bytes"),
    ("not base64", r"reply to request 1 \(exec\) is not base64"),
])
def test_agent_detects_damaged_transfers(damage, match):
    host_end, guest_end = socket.socketpair()
    ch = AgentChannel.from_socket(host_end)
    out = os.urandom(60_000)
    frames = _reply(1, out, got=hashlib.md5(b"true").hexdigest())
    if damage == "short chunk":  # bytes lost inside a chunk
        frames[0] = frames[0][:500] + frames[0][504:]
    elif damage == "md5 out":  # a byte changed, same length
        i = len(frames[1]) // 2
        frames[1] = frames[1][:i] + (b"A" if frames[1][i:i + 1] != b"A" else b"B") + frames[1][i + 1:]
    elif damage == "payload md5":  # the guest received a different command
        frames[0] = frames[0].replace(hashlib.md5(b"true").hexdigest().encode(), b"0" * 32, 1)
    else:
        frames[1] = frames[1].replace(b"A", b"!", 1)

    def guest():
        guest_end.recv(100)  # the request
        for f in frames:
            guest_end.sendall(f)
            if not guest_end.recv(100):  # an ack, or EOF once the host gave up
                return

    t = threading.Thread(target=guest)
    t.start()
    with pytest.raises(AgentCorrupt, match=match):
        ch.exec("true", 5, deadline=time.monotonic() + 5)
    ch.close()
    t.join(10)


def test_agent_channel_out_of_step_after_a_cut_payload():
    host_end, guest_end = socket.socketpair()
    ch = AgentChannel.from_socket(host_end)
    with pytest.raises(AgentTimeout):  # the guest never acknowledges the first chunk
        ch.write_file("/f", b"x" * (CHUNK + 1), 0o644, deadline=time.monotonic() + 0.3)
    with pytest.raises(AgentError, match="out of step"):
        ch.ping(deadline=time.monotonic() + 5)
    guest_end.close()


def test_qmp_reset_by_a_dying_qemu_is_a_qmp_error(tmp_path):
    """A QEMU that dies mid-command resets the QMP socket: recv() raised a bare
    ConnectionResetError, which Sandbox did not turn into SandboxCrashed."""
    from k3lab.agentenv.qemu import QMP, QMPError

    path = str(tmp_path / "qmp.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def qemu():
        conn, _ = server.accept()
        conn.sendall(b'{"QMP": {}}\n')
        conn.recv(1024)
        conn.sendall(b'{"return": {}}\n')
        # Closed with the next command unread: a unix socket then resets the peer's recv().
        while not select.select([conn], [], [], 5)[0]:
            pass
        conn.close()

    t = threading.Thread(target=qemu)
    t.start()
    qmp = QMP(path, time.monotonic() + 5)
    with pytest.raises(QMPError, match="closed"):
        qmp.execute("query-status", timeout=5)
    t.join(5)
    server.close()


def test_guest_operation_arguments_checked_before_any_vm_call():
    """write_file(path, 5) wrote five NUL bytes (bytes(5)); a non-str cmd/path failed with an
    AttributeError from the agent protocol. Checked before the guest is contacted (no VM here)."""
    from k3lab.agentenv import Sandbox

    sb = object.__new__(Sandbox)
    with pytest.raises(TypeError, match="data"):
        sb.write_file("/tmp/x", 5)
    with pytest.raises(TypeError, match="path"):
        sb.write_file(None, "a")
    with pytest.raises(TypeError, match="path"):
        sb.read_file(None)
    with pytest.raises(TypeError, match="cmd"):
        sb.exec(["echo", "hi"])
    with pytest.raises(TypeError, match="root must be a bool, got 1"):
        sb.exec("true", root=1)
    with pytest.raises(TypeError, match="keep_background must be a bool, got 'yes'"):
        sb.exec("true", keep_background="yes")
    with pytest.raises(TypeError, match="max_pids must be an int, got float"):
        sb.limits(max_pids=10.0)
    with pytest.raises(ValueError, match=r"memory_mib must be in \[1, \d+\], got 0"):
        sb.limits(memory_mib=0)


def test_timeout_mode_and_nul_paths_checked_before_any_vm_call():
    """exec(timeout=inf) failed with an OverflowError from select(); write_file(mode="755") with
    "Unknown format code 'o'", mode=0o100644 in the guest's chmod; a NUL in a path was dropped by
    the guest's shell, so another file was written or read. No VM here."""
    from k3lab.agentenv import Sandbox

    sb = object.__new__(Sandbox)
    for timeout in (float("inf"), float("nan"), 1e9, -1):
        with pytest.raises(ValueError, match="timeout must be > 0 and <= 1e"):
            sb.exec("true", timeout=timeout)
    # "5" failed in a comparison (TypeError naming nothing); True ran as 1 s.
    for timeout in ("5", True, None):
        with pytest.raises(TypeError, match="timeout must be a number of seconds"):
            sb.exec("true", timeout=timeout)
    with pytest.raises(TypeError, match="mode must be an int, got str"):
        sb.write_file("/tmp/x", b"", mode="755")
    for mode in (-1, 0o10000, 0o100644):
        with pytest.raises(ValueError, match=r"mode must be permission bits in \[0, 0o7777\]"):
            sb.write_file("/tmp/x", b"", mode=mode)
    with pytest.raises(ValueError, match="NUL"):
        sb.write_file("/tmp/a\0b", b"x")
    with pytest.raises(ValueError, match="NUL"):
        sb.read_file("/tmp/a\0b")


def test_vm_shape_and_fork_count_checked_before_any_vm_work(monkeypatch):
    """Sandbox.create(memory_mib=128.5) / float vcpus went on to boot; SandboxPool(memory_mib=0)
    failed only at the first boot; fork(1.5) took a snapshot before failing. No VM here: building
    the image, probing the host or snapshotting fails the test."""
    from k3lab.agentenv import Sandbox, SandboxPool
    from k3lab.agentenv import sandbox as sandbox_mod

    def no_vm(*args, **kwargs):
        raise AssertionError("VM work started before the arguments were checked")

    monkeypatch.setattr(sandbox_mod, "build_image", no_vm)
    monkeypatch.setattr(sandbox_mod, "detect_host", no_vm)
    for kwargs, exc, match in [
        (dict(memory_mib=128.5), TypeError, "memory_mib must be an int, got float 128.5"),
        (dict(memory_mib=True), TypeError, "memory_mib must be an int, got bool"),
        (dict(vcpus=1.0), TypeError, "vcpus must be an int, got float 1.0"),
        (dict(memory_mib=0), ValueError, r"memory_mib must be in \[64, 65536\] MiB, got 0"),
        (dict(vcpus=0), ValueError, r"vcpus must be in \[1, 64\], got 0"),
    ]:
        with pytest.raises(exc, match=match):
            Sandbox.create(**kwargs)
        with pytest.raises(exc, match=match):
            SandboxPool(**kwargs)
    # A path instead of an Image failed with AttributeError: 'str' object has no attribute 'rootfs'.
    with pytest.raises(TypeError, match="image must be an Image"):
        Sandbox.create(image="nope")

    sb = object.__new__(Sandbox)
    monkeypatch.setattr(sb, "snapshot", no_vm, raising=False)
    with pytest.raises(TypeError, match="n must be an int, got float 1.5"):
        sb.fork(1.5)
    with pytest.raises(TypeError, match="n must be an int, got bool"):
        sb.fork(True)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        sb.fork(0)


def test_build_image_cache_dir_that_is_a_file(tmp_path):
    """A file as cache_dir raised a raw NotADirectoryError from deep inside the download."""
    from k3lab.agentenv.image import ImageError, build_image

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ImageError, match="not a directory"):
        build_image(cache_dir=f)


def test_agentenv_cli_build_error_is_one_line(tmp_path, capsys):
    """``python -m k3lab.agentenv build --cache <a file>`` ended in a traceback."""
    from k3lab.agentenv.__main__ import main

    f = tmp_path / "file"
    f.write_text("x")
    assert main(["build", "--cache", str(f)]) == 1
    assert "not a directory" in capsys.readouterr().err


def test_bench_agentenv_help_names_the_module(capsys):
    """--help printed `usage: agentenv.py`; it must show how the bench is run."""
    from k3lab.bench import agentenv as bench

    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m k3lab.bench.agentenv "), out[:80]
