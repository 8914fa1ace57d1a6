"""``kv.quantized``: mlx-lm's QuantizedKVCache (packed words, scales, biases; bits, group size)."""

from __future__ import annotations

from mlx_lm.models.cache import QuantizedKVCache

from promptstore.codecs._kv import TrimmableKVCodec, check_count, check_seq, covered
from promptstore.codecs._registry import array, register, require
from promptstore.errors import CorruptEntry


class QuantizedKVCodec(TrimmableKVCodec):
    kind = "kv.quantized"
    version = 1
    types = (QuantizedKVCache,)
    always_trimmable = True
    mlx_lm_class = QuantizedKVCache

    def trim(self, layer, n):
        super().trim(layer, n)
        if layer.keys is not None:  # drop the trimmed positions: keep no memory alive
            layer.keys = tuple(x[..., : layer.offset, :] for x in layer.keys)
            layer.values = tuple(x[..., : layer.offset, :] for x in layer.values)

    def encode(self, layer):
        n = int(layer.offset)
        meta = {"offset": n, "group_size": int(layer.group_size), "bits": int(layer.bits), "parts": 0}
        if layer.keys is None:
            return {}, meta
        meta["parts"] = len(layer.keys)
        arrays = {}
        for i, (k, v) in enumerate(zip(layer.keys, layer.values)):
            arrays[f"keys.{i}"] = covered(k, n)
            arrays[f"values.{i}"] = covered(v, n)
        return arrays, meta

    def decode(self, arrays, meta, version):
        n = check_count(self.kind, "offset", require(meta, "offset", int, self.kind))
        group_size = check_count(self.kind, "group_size", require(meta, "group_size", int, self.kind), 1)
        bits = check_count(self.kind, "bits", require(meta, "bits", int, self.kind), 1)
        parts = check_count(self.kind, "parts", require(meta, "parts", int, self.kind))
        if parts > 3 or (parts == 0 and arrays):
            raise CorruptEntry(f"kind {self.kind!r}: {parts} quantized parts")
        cache = QuantizedKVCache(group_size=group_size, bits=bits)
        if parts:
            cache.keys = tuple(
                check_seq(self.kind, f"keys.{i}", array(arrays, f"keys.{i}", self.kind), n)
                for i in range(parts)
            )
            cache.values = tuple(
                check_seq(self.kind, f"values.{i}", array(arrays, f"values.{i}", self.kind), n)
                for i in range(parts)
            )
        cache.offset = n
        return cache

    def coverage(self, layer):
        return int(layer.offset)


register(QuantizedKVCodec())
