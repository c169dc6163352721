"""How many bytes the residual machinery moves: Block AttnRes against the standard residual.

The mixing is memory-bound (a few flops per byte), so its cost in a training step is set by the bytes
it moves. ``bytes_model`` counts them for the paths k3lab implements; ``bytes_floor`` counts what any
implementation of the same algorithm must move, however its kernels are fused. Units: bytes per token
per channel (one pass over an [M, d] tensor of b-byte elements counts b), per sublayer, averaged
over the L sublayers; multiply by tokens x d x L for bytes per training step.
"""
from __future__ import annotations

import numbers

from k3lab.attnres.naive import block_sizes


def _check_sizes(**sizes) -> None:
    for name, b in sizes.items():
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
            raise ValueError(f"{name} must be an element size in bytes (an int >= 1), got {b!r}")


def bytes_model(L: int = 48, N: int = 8, buf: int = 4, h: int = 4, o: int = 2, v: int = 2) -> dict:
    """Memory traffic of the residual machinery per sublayer, in bytes per token per channel (one
    [M, d] pass of a b-byte tensor counts b), averaged over the L sublayers, for the standard
    residual, the per-read AttnRes path (every sublayer reads all its sources; replaced) and the
    two-phase path. Per-token scalars (lse, logits) are left out, and so is the sublayers' own
    traffic, which every residual pays.

    Args:
        L (int), N (int): sublayers and blocks.
        buf, h, o, v (int): bytes per element of the block buffer, of the stream / partial sums /
            their gradients (h0's dtype), of the stored inter-block parts o_k, of the sublayer outputs.

    Returns:
        dict: "standard", "per_read", "two_phase" -> {"fwd": B, "bwd": B}; "floor" -> the extra
        bytes ``bytes_floor`` gives for the same dtypes; and "L", "N".

    Raises:
        ValueError: N not in [1, L], or an element size not an int >= 1.
    """
    _check_sizes(buf=buf, h=h, o=o, v=v)
    # Standard: h' = h + v; backward: the stream's gradient plus the sublayer's input gradient
    # (read, read, write) and v's gradient cast to v's dtype.
    std = dict(fwd=2 * h + v, bwd=3 * h + (h + v))
    old, new = dict(fwd=0, bwd=0), dict(fwd=0, bwd=0)
    for j, S in enumerate(block_sizes(L, N)):
        n = j + 1  # blocks read by this block's sublayers
        for k in range(S):
            p = h if k else 0  # the partial sum is a source from the block's second sublayer on
            # per-read: read n blocks (+ partial), write h; then p = p + v_k (p = v_0 for k = 0)
            read = n * buf + p + h
            old["fwd"] += read + (p + v + h)
            # backward: rebuild h; the kernel reads dh and the sources twice, reads and writes the
            # blocks' gradient sum, writes dp; autograd adds dp to the chain's; v_k's gradient cast
            old["bwd"] += read + (h + 2 * (n * buf + p) + 2 * n * h + p) + (3 * h if k else 0) + (h + v)
            if k:
                # two-phase: p_k = p_{k-1} + v_{k-1} and the merge in one pass (read prev, v, o;
                # write p, h); backward: rebuild h (read o, p; write h); merge backward (read dh, dp_in,
                # p, o; write dp (not for k = 1), dO_k (in o's dtype), dv)
                new["fwd"] += (h if k > 1 else 0) + v + o + 2 * h
                new["bwd"] += (o + 2 * h) + (3 * h + o + (h if k > 1 else 0) + o + v)
        # the block's representation: per-read copies p into the buffer and clones the slot's
        # gradient; two-phase writes p + v straight into the slot (with its logits, formed from it in
        # registers) and casts the slot's gradient for v
        old["fwd"] += h + buf
        old["bwd"] += 2 * h
        new["fwd"] += (h if S > 1 else 0) + v + buf
        new["bwd"] += h + v
        # phase 1: read the n blocks, write h_0 and o_1..o_{S-1}; once more in backward; its
        # backward reads the blocks, h_0, dh and every dO_k (in o's dtype) once, reads and writes the
        # gradient sum
        phase1 = n * buf + h + (S - 1) * o
        new["fwd"] += phase1
        new["bwd"] += phase1 + n * buf + 2 * h + (S - 1) * o + 2 * n * h
    # final aggregation over N + 1 blocks: its backward recomputes h (one more pass over the blocks),
    # reads the blocks, h and dh once and is the first writer of the gradient sum (no read of it)
    final_fwd = (N + 1) * buf + h
    old["fwd"] += final_fwd
    old["bwd"] += final_fwd + h + 2 * (N + 1) * buf + 2 * (N + 1) * h
    new["fwd"] += final_fwd
    new["bwd"] += final_fwd + 2 * h + (N + 1) * buf + (N + 1) * h
    per_sublayer = lambda t: {k: round(x / L, 2) for k, x in t.items()}  # noqa: E731
    return dict(L=L, N=N, standard=std, per_read=per_sublayer(old), two_phase=per_sublayer(new),
                floor=bytes_floor(L, N, buf, h, o, v))


def bytes_floor(L: int = 48, N: int = 8, buf: int = 4, h: int = 4, o: int = 2, v: int = 2) -> dict:
    """The fewest extra bytes that the data flows below move for checkpointed two-phase Block AttnRes
    over the standard residual, both fused as far as those data flows allow (AttnRes paper, Sec. 4:
    phase 1 over the completed blocks, per-sublayer online-softmax merge; activations recomputed in
    backward). Per sublayer, bytes per token per channel, averaged over the L sublayers. A floor for
    the fusions listed, not a proof over every conceivable kernel: a data flow not listed could go lower.

    Assumptions, all in the implementation's favour:
    - the standard residual fuses its add with the next RMSNorm (the last add with the final one), and
      Block AttnRes fuses the partial sum's add, the merge and the RMSNorm (both then write the
      sublayer's normalised input, which cancels; logits and softmax stay in registers); a block's
      first sublayer reads only blocks, so its RMSNorm runs inside phase 1 (forward and backward);
    - each block is stored by the kernel that runs the next block's phase 1 (the last by the final
      aggregation's), so a new block is never read back in forward;
    - per-token scalars (logits, lse, r) cost nothing, and every kernel moves each tensor once;
    - nothing is kept per sublayer beyond what the standard residual keeps (the issue's memory bound),
      so the inter-block parts o_k are rebuilt in backward, by the kernel that already reads the
      blocks there (the next block's phase-1 backward, or the final aggregation's);
    - per block, the cheaper of the two data flows: phase 1 writes o_1..o_{S-1} for the merges to
      read, or every merge reads the n blocks itself;
    - the final aggregation's backward writes only the last block's gradient and its input gradient;
      the last block's phase-1 backward reads that and writes the other blocks' gradient sums first.
    What remains: the blocks (read in forward and twice in backward), the o_k and their gradients dO_k
    (written, read), and the blocks' gradient sums (read and written by every later block's backward:
    block i's gradient sums over all later sublayers, which reach it one block at a time).

    Args:
        L (int), N (int): sublayers and blocks.
        buf, h, o, v (int): bytes per element of the block buffer, of the stream, partial sums and
            gradient sums, of the stored inter-block parts o_k, and of the sublayer outputs.

    Returns:
        dict: "fwd", "bwd" -> extra bytes per token per channel per sublayer (negative where blocks
        stored narrower than the stream move fewer bytes than the stream does).

    Raises:
        ValueError: N not in [1, L], or an element size not an int >= 1.
    """
    _check_sizes(buf=buf, h=h, o=o, v=v)
    fwd = bwd = 0
    for j, S in enumerate(block_sizes(L, N)):
        n = j + 1  # blocks this block's sublayers read
        new = buf if j else 0  # the block just stored, in registers: not read back
        fwd += min(n * buf - new + 2 * (S - 1) * o,  # phase 1 reads the blocks, writes o_k; the merges read them
                   S * n * buf - new)  # every sublayer reads the blocks
        # write o_k (rebuilt where the blocks are read anyway), each merge's backward reads o_k and writes
        # dO_k, and phase 1's backward reads the blocks and each dO_k; or every merge's backward reads the
        # blocks
        bwd += min(n * buf + 4 * (S - 1) * o, S * n * buf + 2 * (S - 1) * o)
        # the n blocks' gradient sums, read and written; the last block's phase 1 reads the final
        # aggregation's input gradient instead and writes them first
        bwd += h + n * h if j == N - 1 else 2 * n * h
        # The block is stored where the standard writes its stream (from the sublayer's output alone
        # when S = 1: no partial sum read where the standard reads its stream); the first block's phase 1
        # reads the embedding where the standard reads its stream.
        fwd += buf - h - (h if S == 1 else 0) - (h if j == 0 else 0)
        # The first sublayer's RMSNorm runs inside phase 1: the standard's stream read, gradient read
        # and gradient write there are saved.
        bwd -= 3 * h
        if S > 1:
            # The second sublayer's partial sum is the first's output: nothing to read (forward) or
            # write, one stream read fewer (the stream write it replaces); read as v from then on.
            fwd += -2 * h + (v - h)
            bwd += v - h
    fwd += N * buf  # final aggregation: read the N earlier blocks (the last is in registers)
    # read all N + 1 again; write the last block's gradient and the input gradient, where the standard
    # reads its stream and writes its gradient
    bwd += (N + 1) * buf
    return dict(fwd=round(fwd / L, 2), bwd=round(bwd / L, 2))


def step_ms(per_sublayer: float, L: int, tokens: int = 8192, d: int = 2048, tbps: float = 4.0) -> float:
    """Milliseconds a training step spends moving ``per_sublayer`` bytes per token per channel in each
    of L sublayers, for ``tokens`` x ``d`` at ``tbps`` TB/s.

    Raises:
        ValueError: tbps not > 0.
    """
    if not tbps > 0:
        raise ValueError(f"tbps must be a bandwidth > 0 in TB/s, got {tbps!r}")
    return per_sublayer * tokens * d * L / (tbps * 1e12) * 1e3


def bytes_table(model: dict, tokens: int = 8192, d: int = 2048, tbps: float = 4.0) -> str:
    """The bytes model as text, with the extra milliseconds per step it predicts at ``tbps`` TB/s, and
    the floor (``bytes_floor``) when the model has one."""
    lines = [f"bytes model, per sublayer (B per token-channel; L={model['L']}, N={model['N']}), and what the "
             f"extra over the standard residual costs at {tbps:.3g} TB/s for {tokens} x {d} over "
             f"{model['L']} sublayers:",
             f"{'path':<12}{'fwd':>7}{'bwd':>7}{'total':>7}{'extra':>7}{'extra ms':>10}"]
    base = sum(model["standard"].values())
    to_ms = step_ms(1.0, model["L"], tokens, d, tbps)
    for name in ("standard", "per_read", "two_phase"):
        f, b = model[name]["fwd"], model[name]["bwd"]
        extra = f + b - base
        lines.append(f"{name:<12}{f:>7.1f}{b:>7.1f}{f + b:>7.1f}{extra:>7.1f}{extra * to_ms:>10.2f}")
    if "floor" in model:  # models stored before the floor existed have none
        extra = sum(model["floor"].values())
        lines.append(f"{'floor':<12}{'':>21}{extra:>7.1f}{extra * to_ms:>10.2f}  (any implementation, both "
                     f"residuals fused: bytes_floor)")
    return "\n".join(lines)
