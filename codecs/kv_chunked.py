"""``kv.chunked``: mlx-lm's ChunkedKVCache; keeps ``start_position`` and ``chunk_size``."""

from __future__ import annotations

from mlx_lm.models.cache import ChunkedKVCache

from promptstore.codecs._kv import TrimmableKVCodec, check_count, check_seq, covered
from promptstore.codecs._registry import array, register, require


class ChunkedKVCodec(TrimmableKVCodec):
    kind = "kv.chunked"
    version = 1
    types = (ChunkedKVCache,)
    mlx_lm_class = ChunkedKVCache

    def encode(self, layer):
        meta = {
            "offset": int(layer.offset),
            "chunk_size": int(layer.chunk_size),
            "start_position": int(layer.start_position),
        }
        if layer.keys is None:
            return {}, meta
        n = meta["offset"] - meta["start_position"]
        return {"keys": covered(layer.keys, n), "values": covered(layer.values, n)}, meta

    def decode(self, arrays, meta, version):
        offset = check_count(self.kind, "offset", require(meta, "offset", int, self.kind))
        start = check_count(self.kind, "start_position", require(meta, "start_position", int, self.kind))
        chunk = check_count(self.kind, "chunk_size", require(meta, "chunk_size", int, self.kind), 1)
        n = check_count(self.kind, "offset - start_position", offset - start)
        cache = ChunkedKVCache(chunk)
        if arrays:
            cache.keys = check_seq(self.kind, "keys", array(arrays, "keys", self.kind), n)
            cache.values = check_seq(self.kind, "values", array(arrays, "values", self.kind), n)
        cache.offset = offset
        cache.start_position = start
        return cache

    def check_trim(self, layer, n):
        # Past start_position the dropped chunk is gone: mlx-lm's trim would
        # stop there without saying so, and the cache would cover more tokens
        # than the caller was told.
        super().check_trim(layer, n)
        if n > int(layer.offset) - int(layer.start_position):
            raise self.missing(layer, "trim", f"it keeps no tokens before position {int(layer.start_position)}")

    def trim_floor(self, meta):
        start = meta.get("start_position")
        return start if isinstance(start, int) and not isinstance(start, bool) and start > 0 else 0

    def prefix_meta(self, meta, n):
        # Only a chunk that starts at token 0 holds the entry's tokens in order.
        return {**meta, "offset": n} if meta.get("start_position") == 0 else None

    def coverage(self, layer):
        return int(layer.offset)


register(ChunkedKVCodec())
