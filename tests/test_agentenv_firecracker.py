"""Firecracker API client and process wrapper against ``tests/fake_firecracker.py`` (real
Firecracker needs KVM, absent here).

The fake serves Firecracker's API subset on ``--api-sock``, logs every request (method, path, JSON
body), keeps Firecracker's state machine (Not started -> Running <-> Paused; pre-boot resources
only before the start; snapshots only while paused; Diff only with dirty-page tracking; load only
on a fresh process, which ends if the load fails) and answers 204/400 with ``fault_message`` like
the real one. These tests assert the exact paths and bodies; ``test_agentenv_fc_sandbox.py`` runs
the Sandbox API on it.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sys
import tarfile
import time

import pytest

from k3lab.agentenv.agent import AgentChannel, AgentClosed, AgentTimeout
from k3lab.agentenv.firecracker import (FirecrackerClient, FirecrackerError, FirecrackerVM,
                                        merge_diff_memory)

pytestmark = pytest.mark.timeout(120)

FAKE = os.path.join(os.path.dirname(__file__), "fake_firecracker.py")


@pytest.fixture
def fake_binary(tmp_path):
    exe = tmp_path / "firecracker"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    exe.chmod(0o755)
    return exe


@pytest.fixture
def files(tmp_path):
    """A kernel, an initrd and a root drive (a tar, the fake's disk format) in tmp_path/img."""
    img = tmp_path / "img"
    img.mkdir()
    (img / "vmlinux").write_bytes(b"\x7fELF")
    (img / "initrd.gz").write_bytes(b"initrd")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("./root")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    (img / "rootfs.ext4").write_bytes(buf.getvalue())
    return img


def _requests(vm: FirecrackerVM) -> list:
    with open(str(vm.api_sock) + ".requests.jsonl") as f:
        return [json.loads(line) for line in f]


def test_boot_pause_snapshot_requests(fake_binary, files, tmp_path):
    vm = FirecrackerVM(str(fake_binary), tmp_path)
    c = vm.launch()
    try:
        assert c.describe()["state"] == "Not started"
        vm.boot(kernel=str(files / "vmlinux"), rootfs=str(files / "rootfs.ext4"), boot_args="console=ttyS0",
                initrd=str(files / "initrd.gz"), vcpus=2, mem_mib=64)
        assert c.describe()["state"] == "Running"
        vm.snapshot(str(tmp_path / "full.state"), str(tmp_path / "full.mem"))
        assert c.describe()["state"] == "Paused"
        c.resume()
        c.pause()
        c.create_snapshot(str(tmp_path / "d.state"), str(tmp_path / "d.mem"), diff=True)
        c.resume()
        assert (tmp_path / "full.mem").stat().st_size == 64 << 20 and (tmp_path / "d.state").is_file()
        reqs = _requests(vm)
    finally:
        vm.kill()
    assert reqs == [
        ["GET", "/", None],
        ["PUT", "/machine-config", {"vcpu_count": 2, "mem_size_mib": 64, "smt": False, "track_dirty_pages": True}],
        ["PUT", "/boot-source", {"kernel_image_path": str(files / "vmlinux"), "boot_args": "console=ttyS0",
                                 "initrd_path": str(files / "initrd.gz")}],
        ["PUT", "/drives/rootfs", {"drive_id": "rootfs", "path_on_host": str(files / "rootfs.ext4"),
                                   "is_root_device": True, "is_read_only": False}],
        ["PUT", "/actions", {"action_type": "InstanceStart"}],
        ["GET", "/", None],
        ["PATCH", "/vm", {"state": "Paused"}],
        ["PUT", "/snapshot/create", {"snapshot_type": "Full", "snapshot_path": str(tmp_path / "full.state"),
                                     "mem_file_path": str(tmp_path / "full.mem")}],
        ["GET", "/", None],
        ["PATCH", "/vm", {"state": "Resumed"}],
        ["PATCH", "/vm", {"state": "Paused"}],
        ["PUT", "/snapshot/create", {"snapshot_type": "Diff", "snapshot_path": str(tmp_path / "d.state"),
                                     "mem_file_path": str(tmp_path / "d.mem")}],
        ["PATCH", "/vm", {"state": "Resumed"}],
    ]
    assert not vm.api_sock.exists() and vm.proc.poll() is not None
    # Firecracker's own log went to --log-path, never into the serial console on stdout
    assert (tmp_path / "firecracker.log").read_text().startswith("Running Firecracker")


def test_load_snapshot_with_file_backend_and_relative_paths(fake_binary, files, tmp_path):
    """A snapshot records relative drive paths; a process in another folder resolves them to
    that folder's files. A failed load ends the process, as Firecracker's does."""
    d1, d2, d3 = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (d1, d2, d3):
        d.mkdir()
    shutil.copy(files / "rootfs.ext4", d1 / "rootfs.ext4")
    vm1 = FirecrackerVM(str(fake_binary), d1)
    vm1.launch()
    try:
        vm1.boot(kernel=str(files / "vmlinux"), rootfs="rootfs.ext4", boot_args="", mem_mib=64)
        vm1.snapshot(str(tmp_path / "s.state"), str(tmp_path / "s.mem"))
    finally:
        vm1.kill()
    shutil.copy(d1 / "rootfs.ext4", d2 / "rootfs.ext4")
    vm2 = FirecrackerVM(str(fake_binary), d2)
    c = vm2.launch()
    try:
        vm2.restore(str(tmp_path / "s.state"), str(tmp_path / "s.mem"))
        assert c.describe()["state"] == "Running"
        # loading again after start is refused by the VMM: the error carries its fault_message
        with pytest.raises(FirecrackerError, match=r"PUT /snapshot/load: HTTP 400: Loading a microVM snapshot"):
            c.load_snapshot(str(tmp_path / "s.state"), str(tmp_path / "s.mem"))
        assert vm2.proc.poll() is None
        reqs = _requests(vm2)
    finally:
        vm2.kill()
    assert reqs[0] == ["PUT", "/snapshot/load", {
        "snapshot_path": str(tmp_path / "s.state"),
        "mem_backend": {"backend_type": "File", "backend_path": str(tmp_path / "s.mem")},
        "track_dirty_pages": True, "resume_vm": True}]
    # d3 has no rootfs.ext4: the recorded relative drive path does not resolve there
    vm3 = FirecrackerVM(str(fake_binary), d3)
    vm3.launch()
    try:
        with pytest.raises(FirecrackerError, match="backing file rootfs.ext4: No such file"):
            vm3.restore(str(tmp_path / "s.state"), str(tmp_path / "s.mem"))
        assert vm3.proc.wait(timeout=10) == 1
    finally:
        vm3.kill()


def test_agent_on_the_serial_console_pipes(fake_binary, files, tmp_path):
    """The guest's serial console is the process's stdin/stdout: the agent answers there after
    boot, keeps its channel across pause/snapshot/resume (the serial device is not reset), and
    after a snapshot load answers on the new process's pipes with no boot banner."""
    shutil.copy(files / "rootfs.ext4", tmp_path / "rootfs.ext4")
    vm = FirecrackerVM(str(fake_binary), tmp_path)
    vm.launch()
    ch = AgentChannel.from_pipes(vm.proc.stdout, vm.proc.stdin)
    try:
        vm.boot(kernel=str(files / "vmlinux"), rootfs="rootfs.ext4", boot_args="", mem_mib=64)
        ch.wait_for(b"@K3READY", time.monotonic() + 10)
        assert b"Linux version" in ch.recent  # boot noise before the banner is skipped
        assert ch.exec("echo hi", 5, deadline=time.monotonic() + 10).stdout == b"hi\n"
        vm.snapshot(str(tmp_path / "s"), str(tmp_path / "m"))
        with pytest.raises(AgentTimeout):  # paused: nothing answers
            ch.ping(deadline=time.monotonic() + 0.3)
        vm.client.resume()
        assert ch.exec("echo again", 5, deadline=time.monotonic() + 10).stdout == b"again\n"
    finally:
        ch.close()
        vm.kill()
    vm2 = FirecrackerVM(str(fake_binary), tmp_path)
    vm2.launch()
    ch = AgentChannel.from_pipes(vm2.proc.stdout, vm2.proc.stdin)
    try:
        vm2.restore(str(tmp_path / "s"), str(tmp_path / "m"))
        ch.ping(deadline=time.monotonic() + 10)
        assert ch.exec("echo restored", 5, deadline=time.monotonic() + 10).stdout == b"restored\n"
        os.kill(vm2.proc.pid, signal.SIGKILL)
        with pytest.raises(AgentClosed):  # the process is gone: its pipes close
            ch.ping(deadline=time.monotonic() + 10)
    finally:
        ch.close()
        vm2.kill()


def test_errors_and_validation(fake_binary, files, tmp_path):
    vm = FirecrackerVM(str(fake_binary), tmp_path)
    c = vm.launch()
    try:
        with pytest.raises(FirecrackerError, match="not supported before starting"):
            c.pause()
        with pytest.raises(FirecrackerError, match="without kernel configuration"):
            c.start()
        with pytest.raises(FirecrackerError, match="cannot be opened"):
            c.set_boot_source(str(tmp_path / "missing-vmlinux"))
        with pytest.raises(FirecrackerError, match="Unable to open the block device"):
            c.add_drive("rootfs", "missing.ext4", is_root_device=True)
        c.set_machine_config(1, 64)  # no dirty-page tracking
        c.set_boot_source(str(files / "vmlinux"))
        c.add_drive("rootfs", str(files / "rootfs.ext4"), is_root_device=True)
        c.start()
        with pytest.raises(FirecrackerError, match="must be paused"):
            c.create_snapshot(str(tmp_path / "a"), str(tmp_path / "b"))
        with pytest.raises(FirecrackerError, match="not allowed after boot"):
            c.set_machine_config(1, 128)
        c.pause()
        with pytest.raises(FirecrackerError, match="dirty page tracking disabled"):
            c.create_snapshot(str(tmp_path / "a"), str(tmp_path / "b"), diff=True)
        with pytest.raises(ValueError, match="vcpu_count"):
            c.set_machine_config(33, 128)
        with pytest.raises(ValueError, match="vcpu_count"):
            c.set_machine_config(3, 128, smt=True)
        with pytest.raises(ValueError, match="absolute"):
            c.set_boot_source("vmlinux")
        with pytest.raises(ValueError, match="path_on_host"):
            c.add_drive("data", "", is_root_device=False)
    finally:
        vm.kill()
    with FirecrackerClient(tmp_path / "nobody.sock", timeout=1) as dead:
        with pytest.raises(FirecrackerError, match="no answer"):
            dead.describe()


def test_launch_failure_is_reported(tmp_path):
    exe = tmp_path / "firecracker"
    exe.write_text("#!/bin/sh\nexit 7\n")
    exe.chmod(0o755)
    with pytest.raises(FirecrackerError, match="exited with 7"):
        FirecrackerVM(str(exe), tmp_path).launch(timeout=5)


def test_merge_diff_memory(tmp_path):
    page = 4096
    full = os.urandom(64 * page)
    (tmp_path / "full.mem").write_bytes(full)
    # a sparse diff: pages 3 and 40-41 dirtied, holes elsewhere
    dirty = {3: os.urandom(page), 40: os.urandom(page), 41: os.urandom(page)}
    with open(tmp_path / "diff.mem", "wb") as f:
        f.truncate(64 * page)
        for i, data in dirty.items():
            f.seek(i * page)
            f.write(data)
    copied = merge_diff_memory(tmp_path / "full.mem", tmp_path / "diff.mem", tmp_path / "merged.mem")
    ref = bytearray(full)
    for i, data in dirty.items():
        ref[i * page:(i + 1) * page] = data
    assert (tmp_path / "merged.mem").read_bytes() == bytes(ref)
    assert copied >= 3 * page and copied < 64 * page  # only the data extents, not the whole file
    assert (tmp_path / "full.mem").read_bytes() == full
    (tmp_path / "short.mem").write_bytes(b"\0" * page)
    with pytest.raises(ValueError, match="size"):
        merge_diff_memory(tmp_path / "full.mem", tmp_path / "short.mem", tmp_path / "x.mem")
