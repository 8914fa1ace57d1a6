"""Shared pieces of the KV-family codecs: covered-token slicing and checks."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from promptstore.errors import CorruptEntry


def covered(x: mx.array, n: int) -> mx.array:
    """The first ``n`` positions of ``x`` along its sequence axis (-2)."""
    if x.shape[-2] == n:
        return x
    return x[..., :n, :]


def check_seq(kind: str, name: str, x: Any, n: int) -> mx.array:
    """Refuse a decoded array whose sequence length is not ``n``."""
    if not isinstance(x, mx.array) or x.ndim < 2 or x.shape[-2] != n:
        shape = getattr(x, "shape", None)
        raise CorruptEntry(f"kind {kind!r}: array {name!r} has shape {shape}, expected {n} positions")
    return x


def check_count(kind: str, name: str, value: int, lo: int = 0) -> int:
    """Refuse a negative (or too small) count read from meta."""
    if value < lo:
        raise CorruptEntry(f"kind {kind!r}: meta field {name!r} is {value}, must be >= {lo}")
    return value
