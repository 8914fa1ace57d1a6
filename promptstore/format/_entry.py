"""Entry format: a msgpack manifest plus one payload of array bytes, chunked.

The manifest records, per layer, its storage kind, codec version and meta,
and per array its dtype, shape, place in the payload and xxh3-64 checksum
(or, format 3, the shared blocks that hold it). The payload is the arrays'
bytes back to back, cut into LMDB values of ``CHUNK`` bytes (4 MiB - 16 B,
exactly 1024 pages with LMDB's overflow header), so large values never need
more contiguous free pages than that; how it is laid out and read back is
``_payload``.

Reading is fail-closed: a newer format, a field of the wrong type, a size
that does not add up or a checksum that does not match raises, and nothing
is returned. Sizes are checked before anything is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import msgpack
import numpy as np
import xxhash

from promptstore.format._blocks import ADDRESS, block_shape
from promptstore.format._limits import MAX_ARRAYS, MAX_LAYERS, MAX_MANIFEST, MAX_MAP, MAX_PAYLOAD, MAX_STR, MAX_TOKENS
from promptstore.codecs import codec_for_kind, decode_layer, readable_codec, trim_floor
from promptstore.errors import CorruptEntry, InvalidInput, PromptStoreError, UnsupportedVersion

FORMAT = 4  # the newest entry format this reads: 1 keeps the payload in LMDB, 2 in a blob file,
BLOB_FORMAT = 2  # 3 also references shared blocks (its payload in LMDB or a blob file), kept in LMDB;
BLOCKS_FORMAT = 3  # 4 is 3 whose blocks may be in pack files (``format._packs``)
PACKS_FORMAT = 4
BLOB_SUFFIX = ".blob"
CHUNK = 4 * 1024 * 1024 - 16

DTYPES: Dict[str, Any] = {
    "bool": mx.bool_,
    "uint8": mx.uint8,
    "uint16": mx.uint16,
    "uint32": mx.uint32,
    "uint64": mx.uint64,
    "int8": mx.int8,
    "int16": mx.int16,
    "int32": mx.int32,
    "int64": mx.int64,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
    "float64": mx.float64,
    "complex64": mx.complex64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class ArrayRecord:
    """Where one array lives in the payload."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int
    checksum: int
    parts: Optional[Tuple[bytes, ...]] = None  # shared block addresses, one per bound (format 3); None: in the payload


@dataclass(frozen=True)
class LayerRecord:
    kind: str
    version: int
    meta: Dict[str, Any]
    arrays: Tuple[ArrayRecord, ...]


@dataclass(frozen=True)
class Manifest:
    """A decoded, validated manifest."""

    model: str
    model_name: str
    tokens: np.ndarray  # uint32
    layers: Tuple[LayerRecord, ...]
    payload: int
    chunks: int
    created: float
    trimmable: bool
    meta: Dict[str, Any]
    entry_id: str
    intact: bool = False  # whether the manifest checksum holds
    blob: Optional[str] = None  # the blob file holding the payload (format 2); None: LMDB chunks
    bounds: Tuple[int, ...] = ()  # token ends of the shared blocks (format 3)

    @property
    def kinds(self) -> Tuple[str, ...]:
        return tuple(layer.kind for layer in self.layers)

    def parted(self) -> Iterator[Tuple[int, ArrayRecord]]:
        """``(layer index, record)`` of every array kept in shared blocks."""
        for li, layer in enumerate(self.layers):
            for rec in layer.arrays:
                if rec.parts is not None:
                    yield li, rec

    def parts(self, rec: "ArrayRecord") -> Iterator[Tuple[bytes, Tuple[int, ...]]]:
        """``(address, shape)`` of each block of array ``rec``, in order."""
        start = 0
        for key, end in zip(rec.parts or (), self.bounds):
            yield key, block_shape(rec.shape, start, end)
            start = end

    def blocks(self) -> Iterator[Tuple[bytes, int]]:
        """``(address, bytes)`` of every shared block reference, repeats included."""
        for _, rec in self.parted():
            start = 0
            row = rec.nbytes // rec.shape[-2] if rec.shape[-2] else 0
            for key, end in zip(rec.parts or (), self.bounds):
                yield key, row * (end - start)
                start = end

    @property
    def shared_bytes(self) -> int:
        """Bytes of the arrays kept in shared blocks."""
        return sum(rec.nbytes for _, rec in self.parted())

    def prefix(self, n: int) -> Optional["Manifest"]:
        """This entry cut to the shortest run of its shared blocks that covers
        ``n`` tokens: what a prefix hit of ``n`` tokens needs to read (then
        trims to ``n``). None when there is nothing to cut, or a layer cannot
        be cut (its kind has no ``prefix_meta``, or it keeps token-spanning
        bytes outside the blocks): the entry is read whole."""
        cut = prefix_cut(self.bounds, self.layers, n, lambda layer: all(r.parts is not None for r in layer.arrays),
                         lambda r, end, m: replace(r, shape=r.shape[:-2] + (end,) + r.shape[-1:],
                                                   nbytes=r.nbytes // r.shape[-2] * end, parts=r.parts[:m]))
        if cut is None:
            return None
        m, layers = cut
        return replace(self, tokens=self.tokens[: self.bounds[m - 1]], layers=layers, bounds=self.bounds[:m])

    def reaches(self, n: int) -> bool:
        """Whether a trim can bring this entry down to ``n`` tokens: every
        layer still holds its tokens back to ``n`` (see ``Codec.trim_floor``;
        a layer of an unknown kind says nothing here, its restore fails)."""
        return n >= len(self.tokens) or trim_floor((layer.kind, layer.meta) for layer in self.layers) <= n

    def check_readable(self, where: str) -> None:
        """Refuse an entry of a newer promptstore before any byte is read.

        Raises:
            UnknownStorageKind, UnsupportedVersion: a layer's kind or codec
                version this promptstore cannot decode.
        """
        for li, layer in enumerate(self.layers):
            try:
                readable_codec(layer.kind, layer.version)
            except PromptStoreError as err:
                raise type(err)(f"{where} layer {li}: {err}") from err

    def payload_only(self) -> "Manifest":
        """This manifest without its shared-block arrays: what the payload readers read."""
        if not self.bounds:
            return self
        layers = tuple(replace(layer, arrays=tuple(r for r in layer.arrays if r.parts is None)) for layer in self.layers)
        return replace(self, layers=layers)


def prefix_cut(bounds: Sequence[int], layers: Sequence[Any], n: int, cuttable: Callable[[Any], bool],
               cut: Callable[[Any, int, int], Any]) -> Optional[Tuple[int, Tuple[Any, ...]]]:
    """An entry's layers cut to the shortest run of its blocks (ending at
    ``bounds``) that covers ``n`` tokens, as a local or a remote manifest
    cuts them: ``(blocks kept, layers)``, each layer with its kind's
    ``prefix_meta`` and its arrays ``cut(array, end, blocks kept)``. None
    when there is nothing to cut, or a layer cannot be cut (not
    ``cuttable``, or its kind has no ``prefix_meta`` for it)."""
    k = next((i for i, end in enumerate(bounds) if end >= n), None)
    if k is None or k == len(bounds) - 1:
        return None
    end = bounds[k]
    out = []
    for layer in layers:
        if not cuttable(layer):
            return None
        try:
            meta = codec_for_kind(layer.kind).prefix_meta(layer.meta, end)
        except PromptStoreError:
            return None
        if meta is None:
            return None
        out.append(replace(layer, meta=meta, arrays=tuple(cut(a, end, k + 1) for a in layer.arrays)))
    return k + 1, tuple(out)


def tokens_bytes(tokens: np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<u4").tobytes()


def n_chunks(payload: int) -> int:
    return math.ceil(payload / CHUNK)


def pack_manifest(
    *,
    model: str,
    model_name: str,
    tokens: np.ndarray,
    layers: List[dict],
    payload: int,
    created: float,
    trimmable: bool,
    meta: Dict[str, Any],
    entry_id: str,
    blob: Optional[str] = None,
    bounds: Sequence[int] = (),
    read_back: bool = True,
) -> bytes:
    """The manifest of an entry, as it is written.

    It is read back as every reader reads it (:func:`unpack_manifest`: its
    limits on strings and lists, at most ``MAX_LAYERS`` layers, shapes of at
    most 8 dimensions...), so what a reader would refuse is never written and
    never replaces an intact entry. ``read_back=False`` skips that for a
    manifest that is not final (a blob entry's before its checksums are in):
    the final one must be read back.

    Raises:
        InvalidInput: ``meta`` is refused (:func:`check_meta`), or the
            manifest is too large or would not read back.
    """
    doc = {
        # An entry in LMDB stays format 1, which older readers read; a blob
        # entry is format 2 and one with shared blocks format 4 (its blocks
        # may be in pack files), which they refuse (fail closed) instead of
        # reporting missing bytes as damage.
        "format": PACKS_FORMAT if bounds else (1 if blob is None else BLOB_FORMAT),
        "model": model,
        "model_name": model_name,
        "tokens": tokens_bytes(tokens),
        "layers": layers,
        "payload": payload,
        "chunks": n_chunks(payload),
        "chunk_size": CHUNK,
        "created": created,
        "trimmable": trimmable,
        "meta": meta,
        "id": entry_id,
        **({} if blob is None else {"blob": blob}),
        **({"bounds": list(bounds)} if bounds else {}),
        "check": bytes(8),  # last: the xxh3-64 of every manifest byte before these 8
    }
    check_meta(meta)
    try:
        raw = msgpack.packb(doc, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as err:
        raise InvalidInput(f"entry metadata is not serialisable: {err}") from err
    if len(raw) > MAX_MANIFEST:  # unpack_manifest would refuse it: never write what cannot be read
        meta_bytes = len(msgpack.packb(meta, use_bin_type=True))
        fix = ("store less meta" if 2 * meta_bytes >= len(raw) else f"{len(tokens)} tokens in {max(len(bounds), 1)} "
               f"blocks over {len(layers)} layers: a larger block_tokens (fewer blocks), or a shorter entry")
        raise InvalidInput(f"the entry's manifest would be {len(raw)} bytes, over {MAX_MANIFEST} ({meta_bytes} of meta): {fix}")
    raw = raw[:-8] + xxhash.xxh3_64_digest(raw[:-8])
    if read_back:
        try:
            unpack_manifest(raw, "the new entry")
        except (CorruptEntry, UnsupportedVersion) as err:
            raise InvalidInput(f"the entry's manifest could not be read back, so it was not written: {err}") from err
    return raw


def manifest_bound(n_tokens: int, n_arrays: int, meta: Dict[str, Any], cut: int) -> int:
    """About the most bytes :func:`pack_manifest` writes for an entry of
    ``n_tokens`` tokens, ``n_arrays`` arrays and ``meta`` (checked) whose
    blocks are ``cut`` tokens long or more (the store's block size, or the
    caller's checkpoint spacing when smaller: each checkpoint ends a block),
    for a caller that must stay under a byte budget before it puts: 4 bytes
    a token, 48 a block reference (measured: 16 to 27), 512 an array record
    (names, dtype, shape, checksum, its layer's meta), 4 KiB for the rest."""
    refs = n_tokens // max(1, cut) + 2
    return 4 * n_tokens + n_arrays * (48 * refs + 512) + 4096 + len(msgpack.packb(meta, use_bin_type=True))


MAX_META_DEPTH = 64  # nesting of lists and maps in an entry's meta
_META_INT = (-(1 << 63), 1 << 64)  # what msgpack packs as an integer
_META_LEN = min(MAX_ARRAYS, MAX_MAP)  # items of one list or map: unpack_manifest's max_array_len and max_map_len
_META_STR = MAX_STR  # UTF-8 bytes of one string: unpack_manifest's max_str_len


def meta_as_read(value: Any) -> Any:
    """``value`` (checked by :func:`check_meta`) as it reads back: tuples are lists."""
    if isinstance(value, dict):
        return {k: meta_as_read(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [meta_as_read(v) for v in value]
    return value


def check_meta(meta: Any) -> None:
    """Refuse entry metadata that would not read back as written, nor print as JSON.

    Allowed: a dict with str keys whose values are, recursively, str, int in
    [-2**63, 2**64), finite float, bool, None, list (or tuple) and dict with
    str keys, nested at most :data:`MAX_META_DEPTH` deep, within the limits
    :func:`unpack_manifest` reads. Checked before anything is written, so a
    bad put never replaces a stored entry.

    Raises:
        InvalidInput: naming the offending key path (``meta["a"][0]``).
    """
    if not isinstance(meta, dict):
        raise InvalidInput(f"meta must be a dict with str keys, not {type(meta).__name__}")
    todo: List[Tuple[str, Any, int]] = [("meta", meta, 0)]
    while todo:  # a stack, not recursion: any nesting is refused cleanly
        path, value, depth = todo.pop()
        if isinstance(value, (dict, list, tuple)):
            if depth >= MAX_META_DEPTH:
                raise InvalidInput(f"{path}: meta is nested more than {MAX_META_DEPTH} deep")
            if len(value) > _META_LEN:
                raise InvalidInput(f"{path}: {len(value)} items, over the {_META_LEN} a meta list or map may hold")
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise InvalidInput(f"{path}: key {key!r} ({type(key).__name__}) is not a str; meta keys must be str")
                    _check_str(f"{path} key {key!r}", key)
                    todo.append((f"{path}[{key!r}]", item, depth + 1))
            else:
                todo.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_str(path, value)
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if not _META_INT[0] <= value < _META_INT[1]:
                raise InvalidInput(f"{path}: the int {value} is out of range; meta ints lie in [-2**63, 2**64)")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidInput(f"{path}: {value} is not allowed; meta floats must be finite (JSON has no NaN or Infinity)")
        else:
            raise InvalidInput(
                f"{path}: {type(value).__name__} is not allowed; meta values are str, int, float, bool, None, list or dict"
            )


def _check_str(path: str, text: str) -> None:
    try:
        n = len(text.encode("utf-8"))
    except UnicodeEncodeError as err:
        raise InvalidInput(f"{path}: not encodable as UTF-8 ({err.reason} at {err.start})") from err
    if n > _META_STR:
        raise InvalidInput(f"{path}: a string of {n} bytes, over the {_META_STR} a meta string may hold")


def _intact(doc: dict, raw: bytes) -> bool:
    """Whether the manifest checksum holds. Every format-1 writer writes one,
    so a manifest without it is damaged (fail closed, never "older writer")."""
    if "check" not in doc:
        return False
    check = doc["check"]
    return isinstance(check, bytes) and raw[-8:] == check and xxhash.xxh3_64_digest(raw[:-8]) == check


def checksum_holds(raw: bytes) -> bool:
    """Whether a manifest's bytes are as written (its last 8 bytes are the
    xxh3-64 of the rest), without parsing it: tells an entry written by a
    newer promptstore (intact, but unreadable here) from a damaged one."""
    return len(raw) > 8 and xxhash.xxh3_64_digest(raw[:-8]) == raw[-8:]


def _field(doc: dict, key: str, types: Any, where: str) -> Any:
    if key not in doc:
        raise CorruptEntry(f"{where}: manifest field {key!r} is missing")
    value = doc[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise CorruptEntry(f"{where}: manifest field {key!r} has type bool")
    if not isinstance(value, types):
        raise CorruptEntry(f"{where}: manifest field {key!r} has type {type(value).__name__}")
    return value


_LAST_TIME = 253402300800.0  # 10000-01-01 UTC: past what a datetime holds


def is_time(value: float) -> bool:
    """Whether ``value``, seconds since the epoch, is a time a datetime holds (NaN is not)."""
    return 0.0 <= value < _LAST_TIME


def _created(doc: dict, where: str) -> float:
    """The manifest's ``created`` time: seconds since the epoch that a
    datetime can hold (a damaged one, NaN or 1e300, broke every listing)."""
    value = float(_field(doc, "created", (int, float), where))
    if not is_time(value):
        raise CorruptEntry(f"{where}: manifest field 'created' is {value!r}, not a time")
    return value


def _unpack(raw: bytes) -> Any:
    """The msgpack document of a manifest, within the limits a manifest keeps to."""
    return msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_TOKENS * 4, max_str_len=MAX_STR,
                           max_array_len=MAX_ARRAYS, max_map_len=MAX_MAP)


def newer_tokens(raw: bytes) -> Optional[Tuple[np.ndarray, bool]]:
    """The token ids and trimmable flag of a manifest this reader refuses
    as newer, read from its map as this format writes them, for the prefix
    index alone (the entry itself is never read): None when they are not
    there in that form. The caller checks the ids against the entry key."""
    try:
        doc = _unpack(raw)
    except Exception:  # msgpack raises many unrelated types on damage
        return None
    tokens = doc.get("tokens") if isinstance(doc, dict) else None
    if not isinstance(tokens, bytes) or not tokens or len(tokens) % 4:
        return None
    return np.frombuffer(tokens, dtype="<u4").astype(np.uint32), doc.get("trimmable") is True


def unpack_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; ``where`` names the entry in errors.

    Raises:
        UnsupportedVersion: the entry format is newer than this reader.
        CorruptEntry: anything else is wrong.
    """
    if len(raw) > MAX_MANIFEST:
        raise CorruptEntry(f"{where}: manifest of {len(raw)} bytes is implausibly large")
    try:
        doc = _unpack(raw)
    except Exception as err:  # msgpack raises many unrelated types on damage
        raise CorruptEntry(f"{where}: manifest does not parse ({type(err).__name__}: {err})") from err
    if not isinstance(doc, dict):
        raise CorruptEntry(f"{where}: manifest is not a map")
    fmt = _field(doc, "format", int, where)
    if fmt > FORMAT:
        raise UnsupportedVersion(
            f"{where}: entry format {fmt} is newer than this promptstore reads ({FORMAT}); upgrade promptstore"
        )
    if fmt < 1:
        raise CorruptEntry(f"{where}: entry format {fmt} is invalid")
    blob = None
    if fmt == BLOB_FORMAT or (fmt >= BLOCKS_FORMAT and "blob" in doc):
        blob = _field(doc, "blob", str, where)
        if not _blob_name(blob):
            raise CorruptEntry(f"{where}: manifest names blob file {blob[:80]!r}, which is not a blob name")
        if not blob.startswith(str(doc.get("id")) + "-"):  # another entry's file: never read or unlink it
            raise CorruptEntry(f"{where}: manifest names blob file {blob!r} of another entry")
    elif "blob" in doc:
        raise CorruptEntry(f"{where}: a format {fmt} manifest names a blob file")
    if _field(doc, "chunk_size", int, where) != CHUNK:
        raise UnsupportedVersion(f"{where}: entry uses chunk size {doc['chunk_size']}, this reader {CHUNK}")
    tok = _field(doc, "tokens", bytes, where)
    if len(tok) % 4:
        raise CorruptEntry(f"{where}: token bytes are not a whole number of uint32")
    bounds = _bounds(doc, fmt, len(tok) // 4, where)
    payload = _field(doc, "payload", int, where)
    chunks = _field(doc, "chunks", int, where)
    if not 0 <= payload <= MAX_PAYLOAD or chunks != n_chunks(payload):
        raise CorruptEntry(f"{where}: payload of {payload} bytes in {chunks} chunks does not add up")
    raw_layers = _field(doc, "layers", list, where)
    if len(raw_layers) > MAX_LAYERS:
        raise CorruptEntry(f"{where}: {len(raw_layers)} layers is implausible")
    layers, expect = [], 0
    for li, rl in enumerate(raw_layers):
        lw = f"{where} layer {li}"
        if not isinstance(rl, dict):
            raise CorruptEntry(f"{lw}: not a map")
        records = []
        for ra in _field(rl, "arrays", list, lw):
            if not (isinstance(ra, list) and (len(ra) == 6 or (bounds and len(ra) == 7))):
                raise CorruptEntry(f"{lw}: malformed array record")
            name, dtype, shape, off, nbytes, checksum = ra[:6]
            parts = _parts(ra[6], bounds, shape, lw, name) if len(ra) == 7 else None
            if not (isinstance(name, str) and isinstance(dtype, str) and isinstance(shape, list)):
                raise CorruptEntry(f"{lw}: malformed array record")
            if dtype not in DTYPES:
                raise CorruptEntry(f"{lw}: array {name!r} has unknown dtype {dtype!r}")
            if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < (1 << 40) for d in shape) or len(shape) > 8:
                raise CorruptEntry(f"{lw}: array {name!r} has malformed shape {shape!r}")
            size = math.prod(shape) * DTYPES[dtype].size
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in (off, nbytes, checksum)):
                raise CorruptEntry(f"{lw}: array {name!r} has malformed location")
            if nbytes != size or off != expect:
                raise CorruptEntry(f"{lw}: array {name!r} of shape {shape} {dtype} does not match its {nbytes} bytes at {off}")
            if parts is None:
                expect += nbytes
            records.append(ArrayRecord(name, dtype, tuple(shape), off, nbytes, checksum, parts))
        layers.append(
            LayerRecord(
                _field(rl, "kind", str, lw),
                _field(rl, "version", int, lw),
                _field(rl, "meta", dict, lw),
                tuple(records),
            )
        )
    if expect != payload:
        raise CorruptEntry(f"{where}: arrays cover {expect} bytes, payload says {payload}")
    return Manifest(
        model=_field(doc, "model", str, where),
        model_name=_field(doc, "model_name", str, where),
        tokens=np.frombuffer(tok, dtype="<u4"),
        layers=tuple(layers),
        payload=payload,
        chunks=chunks,
        created=_created(doc, where),
        trimmable=_field(doc, "trimmable", bool, where),
        meta=_field(doc, "meta", dict, where),
        entry_id=_field(doc, "id", str, where),
        intact=_intact(doc, raw),
        blob=blob,
        bounds=bounds,
    )


def _bounds(doc: dict, fmt: int, n_tokens: int, where: str) -> Tuple[int, ...]:
    """The block ends of a format-3 or -4 manifest: strictly increasing, ending at the token count."""
    if fmt < BLOCKS_FORMAT:
        if "bounds" in doc:
            raise CorruptEntry(f"{where}: a format {fmt} manifest has block bounds")
        return ()
    raw = _field(doc, "bounds", list, where)
    ok = bool(raw) and all(isinstance(b, int) and not isinstance(b, bool) for b in raw)
    if not ok or raw[-1] != n_tokens or any(b <= a for a, b in zip([0] + raw, raw)):
        raise CorruptEntry(f"{where}: block bounds are malformed")
    return tuple(raw)


def _parts(raw: Any, bounds: Tuple[int, ...], shape: Any, lw: str, name: Any) -> Tuple[bytes, ...]:
    """The block addresses of a shared array: one per bound, over its token axis."""
    # set(map(...)): checked at C speed, a long entry names thousands of blocks
    if not (isinstance(raw, list) and len(raw) == len(bounds) and set(map(type, raw)) == {bytes} and set(map(len, raw)) == {ADDRESS}):
        raise CorruptEntry(f"{lw}: array {name!r} has malformed block references")
    if not (isinstance(shape, list) and len(shape) >= 2 and shape[-2] == bounds[-1]):
        raise CorruptEntry(f"{lw}: array {name!r} of shape {shape} does not span the entry's {bounds[-1]} tokens")
    return tuple(raw)


def _blob_name(name: str) -> bool:
    """Whether ``name`` is a blob file name as :mod:`_blobs` makes them (a plain
    file name: a crafted manifest must not reach outside the blobs directory)."""
    head, _, tail = name.partition("-")
    hexdigits = "0123456789abcdef"
    return (
        len(head) == 16 and len(tail) == 16 + len(BLOB_SUFFIX) and tail.endswith(BLOB_SUFFIX)
        and all(c in hexdigits for c in head + tail[:16])
    )



def decode_layers(man: Manifest, arrays: List[Dict[str, mx.array]], where: str) -> List[Any]:
    """Turn each layer's arrays back into a cache object via its codec."""
    layers = []
    for li, (rec, arr) in enumerate(zip(man.layers, arrays)):
        try:
            layers.append(decode_layer(rec.kind, rec.version, arr, rec.meta))
        except PromptStoreError as err:
            raise type(err)(f"{where} layer {li}: {err}") from err
        except Exception as err:  # a codec tripping over damaged meta must not escape untyped
            raise CorruptEntry(f"{where} layer {li} ({rec.kind}): {type(err).__name__}: {err}") from err
    # Checked last, so that a manifest edited on purpose still reports its
    # structural error (unknown kind, newer version) first.
    if man.intact is False:
        raise CorruptEntry(
            f"{where}: manifest checksum mismatch (its metadata is damaged); "
            "run `promptstore verify --fix` to remove damaged entries"
        )
    mx.eval([a for d in arrays for a in d.values()])
    return layers
