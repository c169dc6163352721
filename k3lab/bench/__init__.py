"""Benchmarks run on a GPU as ``python -m k3lab.bench.<name>``; each writes data/results/<name>_h200.json."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a bad value stops the command before any work, naming the option)."""
    return _int_at_least(text, 1, "a positive int")


def nonnegative_int(text: str) -> int:
    """argparse type: an int >= 0 (0 typically meaning "skip")."""
    return _int_at_least(text, 0, "an int >= 0")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {n}")
    return n


def shape_bth(text: str) -> tuple[int, int, int]:
    """argparse type: a shape written BxTxH (positive ints), e.g. 4x8192x16."""
    bad = argparse.ArgumentTypeError(f"expected BxTxH with positive ints, e.g. 4x8192x16, got {text!r}")
    parts = text.split("x")
    if len(parts) != 3:
        raise bad
    try:
        return tuple(positive_int(p) for p in parts)
    except argparse.ArgumentTypeError:
        raise bad from None
