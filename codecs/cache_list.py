"""``list(...)``: mlx-lm's CacheList; its own kind plus its inner kinds."""

from __future__ import annotations

from mlx_lm.models.cache import CacheList

from promptstore.codecs._registry import (
    Codec,
    decode_layer,
    encode_layer,
    layer_coverage,
    prefixed,
    register,
    require,
    storage_kind,
    unprefixed,
)
from promptstore.errors import CorruptEntry, CoverageMismatch

_MAX_INNER = 64


class CacheListCodec(Codec):
    kind = "list"
    version = 1
    types = (CacheList,)

    def kind_of(self, layer):
        return "list(" + ",".join(storage_kind(c) for c in layer.caches) + ")"

    def encode(self, layer):
        arrays, inner = {}, []
        for i, c in enumerate(layer.caches):
            enc = encode_layer(c)
            arrays.update(prefixed(str(i), enc.arrays))
            inner.append({"kind": enc.kind, "version": enc.version, "meta": enc.meta})
        return arrays, {"inner": inner}

    def decode(self, arrays, meta, version):
        inner = require(meta, "inner", list, self.kind)
        if len(inner) > _MAX_INNER:
            raise CorruptEntry(f"kind {self.kind!r}: {len(inner)} inner caches")
        caches = []
        for i, rec in enumerate(inner):
            kind = require(rec, "kind", str, self.kind)
            ver = require(rec, "version", int, self.kind)
            sub = require(rec, "meta", dict, self.kind)
            caches.append(decode_layer(kind, ver, unprefixed(str(i), arrays), sub))
        return CacheList(*caches)

    def coverage(self, layer):
        known = {n for n in (layer_coverage(c) for c in layer.caches) if n is not None}
        if len(known) > 1:
            raise CoverageMismatch(f"CacheList inner caches disagree on coverage: {sorted(known)}")
        return known.pop() if known else None


register(CacheListCodec())
