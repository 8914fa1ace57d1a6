"""``kv.concat``: mlx-lm's ConcatenateKVCache (no step padding).

Only the ``offset`` covered positions are written; a trim drops the trimmed
positions (``OffsetKVCodec``), since mlx-lm's own trim leaves them for the
next update to append after.
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


register(ConcatKVCodec())
