"""``kv``: mlx-lm's KVCache. Writes only the ``offset`` covered positions."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from promptstore.codecs._kv import check_count, check_seq, covered
from promptstore.codecs._registry import Codec, array, register, require


class KVCodec(Codec):
    kind = "kv"
    version = 1
    types = (KVCache,)

    def encode(self, layer):
        n = int(layer.offset)
        if layer.keys is None:
            return {}, {"offset": 0}
        return {"keys": covered(layer.keys, n), "values": covered(layer.values, n)}, {"offset": n}

    def decode(self, arrays, meta, version):
        n = check_count(self.kind, "offset", require(meta, "offset", int, self.kind))
        cache = KVCache()
        if n or arrays:
            cache.keys = check_seq(self.kind, "keys", array(arrays, "keys", self.kind), n)
            cache.values = check_seq(self.kind, "values", array(arrays, "values", self.kind), n)
        cache.offset = n
        return cache

    def coverage(self, layer):
        return int(layer.offset)


register(KVCodec())
