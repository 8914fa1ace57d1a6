"""``kv``: mlx-lm's KVCache. Writes only the ``offset`` covered positions."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from promptstore.codecs._kv import OffsetKVCodec
from promptstore.codecs._registry import register


class KVCodec(OffsetKVCodec):
    kind = "kv"
    version = 1
    types = (KVCache,)


register(KVCodec())
