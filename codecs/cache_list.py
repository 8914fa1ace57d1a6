"""``list(...)``: mlx-lm's CacheList; its own kind plus its inner kinds.

Its capabilities are its inner layers', each through that layer's own codec.
"""

from __future__ import annotations

from mlx_lm.models.cache import CacheList

from promptstore.codecs._registry import (
    Codec,
    codec_for_kind,
    codec_for_layer,
    decode_layer,
    encode_layer,
    layer_coverage,
    prefixed,
    register,
    require,
    rows_for_layer,
    storage_kind,
    unprefixed,
)
from promptstore.codecs._rows import Rows, check_joinable
from promptstore.errors import CorruptEntry, CoverageMismatch, InvalidInput

_MAX_INNER = 64


class CacheListRows(Rows):
    """A CacheList's rows: its inner caches, row by row."""

    serial = CacheList

    def count(self, layer):
        counts = {rows_for_layer(c).count(c) for c in layer.caches}
        if len(counts) != 1:
            raise InvalidInput(f"CacheList inner caches disagree on the number of rows: {sorted(counts)}")
        return counts.pop()

    def coverage(self, layer, i, where):
        covs = (rows_for_layer(c, where).coverage(c, i, where) for c in layer.caches)
        known = {c for c in covs if c is not None}
        if len(known) > 1:
            raise CoverageMismatch(f"{where}: CacheList inner caches of row {i} cover {sorted(known)} tokens")
        return known.pop() if known else None

    def extract(self, layer, i, where):
        return CacheList(*(rows_for_layer(c, where).extract(c, i, where) for c in layer.caches))

    def check_settled(self, layer, where):
        for c in layer.caches:
            rows_for_layer(c, where).check_settled(c, where)

    def parts(self, layer):
        return [layer, *(p for c in layer.caches for p in rows_for_layer(c).parts(c))]

    def check_join(self, batch_layer, row_layer, where):
        if len(row_layer.caches) != len(batch_layer.caches):
            raise InvalidInput(f"{where}: CacheList rows hold a different number of inner caches")
        for j, (b, r) in enumerate(zip(batch_layer.caches, row_layer.caches)):
            check_joinable(b, r, f"{where}.{j}")


def _readable(rec) -> bool:
    """Whether an inner layer's record has its kind and meta (a damaged one may not)."""
    return isinstance(rec, dict) and isinstance(rec.get("kind"), str) and isinstance(rec.get("meta"), dict)


class CacheListCodec(Codec):
    kind = "list"
    version = 1
    types = (CacheList,)
    rows = CacheListRows()
    mlx_lm_class = CacheList
    # mlx-lm flattens the inner arrays together; they compare like KV arrays.
    seq_axis = 2
    shared_blocks = True  # per array: only those spanning the entry's tokens

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

    def prefix_meta(self, meta, n):
        inner = meta.get("inner")
        if not isinstance(inner, list):
            return None
        cut = []
        for rec in inner:
            sub = codec_for_kind(rec["kind"]).prefix_meta(rec["meta"], n) if _readable(rec) else None
            if sub is None:
                return None
            cut.append({**rec, "meta": sub})
        return {**meta, "inner": cut}

    def trim_floor(self, meta):
        inner = meta.get("inner")
        if not isinstance(inner, list):
            return 0
        return max((codec_for_kind(rec["kind"]).trim_floor(rec["meta"]) for rec in inner if _readable(rec)), default=0)

    def coverage(self, layer):
        known = {n for n in (layer_coverage(c) for c in layer.caches) if n is not None}
        if len(known) > 1:
            raise CoverageMismatch(f"CacheList inner caches disagree on coverage: {sorted(known)}")
        return known.pop() if known else None

    def trimmable(self, layer):
        return all(codec_for_layer(c).trimmable(c) for c in layer.caches)

    def check_trim(self, layer, n):
        for c in layer.caches:
            codec_for_layer(c).check_trim(c, n)

    def trim(self, layer, n):
        self.check_trim(layer, n)
        for c in layer.caches:
            codec_for_layer(c).trim(c, n)

    def needs_checkpoints(self, layer, n_tokens):
        return any(codec_for_layer(c).needs_checkpoints(c, n_tokens) for c in layer.caches)

    def to_mlx_lm(self, layer):
        return CacheList(*(codec_for_layer(c).to_mlx_lm(c) for c in layer.caches))


register(CacheListCodec())
