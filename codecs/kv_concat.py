"""``kv.concat``: mlx-lm's ConcatenateKVCache (no step padding).

Only the ``offset`` covered positions are written. mlx-lm's own trim only
lowers ``offset`` and the next update appends after the stale keys, so a
trim here also drops the trimmed positions.
"""

from __future__ import annotations

from mlx_lm.models.cache import ConcatenateKVCache

from promptstore.codecs._kv import OffsetKVCodec
from promptstore.codecs._registry import register


class ConcatKVCodec(OffsetKVCodec):
    kind = "kv.concat"
    version = 1
    types = (ConcatenateKVCache,)
    mlx_lm_class = ConcatenateKVCache

    def trim(self, layer, n):
        super().trim(layer, n)
        if layer.keys is not None:
            layer.keys = layer.keys[..., : layer.offset, :]
            layer.values = layer.values[..., : layer.offset, :]


register(ConcatKVCodec())
