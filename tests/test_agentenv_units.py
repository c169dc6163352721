"""AgentEnv pieces that need no VM: host decision, image build/verify, kernel extraction, sysdeps,
the agent protocol parser."""
from __future__ import annotations

import base64
import gzip
import lzma
import os
import shutil
import socket
import time

import pytest

from k3lab.agentenv import host, image, sysdeps
from k3lab.agentenv.agent import AgentChannel, AgentClosed, AgentError, AgentTimeout


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
    assert sysdeps.missing_packages() == []  # make test ran sysdeps first
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sysdeps.shutil, "which", lambda *a, **k: None)
    assert "qemu-system-x86" in sysdeps.missing_packages()
    assert sysdeps.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "apt-get install -y --no-install-recommends" in err and "qemu-utils" in err


def test_agent_parser_skips_stale_replies_and_detects_eof():
    host_end, guest_end = socket.socketpair()
    ch = AgentChannel(host_end)
    ch.next_id = 2
    out = base64.b64encode(b"payload\x00\xff").decode()
    # a stale reply to request 1 (given up on), console noise, then the reply to request 2
    guest_end.sendall(b"\n@K3 1 0 0\nZm9v\n\n@K3END 1\nnoise\n@K3 2 5 1\n" + out.encode()
                      + b"\nZXJy\n@K3END 2\n")
    r = ch.request("exec", ["x", "1"], b"", deadline=time.monotonic() + 5)
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (5, b"payload\x00\xff", b"err", True)
    assert guest_end.recv(100) == b"2 exec x 1\n"
    with pytest.raises(AgentTimeout):
        ch.ping(deadline=time.monotonic() + 0.2)
    guest_end.sendall(b"\n@K3READY\n")
    with pytest.raises(AgentError, match="restarted"):
        ch.ping(deadline=time.monotonic() + 5)
    guest_end.close()
    with pytest.raises(AgentClosed):
        ch.ping(deadline=time.monotonic() + 5)


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

    sb = object.__new__(Sandbox)
    monkeypatch.setattr(sb, "snapshot", no_vm, raising=False)
    with pytest.raises(TypeError, match="n must be an int, got float 1.5"):
        sb.fork(1.5)
    with pytest.raises(TypeError, match="n must be an int, got bool"):
        sb.fork(True)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        sb.fork(0)


def test_bench_agentenv_help_names_the_module(capsys):
    """--help printed `usage: agentenv.py`; it must show how the bench is run."""
    from k3lab.bench import agentenv as bench

    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m k3lab.bench.agentenv "), out[:80]
