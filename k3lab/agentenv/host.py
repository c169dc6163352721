"""Host detection: can this machine run hardware-virtualised guests, and which backend to use.

:class:`~k3lab.agentenv.Sandbox` uses Firecracker when a ``firecracker`` binary, real KVM and a
Firecracker guest kernel (``$K3LAB_FIRECRACKER_KERNEL``) are all found, QEMU otherwise (KVM when
real, TCG software emulation when not).

``/dev/kvm`` alone is not proof: on these machines it is ``kvm_pvm`` (a paravirtual nested layer,
no vmx/svm CPU flags) where KVM_CREATE_VM works but ordinary guest kernels do not boot. So KVM
counts as usable only with vmx or svm in the CPU flags and without ``kvm_pvm`` loaded.

Run ``python -m k3lab.agentenv.host`` to print the decision.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class HostInfo:
    """What the host offers and what :class:`~k3lab.agentenv.Sandbox` will use.

    Attributes:
        backend (str): "qemu" or "firecracker".
        accel (str): QEMU accelerator, "kvm" or "tcg" (software emulation).
        reason (str): one sentence saying why.
        kvm_device (bool): ``/dev/kvm`` exists and opens read-write.
        kvm_pvm (bool): the ``kvm_pvm`` module is loaded (paravirtual nested KVM).
        hw_virt (bool): vmx or svm in the CPU flags.
        qemu (str | None): path of qemu-system-x86_64.
        qemu_version (str | None): e.g. "7.2.22".
        firecracker (str | None): path of a firecracker binary ($K3LAB_FIRECRACKER or PATH).
        firecracker_kernel (str | None): the guest kernel for Firecracker ($K3LAB_FIRECRACKER_KERNEL).
        tsc_khz (int): host TSC frequency in kHz (the guest needs ``tsc_early_khz=`` under TCG).
    """

    backend: str
    accel: str
    reason: str
    kvm_device: bool
    kvm_pvm: bool
    hw_virt: bool
    qemu: str | None
    qemu_version: str | None
    firecracker: str | None
    tsc_khz: int
    firecracker_kernel: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def tsc_khz(cpuinfo: str | None = None) -> int:
    """Host TSC frequency in kHz from /proc/cpuinfo's first "cpu MHz" line (2600000 if absent)."""
    for line in (cpuinfo if cpuinfo is not None else _cpuinfo()).splitlines():
        if line.startswith("cpu MHz"):
            return int(round(float(line.split(":", 1)[1]) * 1000))
    return 2_600_000


def decide(kvm_device: bool, kvm_pvm: bool, hw_virt: bool, qemu: str | None,
           firecracker: str | None, firecracker_kernel: str | None) -> tuple[str, str, str]:
    """Pure decision rule: returns (backend, accel, reason). See :func:`detect_host`."""
    kvm_ok = kvm_device and hw_virt and not kvm_pvm
    if kvm_pvm:
        why = "kvm_pvm detected: KVM guests cannot boot here"
    elif not kvm_device:
        why = "no usable /dev/kvm"
    elif not hw_virt:
        why = "/dev/kvm present but no vmx/svm CPU flags: KVM guests cannot boot here"
    else:
        why = "real KVM (vmx/svm, /dev/kvm)"
    if kvm_ok and firecracker and firecracker_kernel:
        return "firecracker", "kvm", f"{why}; firecracker at {firecracker}: using firecracker"
    if kvm_ok and firecracker:
        why += (f"; firecracker at {firecracker} but $K3LAB_FIRECRACKER_KERNEL (a kernel with"
                " VIRTIO_MMIO_CMDLINE_DEVICES) is unset")
    elif kvm_ok:
        why += "; no firecracker binary"
    if qemu is None:
        return "qemu", "kvm" if kvm_ok else "tcg", f"{why}; qemu-system-x86_64 missing (run python -m k3lab.agentenv.sysdeps)"
    accel = "kvm" if kvm_ok else "tcg"
    return "qemu", accel, f"{why}, using qemu/{accel.upper()}"


@functools.lru_cache(maxsize=1)
def detect_host() -> HostInfo:
    """Inspect the host once (cached) and pick the backend.

    Returns:
        HostInfo: ``reason`` reads like "kvm_pvm detected: KVM guests cannot boot here, using qemu/TCG".
    """
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
        os.close(fd)
        kvm_device = True
    except OSError:
        kvm_device = False
    kvm_pvm = os.path.isdir("/sys/module/kvm_pvm")
    info = _cpuinfo()
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    hw_virt = "vmx" in flags or "svm" in flags
    qemu = shutil.which("qemu-system-x86_64")
    version = None
    if qemu:
        out = subprocess.run([qemu, "--version"], capture_output=True, text=True).stdout.split()
        version = out[3] if len(out) > 3 else None
    firecracker = os.environ.get("K3LAB_FIRECRACKER") or shutil.which("firecracker")
    fc_kernel = os.environ.get("K3LAB_FIRECRACKER_KERNEL")
    backend, accel, reason = decide(kvm_device, kvm_pvm, hw_virt, qemu, firecracker, fc_kernel)
    return HostInfo(backend=backend, accel=accel, reason=reason, kvm_device=kvm_device,
                    kvm_pvm=kvm_pvm, hw_virt=hw_virt, qemu=qemu, qemu_version=version,
                    firecracker=firecracker, tsc_khz=tsc_khz(info), firecracker_kernel=fc_kernel)


if __name__ == "__main__":
    h = detect_host()
    for k, v in h.as_dict().items():
        print(f"{k:18s} {v}")
