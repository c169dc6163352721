"""AgentEnv: microVM sandboxes for agentic RL (K3 ran 51M of them), with pause/resume,
hibernate/wake, snapshot/restore and fork. One :class:`Sandbox` API over two backends: QEMU
``microvm`` (KVM or TCG) and Firecracker (where a firecracker binary and real KVM are found);
:func:`detect_host` picks and says why. See ``sandbox.py`` for what is and is not isolated.

Public names: :class:`Sandbox`, :class:`SandboxPool`, :class:`Snapshot`, :class:`ExecResult`,
:func:`detect_host`, :func:`build_image`, and the errors.
"""
from k3lab.agentenv.agent import ExecResult
from k3lab.agentenv.host import HostInfo, detect_host
from k3lab.agentenv.image import Image, ImageError, build_image
from k3lab.agentenv.sandbox import (Sandbox, SandboxCrashed, SandboxError, SandboxPool,
                                    SandboxStateError, SandboxTimeout, Snapshot, cleanup,
                                    default_root, leftovers)

__all__ = ["Sandbox", "SandboxPool", "Snapshot", "ExecResult", "HostInfo", "detect_host", "Image",
           "ImageError", "build_image", "SandboxError", "SandboxCrashed", "SandboxTimeout",
           "SandboxStateError", "cleanup", "default_root", "leftovers"]
