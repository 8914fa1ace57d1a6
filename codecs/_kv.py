"""Shared pieces of the KV-family codecs: covered-token slicing, checks, and
the capabilities every KV kind shares (trim through mlx-lm's ``trim``, a
sequence axis, row moves of a serial layer run with B > 1)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from promptstore.codecs._registry import Codec, array, require
from promptstore.codecs._rows import Rows, kv_signature
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


class TrimmableKVCodec(Codec):
    """A KV kind: trims through mlx-lm's ``trim`` whenever the layer says it
    can, so its entries need no checkpoints; arrays are ``[B, heads, seq, dim]``."""

    seq_axis = 2
    shared_blocks = True

    def trimmable(self, layer):
        return bool(layer.is_trimmable())

    def trim(self, layer, n):
        self.check_trim(layer, n)
        layer.trim(n)

    def needs_checkpoints(self, layer, n_tokens):
        return not layer.is_trimmable()

    def prefix_meta(self, meta, n):
        return {**meta, "offset": n}  # its arrays hold exactly the ``offset`` covered positions


class SerialKVRows(Rows):
    """Rows of a serial mlx-lm KV layer run with B > 1 (a plain batched
    forward, no padding): every row covers ``offset`` tokens."""

    def count(self, layer):
        return 1 if layer.keys is None else int(layer.keys.shape[0])

    def coverage(self, layer, i, where):
        return int(layer.offset)

    def kv_signature(self, layer):
        return kv_signature(layer)


class OffsetKVCodec(TrimmableKVCodec):
    """Codec of a KV cache whose state is ``keys``, ``values`` and ``offset``:
    writes the ``offset`` covered positions, restores them with that offset,
    and drops trimmed positions (mlx-lm's trim only lowers ``offset``: memory
    stays alive, and a ConcatenateKVCache would append after stale keys)."""

    def trim(self, layer, n):
        super().trim(layer, n)
        if layer.keys is not None:
            layer.keys = layer.keys[..., : layer.offset, :]
            layer.values = layer.values[..., : layer.offset, :]

    def encode(self, layer):
        n = int(layer.offset)
        if layer.keys is None:
            return {}, {"offset": 0}
        return {"keys": covered(layer.keys, n), "values": covered(layer.values, n)}, {"offset": n}

    def decode(self, arrays, meta, version):
        n = check_count(self.kind, "offset", require(meta, "offset", int, self.kind))
        (cls,) = self.types
        cache = cls()
        if n or arrays:
            cache.keys = check_seq(self.kind, "keys", array(arrays, "keys", self.kind), n)
            cache.values = check_seq(self.kind, "values", array(arrays, "values", self.kind), n)
        cache.offset = n
        return cache

    def coverage(self, layer):
        return int(layer.offset)
