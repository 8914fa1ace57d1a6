"""The store's schema: every LMDB table, key layout and struct, defined once.

Tables (named LMDB databases of one environment):

==========  =========================================  ==============================================
table       key                                        value
==========  =========================================  ==============================================
entries     entry key                                  manifest (msgpack, see ``format._entry``)
chunks      entry key + u32 chunk number               payload bytes of an entry kept in LMDB
nodes       node key                                   u32 number of entries through the node
ends        node key (dupsort)                         end value: u32 length, u64 hash, entry key
trims       node key + block tokens                    u32 child segments and entry ends (trimmable entries)
segs        node key + block tokens (dupsort)          entry key (store format 1 only: dropped by the upgrade)
used        entry key                                  f64 last use (seconds since the epoch)
lru         f64 last use + entry key                   empty: the entries in eviction order
ids         entry id (16 hex digits, ASCII)            entry key
info        ``format``, ``budget``, ``usage``,         u64
            ``dead``, ``stat:<counter>``;
            ``store-id``                               16 bytes: the store's identity (``Env.check_identity``)
pins        entry key                                  empty: present when pinned
sizes       entry key                                  u64 bytes the entry accounts for
blocks      block address (16 bytes, see format._blocks)  a shared block's bytes
refs        block address                              u64 references from manifests, u64 block bytes
places      block address                              u64 pack number, u64 offset: a block in a pack file
packs       ``p`` + u64 pack number                    u64 bytes of its blocks still referenced, u64 file bytes
            ``m`` + u64 pack + u64 offset              the address of the live block there (``_packing``)
==========  =========================================  ==============================================

Key layouts (all integers big-endian, so keys sort by number):

* entry key (36 bytes): model id (16) + digest of the token bytes (16) + u32 token count;
* node key (28 bytes): model id (16) + u64 prefix hash + u32 block number;
* chunk key (40 bytes): entry key + u32 chunk number;
* block address (16 bytes): xxh3-128 of a shared block's kind, version, dtype, shape and bytes.

A block is stored once and counted in ``refs`` once per reference from a
manifest (an array of an entry names one block per token range); the count
is changed in the transaction that writes or removes the manifest, and a
block whose count reaches zero is removed with it. A block is a ``blocks``
value, or, when ``places`` names one, bytes of a pack file
(``format._packs``); a pack is unlinked once the commit that dropped its
last referenced block is done. ``sizes`` counts an
entry's own bytes (payload and manifest); ``info[usage]`` adds every stored
block once.

The prefix index (``nodes``, ``ends``, ``trims``) is explained in ``_index``.
"""

from __future__ import annotations

import struct
from typing import Any, Dict, Optional, Tuple

U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
F64 = struct.Struct(">d")

STORE_FORMAT = 3  # the layout of the tables below; newer stores are refused (2: the trie index, 3: ``lru``)

ENTRIES = b"entries"
CHUNKS = b"chunks"
NODES = b"nodes"
ENDS = b"ends"
SEGS = b"segs"
USED = b"used"
IDS = b"ids"
INFO = b"info"
PINS = b"pins"
SIZES = b"sizes"
BLOCKS = b"blocks"
REFS = b"refs"
PLACES = b"places"
PACKS = b"packs"
TRIMS = b"trims"
LRU = b"lru"
TABLES: Tuple[bytes, ...] = (ENTRIES, CHUNKS, NODES, ENDS, SEGS, USED, IDS, INFO, PINS, SIZES, BLOCKS, REFS, PLACES, PACKS, TRIMS, LRU)
DUPSORT = frozenset({ENDS, SEGS})
OPTIONAL = frozenset({PINS, SIZES, BLOCKS, REFS, PLACES, PACKS, TRIMS, LRU})  # absent from stores older than them; opened read-only, they may be missing

# Keys of the ``info`` table.
FORMAT_KEY = b"format"
STORE_ID_KEY = b"store-id"  # 16 random bytes, also in the store folder's STORE_ID file
STORE_ID_FILE = "STORE_ID"
BUDGET_KEY = b"budget"
USAGE_KEY = b"usage"

MODEL_ID = 16
ENTRY_KEY = 36
ENTRY_ID = 16  # hex digits


def stat_key(counter: str) -> bytes:
    """The ``info`` key of a counter such as ``hits``."""
    return b"stat:" + counter.encode()


def chunk_key(ekey: bytes, i: int) -> bytes:
    return ekey + U32.pack(i)


def owner_of_chunk(key: bytes) -> bytes:
    """The entry key a ``chunks`` key belongs to."""
    return bytes(key[:ENTRY_KEY])


def model_of(ekey: bytes) -> bytes:
    """The model id an entry key (or node key) starts with."""
    return bytes(ekey[:MODEL_ID])


def node_key(mid: bytes, h: int, k: int) -> bytes:
    return mid + U64.pack(int(h)) + U32.pack(k)


def end_value(n: int, h: int, ekey: bytes) -> bytes:
    return U32.pack(n) + U64.pack(int(h)) + ekey


def parse_end(value: bytes) -> Tuple[int, int, bytes]:
    """``(n, h, ekey)`` of an end record."""
    return U32.unpack(value[:4])[0], U64.unpack(value[4:12])[0], bytes(value[12:])


def pair(a: int, b: int) -> bytes:
    """Two u64: a ``places`` value (pack, offset) or a ``packs`` value (live bytes, file bytes)."""
    return U64.pack(a) + U64.pack(b)


def parse_pair(raw: Any) -> Optional[Tuple[int, int]]:
    """The two u64 of a ``places`` or ``packs`` value; None when absent or damaged."""
    if raw is None or len(raw) != 16:
        return None
    raw = bytes(raw)
    return U64.unpack(raw[:8])[0], U64.unpack(raw[8:])[0]


def u64_or(raw: Any, default: int = 0) -> int:
    """A stored u64, or ``default`` when absent or damaged (wrong length)."""
    return U64.unpack(bytes(raw))[0] if raw is not None and len(raw) == 8 else default


def f64_or(raw: Any, default: float) -> float:
    """A stored f64, or ``default`` when absent or damaged (wrong length)."""
    return F64.unpack(bytes(raw))[0] if raw is not None and len(raw) == 8 else default


class Tables:
    """The open tables of the live generation, as attributes.

    Backed by one dict that the environment updates in place when it
    follows a compaction to a new generation, so a reference stays valid.
    ``tables[b"entries"]`` also works, for tools and tests that walk tables
    by name.
    """

    __slots__ = ("_handles",)

    def __init__(self, handles: Optional[Dict[bytes, Any]] = None):
        self._handles: Dict[bytes, Any] = handles if handles is not None else {}

    def replace(self, handles: Dict[bytes, Any]) -> None:
        self._handles.clear()
        self._handles.update(handles)

    def __getitem__(self, name: bytes) -> Any:
        return self._handles[name]

    def __contains__(self, name: object) -> bool:
        return name in self._handles

    def get(self, name: bytes) -> Any:
        return self._handles.get(name)

    entries = property(lambda self: self._handles[ENTRIES])
    chunks = property(lambda self: self._handles[CHUNKS])
    nodes = property(lambda self: self._handles[NODES])
    ends = property(lambda self: self._handles[ENDS])
    segs = property(lambda self: self._handles[SEGS])
    trims = property(lambda self: self._handles[TRIMS])
    lru = property(lambda self: self._handles[LRU])
    used = property(lambda self: self._handles[USED])
    ids = property(lambda self: self._handles[IDS])
    info = property(lambda self: self._handles[INFO])
    pins = property(lambda self: self._handles[PINS])
    sizes = property(lambda self: self._handles[SIZES])
    blocks = property(lambda self: self._handles[BLOCKS])
    refs = property(lambda self: self._handles[REFS])
    places = property(lambda self: self._handles[PLACES])
    packs = property(lambda self: self._handles[PACKS])
