"""``kv.rotating``: mlx-lm's RotatingKVCache, ring position and ``keep`` preserved.

Only valid slots are written: ``min(offset, buffer length)`` positions in
buffer order, plus ``_idx`` (the ring's write position), so the restored
cache continues exactly where the saved one stood.

A window that has dropped nothing holds the entry's tokens in order (its
stored positions are exactly ``offset`` long, and ``idx == offset``), so
its arrays go to shared blocks like a full KV cache's, and a prefix hit
reads only the blocks it needs. Once it wraps, it holds fewer positions than
the entry's tokens, in ring order, and its arrays stay in the entry's
payload (``format._payload.spans_tokens``).

Trimmable only until the window wraps (mlx-lm's trim then leaves the rejected
keys in the ring); speculative decoding runs window rounds on it instead, which
drop rejected positions physically (``window_rounds``, ``promptstore.ssm._window``).
Also the row moves of ``BatchRotatingKVCache``, whose rows are stored as
``kv.rotating``.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from promptstore.codecs._kv import SerialKVRows, TrimmableKVCodec, check_count, check_seq, covered
from promptstore.codecs._registry import array, register, register_rows, require
from promptstore.codecs._rows import Rows, kv_signature, own, refuse_unsettled
from promptstore.errors import CorruptEntry, InvalidInput


class RotatingKVRows(SerialKVRows):
    serial = RotatingKVCache

    def extract(self, layer, i, where):
        out = RotatingKVCache(layer.max_size, keep=layer.keep)
        if layer.keys is not None:
            n = min(int(layer.offset), layer.keys.shape[2])
            out.keys = own(layer.keys[i : i + 1, :, :n, :])
            out.values = own(layer.values[i : i + 1, :, :n, :])
        out.offset, out._idx = int(layer.offset), int(layer._idx)
        return out


class RotatingKVCodec(TrimmableKVCodec):
    kind = "kv.rotating"
    version = 1
    types = (RotatingKVCache,)
    rows = RotatingKVRows()
    mlx_lm_class = RotatingKVCache
    window_rounds = True
    shared_blocks = True  # only while its arrays span the entry's tokens: it has dropped nothing

    def prefix_meta(self, meta, n):
        # Only a window that has dropped nothing is in blocks: its first n
        # positions are the prefix's, with the write position right after them.
        if meta.get("idx") != meta.get("offset"):
            return None
        return {**meta, "offset": n, "idx": n}

    def needs_checkpoints(self, layer, n_tokens):
        # A window no longer than the prompt wraps, and a wrapped one cannot trim.
        return not layer.is_trimmable() or n_tokens is None or layer.max_size <= n_tokens

    def encode(self, layer):
        meta = {
            "offset": int(layer.offset),
            "keep": int(layer.keep),
            "max_size": int(layer.max_size),
            "idx": int(layer._idx),
        }
        if layer.keys is None:
            return {}, meta
        n = min(meta["offset"], layer.keys.shape[2])
        return {"keys": covered(layer.keys, n), "values": covered(layer.values, n)}, meta

    def decode(self, arrays, meta, version):
        offset = check_count(self.kind, "offset", require(meta, "offset", int, self.kind))
        keep = check_count(self.kind, "keep", require(meta, "keep", int, self.kind))
        max_size = check_count(self.kind, "max_size", require(meta, "max_size", int, self.kind), 1)
        idx = check_count(self.kind, "idx", require(meta, "idx", int, self.kind))
        cache = RotatingKVCache(max_size=max_size, keep=keep)
        if arrays:
            keys = array(arrays, "keys", self.kind)
            n = keys.shape[-2] if keys.ndim >= 2 else -1
            if n < 0 or n > offset or idx > n:
                raise CorruptEntry(
                    f"kind {self.kind!r}: {n} stored positions do not fit offset {offset}, idx {idx}"
                )
            cache.keys = check_seq(self.kind, "keys", keys, n)
            cache.values = check_seq(self.kind, "values", array(arrays, "values", self.kind), n)
        cache.offset = offset
        cache._idx = idx
        return cache

    def coverage(self, layer):
        return int(layer.offset)


class BatchRotatingKVRows(Rows):
    """BatchRotatingKVCache: a ring of ``max_size`` (+ a window while
    prefilling) per row; in temporal order row i starts at ``max(0, left_padding[i])``."""

    serial = RotatingKVCache

    def count(self, layer):
        return int(layer.offset.shape[0])

    def check_settled(self, layer, where):
        refuse_unsettled(layer._lengths is not None, where)

    def coverage(self, layer, i, where):
        self.check_settled(layer, where)
        return int(layer.offset[i].item())

    def extract(self, layer, i, where):
        off = self.coverage(layer, i, where)
        out = RotatingKVCache(layer.max_size)
        if layer.keys is None or off == 0:
            return out
        lp = max(0, int(layer.left_padding[i].item()))
        keys, values, end = layer.keys[i : i + 1], layer.values[i : i + 1], layer._idx
        if layer.rotated:  # the oldest position sits at _idx: unroll the ring
            keys, values = mx.roll(keys, -end, axis=2), mx.roll(values, -end, axis=2)
            end = keys.shape[2]
        n = end - lp
        if n <= 0 or n > off or (lp > 0 and n != off):
            raise InvalidInput(
                f"{where}: BatchRotatingKVCache row {i} is inconsistent ({n} positions held for "
                f"offset {off}, left padding {lp})"
            )
        out.keys = own(keys[:, :, lp:end, :])
        out.values = own(values[:, :, lp:end, :])
        out.offset = off
        out._idx = n
        return out

    def check_join(self, batch_layer, row_layer, where):
        if row_layer.max_size != batch_layer.max_size:
            raise InvalidInput(
                f"{where}: a RotatingKVCache of max_size {row_layer.max_size} cannot join a batch "
                f"of max_size {batch_layer.max_size}"
            )

    def kv_signature(self, layer):
        return kv_signature(layer)


register(RotatingKVCodec())
register_rows(BatchRotatingKVCache, BatchRotatingKVRows())
