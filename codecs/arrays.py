"""``arrays``: mlx-lm's ArraysCache (fixed slots, e.g. conv + recurrent state).

Empty slots are recorded as absent; ``left_padding`` and ``lengths`` (batch
bookkeeping) are kept when present. The cache cannot report coverage.
"""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache

from promptstore.codecs._registry import Codec, array, register, require
from promptstore.errors import CorruptEntry

_MAX_SLOTS = 64


class ArraysCodec(Codec):
    kind = "arrays"
    version = 1
    types = (ArraysCache,)

    def encode(self, layer):
        arrays = {}
        present = []
        for i, slot in enumerate(layer.cache):
            present.append(slot is not None)
            if slot is not None:
                arrays[f"slot.{i}"] = slot
        meta = {"present": present, "left_padding": False, "lengths": False}
        for name in ("left_padding", "lengths"):
            value = getattr(layer, name, None)
            if value is not None:
                arrays[name] = value
                meta[name] = True
        return arrays, meta

    def decode(self, arrays, meta, version):
        present = require(meta, "present", list, self.kind)
        if len(present) > _MAX_SLOTS or not all(isinstance(p, bool) for p in present):
            raise CorruptEntry(f"kind {self.kind!r}: malformed slot list")
        cache = ArraysCache(len(present))
        for i, p in enumerate(present):
            if p:
                cache[i] = array(arrays, f"slot.{i}", self.kind)
        for name in ("left_padding", "lengths"):
            if require(meta, name, bool, self.kind):
                setattr(cache, name, array(arrays, name, self.kind))
        return cache


register(ArraysCodec())
