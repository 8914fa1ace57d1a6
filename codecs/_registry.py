"""The codec registry: one codec per storage-kind string, resolved by exact type.

A codec turns one layer cache into ``(arrays, meta)`` and back:

* ``arrays``: ``{name: mx.array}``, only the bytes that carry state;
* ``meta``: a small dict of msgpack scalars (ints, strings, bools, lists).

Resolution is by the layer's EXACT class. A subclass nobody registered is
refused: silently inheriting the parent's kind routes the subclass's extra
state to nowhere.

Every other thing promptstore needs to know about a cache class is a
capability of its codec, found the same way (coverage, trim, row moves,
batched warm-up, speculative rounds, the mlx-lm file class, checkpoints).
Each capability fails closed: a codec has it only when it declares it.
Batch classes that are never stored (``BatchKVCache``...) register their row
moves alone with :func:`register_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx

from promptstore.errors import (
    CorruptEntry,
    CoverageMismatch,
    InvalidInput,
    MissingCapability,
    PromptStoreError,
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

    # -- capabilities: each one fails closed unless the codec declares it ----------

    #: Row moves in a running batch (a ``promptstore.codecs._rows.Rows``).
    rows: Any = None
    #: Warm-up may prefill this kind left-padded in a batch (see ``batch_layer``).
    batchable: bool = False
    #: Trimmable at any length, so speculative decoding may trim rejected drafts.
    always_trimmable: bool = False
    #: Runs speculative verify rounds (``begin_round``/``commit``/``rollback``).
    rounds: bool = False
    #: A sliding window whose speculative rounds drop rejected positions
    #: physically (``promptstore.ssm._window.WindowRound``), wrapped or not.
    window_rounds: bool = False
    #: The mlx-lm class an mlx-lm prompt-cache file holds this kind as.
    mlx_lm_class: Optional[type] = None
    #: Arrays whose second-to-last axis spans the entry's tokens may be stored
    #: as shared content-addressed blocks (``format._blocks``), so entries
    #: that share a prefix store its bytes once.
    shared_blocks: bool = False
    #: The sequence axis of the layer's 4-d arrays (None: no axis grows with
    #: the tokens, so a cache made by the same model has exactly its shapes).
    seq_axis: Optional[int] = None

    def prefix_meta(self, meta: Meta, n: int) -> Optional[Meta]:
        """The meta of this kind's layer cut to its first ``n`` tokens, its
        shared-block arrays cut to ``n`` positions with it, so a prefix hit
        on a longer entry reads only the blocks it needs; None (the default):
        the layer cannot be cut so, and the entry is read whole."""
        return None

    def trimmable(self, layer: Any) -> bool:
        """Whether ``layer`` can drop its last tokens now."""
        return False

    def trim_floor(self, meta: Meta) -> int:
        """The fewest tokens a stored layer of this kind (its ``meta``) can be
        trimmed down to: 0 unless it no longer holds its first tokens (a
        chunked window past its first chunk)."""
        return 0

    def check_trim(self, layer: Any, n: int) -> None:
        """Refuse, before anything is trimmed, a trim of the last ``n`` tokens
        of ``layer`` that ``trim`` would refuse; by default, unless ``trimmable``.
        A kind that trims only some lengths (a chunked window past its first
        chunk) refuses the others here too.

        Raises:
            MissingCapability: ``layer`` cannot drop ``n`` tokens now.
        """
        if not self.trimmable(layer):
            raise self.missing(layer, "trim", "it cannot drop tokens now (a recurrent state, or a sliding window that wrapped)")

    def trim(self, layer: Any, n: int) -> None:
        """Drop the last ``n`` tokens of ``layer`` (only when ``check_trim`` passes).

        Raises:
            MissingCapability: this kind cannot trim.
        """
        raise self.missing(layer, "trim")

    def needs_checkpoints(self, layer: Any, n_tokens: Optional[int]) -> bool:
        """Whether an entry of ``n_tokens`` (None: any length) made of this
        layer could not be trimmed, so chats need boundary checkpoints."""
        return True

    def batch_layer(self, layer: Any, pads: List[int]) -> Any:
        """The batch cache that warm-up prefills rows left-padded by ``pads`` in.

        Raises:
            MissingCapability: this kind is not ``batchable``.
        """
        raise self.missing(layer, "batched prefill")

    def to_mlx_lm(self, layer: Any) -> Any:
        """``layer`` as the mlx-lm class a prompt-cache file holds.

        Raises:
            MissingCapability: this kind has no mlx-lm class.
        """
        if self.mlx_lm_class is not None and type(layer) is self.mlx_lm_class:
            return layer
        raise self.missing(
            layer, "mlx-lm file", "mlx_lm.load_prompt_cache could not read it back"
        )

    def missing(self, layer: Any, capability: str, why: str = "") -> "MissingCapability":
        """The error for ``layer`` lacking ``capability``: names the class and kind."""
        return MissingCapability(
            f"{_qualname(type(layer))} (storage kind {self.kind!r}) has no {capability} support"
            + (f"; {why}" if why else "")
        )


_BY_KIND: Dict[str, Codec] = {}
_BY_TYPE: Dict[type, Codec] = {}
_ROWS_BY_TYPE: Dict[type, Any] = {}  # batch classes that have rows but no codec


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
        _check_unregistered(t)
    _BY_KIND[kind] = codec
    for t in codec.types:
        _BY_TYPE[t] = codec
    return codec


def register_rows(cls: type, rows: Any) -> Any:
    """Register the row moves of a batch class that is never stored itself
    (``BatchKVCache``: its rows are stored as ``KVCache``), by exact type.

    Raises:
        InvalidInput: ``cls`` is registered already (as a codec's type or here).
    """
    _check_unregistered(cls)
    _ROWS_BY_TYPE[cls] = rows
    return rows


def _check_unregistered(t: type) -> None:
    if t in _BY_TYPE:
        raise InvalidInput(f"{_qualname(t)} is registered already (kind {_BY_TYPE[t].kind!r})")
    if t in _ROWS_BY_TYPE:
        raise InvalidInput(f"{_qualname(t)} is registered already (row moves of a batch class)")


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
        raise UnknownStorageKind(f"no codec for cache class {_qualname(t)}{_subclass_hint(t)}")
    return codec


def rows_for_layer(layer: Any, where: str = "layer") -> Any:
    """The row moves of ``layer``'s exact class (a ``codecs._rows.Rows``).

    Raises:
        MissingCapability: neither a batch class registered with
            :func:`register_rows` nor a codec with row support.
    """
    t = type(layer)
    rows = _ROWS_BY_TYPE.get(t)
    if rows is not None:
        return rows
    codec = _BY_TYPE.get(t)
    if codec is None:
        reason = f"no codec or row moves are registered for exactly this class{_subclass_hint(t)}"
    elif codec.rows is None:
        reason = f"its storage kind {codec.kind!r} has no row support"
    else:
        return codec.rows
    raise MissingCapability(f"{where}: cannot take a row of a {_qualname(t)}: {reason}")


def _qualname(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _subclass_hint(t: type) -> str:
    parents = [p for p in t.__mro__[1:] if p in _BY_TYPE or p in _ROWS_BY_TYPE]
    if not parents:
        return "; register a codec for it with promptstore.codecs.register"
    p = parents[0]
    what = f"kind {_BY_TYPE[p].kind!r}" if p in _BY_TYPE else "a batch class"
    return (
        f"; it subclasses {p.__qualname__} ({what}) but subclasses are never "
        "routed to their parent's codec: register a codec for it"
    )


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


def layers_of(cache: Any, what: str = "cache") -> List[Any]:
    """``cache`` as a list of layers (what ``make_prompt_cache(model)`` returns).

    Raises:
        InvalidInput: it is not a list of layers (a string, a dict, None...).
    """
    try:
        layers = None if isinstance(cache, (str, bytes, dict)) else list(cache)
    except TypeError:  # not iterable
        layers = None
    if layers is None:
        raise InvalidInput(f"{what} must be a list of cache layers (make_prompt_cache(model)), not {type(cache).__name__}")
    return layers


# What a codec raises on a layer whose state is not what mlx-lm leaves
# (an array of too few dimensions, a numpy array, None where an array goes).
_BAD_STATE = (TypeError, ValueError, IndexError, AttributeError, KeyError)


def encode_layer(layer: Any) -> Encoded:
    """Encode one layer with its exact-type codec at the codec's current version.

    Raises:
        UnknownStorageKind: no codec for the layer's class.
        InvalidInput: its state cannot be encoded, or an array it holds is
            not an mlx array.
    """
    codec = codec_for_layer(layer)
    try:
        arrays, meta = codec.encode(layer)
    except _BAD_STATE as err:
        raise InvalidInput(f"cannot store this {type(layer).__name__}: {type(err).__name__}: {err}") from err
    for name, value in arrays.items():
        if not isinstance(value, mx.array):
            raise InvalidInput(f"cannot store this {type(layer).__name__}: its {name!r} is a {type(value).__name__}, not an mlx array")
    return Encoded(codec.kind_of(layer), codec.version, arrays, meta)


def check_encoded(encoded: Sequence[Encoded], n: int) -> None:
    """Refuse layers whose encoding would not read back as a layer of ``n``
    tokens: each is decoded as a get decodes it (its arrays' shapes against
    its meta; no bytes are read), and a layer that reports its coverage must
    report ``n``. A cache whose arrays disagree with its own state (keys
    shorter than its offset, a window index past its keys) would otherwise
    be stored, replacing an intact entry, and fail every read.

    Raises:
        InvalidInput: a layer would not decode.
        CoverageMismatch: a layer would decode covering another number of tokens.
    """
    for i, enc in enumerate(encoded):
        codec = readable_codec(enc.kind, enc.version)
        try:
            layer = codec.decode(enc.arrays, enc.meta, enc.version)
        except (CorruptEntry, *_BAD_STATE) as err:
            raise InvalidInput(f"layer {i} ({enc.kind}): its arrays disagree with its state, so it could not be read back: {err}") from err
        covers = codec.coverage(layer)
        if covers is not None and covers != n:
            raise CoverageMismatch(
                f"layer {i} ({enc.kind}) holds {covers} tokens of state, not the {n} it reports: "
                "its arrays are shorter than its offset"
            )


def detached(encoded: Sequence[Encoded]) -> List[Encoded]:
    """The same layers over new array objects, evaluated on this thread.

    mlx-lm writes into a cache's arrays in place (``update_and_fetch``), and a
    codec may hand out the cache's own array: whatever reads the encoding
    later, or on another thread, takes these instead. No data is copied here;
    the cache's next write copies, since its buffer is then shared."""
    out = [Encoded(e.kind, e.version, {k: mx.stop_gradient(v) for k, v in e.arrays.items()}, dict(e.meta)) for e in encoded]
    mx.eval([a for e in out for a in e.arrays.values()])
    return out


def readable_codec(kind: str, version: int) -> Codec:
    """The codec that decodes ``kind`` at codec ``version``.

    Raises:
        UnknownStorageKind, UnsupportedVersion: written by a newer (or
            extended) promptstore.
    """
    codec = codec_for_kind(kind)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise UnsupportedVersion(f"kind {kind!r}: invalid codec version {version!r}")
    if version > codec.version:
        raise UnsupportedVersion(
            f"kind {kind!r} was written by codec version {version}, this promptstore "
            f"reads up to {codec.version}: upgrade promptstore"
        )
    return codec


def decode_layer(kind: str, version: int, arrays: Arrays, meta: Meta) -> Any:
    """Decode one layer; refuses unknown kinds and versions newer than the codec.

    Raises:
        UnknownStorageKind, UnsupportedVersion
    """
    return readable_codec(kind, version).decode(arrays, meta, version)


def layer_coverage(layer: Any) -> Optional[int]:
    """Tokens ``layer`` has absorbed, or None when it cannot tell."""
    return codec_for_layer(layer).coverage(layer)


def is_trimmable(cache: Sequence[Any]) -> bool:
    """Whether every layer of ``cache`` can drop its last tokens now.

    Raises:
        UnknownStorageKind: a layer's exact class has no codec.
    """
    return all(codec_for_layer(layer).trimmable(layer) for layer in cache)


def trim_floor(layers: Iterable[Tuple[str, Meta]]) -> int:
    """The fewest tokens an entry of these stored layers (``(kind, meta)``
    each) can be trimmed down to (``Codec.trim_floor``); a layer of an
    unknown kind adds nothing (its restore fails closed)."""
    floor = 0
    for kind, meta in layers:
        try:
            floor = max(floor, codec_for_kind(kind).trim_floor(meta))
        except PromptStoreError:
            continue
    return floor


def trim_cache(cache: Sequence[Any], n: int) -> None:
    """Trim every layer of ``cache`` by ``n`` tokens, in place, through its codec.

    Plain KV layers also drop the trimmed positions, so their memory is not
    kept alive. Nothing is trimmed unless every layer can drop ``n`` tokens
    (``Codec.check_trim``).

    Raises:
        UnknownStorageKind: a layer's exact class has no codec.
        MissingCapability: a layer cannot drop ``n`` tokens (now).
    """
    codecs_ = [codec_for_layer(layer) for layer in cache]
    for i, (codec, layer) in enumerate(zip(codecs_, cache)):
        try:
            codec.check_trim(layer, n)
        except MissingCapability as err:
            raise MissingCapability(f"layer {i}: {err}; nothing was trimmed") from err
    for codec, layer in zip(codecs_, cache):
        codec.trim(layer, n)


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

