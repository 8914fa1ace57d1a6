"""Random and mutated manifests and records: only PromptStoreError, no crash,
no hang, no huge allocation.

Four feeds: raw random bytes; byte-level mutations of real manifests; field
replacements in real manifests (re-checksummed, so the codecs' own checks are
reached); and whole records planted in LMDB and read through ``store.get``.
PROMPTSTORE_STRESS=1 runs ten times the examples.
"""

from __future__ import annotations

import os
import resource

import msgpack
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _workers import MODEL, make_entry
from promptstore import PromptStore, PromptStoreError
from promptstore.format import _entry, _payload
from promptstore.store import _keys

STRESS = os.environ.get("PROMPTSTORE_STRESS") == "1"
N = 2000 if STRESS else 200
SETTINGS = settings(
    max_examples=N, deadline=2000, derandomize=not STRESS, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
CASES = {"n": 0}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real manifests and chunks of a few entries (kv, arrays, rotating, quantized)."""
    from test_corruption import extra_entries
    import numpy as np

    path = tmp_path_factory.mktemp("fuzz") / "s"
    out = []
    with PromptStore(path) as store:
        items = [make_entry(9, i, big_every=0) for i in range(4)] + extra_entries(np.random.default_rng(1))
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
                out.append((raw, chunks))
    return out


def decode(raw: bytes, chunks) -> None:
    """The whole read path minus LMDB: typed errors only."""
    CASES["n"] += 1
    try:
        man = _entry.unpack_manifest(raw, "fuzz")
        arrays = _payload.read_arrays(man, lambda i: chunks[i] if 0 <= i < len(chunks) else None, "fuzz")
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
    raw, chunks = corpus[data.draw(st.integers(0, len(corpus) - 1))]
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
    decode(bytes(b), chunks)


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
    raw, chunks = corpus[data.draw(st.integers(0, len(corpus) - 1))]
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
    decode(recheck(doc), chunks)


def test_huge_claims_allocate_nothing(corpus):
    """Manifests claiming up to MAX_PAYLOAD (1 TB) with real, short chunks."""
    raw, chunks = corpus[0]
    before = rss_mib()
    for claim in (1 << 30, 1 << 36, (1 << 40) - 8):
        doc = msgpack.unpackb(raw, raw=False)
        doc["layers"] = [{"kind": "arrays", "version": 1, "meta": {}, "arrays": [["a", "uint8", [claim], 0, claim, 0]]}]
        doc["payload"], doc["chunks"] = claim, _entry.n_chunks(claim)
        with pytest.raises(PromptStoreError, match="chunk 0"):
            man = _entry.unpack_manifest(recheck(doc), "huge")
            _payload.read_arrays(man, lambda i: chunks[i] if i < len(chunks) else None, "huge")
    assert rss_mib() - before < 64


@settings(max_examples=N // 4, deadline=5000, derandomize=not STRESS, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_planted_records_through_get(corpus, tmp_path_factory, data):
    """Mutated manifests and chunks planted in LMDB under a real key; get()
    returns a cache or raises a PromptStoreError; verify() never raises."""
    store = _planted_store(tmp_path_factory)
    raw, chunks = corpus[0]
    tokens = make_entry(9, 0, big_every=0)[0]
    k = _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens))
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(0, 4))):
        if b:
            b[data.draw(st.integers(0, len(b) - 1))] ^= data.draw(st.integers(1, 255))
    new_chunks = list(chunks)
    if data.draw(st.booleans()):
        ci = data.draw(st.integers(0, len(chunks) - 1))
        c = bytearray(chunks[ci])
        c[data.draw(st.integers(0, len(c) - 1))] ^= data.draw(st.integers(1, 255))
        cut = data.draw(st.integers(0, len(c)))
        new_chunks[ci] = bytes(c[:cut]) if data.draw(st.booleans()) else bytes(c)

    def plant(txn):
        txn.put(k, bytes(b), db=store._db[b"entries"])
        for i, c in enumerate(new_chunks):
            txn.put(k + _keys.u32(i), c, db=store._db[b"chunks"])

    store.env.write(plant)
    CASES["n"] += 1
    try:
        store.get(MODEL, tokens)
    except PromptStoreError:
        pass
    store.lookup(MODEL, list(tokens) + [1])  # damaged candidates are skipped, never raised
    store.verify()


_STORES = {}


def _planted_store(factory):
    if "s" not in _STORES:
        _STORES["s"] = PromptStore(factory.mktemp("planted") / "s")
        tokens, cache = make_entry(9, 0, big_every=0)
        _STORES["s"].put(MODEL, tokens, cache)
    return _STORES["s"]


def test_zz_report_counts():
    print(f"\nfuzz: {CASES['n']} decoder cases")
    assert CASES["n"] >= 3 * N
    if "s" in _STORES:
        _STORES.pop("s").close()
