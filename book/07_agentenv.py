# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · AgentEnv: microVM sandboxes that pause, hibernate, snapshot and fork
#
# K3's agentic RL ran **51,219,741 sandboxes** over 1,505,678 images (K3 report). An agent's sandbox
# spends about **98%** of its life waiting for the policy's next action (inference), so what made
# this affordable is *not* running fast, but costing nothing while waiting:
#
# * **pause / resume**: a paused sandbox uses no CPU; K3 reports resume in **49 ms**;
# * **hibernate / wake** (checkpoint): the sandbox's memory goes to disk and its process ends;
#   K3 reports checkpoint as low as **133 ms**, and up to 6.5x memory overcommit;
# * **fork**: a new sandbox from the *exact running state*, so a reward check (run the tests, which
#   may delete or rewrite files) never disturbs the agent's own sandbox;
# * **snapshot / restore**: periodic saves for recovery.
#
# K3 used Firecracker microVMs (hardware isolation; container runtimes gave kernel panics and
# deadlocks under this load). kvcache-ai/AgentENV, the open-source counterpart, claims boot and
# resume < 50 ms, pause < 100 ms and incremental snapshots < 100 ms.
#
# This chapter builds the same operations with `k3lab.agentenv`: a `Sandbox` API over QEMU's
# `microvm` machine driven by QMP (on hosts where a firecracker binary and real KVM are found, the
# same API drives Firecracker instead; that path is tested against a fake firecracker, not run
# here), a guest image built offline from Debian packages, and a shell agent inside the guest for
# exec and files.

# %% tags=["parameters"]
profile: str = "cpu"
seed: int = 0
live_runs: int = 5
n_agents: int = 3
rl_steps: int = 2
inference_s: float = 2.0

# %% tags=["nbval-ignore-output"]
import json
import os
import re
import signal
import statistics
import threading
import time

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

import k3lab
from k3lab.agentenv import (Sandbox, SandboxCrashed, SandboxPool, SandboxStateError, SandboxTimeout,
                            build_image, cleanup, detect_host, leftovers)
from k3lab.agentenv.rl_demo import run_rollout
from k3lab.agentenv.notebook import skip_vm_cells_if_missing
from k3lab.bench.agentenv import ANCHORS, paused_memory
from k3lab.book import ROOT

device = k3lab.setup(seed=seed, profile=profile)

# %% [markdown]
# The sandboxes need QEMU and the tools that build the guest image (`python -m k3lab.agentenv.sysdeps`
# installs them; `K3LAB_SKIP_SYSDEPS=1` skips that, and a GPU node has no apt to install them with).
# Checked once here: where they are missing, every cell that boots or uses a VM (its first line is
# `# VM cell`) prints one line saying it is skipped, and the rest of the chapter still runs.

# %%
vm_tools = skip_vm_cells_if_missing()

# %% [markdown]
# ## What a sandbox isolates, and what it does not
#
# Each sandbox is a virtual machine with its **own guest kernel**, memory, processes, filesystem
# (a copy-on-write disk overlay) and devices. A command inside cannot see or change the host's or
# another sandbox's files, memory or processes except through a bug in the virtual machine monitor.
#
# Inside the guest, every command is treated as hostile: it runs as an unprivileged user in a cgroup
# of its own, with its own output files, and its whole process tree dies when it returns or times
# out (the section "what a misbehaving agent can and cannot do" below runs the cases live).
#
# It does **not** isolate: CPU time and host memory are shared with no quota on the host (no
# host-side cgroup limits here; a sandbox's RAM is its VM size); there is no network at all (no
# network device, so also no network escape); the guest sees the host's CPU model and clock; side
# channels are out of scope. And on the machine that stored these outputs the boundary is weaker than
# K3's: see the next cell.
#
# ## Which backend this host gets
#
# On the machine that stored these outputs, `/dev/kvm` exists but is `kvm_pvm`, a paravirtual nested layer without vmx/svm CPU
# flags, on which ordinary guest kernels do not boot. So Firecracker (KVM only) cannot run, and
# QEMU falls back to **TCG**, software CPU emulation: the guest CPU is emulated instruction by
# instruction, QEMU itself is the isolation boundary, and guest-side work is roughly an order of
# magnitude or more slower than under KVM. Host-side operations (stop/cont, state files,
# copy-on-write mappings) are not slowed.

# %% tags=["nbval-ignore-output"]
host = detect_host()
print(host.reason)
for k in ("kvm_device", "kvm_pvm", "hw_virt", "qemu_version", "firecracker", "tsc_khz"):
    print(f"  {k:13s} {getattr(host, k)}")

# %% [markdown]
# ## The guest image
#
# Built once, offline after the first download, cached under `data/images/` (git-ignored) with a
# sha256 for every output, checked on every load: Debian bookworm's `linux-image-*-cloud-amd64`
# (its LZ4-compressed bzImage unpacked to the ELF `vmlinux` that `microvm` boots through the PVH
# entry point), an initrd (busybox + the virtio modules this kernel builds as modules, loaded by
# `/init`; devices are found through ACPI), and a busybox ext4 rootfs made with `mkfs.ext4 -d`
# holding the guest agent: a ~180-line `sh` loop on a tty, `/dev/hvc0` (a virtio console) under QEMU
# or the serial port `/dev/ttyS0` (Firecracker's only console), that answers `exec`, `write`, `read`
# and `limits` requests, and the unprivileged `user` that commands run as. Payloads go in raw, replies come back as marker-framed base64, both in 32 KiB
# chunks that wait for the other side's acknowledgement: consoles drop what their buffers cannot
# take (QEMU's virtio console on a full socket, Firecracker's serial port on a full pipe), so
# without acknowledgements a large read on a loaded host can lose a piece from its middle. md5 sums
# both ways turn any damage into an error instead of wrong data.

# %% tags=["nbval-ignore-output"]
# VM cell
t0 = time.perf_counter()
img = build_image()
print(f"image {img.root.name}: kernel {img.kernel_version}, digest {img.digest[:16]}, "
      f"{time.perf_counter() - t0:.2f} s (cached after the first build)")
for p in (img.kernel, img.initrd, img.rootfs):
    print(f"  {p.name:12s} {p.stat().st_size / 2**20:6.1f} MiB (allocated {p.stat().st_blocks * 512 / 2**20:.1f})")

# %% [markdown]
# ## Boot, exec, files
#
# A cold boot runs the guest kernel (under TCG, seconds). `exec` returns the exit code, stdout and
# stderr; a command runs as the guest's unprivileged `user` (home `/home/user`) unless `root=True`,
# and a timeout kills its whole process tree inside the guest, never the host.

# %% tags=["nbval-ignore-output"]
# VM cell
t0 = time.perf_counter()
sb = Sandbox.create(img)
boot_s = time.perf_counter() - t0
print(f"cold boot to ready: {boot_s:.2f} s")
assert boot_s < 180
# later sections start sandboxes from this freshly booted state instead of booting again
pool = SandboxPool(base=sb.snapshot())

# %%
# VM cell
r = sb.exec("echo hello from $(uname -s); echo oops >&2; exit 3", timeout=10)
print(r.exit_code, r.stdout, r.stderr)
assert (r.exit_code, r.stdout, r.stderr) == (3, b"hello from Linux\n", b"oops\n")

r = sb.exec("sleep 100 & sleep 60; echo unreachable", timeout=1)
print("timed out:", r.timed_out, "exit code:", r.exit_code)
print("its sleeps left running:", sb.exec("ps -o args | grep -cE '^sleep (100|60)$'", timeout=10).text.strip())
assert r.timed_out and r.exit_code == 137

blob = bytes(range(256)) * 64
sb.write_file("/home/user/blob.bin", blob)
assert sb.read_file("/home/user/blob.bin") == blob
print("file round trip:", len(blob), "bytes,", sb.exec("sha256sum blob.bin", timeout=10).text.split()[0][:16])

# %% [markdown]
# ## The lifecycle, measured live
#
# Where each operation's state lives:
#
# | op | how | what remains |
# |---|---|---|
# | pause / resume | QMP `stop` / `cont` | the process and its memory, no CPU |
# | snapshot | stop; device state with `x-ignore-shared` (RAM not in the stream); copy the RAM file (sparse) and the disk overlay; cont | a folder: `state`, `ram`, `disk.qcow2` |
# | restore | new QEMU maps the snapshot's `ram` **copy-on-write** (`share=off`) on a new qcow2 overlay backed by the snapshot's disk; `-incoming` loads the device state | shares unchanged pages with every other restore |
# | hibernate / wake | save state, kill QEMU, evict the RAM file from the page cache / new QEMU from the files | files only: no process, no memory |
# | fork(n) | snapshot + n copy-on-write restores | the parent runs on |
#
# A few live timings (this machine, now; the recorded benchmark below has more runs):

# %% tags=["nbval-ignore-output"]
# VM cell
def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def restore_and_exec(snap):
    child = Sandbox.from_snapshot(snap)
    child.exec("true")
    return child


live = {k: [] for k in ("pause", "resume", "snapshot", "restore_to_first_exec", "hibernate", "wake")}
sb.exec("echo state-1 > /tmp/m", timeout=10)
for _ in range(live_runs):
    live["pause"].append(timed(sb.pause)[0])
    live["resume"].append(timed(sb.resume)[0])
    ms, snap = timed(sb.snapshot)
    live["snapshot"].append(ms)
    ms, child = timed(lambda: restore_and_exec(snap))
    live["restore_to_first_exec"].append(ms)
    child.destroy()
    snap.delete()
    live["hibernate"].append(timed(sb.hibernate)[0])
    live["wake"].append(timed(lambda: (sb.wake(), sb.exec("true")))[0])
for k, v in live.items():
    print(f"{k:24s} median {statistics.median(v):8.1f} ms  (min {min(v):.1f}, max {max(v):.1f}, n={len(v)})")
assert sb.exec("cat /tmp/m", timeout=10).stdout == b"state-1\n"  # survived it all
assert statistics.median(live["resume"]) < 1000

# %% [markdown]
# A paused sandbox refuses commands (it has no CPU); a hibernated one has no process at all:

# %%
# VM cell
sb.pause()
try:
    sb.exec("true")
except SandboxStateError as e:
    print("exec while paused ->", type(e).__name__, ":", str(e).split(";")[1].strip())
sb.resume()
sb.hibernate()
mem = sb.memory()
print("hibernated: processes", sb.pids(), "| process memory KiB:", mem["pss"],
      "| RAM file still in page cache:", "< 4 MiB" if mem["ram_file_cache"] < 4096 else mem["ram_file_cache"])
assert sb.pids() == [] and mem["pss"] == 0 and mem["ram_file_cache"] < 4096
sb.wake()
print("woken:", sb.exec("cat /tmp/m", timeout=10).text.strip())

# %% [markdown]
# ## Fork isolation, on disk and in memory
#
# The parent writes a value into memory (a tmpfs file, and a live shell loop holding a variable,
# started with `keep_background=True` so that it outlives its command) and onto its disk. Two forks then overwrite both. Each fork maps the snapshot's RAM
# copy-on-write and writes its own qcow2 overlay, so no write can reach the parent or the sibling.
# `drop_caches` makes each guest re-read its disk rather than its page cache.

# %%
# VM cell
sb.exec("echo parent > /tmp/m; echo parent > d; sync;"
        # The loop writes a temp file and renames it: a reader never sees the file truncated mid-write.
        " (v=parent; while true; do echo $v > /tmp/live.new; mv /tmp/live.new /tmp/live; sleep 0.2; done)"
        " >/dev/null 2>&1 &", timeout=10, keep_background=True)
a, b = sb.fork(2)
a.exec("echo fork-A > /tmp/m; echo fork-A > d; sync", timeout=10)
b.exec("echo fork-B > /tmp/m; echo fork-B > d; rm blob.bin; sync", timeout=10)
# drop_caches needs root
show = ("echo 3 > /proc/sys/vm/drop_caches; cd /home/user;"
        " echo $(cat /tmp/m) $(cat d) $(cat /tmp/live) $(ls | wc -l)")
print(f"{'':8s} {'memory':8s} {'disk':8s} {'live loop':10s} files in /home/user")
for name, s in (("parent", sb), ("fork A", a), ("fork B", b)):
    print(f"{name:8s} " + " ".join(f"{x:8s}" for x in s.exec(show, timeout=10, root=True).text.split()))
assert sb.exec("cat /tmp/m d", timeout=10).stdout == b"parent\nparent\n"
assert a.exec("cat d; ls blob.bin", timeout=10).stdout == b"fork-A\nblob.bin\n"
a.destroy()
b.destroy()

# %% [markdown]
# ## Crashes are detected and reported
#
# A guest kernel panic (here triggered with sysrq) makes QEMU exit (`-no-reboot`); a SIGKILLed QEMU
# closes the agent channel. Either way the next call raises `SandboxCrashed` with the exit status
# and the tail of the guest console, instead of hanging.

# %%
# VM cell
victim = pool.create()
os.kill(victim.pids()[0], signal.SIGKILL)
try:
    victim.exec("true", timeout=5)
except SandboxCrashed as e:
    print("killed QEMU -> SandboxCrashed: QEMU", re.search(r"QEMU ([^)]*)\)", str(e)).group(1))
victim.destroy()
panicky = pool.create()
try:
    panicky.exec("echo c > /proc/sysrq-trigger", timeout=5, root=True)
except SandboxCrashed as e:
    print("guest panic -> SandboxCrashed: QEMU", re.search(r"QEMU ([^)]*)\)", str(e)).group(1),
          "|", re.search(r"guest: \[[ .\d]*\] ([^;]*);", str(e)).group(1))
panicky.destroy()

# %% [markdown]
# ## What a misbehaving agent can and cannot do
#
# An RL agent runs whatever it generates, and K3 moved from containers to microVMs because
# aggressive agents crashed and deadlocked kernels. So inside the guest every command is hostile by
# assumption (`docs/agentenv.md` has the threat model):
#
# * each `exec` runs as the unprivileged `user` (`root=True` on request) in a **new session and a
#   cgroup of its own**, with **stdout and stderr on a tmpfs of its own**: nothing it leaves behind can
#   write into a later command's output or exit code;
# * when it returns, its **whole tree is killed** (`cgroup.kill`, so daemons that left its session
#   too) unless `keep_background=True`; at its timeout the tree dies regardless, and the agent answers
#   within about a second;
# * all commands together are held to the sandbox's **limits** on processes and memory
#   (`sb.limits()`; cgroup v2 in the guest), so a fork bomb or a memory hog stays inside;
# * a guest whose agent stops answering is reported `grace_s` (5 s) after the deadline, and the
#   sandbox turns **unhealthy**: every later call fails at once, `restore` and `destroy` still work.
#
# Each case below runs live in a fresh copy-on-write sandbox of the pool.

# %%
# VM cell
hostile = []


def outcome(case, ok, what):
    hostile.append((case, ok, what))
    assert ok, (case, what)


with pool.create() as h:
    lim = h.limits()
    print(f"limits ({lim['mechanism']}): {lim['max_pids']} processes, {lim['memory_mib']:.0f} MiB for all commands")
    # 1. a background process writes after its command returned (left alive, it would write into a later result)
    h.exec("(sleep 1; echo LATE; exit 9) & echo a", timeout=10)
    r = h.exec("sleep 2; echo b", timeout=10)
    outcome("background writer, killed at return", r.stdout == b"b\n" and r.exit_code == 0,
            f"next stdout {r.stdout!r}, exit {r.exit_code}")
    # 2. the same writer kept on purpose (a server): later commands stay exact
    h.exec("(while true; do echo X; echo Y >&2; usleep 20000; done) &", timeout=10, keep_background=True)
    r = h.exec("usleep 300000; echo c; exit 4", timeout=10)
    outcome("kept writer (keep_background=True)", (r.stdout, r.stderr, r.exit_code) == (b"c\n", b"", 4),
            f"next stdout {r.stdout!r}, stderr {r.stderr!r}, exit {r.exit_code}")
    # 3. a daemon that leaves the command's session and process group
    h.exec("setsid sh -c 'sleep 1000' &", timeout=10)
    r = h.exec("ps -o args | grep -c '^sleep 1000'", timeout=10)
    outcome("setsid daemon", r.text.strip() == "0", f"{r.text.strip()} left running")
    # 4. privileges: kill the agent, read root's files, raise its own limits
    r = h.exec("kill -9 $PPID; cat /root/.profile; echo 4096 > /sys/fs/cgroup/k3/pids.max", timeout=10)
    denied = r.stderr.count(b"Permission denied") + r.stderr.count(b"not permitted")
    outcome("kill the agent, read /root, raise the limits", denied == 3, f"{denied} of 3 refused")

with pool.create() as h:
    # 5. a fork bomb under a 3 s timeout
    t0 = time.perf_counter()
    r = h.exec("f() { f | f & }; f; sleep 100", timeout=3)
    late = time.perf_counter() - t0 - 3
    left = h.exec("read n < /sys/fs/cgroup/k3/pids.current; echo $((n - 1))", timeout=10).text.strip()
    outcome("fork bomb, timeout=3", r.timed_out and r.exit_code == 137 and left == "0" and late < 3,
            f"killed, answered {late:.1f} s after the timeout, {left} processes left")
    # 6. a memory hog: three 40 MB buffers against the sandbox's memory limit
    r = h.exec("for i in 1 2 3; do dd if=/dev/zero of=/dev/null bs=40M count=1 & done; wait", timeout=20)
    outcome("memory hog", r.exit_code == 137 and b"out of memory" in r.stderr,
            f"exit {r.exit_code}: {r.stderr.decode().strip().split(': ', 1)[1]}")
    alive = h.exec("echo alive", timeout=10).text.strip()
    outcome("the same sandbox afterwards", alive == "alive", alive)

with pool.create() as h:
    # 7. the guest stops answering: here the agent itself is stopped (a root command can do that)
    snap = h.snapshot()
    t0 = time.perf_counter()
    try:
        h.exec("kill -STOP $PPID", timeout=1, root=True)
    except SandboxTimeout as e:
        late = time.perf_counter() - t0 - 1
        outcome("wedged guest (agent stopped)", h.state == "unhealthy" and late < Sandbox.grace_s + 2,
                f"SandboxTimeout {late:.1f} s after the timeout, sandbox {h.state}")
    try:
        h.exec("true")
    except SandboxStateError as e:
        outcome("a later call", "unhealthy" in str(e), "SandboxStateError at once: is unhealthy")
    h.restore(snap)
    snap.delete()
    outcome("restore", h.exec("echo back", timeout=10).text == "back\n", f"state {h.state}")

# 8. destroy from another thread while an exec runs
def error_of_exec(box):
    try:
        box.exec("sleep 60", timeout=120)
    except SandboxStateError as e:
        return e


h = pool.create()
ended = []
t = threading.Thread(target=lambda: ended.append(error_of_exec(h)))
t.start()
time.sleep(0.5)
h.destroy()
t.join(10)
outcome("destroy during exec", isinstance(ended[0], SandboxStateError),
        f"{type(ended[0]).__name__}: " + str(ended[0]).replace(h.id, "<id>"))

print(f"\n{'case':46s} {'contained':9s} outcome")
for case, ok, what in hostile:
    print(f"{case:46s} {'yes' if ok else 'NO':9s} {what}")
# on the host: the only VM process left under the root is the chapter's own sandbox
left = leftovers(pool.root, exclude=(pool.base.path,))["pids"]
print("\nhost VM processes left by these cases:", len(left) - 1)
assert left == sb.pids()

# %% [markdown]
# What it **can** still do: use the sandbox's whole quota (256 processes, three quarters of its
# RAM, a quarter of it as output per command, all of `/tmp`), burn its vCPU until its timeout, keep
# a server running with `keep_background=True`, and, given `root=True`, anything inside the guest,
# up to panicking its kernel (a `SandboxCrashed`, as above). What it cannot do: reach a later
# command's result, outlive its command uninvited, starve the agent, or leave the host waiting: the
# host hears from the guest within `grace_s` of every deadline or marks the sandbox unhealthy.

# %% [markdown]
# ## The recorded benchmark: `python -m k3lab.bench.agentenv`
#
# Ten or more runs per operation on this 2-core CPU box (TCG), against the anchors. Read it with
# the caveats: TCG is software emulation (guest-side work like boot is an order of magnitude or
# more slower than under KVM), and the box was shared with other CPU jobs (the load average is in
# the JSON).

# %% tags=["nbval-ignore-output"]
res = json.loads((ROOT / "data" / "results" / "agentenv_cpu.json").read_text())
guest = res["guest"]
print(f"{res['backend']} on {res['host']}\n{res['date']}, load average {res['load_avg_1min']}; guest "
      f"{guest['memory_mib']} MiB RAM, {guest['vcpus']} vCPU, kernel {guest['kernel']}\n")
anchors = {op: ms for op, (_, ms) in ANCHORS.items()}
print(f"{'op':24s} {'min':>8s} {'median':>8s} {'max':>8s}  {'n':>3s}  anchor")
for k, s in res["ops"].items():
    anc = f"{anchors[k]:g} ms ({ANCHORS[k][0]})" if anchors[k] else ANCHORS[k][0]
    print(f"{k:24s} {s['min_ms']:8.1f} {s['median_ms']:8.1f} {s['max_ms']:8.1f}  {s['n']:3d}  {anc}")
m = res["paused_mib"]
print(f"\n{res['n_paused']} paused sandboxes from one snapshot: {res['paused_per_gib']} per GiB ({m['total']:.1f} MiB "
      f"each = PSS {m['pss']:.1f} + file cache {m['file_cache']:.1f}; RSS {m['rss']:.1f}); hibernated: "
      f"{res['hibernated_memory_kib']} KiB each")

fig, ax = plt.subplots(figsize=(8, 3.6))
ops = list(res["ops"])
ax.barh(ops, [res["ops"][k]["median_ms"] for k in ops], color="tab:blue", label="k3lab, QEMU/TCG (median)")
ax.errorbar([res["ops"][k]["median_ms"] for k in ops], ops,
            xerr=[[res["ops"][k]["median_ms"] - res["ops"][k]["min_ms"] for k in ops],
                  [res["ops"][k]["max_ms"] - res["ops"][k]["median_ms"] for k in ops]],
            fmt="none", color="k", lw=1)
for i, k in enumerate(ops):
    if anchors[k]:
        ax.plot(anchors[k], i, "r|", ms=18, mew=2, label="K3 / AgentENV anchor" if i == 0 else None)
ax.set_xscale("log")
ax.set_xlabel("ms (log)")
ax.invert_yaxis()
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
ax.set_title("sandbox lifecycle: this CPU box vs the Firecracker/KVM anchors")
plt.tight_layout()
plt.show()

# %% [markdown]
# What the numbers say. **pause/resume** (QMP stop/cont) are far under the anchors: they only
# stop and start the vCPU thread. **snapshot** beats K3's 133 ms checkpoint because the RAM is
# already in a file (the guest's RAM file, copied with `copy_file_range`, which keeps its holes, so
# pages the guest never touched cost nothing). **restore**, **wake** and
# **fork** land at a few hundred ms: a fresh QEMU process starting under TCG dominates, where
# Firecracker on KVM restores in tens of ms. **cold boot** is the TCG extreme: seconds of emulated
# kernel boot, which is why everything here restores from a snapshot instead. The density number
# counts QEMU's own overhead (TCG's translation cache, heap) plus each guest's private pages;
# hibernated sandboxes hold none. Every anchor is Firecracker on KVM: the right column says whose figure
# each one is (K3's report or AgentENV's README).

# %% [markdown]
# ## What hibernation buys: memory-time
#
# A sandbox's memory cost is memory x time resident. If an agent step runs for $t_{run}$ and then
# waits $W$ for inference, keeping the sandbox alive holds its memory for $t_{run} + W$; hibernating
# during the wait holds it only for $t_{run} + t_{hib} + t_{wake}$ (the RAM file is on disk in
# between, and `wake` is on the critical path of the next step). The resident fraction is
#
# $$f(W) = \frac{t_{run} + t_{hib} + t_{wake}}{t_{run} + t_{hib} + t_{wake} + W},$$
#
# so the saving grows with the wait: K3's ~98% waiting means $W \approx 49\,t_{run}$. With the
# measured medians, and $t_{run}$ = 0.1 s, about one short exec under TCG (`docs/agentenv.md` measures
# `exec("true")` at 55-75 ms):

# %% tags=["nbval-ignore-output"]
t_hib, t_wake = res["ops"]["hibernate"]["median_ms"] / 1e3, res["ops"]["wake"]["median_ms"] / 1e3
t_run = 0.1
print(f"{'wait W (s)':>10s} {'resident fraction':>18s} {'latency added per step':>24s}")
for W in (0.1, 1.0, 5.0, 30.0, 120.0):
    f = (t_run + t_hib + t_wake) / (t_run + t_hib + t_wake + W)
    print(f"{W:10.1f} {f:18.1%} {1e3 * (t_hib + t_wake):21.0f} ms")
assert (t_run + t_hib + t_wake) / (t_run + t_hib + t_wake + 30.0) < 0.1

# %% [markdown]
# Hibernating pays off once the wait is long against ~0.3 s of hibernate + wake: for waits of
# tens of seconds to minutes (LLM inference of a long agent turn) the sandbox is resident a few
# percent of the time or less (the table above). Short waits are better served by `pause` (sub-millisecond, but memory stays).
#
# ## Experiment: how many paused sandboxes fit in a GiB?
#
# Restores map the snapshot's RAM file copy-on-write, so sandboxes restored from one snapshot
# share every page none of them has written. We count, per sandbox, its QEMU process's PSS
# (proportional set size: each shared page split among its sharers) plus the page cache of the
# guest-RAM file that no process maps (one snapshot file for all copy-on-write restores, split
# among them; one file each with `cow=False`, which shares nothing). QEMU's own overhead (TCG's
# translation cache, heap) is private to each process either way.

# %% tags=["nbval-ignore-output"]
# VM cell
density = {True: [], False: []}
counts = [1, 3, 6]
for cow in (True, False):
    for n in counts:
        density[cow].append(paused_memory(pool.base, n, cow=cow)["total"])
for cow in (True, False):
    print(f"cow={cow!s:5s} MiB per paused sandbox: " + ", ".join(
        f"n={n}: {m:.1f}" for n, m in zip(counts, density[cow])))
assert density[True][-1] < density[False][-1]
fig, ax = plt.subplots(figsize=(5, 3))
for cow, label in ((True, "copy-on-write restores"), (False, "own RAM copy (cow=False)")):
    ax.plot(counts, density[cow], "o-", label=label)
ax.set_xlabel("paused sandboxes from one snapshot")
ax.set_ylabel("MiB per paused sandbox")
ax.set_ylim(0, None)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
print(f"-> {1024 / density[True][-1]:.0f} copy-on-write paused sandboxes per GiB at n={counts[-1]}, "
      f"{1024 / density[False][-1]:.0f} with their own RAM copies")

# %% [markdown]
# ## An RL-style rollout
#
# `k3lab.agentenv.rl_demo.run_rollout`: each agent gets a toy task (sum the numbers in a file);
# a scripted policy stands in for the LLM (agent 2 slips by one). Between steps **every agent is
# hibernated** while "waiting for inference" (no VM process is alive then), woken for its next
# command, and at the end the **reward check runs in a fork**: the grader is destructive (it
# deletes the answer), and the original sandbox is checked untouched.

# %%
# VM cell
rollout = run_rollout(pool, n_agents=n_agents, steps=rl_steps, inference_s=inference_s, seed=seed)
print("rewards:", rollout.rewards)
print("original untouched after grading:", rollout.untouched)
print("VM processes alive while waiting for inference:", rollout.max_live_processes_while_waiting)
for i, out in enumerate(rollout.outputs):
    print(f"agent {i}: " + " | ".join(out))
assert rollout.untouched == [True] * n_agents and rollout.max_live_processes_while_waiting == 0

# %% tags=["nbval-ignore-output"]
# VM cell
print(f"wall {rollout.timings['total_s']:.1f} s; agents spent {rollout.waiting_fraction:.0%} of their "
      f"time hibernated (K3: ~98% waiting, with real inference taking seconds to minutes)")
colors = {"exec": "tab:green", "hibernate": "tab:orange", "wake": "tab:blue",
          "hibernated": "lightgrey", "fork+grade": "tab:purple"}
fig, ax = plt.subplots(figsize=(8, 2.4))
for agent, kind, t0_, t1_ in rollout.events:
    ax.barh(agent, t1_ - t0_, left=t0_, color=colors[kind], edgecolor="none")
ax.set_yticks(range(n_agents), [f"agent {i}" for i in range(n_agents)])
ax.set_xlabel("seconds")
ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], ncol=5, fontsize=7,
          loc="upper center", bbox_to_anchor=(0.5, 1.35))
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Nothing left behind
#
# `destroy` kills the VM and deletes its folder; snapshots are reference-counted and disappear
# when the last sandbox restored from them goes. `leftovers(root)` lists every file and every
# host process that still mentions the sandbox root.

# %%
# VM cell
sb.destroy()
pool.close()
left = leftovers(pool.root)
print("files:", len(left["files"]), "processes:", len(left["pids"]))
assert left == {"files": [], "pids": []}
cleanup()  # also removes this process's sandbox folder (exit handlers may not run in a kernel)
assert not pool.root.exists()

# %% [markdown]
# ## Exercises
#
# 1. Time `sb.exec("true")` twenty times and replace the assumed $t_{run}$ = 0.1 s: how does the resident
#    fraction at $W$ = 1 s move? At which wait does hibernating stop paying against `pause`, if a paused
#    sandbox costs its PSS and a hibernated one nothing?
# 2. Run the density experiment at n = 12 and 20 and compare with the recorded benchmark's figure: why
#    does the copy-on-write cost per sandbox keep falling, and what is its floor?
# 3. In a fork, write 50 MiB to `/tmp` (a tmpfs, so guest RAM) and measure its PSS before and after:
#    which pages stop being shared?
# 4. Add a hostile case: a command that fills `/home/user` (the disk overlay) until the disk is full.
#    What should the sandbox report, and does a later command still run?
# 5. The rollout's reward check forks the agent's sandbox. Estimate the cost of grading by restoring the
#    agent's last snapshot instead, from the recorded medians: which is cheaper, and which is correct?
#
# ## References
#
# * Kimi K3 technical report (arXiv 2607.24653): the AgentEnv section (51,219,741 sandboxes,
#   checkpoint 133 ms, resume 49 ms, 6.5x overcommit).
# * kvcache-ai/AgentENV: Firecracker sandboxes with pause/resume, fork and incremental snapshots.
# * Firecracker API (`src/firecracker/swagger/firecracker.yaml`) and snapshot docs
#   (`docs/snapshotting/snapshot-support.md`); `k3lab.agentenv.firecracker` is a client for it,
#   `k3lab.agentenv.fcvm` the `Sandbox` backend built on it.
# * QEMU: the `microvm` machine (docs/system/i386/microvm.rst), QMP, migration with
#   `x-ignore-shared`.
