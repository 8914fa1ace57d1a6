"""``arrays``: mlx-lm's ArraysCache (fixed slots, e.g. conv + recurrent state).

Empty slots are recorded as absent; ``left_padding`` and ``lengths`` (batch
bookkeeping) are kept when present. The cache cannot report coverage, cannot
trim, and warm-up prefills it left-padded in a batch.
"""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache

from promptstore.codecs._registry import Codec, array, register, require
from promptstore.codecs._rows import Rows, own, refuse_unsettled, slot_signature
from promptstore.errors import CorruptEntry

_MAX_SLOTS = 64


class ArraysRows(Rows):
    """Fixed slots ``[B, ...]``; coverage unknown. Empty slots stay empty
    (mlx-lm's own extract raises TypeError on them)."""

    serial = ArraysCache

    def count(self, layer):
        return int(layer.batch_size)

    def check_settled(self, layer, where):
        refuse_unsettled(layer.lengths is not None, where)

    def coverage(self, layer, i, where):
        self.check_settled(layer, where)
        return None

    def extract(self, layer, i, where):
        self.check_settled(layer, where)
        out = ArraysCache(len(layer.cache))
        # left_padding only masks a window still to come; a serial row has none.
        out.cache = [None if s is None else own(s[i : i + 1]) for s in layer.cache]
        return out

    def slot_signature(self, layer):
        return slot_signature(layer)


class ArraysCodec(Codec):
    kind = "arrays"
    version = 1
    types = (ArraysCache,)
    rows = ArraysRows()
    batchable = True
    mlx_lm_class = ArraysCache

    def batch_layer(self, layer, pads):
        return ArraysCache(len(layer.cache), left_padding=list(pads))

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
