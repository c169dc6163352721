"""AgentEnv against hostile commands: output leaks between execs, fork bombs, memory hogs, a
wedged guest, destroy during exec, and a loop of all of them that must leave nothing on the host.

One guest is cold-booted for the module (the pool's base snapshot); each test works in its own
copy-on-write restore of it. Needs the QEMU tools (``python -m k3lab.agentenv.sysdeps``).
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from k3lab.agentenv import (Sandbox, SandboxPool, SandboxStateError, SandboxTimeout, leftovers,
                            sysdeps)
from k3lab.agentenv.qemu import QemuVM

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(sysdeps.skip_requested() and bool(sysdeps.missing_packages()),
                       reason="K3LAB_SKIP_SYSDEPS=1 and the QEMU tools are missing"),
]

# Killed at its timeout; the background half keeps forking once the foreground shell is done.
FORK_BOMB = "f() { f | f & }; f; sleep 100"
# Three 40 MB buffers (the default memory limit is three quarters of the guest's 128 MiB; one
# buffer larger than the guest's RAM would just fail to allocate).
MEMORY_HOG = "for i in 1 2 3; do dd if=/dev/zero of=/dev/null bs=40M count=1 & done; wait"
# Processes in the sandbox's command cgroups other than this command's own shell (a builtin read).
OTHERS = "read n < /sys/fs/cgroup/k3/pids.current; echo $((n - 1))"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with SandboxPool(root=tmp_path_factory.mktemp("hostile")) as p:
        p.base  # boot once
        yield p


def _nothing_left(pool) -> dict:
    return leftovers(pool.root, exclude=(pool.base.path,))


def _others(sb: Sandbox) -> int:
    """Processes left running by earlier commands (all of them are in the sandbox's cgroup)."""
    return int(sb.exec(OTHERS, timeout=10).text)


def _error_of(fn, *args):
    """The exception ``fn(*args)`` raises (None if it returns)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the caller checks its type
        return e
    return None


def _timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_background_output_never_reaches_a_later_command(pool):
    """The leak: a background process of one exec wrote into the next exec's stdout (``b"b\\n"``,
    NUL bytes, then ``LATE``), and a steady writer made the next exec fail with "does not fit in
    the guest's /run"."""
    with pool.create() as sb:
        assert sb.exec("(sleep 1; echo LATE; echo LATE >&2; exit 9) & echo a", timeout=10).stdout == b"a\n"
        r = sb.exec("sleep 2; echo b; exit 3", timeout=10)
        assert (r.stdout, r.stderr, r.exit_code) == (b"b\n", b"", 3)
        # A steady writer on stdout and stderr, kept alive on purpose: later commands stay exact.
        r = sb.exec("(while true; do echo X; echo Y >&2; usleep 20000; done) & echo started",
                    timeout=10, keep_background=True)
        assert r.stdout.startswith(b"started\n") and set(r.stdout[8:]) <= set(b"X\n"), r
        for i in range(3):
            r = sb.exec(f"usleep 300000; echo out{i}; echo err{i} >&2; exit {i}", timeout=10)
            assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == (f"out{i}\n".encode(),
                                                                     f"err{i}\n".encode(), i, False)
        assert _others(sb) > 0  # still writing
        # A big output after it: the writer's files are not the new command's, nothing overflows.
        r = sb.exec("head -c 2000000 /dev/zero", timeout=60)
        assert r.stdout == bytes(2_000_000) and r.stderr == b""


def test_daemons_die_with_their_command_unless_kept(pool):
    """A daemon (``setsid``, its own session and process group) outlived its command; now the
    command's cgroup takes it along. ``keep_background=True`` keeps it, still writing only into
    its own command's output."""
    daemon = "setsid sh -c 'while true; do echo D; usleep 50000; done' & echo started"
    with pool.create() as sb:
        assert sb.exec(daemon, timeout=10).stdout == b"started\n"
        assert _others(sb) == 0
        sb.exec(daemon, timeout=10, keep_background=True)
        assert sb.exec("usleep 300000; echo quiet", timeout=10).stdout == b"quiet\n"
        assert _others(sb) > 0
        r = sb.exec("usleep 300000; echo quiet", timeout=10, root=True)
        assert (r.stdout, r.stderr) == (b"quiet\n", b"")


def test_commands_run_unprivileged_unless_root(pool):
    with pool.create() as sb:
        r = sb.exec("id -u; pwd; kill -9 $PPID; cat /proc/self/status | grep ^Groups", timeout=10)
        assert re.fullmatch(rb"1000\n/home/user\nGroups:\s*\n", r.stdout) and b"not permitted" in r.stderr, r
        for path in ("/etc/passwd", "/root/x", "/sbin/k3agent", "/sys/fs/cgroup/k3/pids.max",
                     "/proc/sys/kernel/yama/ptrace_scope", "/proc/1/mem", "/dev/hvc0"):
            assert sb.exec(f"echo x >> {path}", timeout=10).exit_code != 0, path
        assert sb.exec("id -u; pwd", timeout=10, root=True).stdout == b"0\n/root\n"
        # a kept process cannot ptrace a later command of the same user
        pid = int(sb.exec("sleep 100 & echo $!", timeout=10, keep_background=True).text)
        r = sb.exec(f"cat /proc/{pid}/mem", timeout=10)
        # the open is refused (without Yama it opens, and the read at address 0 fails with EIO)
        assert b"Permission denied" in r.stderr or b"not permitted" in r.stderr, r
        assert sb.exec("cat /proc/sys/kernel/yama/ptrace_scope", timeout=10).stdout == b"2\n"
        sb.write_file("/home/user/task", "t")
        sb.write_file("/root/grader", "g", root=True)
        r = sb.exec("echo mine >> task && cat task; cat /root/grader", timeout=10)
        assert r.stdout == b"tmine\n" and r.exit_code == 1


@pytest.mark.parametrize("root", [False, True], ids=["user", "root"])
def test_fork_bomb_killed_at_its_timeout(pool, root):
    with pool.create() as sb:
        timeout = 3.0
        r, took = _timed(lambda: sb.exec(FORK_BOMB, timeout=timeout, root=root))
        assert r.timed_out and r.exit_code == 137, r
        # The agent kills the tree at the timeout and answers within about a second; the margin
        # is for a loaded 2-core CI box.
        assert timeout <= took < timeout + 3.0, took
        assert _others(sb) == 0
        assert sb.limits()["memory_used_mib"] < 8


def test_memory_hog_killed_inside_the_sandbox(pool):
    with pool.create() as sb:
        r, took = _timed(lambda: sb.exec(MEMORY_HOG, timeout=20))
        assert r.exit_code == 137 and not r.timed_out, (r, took)  # the OOM killer, not the timeout
        assert b"killed: out of memory (the sandbox's limit is" in r.stderr, r.stderr
        # Smaller limits for this sandbox: a 48 MB buffer no longer fits, 20 processes at most.
        lim = sb.limits(max_pids=20, memory_mib=32)
        assert (lim["mechanism"], lim["max_pids"], lim["memory_mib"]) == ("cgroup", 20, 32)
        r = sb.exec("dd if=/dev/zero of=/dev/null bs=48M count=1", timeout=20)
        assert r.exit_code == 137 and b"out of memory" in r.stderr, r
        r = sb.exec("for i in $(seq 30); do sleep 2 & done; wait", timeout=20)
        assert b"can't fork" in r.stderr, r
        assert sb.exec("dd if=/dev/zero of=/dev/null bs=8M count=1 2>/dev/null && echo fits", timeout=20).stdout == \
            b"fits\n"


def test_wedged_guest_is_reported_within_the_grace_period(pool):
    """A fork bomb without a timeout that kills it made every later exec wait timeout + 60 s. A
    guest agent that is stopped (SIGSTOP) now makes the exec raise grace_s after its timeout;
    the sandbox turns unhealthy, every later call fails at once naming the sandbox and why, and
    restore() brings it back."""
    with pool.create() as sb:
        sb.exec("echo before > /home/user/m", timeout=10)
        with sb.snapshot() as snap:
            timeout = 1.0
            with pytest.raises(SandboxTimeout, match=rf"sandbox {sb.id}: no answer from the guest agent to"
                               r" exec 'kill -STOP \$PPID; echo stopped'.*unhealthy") as e:
                t0 = time.monotonic()
                sb.exec("kill -STOP $PPID; echo stopped", timeout=timeout, root=True)
            took = time.monotonic() - t0
            assert timeout + Sandbox.grace_s <= took < timeout + Sandbox.grace_s + 2.0, took
            assert sb.state == "unhealthy"
            calls = {"exec": lambda: sb.exec("true"), "read_file": lambda: sb.read_file("/home/user/m"),
                     "write_file": lambda: sb.write_file("/tmp/x", "x"), "pause": sb.pause,
                     "snapshot": sb.snapshot, "fork": lambda: sb.fork(1), "limits": sb.limits}
            for name, call in calls.items():
                t0 = time.monotonic()
                with pytest.raises(SandboxStateError, match=rf"sandbox {sb.id} is unhealthy.*kill -STOP"):
                    call()
                assert time.monotonic() - t0 < 0.5, name
            assert "STOP" in str(e.value)
            sb.restore(snap)
            assert sb.exec("cat m", timeout=10).stdout == b"before\n"


def test_destroy_during_exec_is_a_state_error(pool):
    """destroy() from another thread ended the running exec with SandboxCrashed ("QEMU killed by
    signal 9"), though nothing crashed."""
    sb = pool.create()
    out = {}
    t = threading.Thread(target=lambda: out.update(error=_error_of(sb.exec, "sleep 60", 120)))
    t.start()
    time.sleep(0.5)
    _, took = _timed(sb.destroy)
    t.join(10)
    assert not t.is_alive() and took < 5
    assert isinstance(out["error"], SandboxStateError), out
    assert re.fullmatch(rf"sandbox {sb.id} was destroyed during exec 'sleep 60'", str(out["error"]))
    assert _nothing_left(pool) == {"files": [], "pids": []}


def test_hostile_loop_leaves_nothing_on_the_host(pool):
    """Leaks, bombs, hogs, a wedged guest and destroy during exec, mixed, three rounds; then no
    file under the sandbox root and no process that mentions it."""
    for i in range(3):
        sb = pool.create()
        sb.exec("(while true; do echo leak; done) & setsid sleep 1000 & echo go", timeout=10,
                keep_background=i == 1)
        assert sb.exec(f"echo {i}", timeout=10).stdout == f"{i}\n".encode()
        assert sb.exec(FORK_BOMB, timeout=1.5, root=i == 2).timed_out
        assert sb.exec(MEMORY_HOG, timeout=20).exit_code == 137
        if i != 1:
            assert _others(sb) == 0
        sb.grace_s = 1.0  # the wedges below are detected a second after their timeout
        if i == 0:
            with pytest.raises(SandboxTimeout):
                sb.exec("kill -STOP $PPID", timeout=0.5, root=True)
            sb.destroy()
        elif i == 1:
            os.kill(sb.pids()[0], signal.SIGSTOP)  # a wedged VM process: destroy still works
            with pytest.raises(SandboxTimeout):
                sb.exec("true", timeout=0.5)
            sb.destroy()
        else:
            ended = []
            t = threading.Thread(target=lambda: ended.append(_error_of(sb.exec, "sleep 60")))
            t.start()
            time.sleep(0.3)
            sb.destroy()
            t.join(10)
            assert isinstance(ended[0], SandboxStateError), ended
    assert _nothing_left(pool) == {"files": [], "pids": []}


def _without_memory_cgroup(self, *args):
    cmd = _real_cmdline(self, *args)
    i = cmd.index("-append")
    cmd[i + 1] += " cgroup_disable=memory"
    return cmd


_real_cmdline = QemuVM.cmdline


def test_rlimits_where_the_guest_kernel_has_no_memory_cgroup(monkeypatch, tmp_path):
    """Without cgroup v2's memory controller the agent falls back to rlimits of the unprivileged
    user and kills by process group and by uid: a fork bomb and a daemon still die with their
    command, what a command keeps survives (and from then on the kill by uid is off)."""
    monkeypatch.setattr(QemuVM, "cmdline", _without_memory_cgroup)
    with Sandbox.create(root=tmp_path) as sb:
        assert sb.limits(max_pids=40)["mechanism"] == "rlimit"
        assert sb.exec("ulimit -u", timeout=10).stdout == b"40\n"
        ps = "ps -o user,args | grep -c '^user'"  # user's processes: this sh, ps and grep
        r, took = _timed(lambda: sb.exec(FORK_BOMB, timeout=2))
        assert r.timed_out and took < 5 and b"can't fork" in r.stderr, (r, took)
        sb.exec("setsid sleep 1000 & echo d", timeout=10)
        assert sb.exec(ps, timeout=10).stdout == b"3\n"
        sb.exec("setsid sleep 1000 &", timeout=10, keep_background=True)
        assert sb.exec("ps -o args | grep -c '^sleep 1000'", timeout=10).stdout == b"1\n"
        assert b"out of memory" in sb.exec("dd if=/dev/zero of=/dev/null bs=80M count=1", timeout=10).stderr
    assert leftovers(tmp_path) == {"files": [], "pids": []}
