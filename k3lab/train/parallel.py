"""The trainer's parallel layout: one ``DeviceMesh`` (``k3lab.dist.make_mesh``) gives every group; FSDP2 and
expert parallelism are applied to a ``K3Model`` from it.

    data ranks   dp x cp x ep: every rank of the flattened "batch" axis holds its own tokens of the global
                 batch; the loss, the FSDP gradient average and Quantile Balancing's histogram all run
                 over this one group. The dp x ep "rows" read disjoint sequences (ep ranks are data ranks
                 too, as in torchtitan's dp_shard); the cp ranks of a row share its sequences, packed into
                 one stream and cut into cp contiguous pieces (``k3lab.kcp.make_context``).
    experts      each MoE layer's stacked experts [E, l, h] become DTensors Shard(0) over "ep" (rank r
                 holds experts r*E/ep ... (r+1)*E/ep - 1) and run through ``k3lab.moonep``; FSDP then
                 shards them over dp x cp (each such group holds the whole set of experts once).
    the rest     FSDP2 ``fully_shard`` over the batch axis (ZeRO-3: parameters, gradients and optimizer
                 state sharded, parameters all-gathered for forward and backward).
    compile      with ``--compile``, after all of the above (``compile_blocks``): each sublayer and MTP module
                 compiled in place by ``torch.compile``, the regions torchtitan compiles per block.
    stages       with pp > 1 the outermost axis: each pp coordinate holds its own pipeline stages of the model
                 (``k3lab.train.pipeline``), and everything above applies to each stage within its own
                 dp x cp x ep sub-mesh; the same data rows run through every stage.

Gradient scale: every rank's loss is the mean over its own tokens (the same count on every rank), so the
global mean loss is the average over the B = dp*cp*ep data ranks. Under cp a rank's tokens feed the other
cp ranks' losses through the KCP maps, the convolution halo and the MLA latents; the backward of those
collectives sends each rank its share, so the sum over ranks of the local gradients is still the gradient
of the sum of their losses. FSDP averages the other parameters over B ranks. An expert's gradient
is averaged over its ep group by the MoE layer (``moonep_experts`` sums it over the group's losses; the
layer scales by 1/ep) and over dp by FSDP: both come out as the gradient of the global mean. (FSDP's own
divide factor would do the same on NCCL, but it reduces with PREMUL_SUM, which gloo lacks.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch._inductor.config
import torch.distributed as dist
import torch.nn as nn

from k3lab.dist import make_mesh
from k3lab.moe import moe_layers
from k3lab.moonep import MODES


@dataclass
class Parallel:
    """This rank's place in the layout (a plain context object, passed explicitly).

    Attributes:
        mesh: the (pp, dp, cp, ep) ``DeviceMesh``, or None in a one-rank world (no sharding at all).
        dp, ep, cp (int): axis sizes. world (int): pp * dp * cp * ep.
        row (int), rows (int): this rank's data row (dp_rank * ep + ep_rank) and dp * ep: the global batch
            is cut into ``rows`` equal slices of sequences in that order.
        cp_rank (int): this rank's index on the cp axis; cp_group: its process group (None when cp == 1).
        data_size (int): the ranks of the batch axis (dp * cp * ep), over which the loss is averaged.
        batch_mesh: the flattened 1-D (dp, cp, ep) mesh FSDP shards the non-expert parameters over.
        batch_group: its process group (None in a one-rank world): loss average and Quantile Balancing's
            histogram sum.
        ep_group: the process group of the "ep" axis (None when ep == 1).
        pp (int): pipeline-parallel ranks; pp_rank (int): this rank's index on the pp axis; pp_group: its
            process group (None when pp == 1).
        expert_mesh: the ranks that hold the same experts, every dp row and cp piece of them (FSDP's mesh of
            the expert weights).
    """

    mesh: object
    dp: int
    ep: int
    cp: int
    world: int
    row: int
    rows: int
    cp_rank: int
    data_size: int
    batch_mesh: object
    batch_group: object
    ep_group: object
    cp_group: object
    pp: int = 1
    pp_rank: int = 0
    pp_group: object = None
    expert_mesh: object = None


def build_parallel(dp: int, ep: int, device_type: str = "cpu", cp: int = 1, pp: int = 1) -> Parallel:
    """The mesh and groups for ``pp`` x ``dp`` x ``cp`` x ``ep`` ranks over the initialised default process group.

    Raises:
        ValueError: pp * dp * cp * ep differs from the world size (the message gives both), or a size < 1.
        RuntimeError: no default process group.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_parallel needs an initialised default process group")
    world = dist.get_world_size()
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (dp, ep, cp, pp)):
        raise ValueError(f"--dp, --ep, --cp and --pp must be ints >= 1, got dp={dp!r}, ep={ep!r}, cp={cp!r}, pp={pp!r}")
    n = pp * dp * cp * ep
    if n != world:
        lead = f"--pp {pp} x " if pp > 1 else ""
        raise ValueError(f"{lead}--dp {dp} x --cp {cp} x --ep {ep} = {n} ranks, but {world} were launched "
                         f"(torchrun --nproc-per-node {n})")
    if world == 1:
        return Parallel(None, 1, 1, 1, 1, 0, 1, 0, 1, None, None, None, None)
    mesh = make_mesh(pp=pp, dp=dp, cp=cp, ep=ep, device_type=device_type)
    batch = mesh["dp", "cp", "ep"]._flatten("batch")
    dp_rank, cp_rank, ep_rank, pp_rank = (mesh[a].get_local_rank() for a in ("dp", "cp", "ep", "pp"))
    return Parallel(mesh, dp, ep, cp, world, dp_rank * ep + ep_rank, dp * ep, cp_rank, batch.size(), batch,
                    batch.get_group(), mesh["ep"].get_group() if ep > 1 else None,
                    mesh["cp"].get_group() if cp > 1 else None, pp, pp_rank,
                    mesh["pp"].get_group() if pp > 1 else None,
                    mesh["dp", "cp"]._flatten("dp_cp") if cp > 1 else mesh["dp"])


def parallelize(model: nn.Module, par: Parallel, ep_mode: str = "moonep") -> nn.Module:
    """Shard ``model`` (a ``K3Model`` built identically on every rank, or one pipeline stage of it) in place
    for ``par``.

    With ep > 1 each MoE layer keeps its E/ep home experts (DTensor shards of the same global weights)
    and routes through ``moonep_experts`` in ``ep_mode``; then FSDP2 as in the module docstring. A
    one-rank ``par`` leaves the model untouched.

    Raises:
        ValueError: an unknown ``ep_mode``; E not divisible by ep.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method  # noqa: PLC0415
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415

    if ep_mode not in MODES:
        raise ValueError(f"--ep-mode must be one of {MODES}, got {ep_mode!r}")
    if par.mesh is None:
        return model
    moes = moe_layers(model)
    if par.ep > 1:
        ep_mesh = par.mesh["ep"]
        expert_mesh = par.expert_mesh
        r = ep_mesh.get_local_rank()
        for m in moes:
            E = m.config.n_experts
            if E % par.ep:
                raise ValueError(f"--ep {par.ep} must divide the {E} routed experts")
            L = E // par.ep
            for name in ("w_gate", "w_up", "w_down"):
                full = getattr(m.experts, name).detach()
                local = full[r * L:(r + 1) * L].clone()
                setattr(m.experts, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))
            m.ep_group, m.ep_mode = par.ep_group, ep_mode
            fully_shard(m.experts, mesh=expert_mesh, reshard_after_forward=True)
            # The EP path calls experts.ep_forward, not forward: FSDP must gather and reduce around it.
            register_fsdp_forward_method(m.experts, "ep_forward")
    fully_shard(model, mesh=par.batch_mesh, reshard_after_forward=True)
    return model


def compile_blocks(model: nn.Module) -> nn.Module:
    """Regional compilation, torchtitan's ``torch.compile`` per block: every sublayer of ``model`` (a ``K3Model``
    or one of its pipeline stages, parallelised or not) and every MTP module compiled in place
    (``nn.Module.compile(dynamic=False)``, no fullgraph), so inductor fuses their elementwise chains (norms,
    gates, casts, the GLU and the router's scores) into the matmuls' neighbours; Triton kernels registered as
    custom ops (KDA's short convolutions, the MoE's gather-and-sum) are called from the graphs as they are.
    Parameter names, hooks and the module tree are unchanged; the same code of every layer of a kind is
    compiled once.

    Left eager, each at its call site: the KDA operator (FlashKDA or the PyTorch chunked reference), the routed
    experts' grouped GEMMs, the expert-parallel exchange (MoonEP planner, collectives, FSDP's gather of the
    experts), the context-parallel all-gather; and, outside the sublayers, the embedding, Block AttnRes (its
    autograd.Functions share buffers across sublayers; its mixing is Triton on a GPU), the final norm and the
    head's matmuls. The loss's elementwise part (log-softmax and its gradient on each chunk of logits,
    ``k3lab.model.loss``) is compiled too (``compile_loss`` of a ``K3Model`` or its last stage). A sublayer whose
    modules carry activation policies (``k3lab.memory``) stays eager: their saved-tensor hooks and checkpoint
    regions wrap forwards that a compiled graph would swallow. A model on the CPU makes inductor compile in
    this process from then on (``torch._inductor.config.compile_threads = 1``, process-wide).

    Returns:
        ``model`` (compiled in place).

    Raises:
        ValueError: ``model`` has no ``sublayers`` (not a K3Model or a stage).
    """
    if not isinstance(getattr(model, "sublayers", None), nn.ModuleList):
        raise ValueError(f"model must be a K3Model or a K3Stage (with sublayers), got {type(model).__name__}")
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cpu":
        # Inductor's CPU code compiled in its worker processes can write out of bounds when called in this
        # process (glibc aborts later: "malloc(): unaligned tcache chunk detected"; pytorch/pytorch#181618,
        # torch 2.11-2.13 wheels built with oneDNN), which aborted a rank of the compiled cp = 2 test about
        # once in four suite runs. Compiling in this process avoids it; a GPU's Triton compile keeps its pool.
        torch._inductor.config.compile_threads = 1
    blocks = [*model.sublayers, *getattr(model, "mtp", ())]
    for block in blocks:
        # A placeholder of a sublayer that runs on another pipeline stage has no forward to compile.
        if next(block.parameters(), None) is None:
            continue
        if any("_k3lab_activation_policy" in m.__dict__ for m in block.modules()):
            continue
        block.compile(dynamic=False)
    if hasattr(model, "compile_loss"):
        model.compile_loss = True
    return model
