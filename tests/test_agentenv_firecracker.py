"""Firecracker backend against a fake API server (real Firecracker needs KVM, absent here).

The fake is a tiny HTTP server on a unix socket, run as a fake ``firecracker`` executable: it
logs every request (method, path, JSON body), keeps Firecracker's state machine (Not started ->
Running <-> Paused; snapshots only while paused; load only before start) and answers 204/400 with
``fault_message`` like the real one. The tests assert the exact paths and bodies.
"""
from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from k3lab.agentenv.firecracker import (FirecrackerClient, FirecrackerError, FirecrackerVM,
                                        merge_diff_memory)

pytestmark = pytest.mark.timeout(120)

FAKE_FC = r'''
import json, os, socketserver, sys
from http.server import BaseHTTPRequestHandler

sock = sys.argv[sys.argv.index("--api-sock") + 1]
log = open(sock + ".requests.jsonl", "a", buffering=1)
state = {"state": "Not started"}
PUT_PATHS = {"/boot-source", "/machine-config", "/actions", "/snapshot/create", "/snapshot/load", "/vsock"}

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def reply(self, code, body=None):
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(code)
        if data:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def fault(self, msg):
        self.reply(400, {"fault_message": msg})
    def body(self):
        n = int(self.headers.get("Content-Length", 0))
        return json.loads(self.rfile.read(n)) if n else None
    def do_GET(self):
        log.write(json.dumps(["GET", self.path, None]) + "\n")
        if self.path == "/":
            return self.reply(200, {"id": "fake", "state": state["state"], "vmm_version": "1.9.0", "app_name": "Firecracker"})
        self.fault("unknown path")
    def do_PATCH(self):
        b = self.body()
        log.write(json.dumps(["PATCH", self.path, b]) + "\n")
        if self.path != "/vm" or b.get("state") not in ("Paused", "Resumed"):
            return self.fault("bad request")
        if state["state"] == "Not started":
            return self.fault("The requested operation is not supported before starting the microVM.")
        state["state"] = "Paused" if b["state"] == "Paused" else "Running"
        self.reply(204)
    def do_PUT(self):
        b = self.body()
        log.write(json.dumps(["PUT", self.path, b]) + "\n")
        if not (self.path in PUT_PATHS or self.path.startswith("/drives/")):
            return self.fault("unknown path")
        if self.path == "/actions":
            if b != {"action_type": "InstanceStart"} or state["state"] != "Not started":
                return self.fault("bad action")
            state["state"] = "Running"
        elif self.path == "/snapshot/create":
            if state["state"] != "Paused":
                return self.fault("Cannot create snapshot: the microVM must be paused")
            for k in ("snapshot_path", "mem_file_path"):
                open(b[k], "w").write(k)
        elif self.path == "/snapshot/load":
            if state["state"] != "Not started":
                return self.fault("Loading a microVM snapshot not allowed after configuring boot-specific resources.")
            state["state"] = "Running" if b.get("resume_vm") else "Paused"
        elif state["state"] != "Not started":
            return self.fault("The update operation is not allowed after boot.")
        self.reply(204)

class S(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

S(sock, H).serve_forever()
'''


@pytest.fixture
def fake_binary(tmp_path):
    exe = tmp_path / "firecracker"
    exe.write_text(f"#!{sys.executable}\n{FAKE_FC}")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def _requests(vm: FirecrackerVM) -> list:
    with open(str(vm.api_sock) + ".requests.jsonl") as f:
        return [json.loads(line) for line in f]


def test_boot_pause_snapshot_requests(fake_binary, tmp_path):
    vm = FirecrackerVM(str(fake_binary), tmp_path)
    c = vm.launch()
    try:
        assert c.describe()["state"] == "Not started"
        vm.boot(kernel="/img/vmlinux", rootfs="/img/rootfs.ext4", boot_args="console=ttyS0",
                initrd="/img/initrd.gz", vcpus=2, mem_mib=256, vsock_uds=str(tmp_path / "v.sock"))
        assert c.describe()["state"] == "Running"
        vm.snapshot(str(tmp_path / "full.state"), str(tmp_path / "full.mem"))
        assert c.describe()["state"] == "Paused"
        c.resume()
        c.pause()
        c.create_snapshot(str(tmp_path / "d.state"), str(tmp_path / "d.mem"), diff=True)
        c.resume()
        assert (tmp_path / "full.mem").is_file() and (tmp_path / "d.state").is_file()
        reqs = _requests(vm)
    finally:
        vm.kill()
    assert reqs == [
        ["GET", "/", None],
        ["PUT", "/machine-config", {"vcpu_count": 2, "mem_size_mib": 256, "smt": False, "track_dirty_pages": True}],
        ["PUT", "/boot-source", {"kernel_image_path": "/img/vmlinux", "boot_args": "console=ttyS0",
                                 "initrd_path": "/img/initrd.gz"}],
        ["PUT", "/drives/rootfs", {"drive_id": "rootfs", "path_on_host": "/img/rootfs.ext4",
                                   "is_root_device": True, "is_read_only": False}],
        ["PUT", "/vsock", {"guest_cid": 3, "uds_path": str(tmp_path / "v.sock")}],
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


def test_load_snapshot_with_file_backend(fake_binary, tmp_path):
    vm = FirecrackerVM(str(fake_binary), tmp_path)
    c = vm.launch()
    try:
        vm.restore(str(tmp_path / "s.state"), str(tmp_path / "s.mem"))
        assert c.describe()["state"] == "Running"
        # loading again after start is refused by the VMM: the error carries its fault_message
        with pytest.raises(FirecrackerError, match=r"PUT /snapshot/load: HTTP 400: Loading a microVM snapshot"):
            c.load_snapshot(str(tmp_path / "s.state"), str(tmp_path / "s.mem"))
        reqs = _requests(vm)
    finally:
        vm.kill()
    assert reqs[0] == ["PUT", "/snapshot/load", {
        "snapshot_path": str(tmp_path / "s.state"),
        "mem_backend": {"backend_type": "File", "backend_path": str(tmp_path / "s.mem")},
        "track_dirty_pages": True, "resume_vm": True}]


def test_errors_and_validation(fake_binary, tmp_path):
    vm = FirecrackerVM(str(fake_binary), tmp_path)
    c = vm.launch()
    try:
        with pytest.raises(FirecrackerError, match="must be paused"):
            c.start()
            c.create_snapshot(str(tmp_path / "a"), str(tmp_path / "b"))
        with pytest.raises(FirecrackerError, match="not allowed after boot"):
            c.set_machine_config(1, 128)
        with pytest.raises(ValueError, match="vcpu_count"):
            c.set_machine_config(33, 128)
        with pytest.raises(ValueError, match="vcpu_count"):
            c.set_machine_config(3, 128, smt=True)
        with pytest.raises(ValueError, match="absolute"):
            c.set_boot_source("vmlinux")
        with pytest.raises(ValueError, match="guest_cid"):
            c.set_vsock(2, "/x")
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
