"""The payload: laying out an entry's arrays as bytes, and reading them back.

Writing: :func:`prepare` evaluates the arrays and lays them out back to back
(``host_bytes`` gives each one's bytes without a copy), :func:`add_checksums`
fills in their xxh3-64 checksums and :func:`iter_chunks` cuts the payload
into ``CHUNK``-byte LMDB values.

Reading copies each array once, into fresh mlx buffers, and verifies every
checksum: :func:`read_arrays` / :func:`read_mapped` from buffers (LMDB values
or a mapped blob file), :func:`read_file` with ``pread`` on the fill threads.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
import xxhash

from promptstore.codecs import Encoded
from promptstore.errors import CorruptEntry, StoreError
from promptstore.format import _blank, _fill
from promptstore.format._entry import CHUNK, DTYPE_NAMES, DTYPES, ArrayRecord, Manifest

# numpy has no bfloat16: such arrays travel as bytes through a same-width view.
_BYTE_VIEW = {mx.bfloat16: mx.uint16}


def host_bytes(a: mx.array) -> memoryview:
    """A read-only byte view of an evaluated, contiguous array (no copy)."""
    view = _BYTE_VIEW.get(a.dtype)
    if view is not None:
        a = a.view(view)
    if a.size == 0:  # memoryview cannot cast a view with a zero in its shape
        return memoryview(b"")
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
            dtype = DTYPE_NAMES.get(a.dtype)
            if dtype is None:
                raise CorruptEntry(f"kind {enc.kind!r}: array {name!r} has unsupported dtype {a.dtype}")
            if blocks and spans_tokens(a.shape, a.nbytes, n_tokens):
                arrays.append([name, dtype, list(a.shape), offset, a.nbytes, 0, a])
                continue
            buf = host_bytes(a)
            arrays.append([name, dtype, list(a.shape), offset, buf.nbytes, None])
            views.append(buf)
            offset += buf.nbytes
        records.append({"kind": enc.kind, "version": enc.version, "meta": enc.meta, "arrays": arrays})
    return records, views, offset


def spans_tokens(shape: Sequence[int], nbytes: int, n_tokens: int) -> bool:
    """Whether an array of ``shape`` spans an entry's ``n_tokens`` tokens on
    its second-to-last axis: what a layer that allows it keeps in shared blocks."""
    return len(shape) >= 2 and shape[-2] == n_tokens and nbytes > 0


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


def empty(rec: ArrayRecord) -> mx.array:
    """An mlx array of ``rec``'s dtype and shape with no elements."""
    return mx.array(np.zeros(0, dtype=np.uint8)).view(DTYPES[rec.dtype]).reshape(rec.shape)


_SLAB = 64 << 20  # restored arrays share buffers of up to this size
_ALIGN = 64


def rooms(sizes: Sequence[int]) -> Tuple[List[Tuple[int, int]], List[int]]:
    """Where restored arrays of ``sizes`` bytes (each > 0) go in shared
    buffers (see :func:`read_file`): each one's ``(buffer, start of its
    room)``, and the buffers' sizes. A room is the array's bytes plus
    ``_ALIGN`` of slack (:func:`aligned`); a buffer holds rooms up to
    ``_SLAB`` bytes, and a larger room gets a buffer of its own."""
    place: List[Tuple[int, int]] = []
    out: List[int] = []
    slab: Optional[int] = None  # the buffer rooms are being packed into
    for n in sizes:
        room = n + _ALIGN
        if room > _SLAB:
            place.append((len(out), 0))
            out.append(room)
            continue
        start = 0 if slab is None else -(-out[slab] // _ALIGN) * _ALIGN
        if slab is None or start + room > _SLAB:
            slab, start = len(out), 0
            out.append(0)
        place.append((slab, start))
        out[slab] = start + room
    return place, out


def aligned(host: np.ndarray, base: int, like: int) -> int:
    """Where in ``host`` an array whose room starts at ``base`` begins: at
    the address that equals ``like`` (the file offset it is read from)
    modulo ``_ALIGN``, so the kernel's copy moves whole cache lines."""
    return base + (like - host.ctypes.data - base) % _ALIGN


def read_file(man: Manifest, fd: int, offsets: Sequence[int], where: str) -> List[Dict[str, mx.array]]:
    """Read the payload with ``pread`` from the data file, chunk ``i`` being
    at file offset ``offsets[i]``, into fresh mlx arrays; verify checksums.

    The reads and checksums run on the fill threads with the GIL released
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
    Where restores are staged (the CUDA backend, :func:`_blank.staged`), each
    buffer is filled the same way inside mlx's loader instead, into the host
    buffer it copies to the device; the alignment is then the loader's.
    Raises CorruptEntry on a checksum mismatch or a file too short,
    StoreError when reading fails.
    """
    recs = [(li, rec) for li, layer in enumerate(man.layers) for rec in layer.arrays]
    nonempty = [i for i, (_, rec) in enumerate(recs) if rec.nbytes]
    rooms_, sizes = rooms([recs[i][1].nbytes for i in nonempty])
    place = dict(zip(nonempty, rooms_))  # array -> (buffer, start of its room)
    segments: Dict[int, List[Tuple[int, int]]] = {}  # array -> its (file offset, length) pieces
    for i in place:
        rec, pieces, apos = recs[i][1], [], 0
        while apos < rec.nbytes:
            ci, cpos = divmod(rec.offset + apos, CHUNK)
            take = min(rec.nbytes - apos, CHUNK - cpos)
            pieces.append((offsets[ci] + cpos, take))
            apos += take
        segments[i] = pieces
    starts: Dict[int, int] = {}
    digests: Dict[int, int] = {}
    try:
        if _blank.staged():  # written inside mlx's loader, a buffer at a time (see _blank)
            members: Dict[int, List[int]] = {}
            for i, (b, base) in place.items():
                members.setdefault(b, []).append(i)
                starts[i] = base

            def read(indices: Sequence[int], hosts: List[np.ndarray]) -> None:
                """Buffers ``indices`` into ``hosts``: their arrays' reads in one fill."""
                jobs, ks = [], []
                for b, host in zip(indices, hosts):
                    fresh = not _fill.resident(host)
                    for i in members.get(b, []):
                        jobs.append((host[starts[i] : starts[i] + recs[i][1].nbytes], segments[i], fresh))
                        ks.append(i)
                digests.update(zip(ks, _fill.fill(fd, jobs)))

            if _blank.reads_ahead():
                bufs = _blank.ahead(sizes, read)
            else:
                bufs = _blank.filled(sizes, lambda b, view: read([b], [np.frombuffer(view, dtype=np.uint8)]))
        else:
            bufs = _blank.blank(sizes)
            hosts = [np.asarray(b) for b in bufs]
            fresh = [not _fill.resident(h) for h in hosts]
            jobs = []
            for i, (b, base) in place.items():
                nbytes = recs[i][1].nbytes
                start = aligned(hosts[b], base, segments[i][0][0])
                starts[i] = start
                jobs.append((hosts[b][start : start + nbytes], segments[i], fresh[b]))
            digests = dict(zip(place, _fill.fill(fd, jobs)))
    except _fill.ShortRead as err:
        raise CorruptEntry(f"{where}: {err}") from err
    except OSError as err:
        raise StoreError(f"{where}: reading the data file failed: {err}") from err
    flat = []
    for i, (li, rec) in enumerate(recs):
        if i not in place:
            flat.append(empty(rec))
            continue
        verify(digests[i], li, rec, where)
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
    spans = set(spanning)
    flat: List[Optional[mx.array]] = [None] * len(recs)
    for i, (li, rec) in enumerate(recs):
        if i in spans:
            continue
        if not rec.nbytes:
            flat[i] = empty(rec)
            continue
        ci, pos = divmod(rec.offset, CHUNK)
        piece = srcs[ci][pos : pos + rec.nbytes]
        verify(xxhash.xxh3_64_intdigest(piece.data), li, rec, where)
        flat[i] = mx.array(piece).view(DTYPES[rec.dtype]).reshape(rec.shape)
        if release is not None:
            release(bufs[ci][pos : pos + rec.nbytes])
    copied = _Copied(bufs, release)
    digests: Dict[int, int] = {}

    def fill(k: int, host: np.ndarray) -> None:
        rec = recs[spanning[k]][1]
        digests[spanning[k]] = _copy_pieces(srcs, rec.offset, rec.nbytes, host, copied)

    made = _blank.written([recs[i][1].nbytes for i in spanning], fill)
    for i, dest in zip(spanning, made):
        li, rec = recs[i]
        verify(digests[i], li, rec, where)
        flat[i] = dest.view(DTYPES[rec.dtype]).reshape(rec.shape)
    copied.upto(man.payload + CHUNK)
    return _by_layer(man, flat)  # type: ignore[arg-type]


_PIECE = 1 << 20  # hash then copy 1 MiB at a time: the copy reads it from cache


def _spans(rec: ArrayRecord) -> bool:
    return rec.nbytes > 0 and rec.offset // CHUNK != (rec.offset + rec.nbytes - 1) // CHUNK


def verify(digest: int, li: int, rec: ArrayRecord, where: str) -> None:
    """Refuse array ``rec`` of layer ``li`` when ``digest`` (xxh3-64 of its bytes) is not its checksum.

    Raises:
        CorruptEntry: the array's bytes are damaged.
    """
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
