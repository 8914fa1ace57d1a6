"""Codecs: one per storage kind, in one registry keyed by the kind string.

Importing this package registers every built-in codec. See ``_registry`` for
the codec contract and its capabilities; ``register`` adds a codec of your own.
"""

from promptstore.codecs._registry import (
    ALIASES,
    Codec,
    Encoded,
    base_kind,
    codec_for_kind,
    codec_for_layer,
    check_encoded,
    codecs,
    MissingCapability,
    decode_layer,
    detached,
    readable_codec,
    encode_layer,
    is_trimmable,
    layer_coverage,
    layers_of,
    register,
    register_rows,
    rows_for_layer,
    storage_kind,
    trim_cache,
    trim_floor,
    unregister,
)

# Built-in codecs register themselves on import; the order is irrelevant.
from promptstore.codecs import arrays as _arrays  # noqa: F401,E402
from promptstore.codecs import cache_list as _cache_list  # noqa: F401,E402
from promptstore.codecs import kv as _kv  # noqa: F401,E402
from promptstore.codecs import kv_chunked as _kv_chunked  # noqa: F401,E402
from promptstore.codecs import kv_concat as _kv_concat  # noqa: F401,E402
from promptstore.codecs import kv_quantized as _kv_quantized  # noqa: F401,E402
from promptstore.codecs import kv_rotating as _kv_rotating  # noqa: F401,E402
from promptstore.codecs import ssm as _ssm  # noqa: F401,E402

__all__ = [
    "ALIASES",
    "Codec",
    "Encoded",
    "base_kind",
    "codec_for_kind",
    "codec_for_layer",
    "codecs",
    "MissingCapability",
    "decode_layer",
    "detached",
    "readable_codec",
    "encode_layer",
    "is_trimmable",
    "layer_coverage",
    "register",
    "register_rows",
    "rows_for_layer",
    "storage_kind",
    "trim_cache",
    "trim_floor",
    "unregister",
]
