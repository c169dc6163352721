"""Guest image: kernel + initrd + rootfs built offline from Debian packages, cached and checksummed.

Build (``python -m k3lab.agentenv build`` or :func:`build_image`):

1. Debian packages ``linux-image-<ver>-cloud-amd64`` and ``busybox-static`` are taken from the
   image cache, else from ``/var/cache/apt/archives``, else fetched once with ``apt-get download``.
   After the first build everything runs offline.
2. The kernel: Debian ships a compressed bzImage (LZ4 on bookworm's cloud kernel). The ELF
   ``vmlinux`` inside is found by scanning for compression magics and decompressing until the
   output starts with an ELF header (the kernel tree's ``scripts/extract-vmlinux`` idea); QEMU's
   ``microvm`` boots it directly through its PVH entry point.
3. The initrd (cpio newc, written here, gzip): busybox plus the virtio modules the cloud kernel
   builds as modules (virtio, virtio_ring, virtio_mmio, virtio_blk, virtio_console). Its
   ``/init`` loads them, mounts ``/dev/vda`` (ext4) and switches root.
4. The rootfs: a busybox ext4 image made with ``mkfs.ext4 -d`` (no root needed), holding the guest
   agent (:data:`AGENT_SH`) that serves exec / file write / file read on a tty: ``/dev/hvc0``
   (QEMU's virtio console) by default, or the one named by ``k3lab.agent=<tty>`` on the kernel
   command line, e.g. ``ttyS0``, the 8250 serial port that is Firecracker's only console (the
   cloud kernel builds the 8250 driver and its console in: ``CONFIG_SERIAL_8250=y``,
   ``CONFIG_SERIAL_8250_CONSOLE=y``).

The result lives in ``<cache>/images/<key>/`` where ``key`` hashes the package checksums and the
guest scripts; it is built in a temporary folder and renamed into place (atomic), and
``image.json`` records the sha256 of every output, checked on every load.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from k3lab.agentenv.agent import CHUNK

FORMAT_VERSION = 6
MODULES = ("virtio", "virtio_ring", "virtio_mmio", "virtio_blk", "virtio_console")
ROOTFS_MIB = 64
APT_ARCHIVES = Path("/var/cache/apt/archives")

# initrd /init: load virtio modules (the devices are found through ACPI), mount the rootfs.
INIT_SH = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /newroot
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
for m in __MODULES__; do /bin/busybox insmod /lib/modules/$m.ko || echo "k3init: insmod $m failed"; done
n=0
while [ ! -b /dev/vda ] && [ $n -lt 500 ]; do /bin/busybox usleep 10000; n=$((n+1)); done
/bin/busybox mount -t ext4 -o noatime /dev/vda /newroot || { echo "k3init: no rootfs"; /bin/busybox poweroff -f; }
/bin/busybox umount /proc /sys
/bin/busybox mount --move /dev /newroot/dev
exec /bin/busybox switch_root /newroot /sbin/k3init
"""

# rootfs /sbin/k3init (PID 1): mounts, then keeps the agent running on its tty: the one named by
# k3lab.agent=<tty> on the kernel command line (ttyS0 on Firecracker), else hvc0 (QEMU).
K3INIT_SH = r"""#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t tmpfs -o mode=1777 tmp /tmp
mount -t tmpfs -o mode=755 run /run
hostname sandbox
export PATH=/bin:/sbin:/usr/bin:/usr/sbin HOME=/root
# An image built by a non-root user carries that user's uid on its files: system files go to root.
[ "$(stat -c %u /bin/busybox)" = 0 ] || chown -R 0:0 /bin /sbin /usr /etc /root /lib 2>/dev/null
chown 1000:1000 /home/user
cd /root
tty=hvc0
read -r cmdline < /proc/cmdline
for w in $cmdline; do case $w in k3lab.agent=*) tty=${w#k3lab.agent=} ;; esac; done
# init and the agent are the last things the OOM killer may pick (their children reset it).
echo -1000 > /proc/self/oom_score_adj
# Nothing of init's goes to the console from here on: on a serial port it is the agent's channel.
exec </dev/null >/dev/null 2>&1
while true; do /sbin/k3agent /dev/$tty; sleep 0.1; done
"""

# rootfs /sbin/k3run <user> <cgroup> <script>: started by the agent (setsid, its output already
# on the command's own files) to run one command: it joins the command's cgroup (if any), then
# runs the script as root (user 0) or drops to the unprivileged "user" (uid 1000, no
# supplementary groups: busybox nsenter without namespaces is setgroups + setgid + setuid, half
# the cost of su), under rlimits when the guest has no cgroup v2. The script is opened here, as
# root, and read through the open descriptor: its folder is root's alone.
K3RUN_SH = r"""#!/bin/sh
echo 0 > /proc/self/oom_score_adj
[ -n "$2" ] && echo $$ > "$2/cgroup.procs"
if [ "$1" = 0 ]; then cd /root; exec sh "$3"; fi
cd /home/user
export HOME=/home/user USER=user LOGNAME=user
[ -n "$2" ] || { ulimit -u $K3_PIDS; ulimit -v $K3_MEM_KIB; }
exec nsenter -S 1000 -G 1000 sh /proc/self/fd/3 3< "$3"
"""

# The guest agent, serving k3lab.agentenv.agent's protocol (see its docstring) on the tty "$1".
# Payloads arrive raw (the tty is fully raw: no flow-control characters, no CR/NL mapping, no
# signals, 8 bits) and are read with head -c exactly; replies are base64, so the markers, which
# start with "\n@", are unambiguous. md5 sums go both ways. A reply with no output takes no fork
# (each fork costs milliseconds under TCG).
#
# Each exec gets its own folder, a tmpfs of a quarter of guest RAM (its output cap), holding the
# script and the command's stdout and stderr files, and its own cgroup under /sys/fs/cgroup/k3
# (the sandbox's limits on memory and processes). What a command leaves running can only ever
# write into its own command's files (unmounted once replied), and killing a command means
# cgroup.kill: its whole tree, setsid daemons included. Without cgroup v2 the kill is the
# command's process group and the limits are rlimits of the unprivileged user.
AGENT_SH = r"""#!/bin/sh
set -f
# clocal first: opening a serial port without it waits for carrier. The rest once it is open:
# hvc resets a tty's settings whenever its last file is closed.
stty -F "$1" clocal 2>/dev/null
exec <"$1" >"$1" 2>/dev/null
stty raw -echo -iexten
chmod 600 "$1" /dev/console
W=/run/k3agent
K=__CHUNK__
E=d41d8cd98f00b204e9800998ecf8427e
C=/sys/fs/cgroup/k3
D=/run/k3cmd
mkdir -p $W $D
read -r x kb x < /proc/meminfo
OUT_KIB=$((kb / 4))
# Limits for commands: every process in the sandbox's cgroup (or of the unprivileged user).
export K3_PIDS=256 K3_MEM_KIB=$((kb * 3 / 4))
if [ ! -d $C ]; then
  mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null &&
  echo "+memory +pids +cpu" > /sys/fs/cgroup/cgroup.subtree_control &&
  mkdir $C && echo "+memory +pids +cpu" > $C/cgroup.subtree_control &&
  echo $K3_PIDS > $C/pids.max && echo $((K3_MEM_KIB * 1024)) > $C/memory.max &&
  echo 10 > $C/cpu.weight || rmdir $C 2>/dev/null
fi
# cpu.weight 10: a command that spins (a fork bomb) leaves the agent its CPU to answer and kill.
[ -d $C ] || C=
# No ptrace for "user": a process a command kept cannot reach into a later command of the same uid.
echo 2 > /proc/sys/kernel/yama/ptrace_scope 2>/dev/null
seq=0
kept= kept_user=
md5() { h=-; if [ -f "$1" ]; then md5sum "$1" > $W/s && read -r h x < $W/s; fi; }
# recv <id> <n> <file>: the request's n payload bytes, acknowledging each chunk but the last
recv() {
  n=$2
  while [ $n -gt $K ]; do head -c $K >> "$3"; n=$((n - K)); printf '\n@K3A %s\n' $1; done
  if [ $n -gt 0 ]; then head -c $n >> "$3"; fi
}
# ack <id>: wait for "<id> ack"; another line is the next request (the host gave up on this one)
ack() {
  read -r a b c || exit 0
  [ "$a $b" = "$1 ack" ] && return 0
  next="$a $b $c"
  return 1
}
b64() { if [ -s "$1" ]; then base64 -w0 "$1"; fi; }
# unb64 <text>: path=the decoded text, trailing newlines kept ($(...) alone strips them)
unb64() { path=$(echo $1 | base64 -d; echo .); path=${path%.}; }
# stop <pgid> <cgroup> <uid>: SIGKILL a command's whole tree and wait until it is gone. Without a
# cgroup: its process group, and every process of "user" unless a command kept some (a daemon
# that left the group is found by its uid)
stop() {
  if [ -z "$2" ]; then
    kill -KILL -$1 2>/dev/null
    [ "$3" = 0 ] || [ -n "$kept_user" ] || nsenter -S 1000 -G 1000 kill -KILL -1 2>/dev/null
    return
  fi
  echo 1 > $2/cgroup.kill
  n=0
  while read -r a b < $2/cgroup.events && [ "$b" = 1 ] && [ $n -lt 1000 ]; do usleep 5000; n=$((n + 1)); done
  rmdir $2 2>/dev/null
}
# reply <id> <rc> <timed_out> <md5_in>: the header, then base64 of $O (stdout) "\n" base64 of $R
# (stderr) in chunks
reply() {
  if [ ! -s $O ] && [ ! -s $R ]; then
    printf '\n@K3 %s %s %s %s %s %s\n\n\n@K3END %s\n' $1 $2 $3 $4 $E $E $1
    return
  fi
  id=$1 rc=$2 to=$3 mi=$4
  { b64 $O; echo; b64 $R; } > $W/r
  # Sums and sizes through pipes, not files: /run may be full. base64 exits 0 on a full /run,
  # so the size of the encoded reply is what tells.
  set -- $(md5sum $O $R) $(stat -c %s $O $R $W/r)
  if [ "$7" != $(( (($5 + 2) / 3 + ($6 + 2) / 3) * 4 + 1 )) ]; then
    rm -f $W/r; O=$W/o R=$W/e; : > $O
    echo "k3agent: the reply ($5 bytes of stdout, $6 of stderr) does not fit in the guest's /run" > $R
    reply $id $rc $to !
    return
  fi
  printf '\n@K3 %s %s %s %s %s %s\n' $id $rc $to $mi $1 $3
  i=0
  while dd if=$W/r bs=$K skip=$i count=1 2> $W/dd && read -r c x < $W/dd && [ "$c" = 1+0 ]; do
    printf '\n@K3C %s\n' $id
    ack $id || return
    i=$((i + 1))
  done
  printf '\n@K3END %s\n' $id
}
# run <id> <n> <md5> <timeout> <uid> <keep>: one exec, on a tmpfs of its own mounted on D (the
# previous command's was detached from D, and lives on only while processes it kept hold files
# there), in a cgroup of its own G
run() {
  seq=$((seq + 1))
  G= O=$D/o R=$D/e
  mount -t tmpfs -o size=${OUT_KIB}k,mode=700 k3cmd $D
  recv $1 $2 $D/cmd
  md5 $D/cmd
  : > $O; : > $R
  if [ "$h" != "$3" ]; then
    echo "k3agent: the command arrived damaged" > $R; reply $1 1 0 $h; return
  fi
  if [ -n "$C" ]; then G=$C/c$$.$seq; mkdir $G && echo 1 > $G/memory.oom.group; fi
  setsid /sbin/k3run $5 "$G" $D/cmd < /dev/null > $O 2> $R &
  p=$!
  ( trap 'kill $s 2>/dev/null; exit 0' TERM
    sleep $4 & s=$!; wait $s
    : > $D/to; stop $p "$G" $5 ) &
  w=$!
  wait $p; rc=$?
  kill $w 2>/dev/null; wait $w 2>/dev/null
  # The command has ended (or was killed): the host's proof that the agent is alive.
  printf '\n@K3D %s\n' $1
  t=0; [ -e $D/to ] && t=1
  if [ -n "$G" ]; then
    while read -r a b; do
      [ "$a" = oom_kill ] && [ "$b" != 0 ] &&
        echo "k3agent: the command was killed: out of memory (the sandbox's limit is $K3_MEM_KIB KiB)" >> $R
    done < $G/memory.events
  fi
  if [ "$6" = 1 ] && [ $t = 0 ]; then
    kept="$kept $G"
    [ -n "$G" ] || [ "$5" = 0 ] || kept_user=1
    # Its processes write on: the reply is what was written until the command returned.
    cat $O > $W/o; cat $R > $W/e; O=$W/o R=$W/e
  else
    stop $p "$G" $5
  fi
  # A full tmpfs (no free blocks) means the output was cut off; empty output cannot have filled it.
  f=1; { [ -s $O ] || [ -s $R ]; } && f=$(stat -f -c %a $D)
  set -- $1 $rc $t $h $f
  if [ "$5" = 0 ]; then
    : > $O
    echo "k3agent: the command's output filled its $OUT_KIB KiB (a quarter of guest RAM for stdout and stderr together)" > $R
    reply $1 $2 $3 !
  else
    reply $1 $2 $3 $4
  fi
}
printf '\n@K3READY\n'
next=
while true; do
  if [ -n "$next" ]; then l=$next; next=; else read -r l || exit 0; fi
  set -- $l
  [ -n "$2" ] || continue
  O=$W/o R=$W/e
  : > $O; : > $R
  case "$2" in
  ping) reply $1 0 0 - ;;
  exec)
    # kept commands whose processes have all ended leave empty cgroups behind
    if [ -n "$kept" ]; then k=; for g in $kept; do rmdir $g 2>/dev/null || k="$k $g"; done; kept=$k; fi
    run $1 $3 $4 $5 $6 $7
    umount -l $D ;;
  limits)
    # limits <pids> <memory KiB>: "-" keeps a value
    [ "$5" = - ] || K3_PIDS=$5
    [ "$6" = - ] || K3_MEM_KIB=$6
    if [ -n "$C" ]; then
      echo $K3_PIDS > $C/pids.max 2> $R && echo $((K3_MEM_KIB * 1024)) > $C/memory.max 2>> $R
      rc=$?
      read -r cur < $C/memory.current
      echo cgroup $K3_PIDS $K3_MEM_KIB $((cur / 1024)) > $O
    else
      rc=0; echo rlimit $K3_PIDS $K3_MEM_KIB - > $O
    fi
    reply $1 $rc 0 - ;;
  write)
    unb64 $5
    # A file that cannot be created still has its payload read (to /dev/null).
    if { true > "$path"; } 2> $R; then d=$path; else d=; fi
    recv $1 $3 "${d:-/dev/null}"
    if [ -z "$d" ] || ! chmod $6 "$path" 2> $R || ! chown $7:$7 "$path" 2> $R; then reply $1 1 0 -; continue; fi
    md5 "$path"
    reply $1 0 0 $h ;;
  read)
    unb64 $5
    if cat "$path" > $O 2> $R; then rc=0; else rc=1; fi
    reply $1 $rc 0 - ;;
  *) echo "unknown op $2" > $R; reply $1 2 0 - ;;
  esac
done
"""


def agent_script() -> str:
    """:data:`AGENT_SH` with the protocol's chunk size filled in."""
    return AGENT_SH.replace("__CHUNK__", str(CHUNK))


class ImageError(RuntimeError):
    """The image cannot be built or fails its checksum."""


@dataclass(frozen=True)
class Image:
    """A built guest image.

    Attributes:
        root (Path): the image folder.
        kernel (Path): ELF vmlinux with a PVH note (boots on QEMU microvm with ``-kernel``).
        initrd (Path): gzip cpio newc.
        rootfs (Path): raw ext4 (used read-only, as the qcow2 backing file of every sandbox).
        kernel_version (str): e.g. "6.1.0-53-cloud-amd64".
        digest (str): sha256 over the three outputs' sha256s; identifies the image.
    """

    root: Path
    kernel: Path
    initrd: Path
    rootfs: Path
    kernel_version: str
    digest: str

    def verify(self) -> None:
        """Recompute the outputs' sha256 and compare with ``image.json``.

        Raises:
            ImageError: a file is missing or its checksum differs.
        """
        manifest = json.loads((self.root / "image.json").read_text())
        for name, want in manifest["outputs"].items():
            path = self.root / name
            if not path.is_file():
                raise ImageError(f"image file missing: {path}")
            got = _sha256(path)
            if got != want:
                raise ImageError(f"checksum mismatch for {path}: expected {want}, got {got}")


def default_cache_dir() -> Path:
    """``$K3LAB_AGENTENV_CACHE``, else ``data/images`` of the k3lab checkout (git-ignored), else
    ``~/.cache/k3lab/agentenv``."""
    env = os.environ.get("K3LAB_AGENTENV_CACHE")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file() and (repo / "data").is_dir():
        return repo / "data" / "images"
    return Path.home() / ".cache" / "k3lab" / "agentenv"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, check=True, capture_output=True, **kw)
    except FileNotFoundError as e:
        raise ImageError(f"{cmd[0]} not found; run `python -m k3lab.agentenv.sysdeps`") from e
    except subprocess.CalledProcessError as e:
        raise ImageError(f"{' '.join(cmd)} failed: {e.stderr.decode(errors='replace')[-2000:]}") from e


def _latest(paths: list[Path]) -> Path | None:
    return sorted(paths)[-1] if paths else None


def _fetch_debs(debdir: Path) -> dict[str, Path]:
    """The kernel and busybox-static .debs in ``debdir``, copied from apt's cache or downloaded once."""
    debdir.mkdir(parents=True, exist_ok=True)
    patterns = {"kernel": "linux-image-*-cloud-amd64_*_amd64.deb", "busybox": "busybox-static_*_amd64.deb"}
    found = {k: _latest(list(debdir.glob(p))) for k, p in patterns.items()}
    apt_cache = APT_ARCHIVES
    for key, pattern in patterns.items():
        if found[key] is None and apt_cache.is_dir():
            # linux-image-*-cloud-amd64_* also matches the unversioned meta package; skip it.
            cands = [p for p in apt_cache.glob(pattern) if not p.name.startswith("linux-image-cloud-amd64_")]
            if (src := _latest(cands)) is not None:
                shutil.copy2(src, debdir / src.name)
                found[key] = debdir / src.name
    missing = [k for k, v in found.items() if v is None]
    if missing:
        pkgs = []
        if "kernel" in missing:
            try:
                out = _run(["apt-cache", "depends", "linux-image-cloud-amd64"]).stdout.decode()
            except ImageError:
                # A fresh system has no package lists yet.
                _run(["apt-get", "update"])
                out = _run(["apt-cache", "depends", "linux-image-cloud-amd64"]).stdout.decode()
            deps = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Depends:" in ln]
            kern = [d for d in deps if d.startswith("linux-image-") and d.endswith("-cloud-amd64")]
            if not kern:
                raise ImageError(f"could not resolve linux-image-cloud-amd64 from apt-cache:\n{out}")
            pkgs.append(kern[0])
        if "busybox" in missing:
            pkgs.append("busybox-static")
        _run(["apt-get", "download", *pkgs], cwd=debdir)
        found = {k: _latest(list(debdir.glob(p))) for k, p in patterns.items()}
        found["kernel"] = _latest([p for p in debdir.glob(patterns["kernel"])
                                   if not p.name.startswith("linux-image-cloud-amd64_")])
        if None in found.values():
            raise ImageError(f"apt-get download {pkgs} did not produce the packages in {debdir}")
    return found


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF kernel inside a compressed bzImage.

    Tries every gzip / xz / lz4 (legacy) / zstd magic offset and returns the first decompression
    whose output starts with ``\\x7fELF``. gzip and xz use the standard library; lz4 and zstd use
    the ``lz4`` / ``zstd`` command-line tools (installed by ``k3lab.agentenv.sysdeps``).

    Raises:
        ImageError: no compressed ELF found.
    """
    magics = {b"\x1f\x8b\x08": "gzip", b"\xfd7zXZ\x00": "xz", b"\x02\x21\x4c\x18": "lz4",
              b"\x28\xb5\x2f\xfd": "zstd"}
    for magic, kind in magics.items():
        start = 0
        while (off := bzimage.find(magic, start)) >= 0:
            start = off + 1
            data = bzimage[off:]
            out = b""
            try:
                if kind == "gzip":
                    out = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)
                elif kind == "xz":
                    out = lzma.LZMADecompressor().decompress(data)
                else:
                    tool = {"lz4": ["lz4", "-dc"], "zstd": ["zstd", "-dc"]}[kind]
                    # These tools stop with an error at the trailing bytes after the stream, but
                    # what they wrote before is the complete kernel.
                    out = subprocess.run(tool, input=data, capture_output=True).stdout
            except (zlib.error, lzma.LZMAError, FileNotFoundError):
                continue
            if out[:4] == b"\x7fELF":
                return out
    raise ImageError("no compressed ELF vmlinux found in the kernel image (tried gzip, xz, lz4, zstd;"
                     " lz4/zstd need their command-line tools)")


class _Cpio:
    """Minimal cpio "newc" writer (the initramfs format, Documentation/driver-api/early-userspace)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        nameb = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, 2 if mode & 0o040000 else 1, 0, len(data), 0, 0,
                  rdev[0], rdev[1], len(nameb), 0]
        self.ino += 1
        hdr = b"070701" + b"".join(b"%08X" % f for f in fields)
        self.buf.write(hdr + nameb)
        self.buf.write(b"\0" * (-(len(hdr) + len(nameb)) % 4))
        self.buf.write(data)
        self.buf.write(b"\0" * (-len(data) % 4))

    def dir(self, name: str) -> None:
        self._entry(name, 0o040755)

    def file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, 0o100000 | perm, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, 0o120777, target.encode())

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, 0o020600, rdev=(major, minor))

    def finish(self) -> bytes:
        self.ino = 0
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


def _build(out: Path, debs: dict[str, Path]) -> str:
    work = out / "_work"
    kx, bx = work / "kernel", work / "busybox"
    kx.mkdir(parents=True)
    bx.mkdir(parents=True)
    _run(["dpkg-deb", "-x", str(debs["kernel"]), str(kx)])
    _run(["dpkg-deb", "-x", str(debs["busybox"]), str(bx)])
    vmlinuz = _latest(list((kx / "boot").glob("vmlinuz-*")))
    if vmlinuz is None:
        raise ImageError(f"no /boot/vmlinuz-* in {debs['kernel']}")
    kver = vmlinuz.name.removeprefix("vmlinuz-")
    (out / "vmlinux").write_bytes(extract_vmlinux(vmlinuz.read_bytes()))
    busybox = (bx / "bin" / "busybox").read_bytes()

    cpio = _Cpio()
    for d in ("bin", "dev", "lib", "lib/modules", "proc", "sys", "newroot"):
        cpio.dir(d)
    cpio.chardev("dev/console", 5, 1)
    cpio.file("bin/busybox", busybox, 0o755)
    cpio.symlink("bin/sh", "busybox")
    for m in MODULES:
        hits = list((kx / "lib" / "modules" / kver).rglob(f"{m}.ko"))
        if not hits:
            raise ImageError(f"module {m}.ko not found in {debs['kernel']}")
        cpio.file(f"lib/modules/{m}.ko", hits[0].read_bytes())
    cpio.file("init", INIT_SH.replace("__MODULES__", " ".join(MODULES)).encode(), 0o755)
    with gzip.GzipFile(out / "initrd.gz", "wb", mtime=0) as f:
        f.write(cpio.finish())

    stage = work / "rootfs"
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "proc", "sys", "dev", "tmp", "run",
              "root", "var/tmp", "home"):
        (stage / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(bx / "bin" / "busybox", stage / "bin" / "busybox")
    applets = _run([str(stage / "bin" / "busybox"), "--list-full"]).stdout.decode().split()
    for applet in applets:
        link = stage / applet
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to("/bin/busybox")
    for name, text in (("sbin/k3init", K3INIT_SH), ("sbin/k3run", K3RUN_SH), ("sbin/k3agent", agent_script())):
        (stage / name).write_text(text)
        (stage / name).chmod(0o755)
    (stage / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                          "user:x:1000:1000:user:/home/user:/bin/sh\n")
    (stage / "etc" / "group").write_text("root:x:0:\nuser:x:1000:\n")
    (stage / "home" / "user").mkdir()
    # root's home is root's alone: commands run as "user" by default and must not read it.
    (stage / "root").chmod(0o700)
    (stage / "etc" / "hostname").write_text("sandbox\n")
    _run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-L", "k3root", "-E", "root_owner=0:0",
          "-d", str(stage), str(out / "rootfs.ext4"), f"{ROOTFS_MIB}M"])
    shutil.rmtree(work)
    return kver


def build_image(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Image:
    """Build (once) and return the guest image.

    Args:
        cache_dir: where .debs and images live; default :func:`default_cache_dir`.
        force (bool): rebuild even when a verified image exists.

    Returns:
        Image: verified against its ``image.json`` checksums.

    Raises:
        ImageError: a package cannot be found or downloaded, a tool is missing (the message names
            ``python -m k3lab.agentenv.sysdeps``), a checksum does not match, or ``cache_dir`` is
            a file.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if cache.exists() and not cache.is_dir():
        raise ImageError(f"cache_dir {cache} exists and is not a directory")
    debs = _fetch_debs(cache / "debs")
    deb_sums = {k: {"file": p.name, "sha256": _sha256(p)} for k, p in debs.items()}
    key_src = json.dumps({"format": FORMAT_VERSION, "debs": deb_sums, "init": INIT_SH,
                          "k3init": K3INIT_SH, "k3run": K3RUN_SH, "agent": agent_script(), "modules": MODULES,
                          "rootfs_mib": ROOTFS_MIB}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    final = cache / "images" / key
    if final.is_dir() and not force:
        return _load(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=final.parent))
    try:
        kver = _build(tmp, debs)
        outputs = {n: _sha256(tmp / n) for n in ("vmlinux", "initrd.gz", "rootfs.ext4")}
        manifest = {"format": FORMAT_VERSION, "key": key, "kernel_version": kver, "debs": deb_sums,
                    "outputs": outputs,
                    "digest": hashlib.sha256("".join(outputs[n] for n in sorted(outputs)).encode()).hexdigest()}
        (tmp / "image.json").write_text(json.dumps(manifest, indent=1))
        for n in outputs:
            (tmp / n).chmod(0o444)
        if final.is_dir():
            shutil.rmtree(final)
        os.rename(tmp, final)
        # Images of older keys (other package versions or guest scripts) are dead weight.
        for other in final.parent.iterdir():
            if other != final and (other / "image.json").is_file():
                shutil.rmtree(other, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return _load(final)


def _load(root: Path) -> Image:
    manifest = json.loads((root / "image.json").read_text())
    img = Image(root=root, kernel=root / "vmlinux", initrd=root / "initrd.gz",
                rootfs=root / "rootfs.ext4", kernel_version=manifest["kernel_version"],
                digest=manifest["digest"])
    img.verify()
    return img
