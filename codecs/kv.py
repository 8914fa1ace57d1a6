"""``kv``: mlx-lm's KVCache. Writes only the ``offset`` covered positions.

Also the row moves of ``BatchKVCache``, whose rows are stored as ``kv``.
"""

from __future__ import annotations

from mlx_lm.models.cache import BatchKVCache, KVCache

from promptstore.codecs._kv import OffsetKVCodec, SerialKVRows
from promptstore.codecs._registry import register, register_rows
from promptstore.codecs._rows import Rows, kv_signature, own, refuse_unsettled
from promptstore.errors import InvalidInput


class KVRows(SerialKVRows):
    serial = KVCache

    def extract(self, layer, i, where):
        out = KVCache()
        if layer.keys is not None and layer.offset > 0:
            out.keys = own(layer.keys[i : i + 1, :, : layer.offset, :])
            out.values = own(layer.values[i : i + 1, :, : layer.offset, :])
            out.offset = int(layer.offset)
        return out


class KVCodec(OffsetKVCodec):
    kind = "kv"
    version = 1
    types = (KVCache,)
    rows = KVRows()
    batchable = True
    always_trimmable = True
    mlx_lm_class = KVCache

    def batch_layer(self, layer, pads):
        return BatchKVCache(list(pads))


class BatchKVRows(Rows):
    """BatchKVCache: keys ``[B, H, capacity, D]``; row i holds positions
    ``left_padding[i] .. _idx``, and ``offset[i] == _idx - left_padding[i]``."""

    serial = KVCache

    def count(self, layer):
        return int(layer.offset.shape[0])

    def check_settled(self, layer, where):
        refuse_unsettled(layer._right_padding is not None, where)

    def coverage(self, layer, i, where):
        self.check_settled(layer, where)
        off = int(layer.offset[i].item())
        lp = int(layer.left_padding[i].item())
        if lp < 0 or layer._idx - lp != off:
            raise InvalidInput(
                f"{where}: BatchKVCache row {i} is inconsistent (offset {off}, left padding {lp}, "
                f"write position {layer._idx}); was the cache changed behind mlx-lm's back?"
            )
        return off

    def extract(self, layer, i, where):
        off = self.coverage(layer, i, where)
        out = KVCache()
        if layer.keys is not None and off > 0:
            lp = layer._idx - off
            out.keys = own(layer.keys[i : i + 1, :, lp : layer._idx, :])
            out.values = own(layer.values[i : i + 1, :, lp : layer._idx, :])
            out.offset = off
        return out

    def kv_signature(self, layer):
        return kv_signature(layer)


register(KVCodec())
register_rows(BatchKVCache, BatchKVRows())
