"""Block AttnRes cut into pipeline stages: sublayers [start, stop) run from the state the earlier stages
leave, and hand theirs on (K3 report, Sec. 2; AttnRes paper, Sec. 3.2).

With a standard residual a stage boundary carries one hidden state. Block AttnRes reads every completed
block, so the boundary at sublayer c carries the sources any later read needs:

    state(c) = [b_0 = h0, b_1, ..., b_{n-1}]            c at a block boundary (n - 1 blocks completed)
             = [b_0, ..., b_{n-1}, partial sum of block n]   c inside block n

stacked into one tensor [n (+ 1), B, T, d] so that it crosses a pipeline boundary as one tensor. Which
entries it holds follows from the block sizes and c alone (``carried_sources``), so a receiving stage
knows the layout without being told. The stage that ends at L applies the final aggregation (query row L)
and returns [B, T, d]. Chaining stages over cuts 0 = c_0 < c_1 < ... < c_S = L is ``naive_block_attnres``
(the formula, autograd through it), whatever the cuts.
"""
from __future__ import annotations

import itertools

import torch

from k3lab.attnres.naive import _check_inputs, block_sizes, check_input_values, depth_attention


def carried_sources(n_blocks, n_sublayers: int, cut: int) -> tuple[int, bool]:
    """What the state at sublayer boundary ``cut`` holds: (n, partial) for [b_0, ..., b_{n-1}] and, when
    ``partial``, the running sum of block n's sublayers before ``cut``.

    Args:
        n_blocks (int | list[int]): N or the block sizes (``block_sizes``).
        n_sublayers (int): L.
        cut (int): c in [0, L]; 0 is the embedding alone (n = 1), L every block (n = N + 1).

    Returns:
        (int, bool): n >= 1 completed sources and whether a partial sum follows; the stacked state has
        n + partial entries. E.g. blocks [4, 4, 2]: cut 4 -> (2, False), cut 6 -> (2, True).

    Raises:
        ValueError: bad block sizes (``block_sizes``); ``cut`` not an int in [0, L].
    """
    sizes = block_sizes(n_sublayers, n_blocks)
    if not (isinstance(cut, int) and not isinstance(cut, bool) and 0 <= cut <= n_sublayers):
        raise ValueError(f"cut must be an int in [0, L={n_sublayers}], got {cut!r}")
    ends = list(itertools.accumulate(sizes))
    done = sum(e <= cut for e in ends)
    start = ends[done - 1] if done else 0
    return 1 + done, cut > start


def block_attnres_stage(state: torch.Tensor, sublayers, queries: torch.Tensor, n_blocks, start: int, stop: int,
                        eps: float = 1e-6, *, check_values: bool = True) -> torch.Tensor:
    """Sublayers [start, stop) of Block AttnRes from the carried state, by the formula (autograd through it).

    Sublayer l (start <= l < stop) in block m (1-based: b_0 = h0, block m's sum is b_m) reads
    softmax_i(w_l^T RMSNorm(v_i)) over b_0..b_{m-1} and, after the block's first sublayer, its partial sum;
    its output joins the partial sum, which becomes b_m at the block's end (``naive_block_attnres``). The state
    layout is the module docstring's.

    Args:
        state (Tensor): [n + p, B, T, d] = ``carried_sources(n_blocks, L, start)``'s entries stacked; for
            start = 0, [1, B, T, d] holding h0.
        sublayers (Sequence): the stop - start callables [B, T, d] -> [B, T, d] of sublayers start..stop-1
            (each pre-norms its input and returns its output, not added).
        queries (Tensor): [L + 1, d] every pseudo-query (this stage reads rows start..stop-1, and row L
            when stop = L; the other rows get no gradient).
        n_blocks (int | list[int]): N or the block sizes, as ``naive_block_attnres``.
        start (int), stop (int): 0 <= start < stop <= L.
        eps (float): RMSNorm eps of the keys.
        check_values (bool): reject NaN/inf in the state or queries, or a state beyond RMSNorm's range
            (one host sync; ``check_input_values``).

    Returns:
        Tensor: stop < L: the state at ``stop``, [n' + p', B, T, d] in state's dtype; stop = L: the final
        aggregation over b_0..b_N, [B, T, d] (the input of the final norm).

    Raises:
        ValueError: bad block sizes, start/stop not ints with 0 <= start < stop <= L, len(sublayers) !=
            stop - start, state not a floating-point [n + p, B, T, d] with the entry count of ``start``,
            queries not [L + 1, d], eps not a finite number > 0, a sublayer returning anything but a
            tensor of its input's shape; with ``check_values``, NaN/inf or a too large state.

    Example:
        >>> import torch.nn as nn
        >>> fs, w = [nn.Linear(8, 8) for _ in range(6)], torch.randn(7, 8)
        >>> s = block_attnres_stage(torch.randn(1, 2, 5, 8), fs[:3], w, [2, 2, 2], 0, 3)
        >>> s.shape                                       # b_0, b_1 and block 2's partial sum
        torch.Size([3, 2, 5, 8])
        >>> block_attnres_stage(s, fs[3:], w, [2, 2, 2], 3, 6).shape
        torch.Size([2, 5, 8])
    """
    if not isinstance(queries, torch.Tensor) or queries.ndim != 2:
        got = list(queries.shape) if isinstance(queries, torch.Tensor) else type(queries).__name__
        raise ValueError(f"queries must be [L + 1, d], got {got}")
    L = queries.shape[0] - 1
    sizes = block_sizes(L, n_blocks)
    for name, v in (("start", start), ("stop", stop)):
        if not (isinstance(v, int) and not isinstance(v, bool)):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if not 0 <= start < stop <= L:
        raise ValueError(f"need 0 <= start < stop <= L={L}, got start={start}, stop={stop}")
    if len(sublayers) != stop - start:
        raise ValueError(f"expected stop - start = {stop - start} sublayers, got {len(sublayers)}")
    n, partial = carried_sources(sizes, L, start)
    if not isinstance(state, torch.Tensor) or state.ndim != 4 or state.shape[0] != n + partial:
        got = list(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(f"state at sublayer {start} must be [{n + partial}, B, T, d] ({n} completed source(s)"
                         f"{' and a partial sum' if partial else ''}), got {got}")
    if state.shape[-1] != queries.shape[1]:
        raise ValueError(f"state's width d = {state.shape[-1]} differs from the queries' [L + 1, d] = "
                         f"{list(queries.shape)}")
    # The shared checks of every path on the first source; the sublayers come back shape-checked.
    fs = _check_inputs(state[0], [None] * start + list(sublayers) + [None] * (L - stop), queries, eps, False)
    if check_values:
        try:
            check_input_values(state.flatten(0, 1), queries, name="state")
        except ValueError:
            # Name the entry (a second pass, only on failure).
            names = [f"state[{i}] (b_{i})" for i in range(n)] + ([f"state[{n}] (the partial sum)"] if partial else [])
            for name, entry in zip(names, state.unbind(0)):
                check_input_values(entry, queries, name=name)
            raise
    entries = list(state.unbind(0))
    blocks, run = entries[:n], entries[n] if partial else None
    ends = set(itertools.accumulate(sizes))
    for layer in range(start, stop):
        h, _ = depth_attention(blocks if run is None else blocks + [run], queries[layer], eps)
        v = fs[layer](h)
        run = v if run is None else run + v
        if layer + 1 in ends:
            blocks.append(run)
            run = None
    if stop == L:
        return depth_attention(blocks, queries[L], eps)[0]
    return torch.stack(blocks if run is None else blocks + [run])
