"""The Sandbox API end to end on ``backend="firecracker"``, against ``tests/fake_firecracker.py``.

This exercises the HOST-SIDE control path only: which Firecracker API calls the backend makes, in
which states and with which (relative, per-sandbox) paths; the snapshot files it writes and merges
(Full, then Diff merged onto a base); the agent protocol on the serial console (the process's
stdin/stdout pipes, new pipes after every load). No guest kernel runs: the fake's "guest" is a folder on the
host whose commands run on the host (with the guest folder as working directory, so the commands
here use guest-relative paths such as ``root/d`` where a real guest would say ``/root/d``), and
the fake rejects calls in the wrong state the way Firecracker does. ``detect_host`` is patched to
report real KVM and the fake binary; the real host (``kvm_pvm``) never picks Firecracker.
"""
from __future__ import annotations

import io
import json
import os
import signal
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

import fake_firecracker
from k3lab.agentenv import (HostInfo, Image, Sandbox, SandboxCrashed, SandboxError, SandboxPool,
                            SandboxStateError, SandboxTimeout, leftovers)
from k3lab.agentenv import sandbox as sandbox_mod
from k3lab.agentenv.agent import CHUNK, AgentChannel

pytestmark = pytest.mark.timeout(120)

FAKE = Path(__file__).with_name("fake_firecracker.py")


def _tar(files: dict[str, bytes], dirs: tuple[str, ...]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """(HostInfo saying "firecracker", Image): a wrapper running the fake with this Python, a
    dummy kernel and initrd, and a rootfs (a tar: the fake's disk format)."""
    d = tmp_path_factory.mktemp("fakefc")
    exe = d / "firecracker"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    exe.chmod(0o755)
    (d / "vmlinux").write_bytes(b"\x7fELF fake kernel")
    (d / "initrd.gz").write_bytes(b"fake initrd")
    (d / "rootfs.tar").write_bytes(_tar({"./etc/hostname": b"sandbox\n"}, ("./etc", "./root")))
    image = Image(root=d, kernel=d / "vmlinux", initrd=d / "initrd.gz", rootfs=d / "rootfs.tar",
                  kernel_version="fake", digest="fake")
    host = HostInfo(backend="firecracker", accel="kvm", reason="test: real KVM and a fake firecracker",
                    kvm_device=True, kvm_pvm=False, hw_virt=True, qemu=None, qemu_version=None,
                    firecracker=str(exe), tsc_khz=2_600_000, firecracker_kernel=str(d / "vmlinux"))
    return host, image


@pytest.fixture
def fc(fake, monkeypatch, tmp_path):
    """Sandbox factory on the fake; checks that every test leaves no file and no process."""
    host, image = fake
    monkeypatch.setattr(sandbox_mod, "detect_host", lambda: host)
    root = tmp_path / "r"

    def create(**kw):
        return Sandbox.create(image, memory_mib=64, root=root, boot_timeout=20, **kw)

    create.root, create.image = root, image
    yield create
    # a failed test's sandboxes and snapshots go too (only this test's: other modules' stay)
    for sb in [s for s in sandbox_mod._live if s.root == root]:
        sb.destroy()
    for snap in [s for s in sandbox_mod._snapshots if root in s.path.parents]:
        snap.delete()
    assert leftovers(root) == {"files": [], "pids": []}


def _requests(sb: Sandbox) -> list:
    with open(sb.dir / "firecracker.sock.requests.jsonl") as f:
        return [json.loads(line) for line in f]


def _disk_file(sb: Sandbox, name: str) -> bytes | None:
    """A file as the sandbox's own drive (rootfs.ext4, a tar for the fake) holds it."""
    with tarfile.open(sb.dir / "rootfs.ext4") as tar:
        try:
            return tar.extractfile(name).read()
        except KeyError:
            return None


def test_create_exec_files_on_firecracker(fc):
    with fc() as sb:
        assert sb.backend == "firecracker" and sb.state == "running"
        r = sb.exec("echo out; echo err >&2; cat etc/hostname; exit 3", timeout=10)
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"out\nsandbox\n", b"err\n", False)
        r = sb.exec("sleep 30; echo never", timeout=0.3)
        assert r.timed_out and r.exit_code == 137 and r.stdout == b""
        data = os.urandom(50_000)
        sb.write_file("/root/blob.bin", data, mode=0o600)
        assert sb.read_file("/root/blob.bin") == data
        assert sb.exec("stat -c %a root/blob.bin", timeout=10).stdout == b"600\n"
        with pytest.raises(FileNotFoundError, match="/nope"):
            sb.read_file("/nope")
        assert _disk_file(sb, "./root/blob.bin") == data  # the write reached this sandbox's drive
        reqs = _requests(sb)
    # cold boot: machine config with dirty-page tracking, a relative drive path (resolved in the
    # sandbox's own folder, the firecracker process's working directory), the agent on the serial
    # port with the kernel's log kept off it
    assert [r[:2] for r in reqs] == [["PUT", "/machine-config"], ["PUT", "/boot-source"],
                                     ["PUT", "/drives/rootfs"], ["PUT", "/actions"]]
    assert reqs[0][2]["track_dirty_pages"] is True and reqs[0][2]["mem_size_mib"] == 64
    assert reqs[2][2]["path_on_host"] == "rootfs.ext4"
    args = reqs[1][2]["boot_args"].split()
    assert {"console=ttyS0", "loglevel=0", "k3lab.agent=ttyS0"} <= set(args) and "quiet" not in args


def test_binary_transfers_survive_a_stalled_host(fc, monkeypatch):
    """Firecracker's UART drops output that its full stdout pipe refuses (the fake does too, and
    logs it). With the host stalled at the start of every reply, a 300 KB reply (several times the
    64 KiB pipe) still arrives whole: the guest sends one 32 KiB chunk and waits for the host's
    ack. Every byte value passes, control bytes included."""
    data = bytes(range(256)) * 400 + b"\x00\x03\x04\x11\x13\x1a\r\n\x7f\xff" * 3000 + os.urandom(150_000)
    real, stalled = AgentChannel._recv, set()

    def recv(self, deadline):
        if (self, self.next_id) not in stalled:
            stalled.add((self, self.next_id))
            time.sleep(0.5)
        return real(self, deadline)

    with fc() as sb:
        monkeypatch.setattr(AgentChannel, "_recv", recv)
        sb.write_file("/root/blob.bin", data)
        assert sb.read_file("/root/blob.bin") == data
        assert sb.exec("cat root/blob.bin", timeout=30).stdout == data
        assert "lost" not in (sb.dir / "firecracker.log").read_text()


def test_fake_speaks_the_hosts_chunk_size():
    assert fake_firecracker.CHUNK == CHUNK


def test_pause_resume(fc):
    with fc() as sb:
        sb.pause()
        sb.pause()  # idempotent
        assert sb.vm.fc.client.describe()["state"] == "Paused"
        with pytest.raises(SandboxStateError, match="paused"):
            sb.exec("true")
        sb.resume()
        assert sb.vm.fc.client.describe()["state"] == "Running"
        assert sb.exec("echo back", timeout=10).stdout == b"back\n"


def test_snapshot_full_then_diff_restore(fc):
    with fc() as sb:
        sb.exec("echo v1 > tmp/mem; echo v1 > root/disk", timeout=10)
        s1 = sb.snapshot()
        sb.exec("echo v2 > tmp/mem; echo v2 > root/disk", timeout=10)
        s2 = sb.snapshot()
        assert (s1.backend, s1.kind, s2.kind) == ("firecracker", "Full", "Diff")
        types = [r[2]["snapshot_type"] for r in _requests(sb) if r[1] == "/snapshot/create"]
        assert types == ["Full", "Diff"]
        sb.restore(s1)
        assert sb.exec("cat tmp/mem root/disk", timeout=10).stdout == b"v1\nv1\n"
        sb.restore(s2)  # the Diff's memory was merged onto s1's: a loadable full file
        assert sb.exec("cat tmp/mem root/disk", timeout=10).stdout == b"v2\nv2\n"
        # a restored sandbox's next snapshot is a Diff on the loaded memory, even once the
        # snapshot it loaded from is deleted (the base is a hard link)
        s2.delete()
        sb.exec("echo v3 > tmp/mem", timeout=10)
        with sb.snapshot() as s3, Sandbox.from_snapshot(s3) as other:
            assert s3.kind == "Diff"
            assert other.exec("cat tmp/mem root/disk", timeout=10).stdout == b"v3\nv2\n"
        with Sandbox.from_snapshot(s1, cow=False) as copy:
            assert copy.exec("cat tmp/mem", timeout=10).stdout == b"v1\n"
            assert copy.vm.memory_files()[0].parent == copy.dir  # maps its own copy
        s1.delete()


def test_fork_children_have_their_own_disk_memory_and_console(fc):
    with fc() as parent:
        parent.exec("echo parent > tmp/m; echo parent > root/d", timeout=10)
        a, b = parent.fork(2)
        try:
            a.exec("echo A > tmp/m; echo A > root/d; echo A-only > root/new", timeout=10)
            b.exec("echo B > tmp/m; echo B > root/d", timeout=10)
            assert a.exec("cat tmp/m root/d", timeout=10).stdout == b"A\nA\n"
            assert b.exec("cat tmp/m root/d", timeout=10).stdout == b"B\nB\n"
            assert parent.exec("cat tmp/m root/d", timeout=10).stdout == b"parent\nparent\n"
            for sb in (parent, b):
                assert sb.exec("test -e root/new", timeout=10).exit_code == 1
            # on disk: each VM wrote its own drive file
            assert [_disk_file(s, "./root/d") for s in (parent, a, b)] == [b"parent\n", b"A\n", b"B\n"]
            assert _disk_file(parent, "./root/new") is None
            # a child is a snapshot load with a File memory backend, nothing configured by path
            load = _requests(a)[0]
            assert load[:2] == ["PUT", "/snapshot/load"] and load[2]["resume_vm"] is True
            assert load[2]["mem_backend"]["backend_type"] == "File"
            assert all(r[1] != "/drives/rootfs" for r in _requests(a))
            # each child's agent is on its own process's serial console
            assert len({sb.vm.agent.rfd for sb in (parent, a, b)}) == 3
        finally:
            a.destroy()
            b.destroy()


def test_hibernate_wake(fc):
    with fc() as sb:
        sb.exec("echo hib > tmp/m", timeout=10)
        want = b"hib\n"
        for i in range(2):
            sb.hibernate()
            mem = sb.memory()
            assert sb.state == "hibernated" and sb.pids() == [] and mem["rss"] == mem["pss"] == 0
            with pytest.raises(SandboxStateError):
                sb.exec("true")
            # one memory image of its own (the previous one went with the process that mapped it)
            assert len(list(sb.dir.glob("mem-*"))) == 1
            sb.wake()
            assert sb.exec("cat tmp/m", timeout=10).stdout == want
            sb.exec(f"echo {i} >> tmp/m", timeout=10)
            want += f"{i}\n".encode()
        assert [r[2]["snapshot_type"] for r in _requests(sb) if r[1] == "/snapshot/create"] == ["Full", "Diff"]


def test_killed_vm_detected(fc):
    with fc() as sb:
        os.kill(sb.pids()[0], signal.SIGKILL)
        with pytest.raises(SandboxCrashed, match="firecracker killed by signal 9"):
            sb.exec("true", timeout=10)
        assert sb.state == "crashed"
    with fc() as sb:
        os.kill(sb.pids()[0], signal.SIGKILL)
        with pytest.raises(SandboxCrashed, match="signal 9"):
            sb.pause()


def test_pool_fork_destroy_leave_nothing(fc):
    with SandboxPool(fc.image, memory_mib=64, root=fc.root, backend="firecracker") as pool:
        members = pool.create_many(2)
        kids = pool.adopt(members[0].fork(2))
        snap = kids[0].snapshot()
        grandchild = pool.adopt([Sandbox.from_snapshot(snap)])[0]
        snap.delete()  # still needed by grandchild: must survive until it goes
        seen = leftovers(fc.root)
        assert len(seen["pids"]) == 5 and snap.path.is_dir()
        assert grandchild.exec("echo gc", timeout=10).stdout == b"gc\n"
        for s in (*members, *kids, grandchild):
            s.destroy()
        assert not snap.path.exists()
        assert leftovers(fc.root, exclude=(pool.base.path,)) == {"files": [], "pids": []}
        for i in range(5):
            sb = pool.create(cow=False)
            (child,) = sb.fork(1)
            child.pause()
            sb.pause()
            child.resume()
            sb.resume()
            assert child.exec(f"echo {i}", timeout=10).stdout == f"{i}\n".encode()
            child.destroy()
            sb.destroy()
    assert leftovers(fc.root) == {"files": [], "pids": []}


def test_too_deep_root_is_a_value_error(fc):
    """A root too deep for the API socket's path: the firecracker process failed to bind and the
    error was firecracker's exit status. Now a ValueError before the process starts."""
    with pytest.raises(ValueError, match="root is too deep"):
        Sandbox.create(fc.image, memory_mib=64, root=fc.root / ("d" * 100), boot_timeout=20)


def test_backend_argument(fake, monkeypatch):
    """Checked before any VM work: build_image is never reached."""
    host, _ = fake

    def no_vm(*args, **kwargs):
        raise AssertionError("VM work started before the backend was checked")

    monkeypatch.setattr(sandbox_mod, "build_image", no_vm)
    monkeypatch.setattr(sandbox_mod, "detect_host", no_vm)
    with pytest.raises(ValueError, match="backend must be None"):
        Sandbox.create(backend="xen")
    with pytest.raises(ValueError, match="backend must be None"):
        SandboxPool(backend="Firecracker")
    qemu_host = HostInfo(backend="qemu", accel="tcg", reason="kvm_pvm detected: KVM guests cannot boot"
                         " here, using qemu/TCG", kvm_device=True, kvm_pvm=True, hw_virt=False, qemu="/q",
                         qemu_version="7.2", firecracker=None, tsc_khz=2_600_000)
    monkeypatch.setattr(sandbox_mod, "detect_host", lambda: qemu_host)
    with pytest.raises(SandboxError, match="backend='firecracker' needs a firecracker binary.*kvm_pvm detected"):
        Sandbox.create(backend="firecracker")
    monkeypatch.setattr(sandbox_mod, "detect_host", lambda: host)
    with pytest.raises(ValueError, match=r"vcpus must be in \[1, 32\] on firecracker, got 33"):
        Sandbox.create(vcpus=33)
    # This host has no qemu: a bare FileNotFoundError for qemu-img came from deep in the boot.
    with pytest.raises(SandboxError, match="qemu backend needs qemu-system-x86_64 and qemu-img.*fake firecracker"):
        Sandbox.create(backend="qemu")


def test_commands_are_isolated_from_each_other_on_firecracker(fc):
    """The exec protocol as the guest agent speaks it: the end-of-command marker, a kept
    background writer that never reaches a later command's output, the tree killed at return."""
    with fc() as sb:
        assert sb.exec("(sleep 0.5; echo LATE) & echo a", timeout=10).stdout == b"a\n"
        r = sb.exec("sleep 1; echo b; exit 4", timeout=10)
        assert (r.stdout, r.stderr, r.exit_code) == (b"b\n", b"", 4)
        # a writer that stops by itself (the fake's processes run on this host)
        sb.exec("(for i in $(seq 30); do echo X; echo Y >&2; sleep 0.05; done) & echo go", timeout=10,
                keep_background=True)
        for i in range(3):
            r = sb.exec(f"sleep 0.2; echo out{i}", timeout=10)
            assert (r.stdout, r.stderr) == (f"out{i}\n".encode(), b"")
        assert sb.limits(max_pids=64) == {"mechanism": "rlimit", "max_pids": 64, "memory_mib": 64.0,
                                          "memory_used_mib": None}
        time.sleep(1.0)


def test_wedged_guest_and_destroy_during_exec_on_firecracker(fc):
    """A stopped firecracker process (a wedged guest): the exec raises grace_s after its timeout,
    the sandbox is unhealthy and refuses calls at once, restore() revives it. destroy() during an
    exec ends it with a state error naming the sandbox and the command."""
    with fc() as sb:
        sb.exec("echo v1 > root/m", timeout=10)
        with sb.snapshot() as snap:
            sb.grace_s = 1.0
            os.kill(sb.pids()[0], signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(SandboxTimeout, match=rf"sandbox {sb.id}: no answer .* exec 'echo hi'"):
                sb.exec("echo hi", timeout=0.5)
            assert 1.5 <= time.monotonic() - t0 < 4.0 and sb.state == "unhealthy"
            with pytest.raises(SandboxStateError, match=rf"sandbox {sb.id} is unhealthy \(exec 'true'\)"):
                sb.exec("true")
            sb.restore(snap)
            assert sb.exec("cat root/m", timeout=10).stdout == b"v1\n"
        ended = []

        def run():
            try:
                sb.exec("sleep 30", timeout=60)
            except Exception as e:  # noqa: BLE001 - checked below
                ended.append(e)

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.5)
        sb.destroy()
        t.join(10)
        assert isinstance(ended[0], SandboxStateError)
        assert str(ended[0]) == f"sandbox {sb.id} was destroyed during exec 'sleep 30'"
