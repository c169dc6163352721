"""A deterministic, resumable loader over a token split, the global batch cut across data ranks.

The split (documents joined by ``<|endoftext|>``, ``k3lab.data``) is cut into W = (n - 1) // T windows of
T + 1 tokens (window i starts at i*T; consecutive windows share one token, the last target of one is the
first input of the next). Documents are packed: a window may hold the end of one document, the separator
and the start of the next (the separator teaches the model where documents end). Attention crosses it, as
in GPT-2 / nanoGPT training, unless the batch goes through ``pack_documents`` (``--doc-mask``). Each epoch visits every window once in the order of a permutation
seeded by (seed, epoch).

The position is one integer: global sequences consumed. Global sequence k is window perm_e[k mod W] of
epoch e = k // W; at each step data rank r of R takes global sequences position + r*B ... + (r+1)*B - 1
(B = global batch / R). So the position is the same on every rank and does not depend on the layout: a
checkpoint written at one (dp, ep) resumes at another on the same batches.
"""
from __future__ import annotations

import numpy as np
import torch

# Odd multiplier that keeps (seed, epoch) pairs apart when mixed into one generator seed.
_EPOCH_MIX = 1_000_003
# The largest seed: seed * _EPOCH_MIX + epoch stays far below the generator's limit of 2**64 - 1.
MAX_SEED = 2**32 - 1


class TokenLoader:
    """Windows of a token split in a seeded order, this data rank's slice of each global batch.

    Args:
        tokens (np.ndarray): 1-D integer tokens [n] (``k3lab.data.load_split``).
        global_batch (int): G sequences per step over all data ranks, divisible by ``data_size``.
        seq_len (int): T >= 1 with n >= T + 2 (at least one full window).
        data_rank (int), data_size (int): this rank's index in [0, R) and R.
        seed (int): the permutation seed, in [0, 2**32 - 1].

    ``next_batch(device) -> (x, y)``: int64 [G/R, T] each, y shifted by one; the position advances by G.
    ``state_dict() -> {"position", "seed", "seq_len", "global_batch"}`` (ints), ``load_state_dict``.

    Raises:
        ValueError: tokens not 1-D integer, sizes < 1, G not divisible by R, rank outside [0, R), a seed outside
            [0, 2**32 - 1], the split shorter than T + 2 tokens; ``load_state_dict`` with another seed, T or G.
    """

    def __init__(self, tokens: np.ndarray, global_batch: int, seq_len: int, data_rank: int = 0,
                 data_size: int = 1, seed: int = 0):
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer np.ndarray, got {type(tokens).__name__} "
                             f"shape {getattr(tokens, 'shape', None)}")
        for name, v in (("global_batch", global_batch), ("seq_len", seq_len), ("data_size", data_size)):
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if global_batch % data_size:
            raise ValueError(f"the global batch {global_batch} must be divisible by the {data_size} data ranks")
        if not (isinstance(data_rank, int) and 0 <= data_rank < data_size):
            raise ValueError(f"data_rank must be in [0, {data_size}), got {data_rank!r}")
        if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= MAX_SEED):
            raise ValueError(f"seed must be an int in [0, {MAX_SEED}], got {seed!r}")
        if len(tokens) < seq_len + 2:
            raise ValueError(f"seq_len {seq_len} needs a split of at least {seq_len + 2} tokens, got {len(tokens)}")
        self.tokens, self.G, self.T, self.rank, self.R, self.seed = tokens, global_batch, seq_len, data_rank, data_size, seed
        self.W = (len(tokens) - 1) // seq_len
        self.position = 0
        self._perm_epoch, self._perm = None, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * _EPOCH_MIX + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.W, generator=g).numpy(), epoch
        return self._perm

    def window_starts(self, position: int) -> np.ndarray:
        """int64 [G/R]: the first token of each of this rank's windows in the step at ``position``."""
        B = self.G // self.R
        ks = position + self.rank * B + np.arange(B)
        out = np.empty(B, dtype=np.int64)
        for j, k in enumerate(ks):
            out[j] = self._order(int(k) // self.W)[int(k) % self.W] * self.T
        return out

    def next_batch(self, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.window_starts(self.position)
        self.position += self.G
        window = np.asarray(self.tokens[starts[:, None] + np.arange(self.T + 1)], dtype=np.int64)
        xy = torch.from_numpy(window)
        device = torch.device(device)
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    def state_dict(self) -> dict[str, int]:
        return dict(position=self.position, seed=self.seed, seq_len=self.T, global_batch=self.G)

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self.state_dict()
        diff = {k: (int(state[k]), mine[k]) for k in ("seed", "seq_len", "global_batch") if int(state[k]) != mine[k]}
        if diff:
            raise ValueError(f"the checkpoint's loader differs (checkpoint, this run): {diff}; resume with the "
                             f"same --seed, --seq-len and --batch-size")
        self.position = int(state["position"])


def pack_documents(x: torch.Tensor, y: torch.Tensor, eot_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The windows of a batch as one packed row with document boundaries, for ``K3Model(..., cu_seqlens=)``.

    A segment starts at every window start and at every ``eot_id`` in ``x`` (the separator opens the next
    document as its first input, so the previous document's last token still predicts it): KDA restarts
    its state and MLA masks attention at each boundary, so no token sees another document.

    Args:
        x (Tensor), y (Tensor): [B, T] int64 inputs and targets (``TokenLoader.next_batch``).
        eot_id (int): the ``<|endoftext|>`` id (0 for the book's tokenizer).

    Returns:
        (x [1, B*T], y [1, B*T], cu_seqlens [N+1] int64 on x's device: 0, the segment starts, B*T).

    Raises:
        ValueError: x and y not the same [B, T] shape.
    """
    if x.ndim != 2 or x.shape != y.shape:
        raise ValueError(f"x and y must be [B, T] of one shape, got {list(x.shape)} and {list(y.shape)}")
    B, T = x.shape
    starts = (x == eot_id)
    starts[:, 0] = True
    cu = torch.cat([starts.reshape(-1).nonzero()[:, 0], torch.tensor([B * T], device=x.device)])
    return x.reshape(1, B * T), y.reshape(1, B * T), cu
