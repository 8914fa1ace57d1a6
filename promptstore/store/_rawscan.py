"""Finding entries in a data file whose B-tree is lost (for ``salvage``).

When LMDB cannot walk a data file (cut short, a meta page or a branch page
destroyed), most of an entry's bytes may still be there, and they describe
themselves well enough to be found without the tree:

* a manifest is a msgpack map that starts with its ``format`` key and
  carries its own checksum: every occurrence of that key is tried, and only
  manifests whose checksum holds are kept (the newest per entry);
* an LMDB value (a payload chunk, a shared block) follows its key in a leaf
  node, or fills the overflow pages the node points to; the keys are known
  from the manifest (the entry key and chunk number, a block's address), so
  each is searched for, and what follows is checked: a block against its
  content address, a chunk against the checksums of the arrays in it;
* blocks in pack files are named by the pack's footer (``format._packs``),
  and an entry's own payload of 1 MiB or more is in a blob file the
  manifest names.

Only what the cut or the damage destroyed is lost; bytes found are never
trusted: everything is checked as on any read.
"""

from __future__ import annotations

import itertools
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import msgpack

from promptstore.errors import PromptStoreError
from promptstore.format import _blocks, _entry, _packs, _payload
from promptstore.store import _keys
from promptstore.store._schema import chunk_key

PAGE = 4096
_HEADER = 16  # LMDB's page header: pgno u64, pad u16, flags u16, overflow page count u32
_P_OVERFLOW = 0x04
_F_BIGDATA = 0x01  # a leaf node whose value is in overflow pages (its first page number follows the key)
_KEY = b"\xa6format"  # msgpack: the 6-byte string "format", a manifest's first key
_MAX_MANIFEST = 16 << 20


@dataclass
class Found:
    """An intact manifest found by the scan, and where its parts are."""

    raw: bytes
    man: _entry.Manifest
    chunks: List[bytes] = field(default_factory=list)
    blocks: Dict[bytes, bytes] = field(default_factory=dict)


class DataFile:
    """The raw bytes of one (damaged) data file, indexed for the search."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            self.data: bytes = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else b""  # type: ignore[assignment]

    def values(self, key: bytes, size: int) -> Iterator[bytes]:
        """Candidate values of ``size`` bytes stored under ``key``: wherever
        the key's bytes sit in a leaf node that says so (the node's header,
        just before the key, gives the key's length and the value's size), the
        value that follows it, or the overflow pages it points to. Stale copies
        (pages freed since) come too: the caller checks each."""
        data, n = self.data, len(self.data)
        at = data.find(key)
        while at >= 0:
            if at >= 8:
                lo, hi, flags, ksize = struct.unpack_from("<HHHH", data, at - 8)
                if ksize == len(key) and lo | (hi << 16) == size:
                    if flags & _F_BIGDATA:
                        if at + ksize + 8 <= n:
                            pgno = struct.unpack_from("<Q", data, at + ksize)[0]
                            start = pgno * PAGE + _HEADER
                            if start + size <= n and struct.unpack_from("<H", data, pgno * PAGE + 10)[0] & _P_OVERFLOW:
                                yield bytes(data[start : start + size])
                    elif at + ksize + size <= n:
                        yield bytes(data[at + ksize : at + ksize + size])
            at = data.find(key, at + 1)

    def manifests(self, where: str) -> Dict[bytes, Found]:
        """The intact manifests in the file, the newest per entry key (by its
        creation time), keyed by entry key."""
        out: Dict[bytes, Found] = {}
        at = self.data.find(_KEY)
        while at >= 0:
            for start in (at - 1, at - 3, at - 5):  # fixmap, map16, map32 headers
                raw = _one_object(self.data, start)
                if raw is None:
                    continue
                try:
                    man = _entry.unpack_manifest(raw, where)
                except PromptStoreError:
                    continue
                if not man.intact:
                    continue
                ekey = _keys.entry_key(_keys.model_id(man.model), man.tokens)
                if _keys.entry_id(ekey) != man.entry_id:
                    continue
                old = out.get(ekey)
                if old is None or man.created > old.man.created:
                    out[ekey] = Found(raw, man)
                break
            at = self.data.find(_KEY, at + 1)
        return out

    def close(self) -> None:
        if isinstance(self.data, mmap.mmap):
            self.data.close()


def _one_object(data, start: int) -> Optional[bytes]:
    """The bytes of the one msgpack object at ``start``, or None."""
    if start < 0:
        return None
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=_MAX_MANIFEST, strict_map_key=False)
    unpacker.feed(data[start : start + _MAX_MANIFEST])
    try:
        obj = unpacker.unpack()
    except Exception:  # msgpack raises many unrelated types on garbage
        return None
    if not isinstance(obj, dict) or "format" not in obj:
        return None
    return bytes(data[start : start + unpacker.tell()])


def pack_blocks(root: Path, where: str) -> Dict[bytes, Tuple[int, int, int]]:
    """Every block the store's pack files name in their footers: address ->
    (pack, offset, size). Packs without an intact footer are left out."""
    out: Dict[bytes, Tuple[int, int, int]] = {}
    for pack, key, offset, size in _packs.Packs(root).footers(where):
        out.setdefault(key, (pack, offset, size))
    return out


def complete(found: Found, data: DataFile, in_packs: Dict[bytes, Tuple[int, int, int]], packs: _packs.Packs, where: str) -> Optional[str]:
    """Find the parts of ``found``'s entry: its payload chunk (LMDB entries
    of one chunk; blob files are read by the caller) and every shared block.
    Returns why it cannot be recovered, or None."""
    man = found.man
    if man.blob is None and man.chunks:
        ekey = _keys.entry_key(_keys.model_id(man.model), man.tokens)
        own = man.payload_only()
        options = [list(data.values(chunk_key(ekey, i), min(_entry.CHUNK, man.payload - i * _entry.CHUNK))) for i in range(man.chunks)]
        if not all(options):
            return "a chunk of its payload is not in the file"
        for pick in itertools.islice(itertools.product(*options), 16):
            try:
                _payload.read_arrays(own, lambda i: pick[i], where)
            except PromptStoreError:
                continue
            found.chunks = list(pick)
            break
        else:
            return "its payload's chunks in the file do not check"
    for li, rec in man.parted():
        layer = man.layers[li]
        size = _entry.DTYPES[rec.dtype].size
        for key, shape in man.parts(rec):
            if key in found.blocks:
                continue
            nbytes = math.prod(shape) * size
            block = _read_packed(packs, in_packs.get(key), nbytes, where)
            if block is None:
                block = next((v for v in data.values(key, nbytes) if _blocks.address(layer.kind, layer.version, rec.dtype, shape, v) == key), None)
            if block is None:
                return f"block {key.hex()} is neither in a pack file nor in the data file"
            found.blocks[key] = block
    return None


def _read_packed(packs: _packs.Packs, place: Optional[Tuple[int, int, int]], nbytes: int, where: str) -> Optional[bytes]:
    if place is None or place[2] != nbytes:
        return None
    try:
        data = packs.read(place[0], place[1], nbytes, where)
    except PromptStoreError:
        return None
    return data if len(data) == nbytes else None
