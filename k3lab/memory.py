"""The activation manager (K3 report, "Training system"): a storage policy for every tensor saved for
backward, declared outside the model code.

Policies (``POLICIES``):

    keep        the tensor stays where autograd put it (the default of plain PyTorch)
    recompute   the region is activation-checkpointed (``torch.utils.checkpoint``, non-reentrant):
                only its inputs are kept, everything inside is recomputed in backward except the
                outputs of top-k (``SAVED_IN_RECOMPUTE``): a replay routes to the forward's experts
    offload     a copy goes to host memory (pinned, copied on a side stream on CUDA; a plain copy on
                CPU, which only simulates the saving) and comes back when backward needs it
    fp8         block-wise FP8: float8_e4m3fn with one float32 scale (float64 for float64) per block of 128 values along
                the last dim; dequantised to the original dtype in backward (lossy: ~2^-4 relative)

Everything is built on ``torch.autograd.graph.saved_tensors_hooks`` and ``torch.utils.checkpoint``.
Policies attach to modules by name pattern (``fnmatch`` on ``model.named_modules()`` names, the root
being ""), or to a block of code with a context manager:

    >>> mgr = ActivationManager()
    >>> handle = apply_policies(model, {"*.experts": "fp8", "sublayers.0": "recompute"}, manager=mgr)
    >>> loss = model(x, targets=x)[1]
    >>> mgr.stats()["fp8"]["live_bytes"]          # bytes held for backward under fp8, right now
    >>> loss.backward(); mgr.live_bytes()          # 0: every saved tensor released
    >>> handle.remove()                            # the model is plain again

    >>> with activation_policy("offload", manager=mgr):
    ...     y = mlp(x)

For a module that several patterns match, the first rule (in the rules' order) whose pattern matches it
wins, so a specific pattern goes before a broad one: {"sublayers.1": "offload", "sublayers.[0-9]": "recompute"}
(fnmatch's ``*`` also matches dots: "sublayers.*" matches every module below the sublayers too). One pattern
given two policies is an error (``parse_rules``). Between nested modules the innermost policy wins: a module's
policy replaces its parent's for the tensors its own forward saves. Inside a recompute region nested policies
are switched off, because checkpoint must see (and recompute) every tensor of the region itself. Parameters
(and views of them, and copies of them made for the call alone: autocast's cast of a weight, a concatenation of
weights) are never copied, quantised or counted: they are not activations, and the weights live anyway.

Counters (``ActivationManager.stats()``), per policy: ``live_bytes`` (held for backward now, on the
device the tensor came from: for offload this is 0 and the copy is counted in ``host_bytes``; for
recompute it is the region's inputs), ``peak_bytes``, ``total_bytes`` (summed over all saves),
``live_tensors``. A tensor saved twice while alive (by two ops) is counted once.
"""
from __future__ import annotations

import contextlib
import fnmatch
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

POLICIES = ("keep", "recompute", "offload", "fp8")
FP8_BLOCK = 128
# Largest finite float8_e4m3fn value: the block's absolute maximum is mapped onto it.
FP8_MAX = 448.0


# Ops a recompute region keeps the forward's outputs of instead of recomputing them: top-k makes the MoE
# routers' discrete choice. On a GPU a replay's router logits can differ from the forward's in the last bit
# (reductions in another order), and a flipped near-tie would send the replayed tokens to other experts:
# the backward would differentiate another function (silently, or with a shape error in the dispatch).
SAVED_IN_RECOMPUTE = (torch.ops.aten.topk.default,)


def _recompute_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_IN_RECOMPUTE else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_contexts():
    return create_selective_checkpoint_contexts(_recompute_policy)


def check_policy(policy: str) -> str:
    """Return ``policy`` if it is one of ``POLICIES``.

    Raises:
        ValueError: anything else, naming the valid choices.
    """
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"unknown activation policy {policy!r}; expected one of {list(POLICIES)}")
    return policy


def _check_block(who: str, block: int) -> None:
    if not (isinstance(block, int) and not isinstance(block, bool) and block >= 1):
        raise ValueError(f"{who}: block (values per scale) must be a positive int, got {block!r}")


def fp8_quantize(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 (e4m3) quantisation along the last dim.

    Args:
        x (Tensor): [..., D] floating point, any device; D need not be a multiple of ``block`` (the last
            block of each row is shorter).
        block (int): values per scale, >= 1.

    Returns:
        (q [..., D] float8_e4m3fn, scale [..., ceil(D / block)] float32, float64 for a float64 x): value j of
        a row is ``q[j] * scale[j // block]`` (``fp8_dequantize``). 1 byte per value plus 4 (8) per block.
        A block's scale comes from its finite values; NaN and +-inf are stored as NaN (e4m3 has no
        infinity), so one non-finite value loses only itself.

    Raises:
        ValueError: x not floating point or 0-dim, block not a positive int.
    """
    if not x.is_floating_point() or x.ndim == 0:
        raise ValueError(f"fp8_quantize needs a floating tensor with ndim >= 1, got {x.dtype} {list(x.shape)}")
    _check_block("fp8_quantize", block)
    d = x.shape[-1]
    nb = -(-d // block)
    # A block wider than the row is the row: padding a row to a block of 2^28 took gigabytes for one scale.
    block = min(block, max(d, 1))
    # float64 keeps its own range: through float32, values past 3.4e38 became inf and those below 1e-45 zero.
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = x.detach().to(work)
    # Zero padding to whole blocks changes no block's maximum; it is dropped again before storing.
    padded = torch.nn.functional.pad(rows, (0, nb * block - d)) if nb * block != d else rows
    blocks = padded.reshape(*x.shape[:-1], nb, block)
    finite = torch.isfinite(blocks)
    amax = torch.where(finite, blocks.abs(), 0).amax(dim=-1, keepdim=True)
    # An all-zero block keeps scale 1 (any scale gives 0), avoiding 0/0; a block whose maximum is below
    # 448 x the smallest subnormal would get scale 0 (and NaN): the smallest normal number is its floor.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).clamp(min=torch.finfo(work).tiny)
    q = torch.where(finite, (blocks / scale).clamp(-FP8_MAX, FP8_MAX), torch.nan).to(torch.float8_e4m3fn)
    q = q.reshape(*x.shape[:-1], nb * block)[..., :d].contiguous()
    return q, scale.squeeze(-1)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of ``fp8_quantize``: q [..., D] float8_e4m3fn and scale [..., ceil(D / block)] float32 -> [..., D]
    in ``dtype``, value j of a row being ``q[j] * scale[j // block]``.

    Raises:
        ValueError: block not a positive int; q not a float8_e4m3fn tensor with ndim >= 1; scale not float32 or
            float64 of the shape ``fp8_quantize`` gives q with this block (scales made with another block would
            be read against the wrong values); dtype not a floating dtype.
    """
    _check_block("fp8_dequantize", block)
    if not (isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn and q.ndim >= 1):
        got = f"{q.dtype} {list(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"fp8_dequantize: q must be a float8_e4m3fn tensor with ndim >= 1 (fp8_quantize's), got {got}")
    d = q.shape[-1]
    want = (*q.shape[:-1], -(-d // block))
    if not (isinstance(scale, torch.Tensor) and tuple(scale.shape) == want and scale.dtype in (torch.float32, torch.float64)):
        got = f"{scale.dtype} {list(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"fp8_dequantize: scale must be float32 or float64 {list(want)} for q {list(q.shape)} "
                         f"with block={block} (fp8_quantize's), got {got}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"fp8_dequantize: dtype must be a floating torch.dtype, got {dtype!r}")
    block = min(block, max(d, 1))
    return (q.to(scale.dtype) * scale.repeat_interleave(block, dim=-1)[..., :d]).to(dtype)


@dataclass
class _Counter:
    live_bytes: int = 0
    peak_bytes: int = 0
    total_bytes: int = 0
    live_tensors: int = 0
    host_bytes: int = 0


class _Packed:
    """What a pack hook returns: the stored form plus the bookkeeping that releases the counter when
    autograd drops it (after backward, or when the graph is freed)."""

    __slots__ = ("manager", "policy", "nbytes", "host", "data", "meta", "__weakref__")

    def __init__(self, manager, policy, nbytes, host, data, meta=None):
        self.manager, self.policy, self.nbytes, self.host, self.data, self.meta = (
            manager, policy, nbytes, host, data, meta)
        manager._acquire(policy, nbytes, host)

    def __del__(self):
        self.manager._release(self.policy, self.nbytes, self.host)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# How far back a saved tensor's history is searched for parameters alone (autocast's cast of a weight is one
# node, ``expert_ffn``'s cat of two cast weights three); longer histories are activations.
_WEIGHT_HISTORY_NODES = 8


def _from_parameters(fn) -> bool:
    """True when the autograd history ``fn`` (a saved tensor's grad_fn) reaches only parameters within
    ``_WEIGHT_HISTORY_NODES`` nodes: a weight's copy made for this call (autocast's bf16 cast, a concatenation
    of weights), which lives as long as the weights do in substance and is no activation. An input that does
    not require grad (a None edge) or a leaf that is not a parameter makes it an activation."""
    if fn is None:
        return False
    todo, seen = [fn], 0
    while todo:
        node = todo.pop()
        seen += 1
        if seen > _WEIGHT_HISTORY_NODES:
            return False
        if type(node).__name__ == "AccumulateGrad":
            if not isinstance(node.variable, nn.Parameter):
                return False
            continue
        edges = node.next_functions
        if not edges or any(n is None for n, _ in edges):
            return False
        todo.extend(n for n, _ in edges)
    return True


class ActivationManager:
    """Holds the counters, the cache that dedupes repeated saves, and (on CUDA) the offload stream.

    One manager per model is the usual choice; ``apply_policies`` and ``activation_policy`` create
    one when none is given.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.counters = {p: _Counter() for p in POLICIES}
        # id(tensor) -> (weakref tensor, version, weakref packed): the same live tensor saved by two
        # ops (a linear's input also read by a norm's backward) is stored and counted once.
        self._cache: dict[int, tuple] = {}
        self._param_ptrs: set[int] = set()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._local = threading.local()

    # -- counters ------------------------------------------------------------------------------------
    def _acquire(self, policy, nbytes, host):
        with self._lock:
            c = self.counters[policy]
            c.live_tensors += 1
            c.total_bytes += nbytes
            if host:
                c.host_bytes += nbytes
            else:
                c.live_bytes += nbytes
                c.peak_bytes = max(c.peak_bytes, c.live_bytes)

    def _release(self, policy, nbytes, host):
        with self._lock:
            c = self.counters[policy]
            c.live_tensors -= 1
            if host:
                c.host_bytes -= nbytes
            else:
                c.live_bytes -= nbytes

    def stats(self) -> dict[str, dict[str, int]]:
        """Per policy: live_bytes, peak_bytes, total_bytes, live_tensors, host_bytes (ints, bytes)."""
        with self._lock:
            return {p: dict(vars(c)) for p, c in self.counters.items()}

    def live_bytes(self) -> int:
        """Bytes held for backward now on the compute device, all policies together."""
        return sum(c.live_bytes for c in self.counters.values())

    def live_tensors(self) -> int:
        """Saved tensors held for backward now, all policies together."""
        return sum(c.live_tensors for c in self.counters.values())

    def reset_peaks(self) -> None:
        """Start ``peak_bytes`` and ``total_bytes`` afresh (live counts are kept)."""
        with self._lock:
            for c in self.counters.values():
                c.peak_bytes, c.total_bytes = c.live_bytes, 0

    def track_parameters(self, module: nn.Module) -> None:
        """Remember ``module``'s parameter storages so that saves of them (or views) are left alone."""
        self._param_ptrs.update(p.untyped_storage().data_ptr() for p in module.parameters())

    # -- hooks ---------------------------------------------------------------------------------------
    def _is_param(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        if t.device.type != "meta" and t.untyped_storage().data_ptr() in self._param_ptrs:
            return True
        return _from_parameters(t.grad_fn)

    def _pack(self, policy: str, t: torch.Tensor):
        if self._is_param(t):
            return t
        hit = self._cache.get(id(t))
        if hit is not None:
            ref, version, packed_ref = hit
            packed = packed_ref()
            if ref() is t and version == t._version and packed is not None and packed.policy == policy:
                return packed
        if policy == "fp8" and t.is_floating_point() and t.ndim > 0 and t.numel() > 0:
            q, scale = fp8_quantize(t)
            packed = _Packed(self, policy, _nbytes(q) + _nbytes(scale), False, (q, scale), t.dtype)
        elif policy == "offload" and t.numel() > 0:
            packed = self._offload(t)
        else:
            # keep, recompute (the region's inputs), and what fp8/offload cannot change (ints, scalars).
            # Detached: a saved output holding its own grad_fn is a reference cycle (output -> grad_fn
            # -> saved -> output) that only gc frees when backward never runs on it (pytorch#161186).
            packed = _Packed(self, policy, _nbytes(t), False, t.detach(), t._version)
        self._cache[id(t)] = (weakref.ref(t), t._version, weakref.ref(packed))
        if len(self._cache) > 4096:
            self._cache = {k: v for k, v in self._cache.items() if v[0]() is not None and v[2]() is not None}
        return packed

    def _offload(self, t: torch.Tensor) -> _Packed:
        if t.device.type != "cuda":
            return _Packed(self, "offload", _nbytes(t), True, t.detach().clone(), ("cpu", None))
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        # The side stream must wait for the kernel that produced t; the wait is issued before entering
        # the stream context so it orders the two streams (torchtitan#2581: inside it was a no-op).
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        # t's memory may be reused by the allocator only after the copy on the side stream.
        t.record_stream(stream)
        return _Packed(self, "offload", _nbytes(t), True, host, (t.device, done))

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        if packed.policy == "fp8" and isinstance(packed.data, tuple):
            q, scale = packed.data
            return fp8_dequantize(q, scale, packed.meta)
        # Only offloaded copies are on the host; what offload cannot change (an empty tensor) is kept
        # as under "keep", its meta the version counter.
        if packed.host:
            device, done = packed.meta
            if device == "cpu":
                return packed.data
            done.synchronize()
            return packed.data.to(device, non_blocking=True)
        # The stored tensor shares its version counter with the saved one (detach): a write in place after the
        # save would reach backward silently, where plain autograd raises.
        if packed.data._version != packed.meta:
            raise RuntimeError(f"a tensor of shape {list(packed.data.shape)} saved for backward under policy "
                               f"{packed.policy!r} was modified by an in-place operation after it was saved "
                               f"(version {packed.data._version}, saved at {packed.meta}); clone it before the "
                               "in-place op")
        return packed.data

    def hooks(self, policy: str):
        """``saved_tensors_hooks`` that store every saved tensor under ``policy`` (not "recompute")."""
        check_policy(policy)
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(policy, t), self._unpack)

    # -- regions -------------------------------------------------------------------------------------
    @property
    def in_recompute(self) -> bool:
        return getattr(self._local, "recompute_depth", 0) > 0

    @contextlib.contextmanager
    def _recompute_scope(self):
        self._local.recompute_depth = getattr(self._local, "recompute_depth", 0) + 1
        try:
            yield
        finally:
            self._local.recompute_depth -= 1

    def run(self, policy: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` with its saved tensors stored under ``policy``.

        Inside a recompute region this is a plain call (see the module docstring).

        Raises:
            ValueError: unknown policy.
        """
        check_policy(policy)
        if self.in_recompute:
            return fn(*args, **kwargs)
        if policy != "recompute":
            with self.hooks(policy):
                return fn(*args, **kwargs)

        def region(*a, **k):
            # Also entered when checkpoint replays the region in backward: nested policies stay off.
            with self._recompute_scope():
                return fn(*a, **k)

        # checkpoint stores the region's inputs through a Function that saves them before it pushes
        # its own hooks, so these hooks see (and count) exactly what recompute keeps.
        with self.hooks("recompute"):
            return checkpoint(region, *args, use_reentrant=False, context_fn=_recompute_contexts, **kwargs)


def _check_manager(manager) -> None:
    if manager is not None and not isinstance(manager, ActivationManager):
        raise ValueError(f"manager must be an ActivationManager or None, got {type(manager).__name__}")


@contextlib.contextmanager
def activation_policy(policy: str, manager: ActivationManager | None = None):
    """Store every tensor saved for backward inside the block under ``policy``.

    ``recompute`` needs a function to replay, so it is not a block policy: use
    ``manager.run("recompute", fn, *args)`` or ``apply_policies``.

    Yields:
        ActivationManager: the one given, or a new one.

    Raises:
        ValueError: unknown policy, or "recompute"; manager neither None nor an ActivationManager.
    """
    check_policy(policy)
    _check_manager(manager)
    if policy == "recompute":
        raise ValueError("'recompute' needs a region to replay: use manager.run('recompute', fn, *args) or "
                         "apply_policies(model, {pattern: 'recompute'})")
    manager = manager or ActivationManager()
    if manager.in_recompute:
        yield manager
        return
    with manager.hooks(policy):
        yield manager


@dataclass
class PolicyHandle:
    """Returned by ``apply_policies``: which module got which policy, and ``remove()`` to undo it."""

    manager: ActivationManager
    assigned: dict[str, str] = field(default_factory=dict)
    _modules: list = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Give every wrapped module back its own forward."""
        for m in self._modules:
            if "forward" in m.__dict__:
                del m.__dict__["forward"]
            m.__dict__.pop("_k3lab_activation_policy", None)
        self._modules.clear()
        self.assigned.clear()


def parse_rules(spec: str) -> dict[str, str]:
    """``apply_policies`` rules {pattern: policy} from "PATTERN=POLICY,..." (a command line's), in the
    string's order; empty entries are skipped.

    Raises:
        ValueError: spec not a str; an entry not PATTERN=POLICY; an unknown policy; one pattern given two
            different policies (a dict keeps one value per pattern, so one of them would be dropped unseen).
    """
    if not isinstance(spec, str):
        raise ValueError(f"rules must be a str of PATTERN=POLICY entries, got {type(spec).__name__}")
    rules: dict[str, str] = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        pattern, sep, policy = item.partition("=")
        pattern, policy = pattern.strip(), policy.strip()
        if not sep or not pattern:
            raise ValueError(f"expected PATTERN=POLICY entries separated by commas, got {item!r}")
        check_policy(policy)
        if rules.get(pattern, policy) != policy:
            raise ValueError(f"pattern {pattern!r} is given two policies, {rules[pattern]!r} and {policy!r}; "
                             f"give it one")
        rules.setdefault(pattern, policy)
    return rules


def apply_policies(model: nn.Module, rules: dict[str, str], manager: ActivationManager | None = None,
                   default: str | None = "keep", strict: bool = True) -> PolicyHandle:
    """Attach storage policies to ``model``'s modules by name pattern, without touching model code.

    Args:
        model (nn.Module): any module; its own forward and its submodules' forwards are wrapped
            (an instance attribute ``forward``, removed by ``PolicyHandle.remove``).
        rules (dict[str, str]): ``fnmatch`` pattern on ``named_modules()`` names ("" is the root,
            "*.experts", "sublayers.[02]") -> policy; for a module that several patterns match,
            the first rule in dict order whose pattern matches it wins (a later, narrower pattern does not
            override it: put it first). ``parse_rules`` makes this dict from "PATTERN=POLICY,...".
        manager (ActivationManager | None): counters and streams; a new one when None.
        default (str | None): the root's policy, so everything else is counted too ("keep"); None
            leaves unmatched code entirely to plain autograd. A rule matching "" overrides it.
        strict (bool): a pattern that matches no module is an error (it is almost always a typo).

    Returns:
        PolicyHandle with ``assigned`` {module name: policy} and ``remove()``.

    Raises:
        ValueError: unknown policy name; a pattern matching nothing under ``strict``; ``model``
            already has policies applied; rules not a dict of str -> str; model not an nn.Module; manager
            neither None nor an ActivationManager.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_manager(manager)
    if not isinstance(rules, dict) or not all(isinstance(k, str) for k in rules):
        raise ValueError(f"rules must be a dict of module-name pattern -> policy, got {type(rules).__name__}")
    for pattern, policy in rules.items():
        try:
            check_policy(policy)
        except ValueError as e:
            raise ValueError(f"rule {pattern!r}: {e}") from None
    if default is not None:
        check_policy(default)
    named = list(model.named_modules())
    if any("_k3lab_activation_policy" in m.__dict__ for _, m in named):
        raise ValueError("model already has activation policies; call remove() on the earlier handle first")
    manager = manager or ActivationManager()
    manager.track_parameters(model)
    assigned: dict[str, str] = {}
    used = set()
    for name, _ in named:
        for pattern, policy in rules.items():
            if fnmatch.fnmatchcase(name, pattern):
                used.add(pattern)
                assigned.setdefault(name, policy)
    unused = [p for p in rules if p not in used]
    if strict and unused:
        some = [n for n, _ in named[1:6]]
        raise ValueError(f"patterns {unused} match no module of {type(model).__name__} (names look like {some})")
    if default is not None and "" not in assigned:
        assigned[""] = default
    handle = PolicyHandle(manager, dict(sorted(assigned.items())))
    modules = dict(named)
    for name, policy in assigned.items():
        m = modules[name]
        m._k3lab_activation_policy = policy
        m.forward = _wrapped_forward(manager, policy, m.forward)
        handle._modules.append(m)
    return handle


def _wrapped_forward(manager: ActivationManager, policy: str, forward):
    def wrapped(*args, **kwargs):
        # Plain autograd when nothing is saved (eval, no_grad): no hooks, no checkpoint.
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return manager.run(policy, forward, *args, **kwargs)
    return wrapped
