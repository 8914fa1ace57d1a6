"""``kv.concat``: mlx-lm's ConcatenateKVCache (no step padding; offset may be trimmed)."""

from __future__ import annotations

from mlx_lm.models.cache import ConcatenateKVCache

from promptstore.codecs._kv import check_count, check_seq, covered
from promptstore.codecs._registry import Codec, array, register, require


class ConcatKVCodec(Codec):
    kind = "kv.concat"
    version = 1
    types = (ConcatenateKVCache,)

    def encode(self, layer):
        n = int(layer.offset)
        if layer.keys is None:
            return {}, {"offset": 0}
        return {"keys": covered(layer.keys, n), "values": covered(layer.values, n)}, {"offset": n}

    def decode(self, arrays, meta, version):
        n = check_count(self.kind, "offset", require(meta, "offset", int, self.kind))
        cache = ConcatenateKVCache()
        if n or arrays:
            cache.keys = check_seq(self.kind, "keys", array(arrays, "keys", self.kind), n)
            cache.values = check_seq(self.kind, "values", array(arrays, "values", self.kind), n)
        cache.offset = n
        return cache

    def coverage(self, layer):
        return int(layer.offset)


register(ConcatKVCodec())
