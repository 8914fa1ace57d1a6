"""The codec registry: one codec per storage-kind string, resolved by exact type.

A codec turns one layer cache into ``(arrays, meta)`` and back:

* ``arrays``: ``{name: mx.array}``, only the bytes that carry state;
* ``meta``: a small dict of msgpack scalars (ints, strings, bools, lists).

Resolution is by the layer's EXACT class. A subclass nobody registered is
refused: silently inheriting the parent's kind routes the subclass's extra
state to nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from promptstore.errors import (
    CorruptEntry,
    InvalidInput,
    UnknownStorageKind,
    UnsupportedVersion,
)

Arrays = Dict[str, mx.array]
Meta = Dict[str, Any]

# Kind strings never change once written. A renamed kind maps old -> new here.
ALIASES: Dict[str, str] = {}


@dataclass(frozen=True)
class Encoded:
    """One layer, encoded: its storage kind, codec version, arrays and meta."""

    kind: str
    version: int
    arrays: Arrays
    meta: Meta


class Codec:
    """Base class of codecs. Subclasses set ``kind``, ``version`` and ``types``.

    ``encode`` always writes ``version``; ``decode`` must read every version
    from 1 to ``version`` (golden entries under fixtures/ prove it).
    """

    kind: str = ""
    version: int = 1
    types: Tuple[type, ...] = ()

    def encode(self, layer: Any) -> Tuple[Arrays, Meta]:
        raise NotImplementedError

    def decode(self, arrays: Arrays, meta: Meta, version: int) -> Any:
        raise NotImplementedError

    def coverage(self, layer: Any) -> Optional[int]:
        """Tokens the layer has absorbed, or None when the layer cannot tell."""
        return None

    def kind_of(self, layer: Any) -> str:
        """The full storage-kind string of ``layer`` (wrappers add inner kinds)."""
        return self.kind


_BY_KIND: Dict[str, Codec] = {}
_BY_TYPE: Dict[type, Codec] = {}


def register(codec: Codec) -> Codec:
    """Register ``codec`` for its kind and exact types.

    Raises:
        InvalidInput: the kind or one of the types is registered already, or
            the kind string is malformed.
    """
    kind = codec.kind
    if not kind or "(" in kind or ")" in kind or "," in kind:
        raise InvalidInput(f"codec {type(codec).__name__}: malformed kind {kind!r}")
    if not isinstance(codec.version, int) or codec.version < 1:
        raise InvalidInput(f"codec {kind!r}: version must be an int >= 1")
    if kind in _BY_KIND:
        raise InvalidInput(f"storage kind {kind!r} is registered already")
    for t in codec.types:
        if t in _BY_TYPE:
            raise InvalidInput(
                f"{t.__module__}.{t.__qualname__} is registered already "
                f"(kind {_BY_TYPE[t].kind!r})"
            )
    _BY_KIND[kind] = codec
    for t in codec.types:
        _BY_TYPE[t] = codec
    return codec


def unregister(kind: str) -> None:
    """Remove a codec (tests and plug-ins only)."""
    codec = _BY_KIND.pop(kind)
    for t in codec.types:
        _BY_TYPE.pop(t, None)


def codecs() -> List[Codec]:
    """Every registered codec, sorted by kind."""
    return [_BY_KIND[k] for k in sorted(_BY_KIND)]


def codec_for_layer(layer: Any) -> Codec:
    """The codec of ``layer``'s exact class.

    Raises:
        UnknownStorageKind: no codec handles exactly this class.
    """
    codec = _BY_TYPE.get(type(layer))
    if codec is None:
        t = type(layer)
        parents = [p for p in t.__mro__[1:] if p in _BY_TYPE]
        hint = (
            f"; it subclasses {parents[0].__qualname__} (kind {_BY_TYPE[parents[0]].kind!r}) "
            "but subclasses are never routed to their parent's codec: register a codec for it"
            if parents
            else "; register a codec for it with promptstore.codecs.register"
        )
        raise UnknownStorageKind(
            f"no codec for cache class {t.__module__}.{t.__qualname__}{hint}"
        )
    return codec


def base_kind(kind: str) -> str:
    """``'list(kv,kv)'`` -> ``'list'``; aliases resolved."""
    base = kind.split("(", 1)[0]
    return ALIASES.get(base, base)


def codec_for_kind(kind: str) -> Codec:
    """The codec registered for a (possibly wrapped) storage-kind string.

    Raises:
        UnknownStorageKind: nothing is registered under that kind.
    """
    if not isinstance(kind, str):
        raise UnknownStorageKind(f"storage kind must be a string, got {type(kind).__name__}")
    codec = _BY_KIND.get(base_kind(kind))
    if codec is None:
        raise UnknownStorageKind(
            f"unknown storage kind {kind!r}: this entry was written by a newer or "
            "extended promptstore; upgrade promptstore or delete the entry"
        )
    return codec


def storage_kind(layer: Any) -> str:
    """The storage-kind string of ``layer`` (e.g. ``'kv'``, ``'list(kv,kv)'``)."""
    return codec_for_layer(layer).kind_of(layer)


def encode_layer(layer: Any) -> Encoded:
    """Encode one layer with its exact-type codec at the codec's current version."""
    codec = codec_for_layer(layer)
    arrays, meta = codec.encode(layer)
    return Encoded(codec.kind_of(layer), codec.version, arrays, meta)


def decode_layer(kind: str, version: int, arrays: Arrays, meta: Meta) -> Any:
    """Decode one layer; refuses unknown kinds and versions newer than the codec.

    Raises:
        UnknownStorageKind, UnsupportedVersion
    """
    codec = codec_for_kind(kind)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise UnsupportedVersion(f"kind {kind!r}: invalid codec version {version!r}")
    if version > codec.version:
        raise UnsupportedVersion(
            f"kind {kind!r} was written by codec version {version}, this promptstore "
            f"reads up to {codec.version}: upgrade promptstore"
        )
    return codec.decode(arrays, meta, version)


def layer_coverage(layer: Any) -> Optional[int]:
    """Tokens ``layer`` has absorbed, or None when it cannot tell."""
    return codec_for_layer(layer).coverage(layer)


def prefixed(prefix: str, arrays: Arrays) -> Arrays:
    """Name arrays of an inner layer ``'<prefix>.<name>'``."""
    return {f"{prefix}.{k}": v for k, v in arrays.items()}


def unprefixed(prefix: str, arrays: Arrays) -> Arrays:
    """The arrays of inner layer ``prefix``, with the prefix stripped."""
    p = prefix + "."
    return {k[len(p):]: v for k, v in arrays.items() if k.startswith(p)}


def require(meta: Meta, key: str, types: Any, kind: str) -> Any:
    """``meta[key]`` checked against ``types``; a decoder's guard against damage."""
    if not isinstance(meta, dict) or key not in meta:
        raise CorruptEntry(f"kind {kind!r}: meta field {key!r} is missing")
    value = meta[key]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise CorruptEntry(f"kind {kind!r}: meta field {key!r} has type {type(value).__name__}")
    return value


def array(arrays: Arrays, name: str, kind: str) -> mx.array:
    """``arrays[name]``, or CorruptEntry naming what is missing."""
    if name not in arrays:
        raise CorruptEntry(f"kind {kind!r}: array {name!r} is missing")
    return arrays[name]


def _as_tuple(types: Any) -> Tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)

