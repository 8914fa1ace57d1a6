"""Random and mutated manifests and records: only PromptStoreError, no crash,
no hang, no huge allocation.

Four feeds: raw random bytes; byte-level mutations of real manifests; field
replacements in real manifests (re-checksummed, so the codecs' own checks are
reached); and whole records (manifests, payload chunks, shared blocks) planted
in LMDB and read through ``store.get``. The real manifests are of both
layouts: entries with shared blocks (format 3: the turns of chats sharing
them) and without (format 1). PROMPTSTORE_STRESS=1 runs ten times the examples.
"""

from __future__ import annotations

import math
import os
import resource

import msgpack
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _raw import blocks_of, ekey_of, get_block
from _content import MODEL, chat_entry, make_entry
from promptstore import PromptStore, PromptStoreError
from promptstore.format import _entry, _payload
from promptstore.store import _keys
from promptstore.store._read import assemble

STRESS = os.environ.get("PROMPTSTORE_STRESS") == "1"
N = 2000 if STRESS else 200
SETTINGS = settings(
    max_examples=N, deadline=2000, derandomize=not STRESS, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
CASES = {"n": 0}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, blocks_in_lmdb):
    """Real manifests, chunks and blocks of a few entries (kv, arrays,
    rotating, quantized; the turns of two chats), in both layouts:
    ``(manifest, chunks, {block address: bytes})``."""
    from test_corruption import extra_entries
    import numpy as np

    out = []
    for shared_blocks in (True, False):
        path = tmp_path_factory.mktemp("fuzz") / "s"
        with PromptStore(path, shared_blocks=shared_blocks) as store:
            items = [make_entry(9, i, big_every=0) for i in range(4)] + extra_entries(np.random.default_rng(1))
            items += [chat_entry(conv, turn) for conv in (90, 91) for turn in range(3)]
            for tokens, cache in items:
                store.put(MODEL, tokens, cache)
            with store.env.read() as txn:
                for tokens, _ in items:
                    k = _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens))
                    raw = bytes(txn.get(k, db=store._db[b"entries"]))
                    chunks, i = [], 0
                    while (c := txn.get(k + _keys.u32(i), db=store._db[b"chunks"])) is not None:
                        chunks.append(bytes(c))
                        i += 1
                    blocks = {}
                    for key, _ in _entry.unpack_manifest(raw, "corpus").blocks():
                        blocks[key] = bytes(txn.get(key, db=store._db[b"blocks"]))
                    out.append((raw, chunks, blocks))
    assert sum(1 for _, _, blocks in out if len(blocks) > 2) >= 4  # manifests of several blocks per array
    return out


def decode(raw: bytes, chunks, blocks=None) -> None:
    """The whole read path minus LMDB (as ``store._read.Reader.restore``):
    the payload from ``chunks``, the arrays in shared blocks from ``blocks``;
    typed errors only."""
    CASES["n"] += 1
    try:
        man = _entry.unpack_manifest(raw, "fuzz")
        arrays = _payload.read_arrays(man.payload_only(), lambda i: chunks[i] if 0 <= i < len(chunks) else None, "fuzz")
        if man.bounds:
            assemble((blocks or {}).get, man, arrays, "fuzz")
        _entry.decode_layers(man, arrays, "fuzz")
    except PromptStoreError:
        pass


def recheck(doc: dict) -> bytes:
    """Pack ``doc`` with a valid manifest checksum (as the writer does)."""
    doc = dict(doc)
    doc.pop("check", None)
    doc["check"] = bytes(8)
    raw = msgpack.packb(doc, use_bin_type=True)
    return raw[:-8] + xxhash.xxh3_64_digest(raw[:-8])


def rss_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


@SETTINGS
@given(raw=st.binary(max_size=4096))
def test_random_bytes(raw):
    decode(raw, [])


@SETTINGS
@given(data=st.data())
def test_byte_mutations(corpus, data):
    raw, chunks, blocks = corpus[data.draw(st.integers(0, len(corpus) - 1))]
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate", "set"]))
        pos = data.draw(st.integers(0, max(0, len(b) - 1)))
        if op == "flip" and b:
            b[pos] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            b[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        elif op == "delete" and b:
            del b[pos : pos + data.draw(st.integers(1, 16))]
        elif op == "truncate":
            del b[pos:]
        elif op == "set" and b:  # msgpack headers that claim huge sizes
            b[pos] = data.draw(st.sampled_from([0xC6, 0xDB, 0xDD, 0xDF, 0xCF, 0xD3, 0xCB]))
    decode(bytes(b), chunks, blocks)


VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=True)
    | st.text(max_size=20) | st.binary(max_size=64)
    | st.sampled_from([0, -1, 1, 1 << 40, (1 << 40) - 1, 1 << 62, "float32", "bfloat16", "kv", "arrays", "list(kv,kv)"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=12,
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@SETTINGS
@given(data=st.data())
def test_field_replacements(corpus, data):
    """A field anywhere in the manifest replaced, the checksum made valid again:
    the structural checks and the codecs must catch what the checksum cannot."""
    raw, chunks, blocks = corpus[data.draw(st.integers(0, len(corpus) - 1))]
    doc = msgpack.unpackb(raw, raw=False)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p and p[0] != "check"]
        path = data.draw(st.sampled_from(paths))
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(VALUES)
    decode(recheck(doc), chunks, blocks)


def test_huge_claims_allocate_nothing(corpus):
    """Manifests claiming up to MAX_PAYLOAD (1 TB) with real, short chunks."""
    raw, chunks, _ = corpus[0]
    before = rss_mib()
    for claim in (1 << 30, 1 << 36, (1 << 40) - 8):
        doc = msgpack.unpackb(raw, raw=False)
        doc["layers"] = [{"kind": "arrays", "version": 1, "meta": {}, "arrays": [["a", "uint8", [claim], 0, claim, 0]]}]
        doc["payload"], doc["chunks"] = claim, _entry.n_chunks(claim)
        with pytest.raises(PromptStoreError, match="chunk 0"):
            man = _entry.unpack_manifest(recheck(doc), "huge")
            _payload.read_arrays(man, lambda i: chunks[i] if i < len(chunks) else None, "huge")
    assert rss_mib() - before < 64


def _claim(raw: bytes, width: int) -> bytes:
    """``raw`` (a format-3 manifest) with its first array in shared blocks
    claiming rows ``width`` elements wide, re-checksummed."""
    doc = msgpack.unpackb(raw, raw=False)
    a = next(a for layer in doc["layers"] for a in layer["arrays"] if len(a) == 7)
    a[2] = a[2][:-1] + [width]
    a[4] = math.prod(a[2]) * _entry.DTYPES[a[1]].size
    return recheck(doc)


def test_huge_block_claims_allocate_nothing(corpus):
    """Format-3 manifests (re-checksummed) whose array in shared blocks claims
    up to ~400 MB, with the real blocks: typed errors, nothing allocated."""
    raw, chunks, blocks = next(c for c in corpus if c[2] and _entry.unpack_manifest(c[0], "x").bounds)
    before = rss_mib()
    for width in (1 << 10, 1 << 16, 1 << 20):
        with pytest.raises(PromptStoreError, match="block"):
            man = _entry.unpack_manifest(_claim(raw, width), "huge")
            arrays = _payload.read_arrays(man.payload_only(), lambda i: chunks[i] if i < len(chunks) else None, "huge")
            assemble(blocks.get, man, arrays, "huge")
    assert rss_mib() - before < 64


@pytest.mark.parametrize("call", ["get", "lookup", "verify"])
def test_a_huge_block_claim_in_the_store_is_a_typed_error(tmp_path, call):
    """A planted format-3 manifest (re-checksummed) whose array in shared
    blocks claims ~100 GB: get raises a PromptStoreError, lookup skips the
    entry, verify reports it."""
    tokens, cache = make_entry(9, 0, big_every=0)
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        eid = store.put(MODEL, tokens, cache).id
        k = ekey_of(store, eid)
        with store.env.read() as txn:
            raw = bytes(txn.get(k, db=store._db[b"entries"]))
        huge = _claim(raw, 1 << 28)
        store.env.write(lambda t: t.put(k, huge, db=store._db[b"entries"]))
        if call == "get":
            with pytest.raises(PromptStoreError):
                store.get(MODEL, tokens)
        elif call == "lookup":
            assert store.lookup(MODEL, list(tokens) + [1]) is None
        else:
            assert [p for p, _ in store.verify().problems] == [eid]


@settings(max_examples=N // 4, deadline=5000, derandomize=not STRESS, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_planted_records_through_get(corpus, tmp_path_factory, data):
    """Mutated manifests, chunks and shared blocks planted in LMDB under a
    real key; get() returns a cache or raises a PromptStoreError; lookup
    never raises; verify() never raises."""
    shared_blocks = data.draw(st.booleans())
    store, eid, tokens = _planted_store(tmp_path_factory, shared_blocks)
    raw, chunks, blocks = _STORES["records", shared_blocks]
    k = _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens))
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(0, 4))):
        if b:
            b[data.draw(st.integers(0, len(b) - 1))] ^= data.draw(st.integers(1, 255))
    new_chunks = list(chunks)
    new_blocks = dict(blocks)

    def mutate(c: bytes) -> bytes:
        c = bytearray(c)
        c[data.draw(st.integers(0, len(c) - 1))] ^= data.draw(st.integers(1, 255))
        cut = data.draw(st.integers(0, len(c)))
        return bytes(c[:cut]) if data.draw(st.booleans()) else bytes(c)

    if chunks and data.draw(st.booleans()):
        ci = data.draw(st.integers(0, len(chunks) - 1))
        new_chunks[ci] = mutate(chunks[ci])
    if blocks and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(blocks)))
        new_blocks[key] = None if data.draw(st.booleans()) else mutate(blocks[key])

    def plant(txn):
        txn.put(k, bytes(b), db=store._db[b"entries"])
        for i, c in enumerate(new_chunks):
            txn.put(k + _keys.u32(i), c, db=store._db[b"chunks"])
        for key, c in new_blocks.items():
            if c is None:
                txn.delete(key, db=store._db[b"blocks"])
            else:
                txn.put(key, c, db=store._db[b"blocks"])

    store.env.write(plant)
    CASES["n"] += 1
    try:
        store.get(MODEL, tokens)
    except PromptStoreError:
        pass
    store.lookup(MODEL, list(tokens) + [1])  # damaged candidates are skipped, never raised
    store.verify()


_STORES = {}


def _planted_store(factory, shared_blocks: bool):
    """A store (one per layout) holding one entry of a KV and an ArraysCache
    layer, and the entry's records as written: ``(store, entry id, tokens)``."""
    if shared_blocks not in _STORES:
        store = PromptStore(factory.mktemp("planted") / "s", shared_blocks=shared_blocks)
        tokens, cache = make_entry(9, 1, big_every=0)
        eid = store.put(MODEL, tokens, cache).id
        k = ekey_of(store, eid)
        with store.env.read() as txn:
            raw = bytes(txn.get(k, db=store._db[b"entries"]))
            chunks = [bytes(txn.get(k + _keys.u32(i), db=store._db[b"chunks"])) for i in range(_entry.unpack_manifest(raw, eid).chunks)]
        _STORES[shared_blocks] = (store, eid, tokens)
        _STORES["records", shared_blocks] = (raw, chunks, {key: get_block(store, key) for key in blocks_of(store, eid)})
    return _STORES[shared_blocks]


def test_zz_report_counts():
    print(f"\nfuzz: {CASES['n']} decoder cases")
    assert CASES["n"] >= 3 * N
    for layout in (True, False):
        if layout in _STORES:
            _STORES.pop(layout)[0].close()
