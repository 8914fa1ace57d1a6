"""What the remote tier stores: a checked manifest and content-addressed blocks.

A manifest value is ``MAGIC`` (4 bytes), the xxh3-64 of the body (8 bytes,
big-endian) and the body: msgpack of

    {"f": 1, "model": str, "name": str, "tokens": bytes (<u4), "trimmable": bool,
     "created": float, "meta": {...}, "bounds": [int, ...],
     "layers": [{"kind": str, "version": int, "meta": {...},
                 "arrays": [{"name": str, "dtype": str, "shape": [int, ...],
                             "cut": bool, "parts": [[address (16 bytes), nbytes], ...]}]}]}

An array whose second-to-last axis spans the entry's tokens is ``cut`` along
it at ``bounds`` (every ``BLOCK_TOKENS`` tokens from 0), one block per token
range, so the entries of a growing conversation share their whole blocks;
any other array is cut into byte pieces of at most ``PIECE`` bytes (a Redis
value is at most 512 MB). A block's key is its content address
(``format._blocks.address``), which is also its checksum.

Reading is fail-closed and never unpickles or evaluates anything: a wrong
magic, checksum, type, size or a field this reader does not expect raises
RemoteCorrupt; a newer format raises UnsupportedVersion.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import mlx.core as mx
import msgpack
import numpy as np
import xxhash

from promptstore.codecs import Encoded, decode_layer
from promptstore.errors import InvalidInput, PromptStoreError, UnknownStorageKind, UnsupportedVersion
from promptstore.format import _blank, _blocks, _fill
from promptstore.format._entry import DTYPE_NAMES, DTYPES, MAX_ARRAYS, MAX_LAYERS, MAX_TOKENS, check_meta, is_time, prefix_cut
from promptstore.format._payload import host_bytes
from promptstore.errors import RemoteCorrupt, RemoteMissing

_SMALL = 1 << 20  # entries of fewer bytes are assembled in numpy, then copied into mlx

MAGIC = b"PSR\x01"
FORMAT = 1
PIECE = 64 << 20  # the most bytes of one block of an array that spans no tokens
MAX_MANIFEST = 64 << 20
_SUM = struct.Struct(">Q")
_PIECE_DTYPE = "bytes"  # the dtype named in a piece's address


@dataclass(frozen=True)
class RArray:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    cut: bool  # cut along the token axis at the manifest's bounds; else byte pieces
    parts: Tuple[Tuple[bytes, int], ...]  # (address, nbytes)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True)
class RLayer:
    kind: str
    version: int
    meta: Dict[str, Any]
    arrays: Tuple[RArray, ...]


@dataclass(frozen=True)
class RManifest:
    """A decoded, checked remote manifest."""

    model: str
    name: str
    tokens: np.ndarray  # uint32
    trimmable: bool
    created: float
    meta: Dict[str, Any]
    bounds: Tuple[int, ...]
    layers: Tuple[RLayer, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self.layers for a in layer.arrays)

    @property
    def kinds(self) -> Tuple[str, ...]:
        return tuple(layer.kind for layer in self.layers)

    def prefix(self, n: int) -> Optional["RManifest"]:
        """This entry cut to the shortest run of its blocks that covers ``n``
        tokens: what a prefix hit of ``n`` tokens fetches (then trims to
        ``n``), as ``Manifest.prefix`` cuts a local entry. None when there is
        nothing to cut, or a layer cannot be cut (an array not cut along the
        tokens, or a kind without ``prefix_meta``): the entry is fetched whole."""
        cut = prefix_cut(self.bounds, self.layers, n, lambda layer: all(a.cut for a in layer.arrays),
                         lambda a, end, m: replace(a, shape=a.shape[:-2] + (end,) + a.shape[-1:], parts=a.parts[:m]))
        if cut is None:
            return None
        m, layers = cut
        return replace(self, tokens=self.tokens[: self.bounds[m - 1]], bounds=self.bounds[:m], layers=layers)

    def parts(self) -> List[Tuple[bytes, int]]:
        """Every distinct block ``(address, nbytes)``, in manifest order."""
        seen: Dict[bytes, int] = {}
        for layer in self.layers:
            for a in layer.arrays:
                for addr, n in a.parts:
                    seen.setdefault(addr, n)
        return list(seen.items())


def _itemsize(dtype: str) -> int:
    return DTYPES[dtype].size


# -- writing ---------------------------------------------------------------------


def encode_entry(
    model: str, name: str, tokens: np.ndarray, layers: Sequence[Encoded], trimmable: bool, meta: Dict[str, Any], created: float
) -> Tuple[bytes, Dict[bytes, bytes]]:
    """The manifest value and the blocks ``{address: bytes}`` of one entry."""
    n = len(tokens)
    bounds = _blocks.plan_bounds((), 0, n)
    flat = [mx.contiguous(a) for enc in layers for a in enc.arrays.values()]
    mx.eval(flat)
    blocks: Dict[bytes, bytes] = {}
    out_layers, i = [], 0
    for enc in layers:
        arrays = []
        for aname in enc.arrays:
            a = flat[i]
            i += 1
            dtype = DTYPE_NAMES.get(a.dtype)
            if dtype is None:
                raise PromptStoreError(f"kind {enc.kind!r}: array {aname!r} has unsupported dtype {a.dtype}")
            shape = tuple(int(d) for d in a.shape)
            buf = host_bytes(a) if a.size else memoryview(b"")
            cut = len(shape) >= 2 and shape[-2] == n and buf.nbytes > 0
            parts = []
            if cut:
                rows = np.frombuffer(buf, dtype=np.uint8).reshape(math.prod(shape[:-2]), n, -1)
                start = 0
                for end in bounds:
                    data = np.ascontiguousarray(rows[:, start:end, :]).tobytes()
                    addr = _blocks.address(enc.kind, enc.version, dtype, _blocks.block_shape(shape, start, end), data)
                    blocks.setdefault(addr, data)
                    parts.append([addr, len(data)])
                    start = end
            else:
                for off in range(0, buf.nbytes, PIECE):
                    data = bytes(buf[off : off + PIECE])
                    addr = _blocks.address(enc.kind, enc.version, _PIECE_DTYPE, (len(data),), data)
                    blocks.setdefault(addr, data)
                    parts.append([addr, len(data)])
            arrays.append({"name": aname, "dtype": dtype, "shape": list(shape), "cut": cut, "parts": parts})
        out_layers.append({"kind": enc.kind, "version": enc.version, "meta": enc.meta, "arrays": arrays})
    doc = {
        "f": FORMAT,
        "model": model,
        "name": name,
        "tokens": np.ascontiguousarray(tokens, dtype="<u4").tobytes(),
        "trimmable": bool(trimmable),
        "created": float(created),
        "meta": meta,
        "bounds": list(bounds),
        "layers": out_layers,
    }
    try:
        body = msgpack.packb(doc, use_bin_type=True)
    except (TypeError, ValueError) as err:
        raise PromptStoreError(f"entry of {n} tokens cannot be published: {err}") from err
    return MAGIC + _SUM.pack(xxhash.xxh3_64_intdigest(body)) + body, blocks


# -- reading ---------------------------------------------------------------------


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def decode_manifest(raw: Optional[bytes], where: str) -> RManifest:
    """Check and decode a manifest value.

    Raises:
        RemoteCorrupt: wrong magic, checksum, size, type or field.
        UnsupportedVersion: a newer remote format.
    """
    if raw is None:
        raise RemoteMissing(f"{where}: manifest gone")
    if not isinstance(raw, (bytes, bytearray)) or len(raw) < len(MAGIC) + _SUM.size:
        raise RemoteCorrupt(f"{where}: manifest truncated ({len(raw) if isinstance(raw, (bytes, bytearray)) else type(raw).__name__})")
    if len(raw) > MAX_MANIFEST:
        raise RemoteCorrupt(f"{where}: manifest of {len(raw)} bytes is larger than {MAX_MANIFEST}")
    if raw[:3] != MAGIC[:3]:
        raise RemoteCorrupt(f"{where}: not a promptstore manifest (magic {bytes(raw[:4])!r})")
    if raw[3] > MAGIC[3]:
        raise UnsupportedVersion(f"{where}: remote manifest format {raw[3]}, this promptstore reads up to {MAGIC[3]}: upgrade")
    body = bytes(raw[len(MAGIC) + _SUM.size:])
    if xxhash.xxh3_64_intdigest(body) != _SUM.unpack(raw[len(MAGIC) : len(MAGIC) + _SUM.size])[0]:
        raise RemoteCorrupt(f"{where}: manifest checksum mismatch (damaged or truncated)")
    try:
        doc = msgpack.unpackb(body, raw=False, ext_hook=_refuse_ext, strict_map_key=True, max_bin_len=4 * MAX_TOKENS)
        return _manifest(doc, where)
    except (RemoteCorrupt, UnsupportedVersion):
        raise
    except Exception as err:  # msgpack's own errors, or a field of the wrong shape
        raise RemoteCorrupt(f"{where}: manifest unreadable: {type(err).__name__}: {err}") from err


def _field(doc: Any, key: str, types: Any, where: str) -> Any:
    if not isinstance(doc, dict) or key not in doc:
        raise RemoteCorrupt(f"{where}: manifest field {key!r} missing")
    v = doc[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,))):
        raise RemoteCorrupt(f"{where}: manifest field {key!r} has type {type(v).__name__}")
    return v


def _only(doc: dict, keys: Sequence[str], where: str) -> None:
    extra = set(doc) - set(keys)
    if extra:
        raise RemoteCorrupt(f"{where}: unexpected manifest field(s) {sorted(map(str, extra))}")


def _manifest(doc: Any, where: str) -> RManifest:
    if not isinstance(doc, dict):
        raise RemoteCorrupt(f"{where}: manifest is not a map")
    fmt = _field(doc, "f", int, where)
    if fmt > FORMAT:
        raise UnsupportedVersion(f"{where}: remote manifest format {fmt}, this promptstore reads up to {FORMAT}: upgrade")
    if fmt != FORMAT:
        raise RemoteCorrupt(f"{where}: manifest format {fmt}")
    _only(doc, ("f", "model", "name", "tokens", "trimmable", "created", "meta", "bounds", "layers"), where)
    raw_tokens = _field(doc, "tokens", bytes, where)
    if not raw_tokens or len(raw_tokens) % 4 or len(raw_tokens) > 4 * MAX_TOKENS:
        raise RemoteCorrupt(f"{where}: token bytes of length {len(raw_tokens)}")
    tokens = np.frombuffer(raw_tokens, dtype="<u4").astype(np.uint32)
    n = len(tokens)
    bounds = tuple(_field(doc, "bounds", list, where))
    if not bounds or any(not isinstance(b, int) or isinstance(b, bool) for b in bounds) or bounds[-1] != n \
            or any(b <= a for a, b in zip((0,) + bounds, bounds)):
        raise RemoteCorrupt(f"{where}: block bounds {bounds[:8]!r} do not cut {n} tokens")
    layers_doc = _field(doc, "layers", list, where)
    if not layers_doc or len(layers_doc) > MAX_LAYERS:
        raise RemoteCorrupt(f"{where}: {len(layers_doc)} layers")
    layers, total = [], 0
    for li, ldoc in enumerate(layers_doc):
        lw = f"{where} layer {li}"
        _only(_dict(ldoc, lw), ("kind", "version", "meta", "arrays"), lw)
        arrays = []
        adocs = _field(ldoc, "arrays", list, lw)
        total += len(adocs)
        if total > MAX_ARRAYS:
            raise RemoteCorrupt(f"{where}: more than {MAX_ARRAYS} arrays")
        for adoc in adocs:
            arrays.append(_array(adoc, bounds, n, lw))
        version = _field(ldoc, "version", int, lw)
        layers.append(RLayer(_field(ldoc, "kind", str, lw), version, _field(ldoc, "meta", dict, lw), tuple(arrays)))
    created = float(_field(doc, "created", (float, int), where))
    if not is_time(created):
        raise RemoteCorrupt(f"{where}: field 'created' is {created!r}, not a time")
    meta = _field(doc, "meta", dict, where)
    try:
        check_meta(meta)  # what a put accepts, so the local copy can be written and listed
    except InvalidInput as err:
        raise RemoteCorrupt(f"{where}: {err}") from err
    return RManifest(
        model=_field(doc, "model", str, where),
        name=_field(doc, "name", str, where),
        tokens=tokens,
        trimmable=_field(doc, "trimmable", bool, where),
        created=created,
        meta=meta,
        bounds=bounds,
        layers=tuple(layers),
    )


def _dict(doc: Any, where: str) -> dict:
    if not isinstance(doc, dict):
        raise RemoteCorrupt(f"{where}: not a map")
    return doc


def _array(adoc: Any, bounds: Tuple[int, ...], n: int, where: str) -> RArray:
    _only(_dict(adoc, where), ("name", "dtype", "shape", "cut", "parts"), where)
    name = _field(adoc, "name", str, where)
    aw = f"{where} array {name!r}"
    dtype = _field(adoc, "dtype", str, aw)
    if dtype not in DTYPES:
        raise RemoteCorrupt(f"{aw}: unknown dtype {dtype!r}")
    shape = tuple(_field(adoc, "shape", list, aw))
    if len(shape) > 8 or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise RemoteCorrupt(f"{aw}: bad shape {shape!r}")
    cut = _field(adoc, "cut", bool, aw)
    parts = []
    for p in _field(adoc, "parts", list, aw):
        if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], bytes) and len(p[0]) == _blocks.ADDRESS
                and isinstance(p[1], int) and not isinstance(p[1], bool) and 0 < p[1] <= PIECE * 8):
            raise RemoteCorrupt(f"{aw}: bad block reference")
        parts.append((p[0], p[1]))
    nbytes = math.prod(shape) * _itemsize(dtype)
    if cut:
        if len(shape) < 2 or shape[-2] != n or len(parts) != len(bounds):
            raise RemoteCorrupt(f"{aw}: cut array of shape {shape} does not match {n} tokens in {len(bounds)} blocks")
        row = nbytes // n
        starts = (0,) + bounds[:-1]
        if any(size != row * (e - s) for (_, size), s, e in zip(parts, starts, bounds)):
            raise RemoteCorrupt(f"{aw}: block sizes do not match the bounds")
    elif sum(size for _, size in parts) != nbytes or any(size > PIECE for _, size in parts):
        raise RemoteCorrupt(f"{aw}: pieces hold other than {nbytes} bytes")
    return RArray(name, dtype, shape, cut, tuple(parts))


def check_block(layer: RLayer, array: RArray, index: int, bounds: Tuple[int, ...], data: Any, where: str,
                into: Optional[np.ndarray] = None) -> None:
    """Refuse a block whose bytes do not hash to the address the manifest names.

    ``into``: for a ``cut`` array, the block's ``[rows, tokens, width]``
    bytes in the destination, each row copied there as it is hashed (see
    ``_blocks.address``); the copy is left unfinished when the check fails.

    Raises:
        RemoteCorrupt
    """
    addr, size = array.parts[index]
    if len(data) != size:
        raise RemoteCorrupt(f"{where}: block {addr.hex()} has {len(data)} bytes, expected {size} (truncated?)")
    if array.cut and into is not None:
        data = np.frombuffer(data, dtype=np.uint8).reshape(into.shape)
    check_placed(layer, array, index, bounds, data, where, into)


def check_placed(layer: RLayer, array: RArray, index: int, bounds: Tuple[int, ...], placed: Any, where: str,
                 into: Optional[np.ndarray] = None) -> None:
    """Refuse a block whose bytes (``placed``: for a ``cut`` array its bytes
    or a ``[rows, tokens, width]`` view of them, as read straight into the
    destination; ``into`` as :func:`check_block`'s) do not hash to the
    address the manifest names.

    Raises:
        RemoteCorrupt
    """
    addr, size = array.parts[index]
    if array.cut:
        start = bounds[index - 1] if index else 0
        shape = _blocks.block_shape(array.shape, start, bounds[index])
        got = _blocks.address(layer.kind, layer.version, array.dtype, shape, placed, into)
    else:
        got = _blocks.address(layer.kind, layer.version, _PIECE_DTYPE, (size,), placed)
    if got != addr:
        raise RemoteCorrupt(f"{where}: block {addr.hex()} does not match its address (damaged)")


def _gone(where: str, addr: bytes) -> RemoteMissing:
    return RemoteMissing(f"{where}: block {addr.hex()} is gone from the remote (evicted?)")


@dataclass(frozen=True)
class Direct:
    """Blocks read straight into the destination (``Client.get_into``) rather
    than handed over as bytes: ``present(addresses)`` says which are there,
    ``read(addresses, sinks)`` reads each into its writable views (in order)
    and says which were there."""

    addresses: FrozenSet[bytes]
    present: Callable[[Sequence[bytes]], List[bool]]
    read: Callable[[Sequence[bytes], Sequence[Sequence[memoryview]]], List[bool]]


def assemble(man: RManifest, block: Callable[[bytes], Any], where: str, direct: Optional[Direct] = None) -> List[Any]:
    """The entry's cache: every block from ``block(address)`` (bytes, or
    None when gone), or for those in ``direct`` read into place, checked
    against its address, copied into fresh mlx arrays and decoded by the
    layers' codecs.

    Raises:
        RemoteMissing: a block is gone.
        RemoteCorrupt: a block fails its check, or a codec refuses the layer.
        RemoteUnavailable: reading the ``direct`` blocks failed.
        UnknownStorageKind, UnsupportedVersion: written by a newer promptstore.
    """
    n = len(man.tokens)
    starts = (0,) + man.bounds[:-1]
    placed = direct.addresses if direct is not None else frozenset()
    # Every block is there, with the size the manifest gives it, before
    # anything is allocated: a crafted manifest may claim any size. (A block
    # read into place is checked for its size as it is read.)
    for li, layer in enumerate(man.layers):
        for a in layer.arrays:
            got = 0
            for addr, size in a.parts:
                if addr in placed:
                    got += size
                    continue
                data = block(addr)
                if data is None:
                    raise _gone(f"{where} layer {li}", addr)
                got += len(data)
            if got != a.nbytes:
                raise RemoteCorrupt(f"{where} layer {li}: array {a.name!r} has {got} bytes in its blocks, {a.nbytes} claimed")
    if direct is not None and placed:
        ask = sorted(placed)
        for addr, there in zip(ask, direct.present(ask)):
            if not there:
                raise _gone(where, addr)
    sizes = [a.nbytes for layer in man.layers for a in layer.arrays]
    flat = [(li, layer, a) for li, layer in enumerate(man.layers) for a in layer.arrays]

    def fill(k: int, host: np.ndarray) -> None:
        """Array ``k``'s bytes from its blocks (each checked) into ``host``."""
        li, layer, a = flat[k]
        if a.cut:
            lead = math.prod(a.shape[:-2])
            grid = host.reshape(lead, n, -1)
        pos = 0
        reads: List[Tuple[int, bytes, np.ndarray]] = []  # blocks read into place: (index, address, destination)
        for idx, (addr, size) in enumerate(a.parts):
            if a.cut:
                dest = grid[:, starts[idx] : man.bounds[idx], :]
            else:
                dest = host[pos : pos + size]
                pos += size
            if addr in placed:
                reads.append((idx, addr, dest))
                continue
            data = block(addr)
            if a.cut:  # checked and copied row by row
                check_block(layer, a, idx, man.bounds, data, f"{where} layer {li}", dest)
            else:
                check_block(layer, a, idx, man.bounds, data, f"{where} layer {li}")
                dest[...] = np.frombuffer(data, dtype=np.uint8)
        if reads:
            assert direct is not None
            sinks = [[row.reshape(-1).data for row in dest] if a.cut else [dest.data] for _, _, dest in reads]
            found = direct.read([addr for _, addr, _ in reads], sinks)
            for (idx, addr, dest), there in zip(reads, found):
                if not there:
                    raise _gone(f"{where} layer {li}", addr)
                check_placed(layer, a, idx, man.bounds, dest, f"{where} layer {li}")

    # Large entries go straight into fresh mlx buffers (one copy): written
    # inside mlx's loader where restores are staged (the CUDA backend), else
    # after it; small ones through numpy (mlx's loader costs more than
    # copying them again).
    large = sum(sizes) >= _SMALL and all(sizes)

    def fill_fresh(k: int, host: np.ndarray) -> None:
        if not _fill.resident(host):
            _fill.populate(host)  # fault its pages in at once, not one at a time inside the copies
        fill(k, host)

    dests: List[Any]
    if large:
        dests = _blank.written(sizes, fill_fresh)
    else:
        dests = [np.empty(size, dtype=np.uint8) for size in sizes]
        for k, dest in enumerate(dests):
            fill(k, dest)
    cache = []
    made = iter(dests)
    for li, layer in enumerate(man.layers):
        lw = f"{where} layer {li}"
        arrays: Dict[str, mx.array] = {}
        for a in layer.arrays:
            dest = next(made)
            whole = dest if large else mx.array(dest)
            arrays[a.name] = whole.view(DTYPES[a.dtype]).reshape(a.shape)
        mx.eval(list(arrays.values()))
        try:
            cache.append(decode_layer(layer.kind, layer.version, arrays, layer.meta))
        except (UnsupportedVersion, UnknownStorageKind):
            raise
        except PromptStoreError as err:
            raise RemoteCorrupt(f"{lw} ({layer.kind}): {err}") from err
        except Exception as err:  # a codec tripping over bad meta must not escape untyped
            raise RemoteCorrupt(f"{lw} ({layer.kind}): {type(err).__name__}: {err}") from err
    return cache
