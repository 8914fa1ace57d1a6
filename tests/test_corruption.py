"""Flipped bytes in payload chunks, shared blocks and manifests, through LMDB
and in data.mdb.

Every get returns a bit-exact cache or raises a typed PromptStoreError;
verify() reports every damaged entry (every entry referencing a damaged
block); verify(fix=True) leaves a clean store in which every undamaged entry
is still bit-exact.
"""

from __future__ import annotations

import os
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from _raw import audit_blocks, referrers
from _content import MODEL, TURNS, chat_entry, make_entry, same_cache
from promptstore import PromptStore, PromptStoreError
from promptstore.store import _keys

STRESS = os.environ.get("PROMPTSTORE_STRESS") == "1"


def extra_entries(rng: np.random.Generator):
    """Entries of more kinds than _content.make_entry: rotating and quantized KV."""
    out = []
    for j in range(3):
        n = 20 + 7 * j
        toks = [900 + j] + rng.integers(0, 5000, n - 1).tolist()
        rot = RotatingKVCache(max_size=16, keep=2)
        for t in range(n):
            x = mx.array(rng.standard_normal((1, 2, 1, 8)).astype(np.float32))
            rot.update_and_fetch(x, x)
        q = QuantizedKVCache(group_size=32, bits=8)
        x = mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float32))
        q.update_and_fetch(x, x)
        kv = KVCache()
        kv.update_and_fetch(x.astype(mx.bfloat16), x.astype(mx.bfloat16))
        out.append((toks, [rot, q, kv]))
    return out


def fill(store, n_plain: int):
    """``n_plain`` entries sharing nothing, the extra kinds, and the turns of
    two chats (one with an ArraysCache layer): those share blocks along each
    chat, and the system prompt's across both."""
    rng = np.random.default_rng(5)
    chats = [chat_entry(conv, turn) for conv in (30, 31) for turn in range(TURNS)]
    items = [make_entry(3, i) for i in range(n_plain)] + extra_entries(rng) + chats
    for tokens, cache in items:
        store.put(MODEL, tokens, cache, meta={"note": "x" * 10})
    return items


def users(store, items) -> dict:
    """Block address -> the entry keys of the entries referencing it."""
    by_id = {_keys.entry_id(ekey(t)): ekey(t) for t, _ in items}
    found = {k: {by_id[e] for e in who} for k, who in referrers(store).items()}
    assert sum(len(who) > 2 for who in found.values()) >= 4  # the chats' blocks are shared
    return found


def ekey(tokens) -> bytes:
    return _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens))


def flip(data: bytes, rng: random.Random, lo: int = 0, hi: int = None, n: int = None) -> bytes:
    b = bytearray(data)
    hi = len(b) if hi is None else hi
    for _ in range(n or rng.randint(1, 3)):
        b[rng.randrange(lo, hi)] ^= rng.randrange(1, 256)
    return bytes(b)


def check_all(store, items, damaged):
    """Every get is bit-exact or a typed error; every damaged entry fails."""
    typed = 0
    for tokens, cache in items:
        try:
            got = store.get(MODEL, tokens)
        except PromptStoreError:
            typed += 1
            assert ekey(tokens) in damaged, "an undamaged entry raised"
            hit = store.lookup(MODEL, list(tokens) + [7])  # never raises: the damaged entry is skipped
            assert hit is None or hit.info.id != _keys.entry_id(ekey(tokens)), "lookup served a damaged entry"
            continue
        assert got is not None
        assert same_cache(got, cache), "a get returned a cache that is not bit-exact"
        assert ekey(tokens) not in damaged, "a damaged entry was returned as if intact"
    rep = store.verify()
    reported = {eid for eid, _ in rep.problems}
    assert reported == {_keys.entry_id(k) for k in damaged}
    return typed


def fix_and_recheck(store, items, damaged):
    rep = store.verify(fix=True)
    assert len(rep.problems) == len(damaged)
    after = store.verify()
    assert after.ok, after
    audit_blocks(store)  # the blocks only damaged entries referenced went with them
    for tokens, cache in items:
        got = store.get(MODEL, tokens)
        if ekey(tokens) in damaged:
            assert got is None
        else:
            assert same_cache(got, cache)
    # the prefix index was rebuilt: lookups of surviving entries still hit
    for tokens, cache in items:
        if ekey(tokens) not in damaged:
            hit = store.lookup(MODEL, list(tokens) + [7])
            assert hit is not None and hit.matched == len(tokens)


@pytest.mark.parametrize("target", ["chunk", "block", "manifest"])
def test_flips_through_lmdb(tmp_path, target):
    cycles = 20 if STRESS else 4
    rng = random.Random({"chunk": 11, "manifest": 12, "block": 14}[target])
    flips = n_damaged = 0
    for cycle in range(cycles):
        flips_c, damaged = _lmdb_cycle(tmp_path / f"s{cycle}", target, rng)
        flips += flips_c
        n_damaged += len(damaged)
    print(f"\n{target}: {flips} flips through LMDB in {cycles} stores, {n_damaged} damaged entries of {cycles * 25}")


def _lmdb_cycle(path, target, rng):
    """Flip bytes of random records: a payload chunk (its entry damaged), a
    shared block (most often one several entries share: all of them damaged)
    or a manifest."""
    flips = 0
    with PromptStore(path) as store:
        items = fill(store, 14)
        blocks = users(store, items)
        chunked = []  # (entry key, chunks)
        with store.env.read() as txn:
            for tokens, _ in items:
                k = ekey(tokens)
                n = sum(1 for i in range(64) if txn.get(k + _keys.u32(i), db=store._db[b"chunks"]) is not None)
                if n:
                    chunked.append((k, n))
        damaged = set()
        for r in range(12):
            if target == "chunk":
                k, n = chunked[rng.randrange(len(chunked))]
                key, db, hurt = k + _keys.u32(rng.randrange(n)), store._db[b"chunks"], {k}
            elif target == "block":
                shared = sorted(b for b, who in blocks.items() if len(who) > 1)
                key = rng.choice(shared if rng.random() < 0.7 else sorted(blocks))
                db, hurt = store._db[b"blocks"], blocks[key]
            else:
                tokens, _ = items[rng.randrange(len(items))]
                key, db, hurt = ekey(tokens), store._db[b"entries"], {ekey(tokens)}
            with store.env.read() as txn:
                old = txn.get(key, db=db)
            if old is None:  # already removed by a fix in this run
                continue
            old = bytes(old)
            if target == "manifest" and rng.random() < 0.7:
                # Most manifest bytes are token ids (caught by the key check); aim at the rest.
                tok = _keys.as_tokens(items[[ekey(t) for t, _ in items].index(key)][0]).astype("<u4").tobytes()
                at = old.find(tok)
                spots = [i for i in range(len(old)) if not at <= i < at + len(tok)]
                b = bytearray(old)
                for _ in range(rng.randint(1, 2)):
                    b[rng.choice(spots)] ^= rng.randrange(1, 256)
                new = bytes(b)
            else:
                new = flip(old, rng)
            if new == old:  # two flips of one byte undid each other
                continue
            store.env.write(lambda t: t.put(key, new, db=db))
            flips += 1
            damaged |= hurt
            if r % 4 == 3:
                check_all(store, items, damaged)
        check_all(store, items, damaged)
        fix_and_recheck(store, items, damaged)
    return flips, damaged


def _find_all(data: bytes, needle: bytes):
    out, at = [], data.find(needle)
    while at >= 0:
        out.append(at)
        at = data.find(needle, at + 1)
    return out


def test_flips_in_data_file(tmp_path, blocks_in_lmdb):
    """Bytes flipped in data.mdb at the offsets where value bytes live (found by
    searching the file for the values' own bytes; every copy is flipped, as an
    old copy may sit in a free page)."""
    cycles = 12 if STRESS else 3
    rng = random.Random(13)
    flips = n_damaged = 0
    for cycle in range(cycles):
        f, d = _file_cycle(tmp_path / f"s{cycle}", rng)
        flips += f
        n_damaged += d
    print(f"\ndata.mdb: {flips} flips at value offsets in {cycles} stores, {n_damaged} damaged entries of {cycles * 25}")


def _file_cycle(path, rng):
    rounds = 10
    with PromptStore(path) as store:
        items = fill(store, 14)
        data_file = store.env.dir / "data.mdb"
        values = []  # (keys of the entries it belongs to, value bytes)
        with store.env.read() as txn:
            for tokens, _ in items:
                k = ekey(tokens)
                values.append(({k}, bytes(txn.get(k, db=store._db[b"entries"]))))
                i = 0
                while (c := txn.get(k + _keys.u32(i), db=store._db[b"chunks"])) is not None:
                    values.append(({k}, bytes(c)))
                    i += 1
            for key, who in users(store, items).items():  # a block: every entry that references it
                values.append((who, bytes(txn.get(key, db=store._db[b"blocks"]))))
    damaged, flips = set(), 0
    blob = bytearray(data_file.read_bytes())
    for _ in range(rounds):
        k, val = values[rng.randrange(len(values))]
        start = rng.randrange(0, max(1, len(val) - 24))
        needle = val[start : start + 24]
        where = _find_all(bytes(blob), needle)
        assert where, "value bytes not found in data.mdb"
        pos = rng.randrange(24)
        x = rng.randrange(1, 256)
        for at in where:
            blob[at + pos] ^= x
        flips += 1
        # Every live value holding these bytes is damaged now (manifests share text).
        for j, (kk, v) in enumerate(values):
            hits = _find_all(v, needle)
            if hits:
                b = bytearray(v)
                for at in hits:
                    b[at + pos] ^= x
                values[j] = (kk, bytes(b))
                damaged |= kk
    data_file.write_bytes(bytes(blob))
    with PromptStore(path) as store:
        check_all(store, items, damaged)
        fix_and_recheck(store, items, damaged)
    return flips, len(damaged)
