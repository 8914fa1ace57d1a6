"""Entry format: a msgpack manifest plus one payload of array bytes, chunked.

The manifest records, per layer, its storage kind, codec version and meta,
and per array its dtype, shape, place in the payload and xxh3-64 checksum.
The payload is the arrays' bytes back to back, cut into LMDB values of
``CHUNK`` bytes (4 MiB - 16 B, exactly 1024 pages with LMDB's overflow
header), so large values never need more contiguous free pages than that.

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

from promptstore.format import _blank, _fill
from promptstore.format._blocks import ADDRESS
from promptstore.codecs import Encoded, decode_layer
from promptstore.errors import CorruptEntry, InvalidInput, PromptStoreError, StoreError, UnsupportedVersion

FORMAT = 3  # the newest entry format this reads: 1 keeps the payload in LMDB, 2 in a blob file,
BLOB_FORMAT = 2  # 3 also references shared blocks (its payload in LMDB or a blob file)
BLOCKS_FORMAT = 3
BLOB_SUFFIX = ".blob"
CHUNK = 4 * 1024 * 1024 - 16
MAX_MANIFEST = 64 * 1024 * 1024
MAX_TOKENS = 1 << 24
MAX_LAYERS = 4096
MAX_ARRAYS = 1 << 16
MAX_PAYLOAD = 1 << 40

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
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# numpy has no bfloat16: such arrays travel as bytes through a same-width view.
_BYTE_VIEW = {mx.bfloat16: mx.uint16}


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

    def payload_only(self) -> "Manifest":
        """This manifest without its shared-block arrays: what the payload readers read."""
        if not self.bounds:
            return self
        layers = tuple(replace(layer, arrays=tuple(r for r in layer.arrays if r.parts is None)) for layer in self.layers)
        return replace(self, layers=layers)


def tokens_bytes(tokens: np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<u4").tobytes()


def _host_bytes(a: mx.array) -> memoryview:
    """A read-only byte view of an evaluated, contiguous array (no copy)."""
    view = _BYTE_VIEW.get(a.dtype)
    if view is not None:
        a = a.view(view)
    return np.asarray(a).data.cast("B")


def prepare(
    layers: Sequence[Encoded], n_tokens: int = 0, shared: Optional[Callable[[Encoded], bool]] = None
) -> Tuple[List[dict], List[memoryview], int]:
    """Evaluate every array contiguously and lay out the payload.

    Returns the manifest's layer records, the byte views in payload order and
    the payload size. The records' checksums are None until
    :func:`add_checksums` fills them in (a put overlaps that with writing).

    With ``shared``, an array of a layer it accepts whose second-to-last axis
    spans the ``n_tokens`` tokens goes to shared blocks instead: its record
    gets a 7th element, the evaluated array (the writer replaces it with the
    block addresses), and it takes no payload bytes.
    """
    flat = [mx.contiguous(a) for enc in layers for a in enc.arrays.values()]
    mx.eval(flat)
    records, views, offset, i = [], [], 0, 0
    for enc in layers:
        arrays = []
        blocks = shared is not None and n_tokens > 0 and shared(enc)
        for name in enc.arrays:
            a = flat[i]
            i += 1
            dtype = _DTYPE_NAMES.get(a.dtype)
            if dtype is None:
                raise CorruptEntry(f"kind {enc.kind!r}: array {name!r} has unsupported dtype {a.dtype}")
            if blocks and a.ndim >= 2 and a.shape[-2] == n_tokens and a.nbytes:
                arrays.append([name, dtype, list(a.shape), offset, a.nbytes, 0, a])
                continue
            buf = _host_bytes(a)
            arrays.append([name, dtype, list(a.shape), offset, buf.nbytes, None])
            views.append(buf)
            offset += buf.nbytes
        records.append({"kind": enc.kind, "version": enc.version, "meta": enc.meta, "arrays": arrays})
    return records, views, offset


def add_checksums(records: List[dict], views: Sequence[memoryview]) -> None:
    """Fill in the checksums :func:`prepare` left out (``views`` in payload order)."""
    arrays = [a for rec in records for a in rec["arrays"] if len(a) == 6]
    for a, view in zip(arrays, views):
        a[5] = xxhash.xxh3_64_intdigest(view)


def iter_chunks(views: Sequence[memoryview], total: int) -> Iterator[memoryview]:
    """The payload cut into ``CHUNK``-byte values.

    A chunk that lies inside one array is that array's memory itself; only
    chunks that straddle arrays are assembled (one copy of those bytes), into
    one scratch buffer reused for every such chunk: an assembled chunk is
    valid only until the next one is requested (``txn.put`` copies it at once).
    """
    scratch: Optional[bytearray] = None
    fill = 0
    for view in views:
        pos = 0
        while pos < view.nbytes:
            take = min(CHUNK - fill, view.nbytes - pos)
            if fill == 0 and take == CHUNK:
                yield view[pos : pos + take]
                pos += take
                continue
            if scratch is None:
                scratch = bytearray(CHUNK)
            scratch[fill : fill + take] = view[pos : pos + take]
            pos += take
            fill += take
            if fill == CHUNK:
                yield memoryview(scratch)
                fill = 0
    if fill and scratch is not None:
        yield memoryview(scratch)[:fill]


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
) -> bytes:
    doc = {
        # An entry in LMDB stays format 1, which older readers read; a blob
        # entry is format 2 and one with shared blocks format 3, which they
        # refuse (fail closed) instead of reporting missing bytes as damage.
        "format": BLOCKS_FORMAT if bounds else (1 if blob is None else BLOB_FORMAT),
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
    try:
        raw = msgpack.packb(doc, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as err:
        raise InvalidInput(f"entry metadata is not serialisable: {err}") from err
    return raw[:-8] + xxhash.xxh3_64_digest(raw[:-8])


def _intact(doc: dict, raw: bytes) -> bool:
    """Whether the manifest checksum holds. Every format-1 writer writes one,
    so a manifest without it is damaged (fail closed, never "older writer")."""
    if "check" not in doc:
        return False
    check = doc["check"]
    return isinstance(check, bytes) and raw[-8:] == check and xxhash.xxh3_64_digest(raw[:-8]) == check


def _field(doc: dict, key: str, types: Any, where: str) -> Any:
    if key not in doc:
        raise CorruptEntry(f"{where}: manifest field {key!r} is missing")
    value = doc[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise CorruptEntry(f"{where}: manifest field {key!r} has type bool")
    if not isinstance(value, types):
        raise CorruptEntry(f"{where}: manifest field {key!r} has type {type(value).__name__}")
    return value


def unpack_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; ``where`` names the entry in errors.

    Raises:
        UnsupportedVersion: the entry format is newer than this reader.
        CorruptEntry: anything else is wrong.
    """
    if len(raw) > MAX_MANIFEST:
        raise CorruptEntry(f"{where}: manifest of {len(raw)} bytes is implausibly large")
    try:
        doc = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_TOKENS * 4,
            max_str_len=1 << 20,
            max_array_len=MAX_ARRAYS,
            max_map_len=1 << 16,
        )
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
    if fmt == BLOB_FORMAT or (fmt == BLOCKS_FORMAT and "blob" in doc):
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
        created=float(_field(doc, "created", (int, float), where)),
        trimmable=_field(doc, "trimmable", bool, where),
        meta=_field(doc, "meta", dict, where),
        entry_id=_field(doc, "id", str, where),
        intact=_intact(doc, raw),
        blob=blob,
        bounds=bounds,
    )


def _bounds(doc: dict, fmt: int, n_tokens: int, where: str) -> Tuple[int, ...]:
    """The block ends of a format-3 manifest: strictly increasing, ending at the token count."""
    if fmt != BLOCKS_FORMAT:
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
    if not (isinstance(raw, list) and len(raw) == len(bounds) and all(isinstance(k, bytes) and len(k) == ADDRESS for k in raw)):
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



def read_arrays(
    man: Manifest,
    get_chunk: Callable[[int], Any],
    where: str,
    release: Optional[Callable[[Any], None]] = None,
) -> List[Dict[str, mx.array]]:
    """Copy the payload into fresh mlx arrays (one copy) and verify checksums.

    ``get_chunk(i)`` returns chunk ``i`` as a buffer, or None when missing.
    It must be called inside the read transaction that owns the buffers.
    ``release(buf)``, when given, is called on each chunk once its bytes are
    copied (the store drops the chunk's pages from the process's mapping).
    """
    return read_mapped(man, chunk_buffers(man, get_chunk, where, release), where, release)


def chunk_buffers(
    man: Manifest, get_chunk: Callable[[int], Any], where: str, release: Optional[Callable[[Any], None]] = None
) -> List[Any]:
    """Every chunk, checked present with its exact length before anything
    is allocated: a manifest claiming a huge payload costs nothing."""
    bufs = []
    for ci in range(man.chunks):
        buf = get_chunk(ci)
        if buf is None:
            raise CorruptEntry(f"{where}: payload chunk {ci} of {man.chunks} is missing")
        expect = min(CHUNK, man.payload - ci * CHUNK)
        if len(buf) != expect:
            raise CorruptEntry(f"{where}: payload chunk {ci} has {len(buf)} bytes, expected {expect}")
        if release is not None:
            release(buf)  # fetching a value maps all of its pages
        bufs.append(buf)
    return bufs


def _by_layer(man: Manifest, flat: Sequence[mx.array]) -> List[Dict[str, mx.array]]:
    out: List[Dict[str, mx.array]] = []
    i = 0
    for layer in man.layers:
        out.append({rec.name: flat[i + k] for k, rec in enumerate(layer.arrays)})
        i += len(layer.arrays)
    return out


def _empty(rec: ArrayRecord) -> mx.array:
    return mx.array(np.zeros(0, dtype=np.uint8)).view(DTYPES[rec.dtype]).reshape(rec.shape)


_SLAB = 64 << 20  # restored arrays share buffers of up to this size
_ALIGN = 64


def read_file(man: Manifest, fd: int, offsets: Sequence[int], where: str) -> List[Dict[str, mx.array]]:
    """Read the payload with ``pread`` from the data file, chunk ``i`` being
    at file offset ``offsets[i]``, into fresh mlx arrays; verify checksums.

    The reads and checksums run on two threads with the GIL released
    (:mod:`_fill`), into mlx buffers that nothing has written before
    (:mod:`_blank`). The arrays share buffers of up to 64 MiB (a larger one
    gets its own), since each buffer costs the loader a call back into
    Python, and a restore has about a hundred arrays. A shared buffer lives while any of its arrays does; mlx-lm's caches
    replace every restored array at their first step (a full KV cache grows
    by concatenation, a recurrent state is recomputed), and the first
    in-place update of one (a full RotatingKVCache) copies it out once,
    since mlx reuses only a buffer an array owns alone.

    Every array starts at the same address modulo 64 as its bytes in the
    file, so the kernel's copy moves whole cache lines: mlx's buffers start
    24 bytes past a page boundary, and reading from page-aligned file
    offsets into such addresses ran at less than half the speed of a copy
    between equally aligned addresses (docs/performance.md). Each array therefore gets
    64 bytes of slack in its buffer and is a view at the matching offset.
    Raises CorruptEntry on a checksum mismatch or a file too short,
    StoreError when reading fails.
    """
    recs = [(li, rec) for li, layer in enumerate(man.layers) for rec in layer.arrays]
    place: Dict[int, Tuple[int, int]] = {}  # array -> (buffer, start of its room)
    sizes: List[int] = []
    slab: Optional[int] = None  # the buffer arrays are being packed into
    for i, (_, rec) in enumerate(recs):
        if not rec.nbytes:
            continue
        room = rec.nbytes + _ALIGN
        if room > _SLAB:
            place[i] = (len(sizes), 0)
            sizes.append(room)
            continue
        start = 0 if slab is None else -(-sizes[slab] // _ALIGN) * _ALIGN
        if slab is None or start + room > _SLAB:
            slab, start = len(sizes), 0
            sizes.append(0)
        place[i] = (slab, start)
        sizes[slab] = start + room
    bufs = _blank.blank(sizes)
    hosts = [np.asarray(b) for b in bufs]
    fresh = [not _fill.resident(h) for h in hosts]
    jobs, starts = [], {}
    for i, (b, base) in place.items():
        rec = recs[i][1]
        segments, apos = [], 0
        while apos < rec.nbytes:
            ci, cpos = divmod(rec.offset + apos, CHUNK)
            take = min(rec.nbytes - apos, CHUNK - cpos)
            segments.append((offsets[ci] + cpos, take))
            apos += take
        start = base + (segments[0][0] - hosts[b].ctypes.data - base) % _ALIGN
        starts[i] = start
        jobs.append((hosts[b][start : start + rec.nbytes], segments, fresh[b]))
    try:
        digests = dict(zip(place, _fill.fill(fd, jobs)))
    except _fill.ShortRead as err:
        raise CorruptEntry(f"{where}: {err}") from err
    except OSError as err:
        raise StoreError(f"{where}: reading the data file failed: {err}") from err
    flat = []
    for i, (li, rec) in enumerate(recs):
        if i not in place:
            flat.append(_empty(rec))
            continue
        _verify(digests[i], li, rec, where)
        b, start = place[i][0], starts[i]
        flat.append(bufs[b][start : start + rec.nbytes].view(DTYPES[rec.dtype]).reshape(rec.shape))
    return _by_layer(man, flat)


def read_mapped(man: Manifest, bufs: List[Any], where: str, release: Optional[Callable[[Any], None]] = None) -> List[Dict[str, mx.array]]:
    """Copy the payload out of the chunk buffers (see :func:`chunk_buffers`)
    on this thread, verifying checksums.

    Checksums are taken of the source bytes, a piece at a time, right before
    the piece is copied, so the copy reads them from the CPU cache. An array
    inside one chunk is copied by ``mx.array`` straight from the chunk; an
    array spanning chunks is assembled into an mlx buffer that nothing has
    written before (:mod:`_blank`).
    """
    recs = [(li, rec) for li, layer in enumerate(man.layers) for rec in layer.arrays]
    srcs = [np.frombuffer(buf, dtype=np.uint8) for buf in bufs]
    spanning = [i for i, (_, rec) in enumerate(recs) if _spans(rec)]
    dests = dict(zip(spanning, _blank.blank([recs[i][1].nbytes for i in spanning])))
    flat: List[Optional[mx.array]] = [None] * len(recs)
    for i, (li, rec) in enumerate(recs):
        if i in dests:
            continue
        if not rec.nbytes:
            flat[i] = _empty(rec)
            continue
        ci, pos = divmod(rec.offset, CHUNK)
        piece = srcs[ci][pos : pos + rec.nbytes]
        _verify(xxhash.xxh3_64_intdigest(piece.data), li, rec, where)
        flat[i] = mx.array(piece).view(DTYPES[rec.dtype]).reshape(rec.shape)
        if release is not None:
            release(bufs[ci][pos : pos + rec.nbytes])
    copied = _Copied(bufs, release)
    for i in spanning:
        li, rec = recs[i]
        dest = dests.pop(i)
        _verify(_copy_pieces(srcs, rec.offset, rec.nbytes, np.asarray(dest), copied), li, rec, where)
        flat[i] = dest.view(DTYPES[rec.dtype]).reshape(rec.shape)
    copied.upto(man.payload + CHUNK)
    return _by_layer(man, flat)  # type: ignore[arg-type]


_PIECE = 1 << 20  # hash then copy 1 MiB at a time: the copy reads it from cache


def _spans(rec: ArrayRecord) -> bool:
    return rec.nbytes > 0 and rec.offset // CHUNK != (rec.offset + rec.nbytes - 1) // CHUNK


def _verify(digest: int, li: int, rec: ArrayRecord, where: str) -> None:
    if digest != rec.checksum:
        raise CorruptEntry(
            f"{where}: checksum mismatch in layer {li} array {rec.name!r}; "
            "run `promptstore verify --fix` to remove damaged entries"
        )


class _Copied:
    """Releases each chunk as soon as the copy has passed its end, so at
    most one chunk of source pages is mapped at a time."""

    def __init__(self, bufs: List[Any], release: Optional[Callable[[Any], None]]):
        self.bufs, self.release, self.done = bufs, release, 0

    def upto(self, pos: int) -> None:
        if self.release is None:
            return
        end = min(pos // CHUNK, len(self.bufs))
        while self.done < end:
            self.release(self.bufs[self.done])
            self.done += 1


def _copy_pieces(srcs: List[np.ndarray], offset: int, nbytes: int, host: np.ndarray, copied: _Copied) -> int:
    """Copy payload bytes ``[offset, offset + nbytes)`` into ``host``; return their xxh3-64."""
    hasher = xxhash.xxh3_64()
    apos = 0
    while apos < nbytes:
        ci, cpos = divmod(offset + apos, CHUNK)
        take = min(nbytes - apos, CHUNK - cpos, _PIECE)
        piece = srcs[ci][cpos : cpos + take]
        hasher.update(piece.data)
        host[apos : apos + take] = piece
        apos += take
        copied.upto(offset + apos)
    return hasher.intdigest()


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
