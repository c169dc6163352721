"""AgentEnv sandboxes: exec, files, lifecycle, fork isolation, crash detection, cleanup.

One guest is cold-booted per module (the pool's base snapshot, ~5 s under TCG); every test gets
its own copy-on-write restore of it (~0.3 s). Needs the system packages installed by
``python -m k3lab.agentenv.sysdeps`` (``make test`` runs it first); skipped when
``K3LAB_SKIP_SYSDEPS=1`` left them uninstalled.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time

import pytest

from k3lab.agentenv import (Sandbox, SandboxCrashed, SandboxError, SandboxPool, SandboxStateError,
                            build_image, detect_host, leftovers)
from k3lab.agentenv.agent import AgentChannel, AgentClosed
from k3lab.agentenv import sysdeps
from k3lab.agentenv.qemu import QemuVM

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(sysdeps.skip_requested() and bool(sysdeps.missing_packages()),
                       reason="K3LAB_SKIP_SYSDEPS=1 and the QEMU tools are missing"),
]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("sandboxes")
    with SandboxPool(root=root) as p:
        p.base  # boot once
        yield p


def _nothing_left(pool) -> dict:
    return leftovers(pool.root, exclude=(pool.base.path,))


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_exec_exit_code_stdout_stderr(pool):
    with pool.create() as sb:
        r = sb.exec("echo out; echo err >&2; exit 3", timeout=10)
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"out\n", b"err\n", False)
        # binary-safe and large: every byte value, and 300 KB of output
        r = sb.exec("i=0; while [ $i -lt 256 ]; do printf \"\\\\$(printf %o $i)\"; i=$((i+1)); done", timeout=30)
        assert r.stdout == bytes(range(256)), r.stdout[:40]
        # Generous timeout: under TCG on a loaded 2-core host this took > 30 s once (the guest's timeout
        # fired and a correct, partial stdout came back).
        r = sb.exec("head -c 300000 /dev/urandom | base64 -w0 | head -c 300000", timeout=180)
        assert r.ok and len(r.stdout) == 300000, (r.exit_code, r.timed_out, len(r.stdout))
        with pytest.raises(ValueError, match="timeout"):
            sb.exec("true", timeout=0)
        # The guest's shell dropped the NUL and ran "echo ab".
        with pytest.raises(ValueError, match="cmd must not contain a NUL"):
            sb.exec("echo a\0b")
        with pytest.raises(TypeError, match="root must be a bool"):
            sb.write_file("/tmp/x", "a", root="yes")


def test_exec_timeout_kills_command_not_host(pool):
    with pool.create() as sb:
        t0 = time.monotonic()
        r = sb.exec("sleep 300 & sleep 200; echo never", timeout=1.0)
        assert r.timed_out and r.exit_code == 137 and b"never" not in r.stdout
        assert time.monotonic() - t0 < 30
        # the whole process group died (the background sleep too) and the sandbox still serves
        ps = sb.exec("ps -o args", timeout=10).text
        assert "sleep 300" not in ps and "sleep 200" not in ps, ps
        assert sb.exec("echo alive", timeout=10).stdout == b"alive\n"
        # a command that kills the agent itself: reported, and the restarted agent serves on
        with pytest.raises(SandboxError, match="agent restarted"):
            sb.exec("kill -9 $PPID; sleep 5", timeout=10, root=True)
        assert sb.exec("echo again", timeout=10).stdout == b"again\n"


def test_files_roundtrip(pool):
    data = os.urandom(150_000)
    with pool.create() as sb:
        sb.write_file("/home/user/blob.bin", data, mode=0o600)
        assert sb.read_file("/home/user/blob.bin") == data
        assert sb.exec("stat -c %a /home/user/blob.bin", timeout=10).stdout == b"600\n"
        sb.write_file("/tmp/t.txt", "hello\n")
        assert sb.exec("cat /tmp/t.txt", timeout=10).stdout == b"hello\n"
        with pytest.raises(FileNotFoundError, match="/nope"):
            sb.read_file("/nope")
        with pytest.raises(ValueError, match="absolute"):
            sb.write_file("relative.txt", b"x")


def _stall_host(monkeypatch, seconds: float) -> None:
    """Make the host stop reading for ``seconds`` at the start of every reply, as a host process
    descheduled on a loaded box does."""
    real, stalled = AgentChannel._recv, set()

    def recv(self, deadline):
        if (self, self.next_id) not in stalled:
            stalled.add((self, self.next_id))
            time.sleep(seconds)
        return real(self, deadline)

    monkeypatch.setattr(AgentChannel, "_recv", recv)


def test_binary_roundtrip_under_load_with_a_stalled_host(pool, monkeypatch):
    """The flake this guards: on a loaded box a 150 KB read came back with its end wrong. QEMU's
    virtconsole drops guest output that the host socket cannot take at once, so a host that
    stopped reading for a moment lost the middle of a reply. Now the guest sends one 32 KiB chunk
    and waits for the host's ack. Every byte value and the tty control bytes (^C ^D XON XOFF ^Z
    CR LF DEL) pass raw to the guest; a busy sibling sandbox loads the host meanwhile."""
    control = b"\x00\x03\x04\x11\x13\x1a\r\n\r\x7f\xff"
    data = bytes(range(256)) * 400 + control * 3000 + os.urandom(150_000)
    with pool.create() as busy, pool.create() as sb:
        busy.exec("(while true; do :; done) >/dev/null 2>&1 &", timeout=10, keep_background=True)
        _stall_host(monkeypatch, 1.0)
        sb.write_file("/home/user/blob.bin", data)
        assert sb.exec("md5sum /home/user/blob.bin", timeout=60).stdout.split()[0].decode() == \
            hashlib.md5(data).hexdigest()
        back = sb.read_file("/home/user/blob.bin")
        assert len(back) == len(data) and back == data
        assert sb.exec("cat /home/user/blob.bin", timeout=60).stdout == data


def test_agent_on_the_serial_port(tmp_path):
    """The image's Firecracker path on QEMU: the agent on the 8250 serial port (``ttyS0``, named
    by ``k3lab.agent=``; no virtio console), the kernel console on the same port but silent
    (``loglevel=0``)."""
    image, host = build_image(), detect_host()
    vm = QemuVM(tmp_path, image, 128, 1, host.accel, host.tsc_khz, agent_port="ttyS0")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(image.rootfs),
                    str(tmp_path / "disk.qcow2")], check=True)
    vm.start(tmp_path / "disk.qcow2", tmp_path / "ram", True)
    ch = None
    try:
        ch = AgentChannel.connect_unix(vm.agent_path, time.monotonic() + 180)
        ch.wait_for(b"@K3READY", time.monotonic() + 180)

        def deadline():
            return time.monotonic() + 120

        r = ch.exec("cat /proc/cmdline; test -e /dev/hvc0 || echo no-hvc0", 30, deadline())
        assert "k3lab.agent=ttyS0" in r.text and "no-hvc0" in r.text, r
        data = bytes(range(256)) * 200 + b"\x03\x04\x11\x13\x1a\r\n" * 2000  # 65 KB: 2 payload chunks
        assert ch.write_file("/home/user/b", data, 0o600, deadline()).exit_code == 0
        assert ch.read_file("/home/user/b", deadline()).stdout == data
        r = ch.exec("echo '<0>k3lab-emergency' > /dev/kmsg; dmesg | grep -c k3lab-emergency", 30, deadline(),
                    root=True)
        assert r.stdout == b"1\n" and b"k3lab-emergency" not in ch.recent  # logged, not on the port
        with pytest.raises(AgentClosed):  # a guest panic ends QEMU (-no-reboot): EOF
            ch.exec("echo c > /proc/sysrq-trigger", 30, deadline(), root=True)
    finally:
        if ch is not None:
            ch.close()
        vm.kill()


def test_paths_keep_trailing_newlines_and_a_too_big_output_is_named(pool):
    """write_file("/tmp/t\\n") wrote /tmp/t (the guest's $(...) dropped the newline), and read_file
    read /tmp/t. Output larger than a command's output space (a quarter of guest RAM) is named as
    such, not passed on cut short, and the agent serves on."""
    with pool.create() as sb:
        sb.write_file("/tmp/t\n", b"newline")
        sb.write_file("/tmp/t", b"plain")
        assert sb.read_file("/tmp/t\n") == b"newline" and sb.read_file("/tmp/t") == b"plain"
        assert sb.exec("cat /tmp/t '/tmp/t\n'", timeout=10).stdout == b"plainnewline"
        with pytest.raises(SandboxError, match=r"sandbox sb.*exec 'head -c 30000000 /dev/zero'.*output filled"
                                               r" its \d+ KiB"):
            sb.exec("head -c 30000000 /dev/zero", timeout=120)
        assert sb.exec("echo ok", timeout=10).stdout == b"ok\n"


def test_paused_sandbox_snapshots_forks_and_hibernates_again(pool):
    """A snapshot of a paused sandbox left QEMU in "postmigrate", which refuses a migration: the
    next snapshot, fork or hibernate failed ("Can't migrate the vm that was paused due to
    previous migration")."""
    with pool.create() as sb:
        sb.exec("echo p > /tmp/m", timeout=10)
        sb.pause()
        sb.snapshot().delete()
        sb.snapshot().delete()
        (kid,) = sb.fork(1)
        with kid:
            assert kid.exec("cat /tmp/m", timeout=10).stdout == b"p\n"
        assert sb.state == "paused"
        sb.hibernate()
        sb.wake()
        assert sb.exec("cat /tmp/m", timeout=10).stdout == b"p\n"
    assert _nothing_left(pool) == {"files": [], "pids": []}


def test_odd_and_too_deep_roots(pool, tmp_path):
    """A root with "," in its path: QEMU read the comma as the end of an option value and exited
    ("=" broke the -qmp option the same way). A root too deep for a unix socket path failed with
    a bare OSError from connect()."""
    odd = tmp_path / "a,b=c"
    with Sandbox.from_snapshot(pool.base, root=odd) as sb:
        sb.exec("echo x > /home/user/f", timeout=10)
        (kid,) = sb.fork(1)  # a snapshot and a restore inside the odd root
        with kid:
            assert kid.exec("cat /home/user/f", timeout=10).stdout == b"x\n"
    deep = tmp_path / ("d" * 100)
    with pytest.raises(ValueError, match="root is too deep"):
        Sandbox.from_snapshot(pool.base, root=deep)
    assert leftovers(tmp_path) == {"files": [], "pids": []}


def test_restore_refuses_a_snapshot_of_another_shape(pool, tmp_path):
    """Restoring a 192 MiB snapshot into a 128 MiB sandbox escaped as a bare ConnectionResetError
    (QEMU refused the state and dropped QMP mid-command) and left the dead sandbox "running"."""
    with Sandbox.create(memory_mib=192, root=tmp_path) as big, pool.create() as sb:
        with big.snapshot() as snap:
            with pytest.raises(SandboxError, match="memory_mib=192"):
                sb.restore(snap)
        assert sb.exec("echo still", timeout=10).stdout == b"still\n"


def _cmdline_with_a_bad_option(self, *args):
    return _real_cmdline(self, *args) + ["-no-such-option"]


_real_cmdline = QemuVM.cmdline


def test_qemu_that_refuses_to_start_is_reported_at_once(pool, monkeypatch):
    """QEMU exiting on its command line was reported only when the start timeout ran out (60 s
    for a restore, 180 s for a boot): the wait for the QMP socket did not look at the process."""
    monkeypatch.setattr(QemuVM, "cmdline", _cmdline_with_a_bad_option)
    with pytest.raises(SandboxCrashed, match=r"QEMU exited \(status 1\) before its QMP socket"):
        Sandbox.from_snapshot(pool.base, timeout=20)
    assert _nothing_left(pool) == {"files": [], "pids": []}


def test_pause_holds_no_cpu_and_resume(pool):
    with pool.create() as sb:
        sb.exec("(while true; do :; done) >/dev/null 2>&1 &", timeout=10, keep_background=True)  # busy
        sb.pause()
        with pytest.raises(SandboxStateError, match="paused"):
            sb.exec("true")
        pid = sb.pids()[0]
        before = _cpu_ticks(pid)
        time.sleep(1.0)
        used = _cpu_ticks(pid) - before
        assert used <= 5, f"paused VM used {used} ticks in 1 s"  # 100 ticks = one busy core
        sb.resume()
        assert sb.exec("echo back", timeout=10).stdout == b"back\n"


def test_snapshot_restore_in_place(pool):
    with pool.create() as sb:
        sb.exec("echo v1 > /tmp/mem; echo v1 > /home/user/disk; sync", timeout=10)
        with sb.snapshot() as snap:
            sb.exec("echo v2 > /tmp/mem; echo v2 > /home/user/disk; sync", timeout=10)
            sb.restore(snap)
            assert sb.exec("cat /tmp/mem /home/user/disk", timeout=10).stdout == b"v1\nv1\n"
            with Sandbox.from_snapshot(snap) as other:
                assert other.exec("cat /tmp/mem", timeout=10).stdout == b"v1\n"


@pytest.mark.parametrize("cow_parent", [False, True], ids=["own-ram-parent", "cow-parent"])
def test_fork_isolation_disk_and_memory(pool, cow_parent):
    with pool.create(cow=cow_parent) as parent:
        # memory: a tmpfs file and a live shell process holding a value; disk: an ext4 file. The loop renames
        # a finished file into place: `echo > /tmp/live` truncates first, and a read in between sees nothing.
        parent.exec("echo parent > /tmp/m; echo parent > /home/user/d; sync;"
                    " (v=parent; while true; do echo $v > /tmp/live.new; mv /tmp/live.new /tmp/live; sleep 0.2;"
                    " done) >/dev/null 2>&1 &",
                    timeout=10, keep_background=True)
        a, b = parent.fork(2)
        try:
            a.exec("echo A > /tmp/m; echo A > /home/user/d; echo A-only > /home/user/new; sync", timeout=10)
            b.exec("echo B > /tmp/m; echo B > /home/user/d; sync", timeout=10)
            drop = "echo 3 > /proc/sys/vm/drop_caches; "  # re-read the disk, not the page cache
            assert a.exec(drop + "cat /tmp/m /home/user/d", timeout=10, root=True).stdout == b"A\nA\n"
            assert b.exec(drop + "cat /tmp/m /home/user/d", timeout=10, root=True).stdout == b"B\nB\n"
            assert parent.exec(drop + "cat /tmp/m /home/user/d", timeout=10, root=True).stdout == \
                b"parent\nparent\n"
            for sb in (parent, b):
                assert sb.exec("test -e /home/user/new", timeout=10).exit_code == 1
            # the forked process state came along and runs on in each child
            time.sleep(0.5)
            assert a.exec("cat /tmp/live", timeout=10).stdout == b"parent\n"
        finally:
            a.destroy()
            b.destroy()


@pytest.mark.parametrize("cow", [False, True], ids=["own-ram", "cow"])
def test_hibernate_releases_everything_and_wakes_exactly(pool, cow):
    with pool.create(cow=cow) as sb:
        sb.exec("echo hib > /tmp/m; sleep 1000 >/dev/null 2>&1 & echo $! > /tmp/pid", timeout=10,
                keep_background=True)
        sb.hibernate()
        mem = sb.memory()
        assert sb.state == "hibernated" and sb.pids() == [] and mem["rss"] == mem["pss"] == 0
        assert mem["ram_file_cache"] < 4096, mem  # KiB: the RAM file was evicted from the page cache
        with pytest.raises(SandboxStateError):
            sb.exec("true")
        # A NaN timeout started a QEMU that nothing tracked; 0 left a sandbox that could never wake.
        for bad in (float("nan"), 0, -1):
            with pytest.raises(ValueError, match="timeout must be > 0"):
                sb.wake(timeout=bad)
        assert sb.state == "hibernated" and sb.pids() == []
        sb.wake()
        r = sb.exec("cat /tmp/m; kill -0 $(cat /tmp/pid) && echo running", timeout=10)
        assert r.stdout == b"hib\nrunning\n"
        # a copy-on-write sandbox hibernates through a full stream and wakes on its own RAM file
        assert sb.ram_shared


def test_crashed_and_killed_guest_detected(pool):
    with pool.create() as sb:
        with pytest.raises(SandboxCrashed, match="guest: .*Kernel panic"):
            sb.exec("echo c > /proc/sysrq-trigger", timeout=10, root=True)  # guest kernel panic
        assert sb.state == "crashed"
    with pool.create() as sb:
        os.kill(sb.pids()[0], signal.SIGKILL)
        with pytest.raises(SandboxCrashed, match="signal 9"):
            sb.exec("true", timeout=10)
    with pool.create() as sb:
        os.kill(sb.pids()[0], signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(SandboxCrashed):
            sb.pause()
    assert _nothing_left(pool) == {"files": [], "pids": []}


def test_destroy_leaves_no_files_or_processes(pool):
    assert _nothing_left(pool) == {"files": [], "pids": []}
    sb = pool.create()
    kids = sb.fork(2)
    snap = kids[0].snapshot()
    grandchild = Sandbox.from_snapshot(snap)
    seen = _nothing_left(pool)
    assert len(seen["pids"]) == 4 and len(seen["files"]) > 8
    snap.delete()  # still needed by grandchild: must survive until it goes
    assert snap.path.is_dir()
    for s in (sb, *kids, grandchild):
        s.destroy()
        s.destroy()  # idempotent
    assert not snap.path.exists()
    assert _nothing_left(pool) == {"files": [], "pids": []}


def test_loop_of_20_leaves_nothing(pool):
    for i in range(20):
        sb = pool.create(cow=False)
        (child,) = sb.fork(1)
        child.pause()
        sb.pause()
        child.resume()
        sb.resume()
        assert child.exec(f"echo {i}", timeout=10).stdout == f"{i}\n".encode()
        child.destroy()
        sb.destroy()
    pool.live()
    assert _nothing_left(pool) == {"files": [], "pids": []}


def test_pool_many_and_close(tmp_path, pool):
    sbs = pool.create_many(3)
    assert len({s.id for s in sbs}) == 3
    assert [s.exec("echo ok", timeout=10).stdout for s in sbs] == [b"ok\n"] * 3
    for s in sbs:
        s.destroy()
    assert _nothing_left(pool) == {"files": [], "pids": []}


def test_bad_arguments():
    with pytest.raises(ValueError, match="memory_mib"):
        Sandbox.create(memory_mib=16)
    with pytest.raises(ValueError, match="boot_timeout must be > 0"):
        Sandbox.create(boot_timeout=0)
    with pytest.raises(TypeError, match="snapshot must be a Snapshot"):
        Sandbox.from_snapshot("/tmp/x")
    with pytest.raises(ValueError, match="vcpus"):
        Sandbox.create(vcpus=0)


def test_rl_rollout_hibernates_while_waiting_and_grades_in_a_fork(pool):
    from k3lab.agentenv.rl_demo import run_rollout

    res = run_rollout(pool, n_agents=3, steps=2, inference_s=0.1)
    assert res.rewards == [1, 1, 0]  # agent 2's scripted policy slips by one
    assert res.untouched == [True, True, True]  # the destructive grader ran in forks only
    assert res.max_live_processes_while_waiting == 0
    assert [o[0] for o in res.outputs] == ["5", "6", "7"]
    assert _nothing_left(pool) == {"files": [], "pids": []}
