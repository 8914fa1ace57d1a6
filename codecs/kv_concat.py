"""``kv.concat``: mlx-lm's ConcatenateKVCache (no step padding).

Only the ``offset`` covered positions are written; mlx-lm's own trim keeps
serving trimmed keys of this class, a restored one does not.
"""

from __future__ import annotations

from mlx_lm.models.cache import ConcatenateKVCache

from promptstore.codecs._kv import OffsetKVCodec
from promptstore.codecs._registry import register


class ConcatKVCodec(OffsetKVCodec):
    kind = "kv.concat"
    version = 1
    types = (ConcatenateKVCache,)


register(ConcatKVCodec())
