"""``kv.rotating``: mlx-lm's RotatingKVCache, ring position and ``keep`` preserved.

Only valid slots are written: ``min(offset, buffer length)`` positions in
buffer order, plus ``_idx`` (the ring's write position), so the restored
cache continues exactly where the saved one stood.
"""

from __future__ import annotations

from mlx_lm.models.cache import RotatingKVCache

from promptstore.codecs._kv import check_count, check_seq, covered
from promptstore.codecs._registry import Codec, array, register, require
from promptstore.errors import CorruptEntry


class RotatingKVCodec(Codec):
    kind = "kv.rotating"
    version = 1
    types = (RotatingKVCache,)

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


register(RotatingKVCodec())
