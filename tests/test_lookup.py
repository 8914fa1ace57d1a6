"""Longest-prefix lookup: exact, shorter prefix, trimmed longer entry, recurrent exactness."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache

from conftest import greedy, load_fixture, sample_tokens
from _raw import blocks_of, set_block
from promptstore.jobs.prefill import prefill
from promptstore.store import _keys


def _prefilled(name, tokens):
    model, _, fp, _ = load_fixture(name)
    return model, fp, prefill(model, tokens)


def test_exact_and_shorter_prefix(store):
    t = sample_tokens(40)
    model, fp, cache = _prefilled("llama", t)
    store.put(fp, t, cache)
    hit = store.lookup(fp, t)
    assert (hit.matched, hit.trimmed) == (40, 0)
    hit = store.lookup(fp, t + sample_tokens(7, seed=1))
    assert (hit.matched, hit.trimmed) == (40, 0)
    assert store.lookup(fp, t[:39]) is not None  # longer dense entry trimmed down
    assert store.lookup(fp, sample_tokens(40, seed=2)) is None
    assert store.lookup("other@model", t) is None


def test_longer_trimmable_entry_is_trimmed(store):
    model, _, fp, _ = load_fixture("llama")
    t = sample_tokens(40)
    longer = t + sample_tokens(25, seed=3)
    store.put(fp, longer, prefill(model, longer))
    query = t + [longer[40] + 1 if longer[40] < 400 else 5]
    hit = store.lookup(fp, query)
    assert (hit.matched, hit.trimmed) == (40, 25)
    assert all(c.offset == 40 for c in hit.cache)
    # Re-feeding the last token to the trimmed cache continues as a fresh prefill of t does.
    fresh = prefill(model, t[:-1])
    trimmed = hit.cache
    for c in trimmed:
        c.trim(1)
    last = mx.array([[t[-1]]])
    toks_a, _ = greedy(model, fresh, model(last, cache=fresh), 12)
    toks_b, _ = greedy(model, trimmed, model(last, cache=trimmed), 12)
    assert toks_a == toks_b


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_longer_recurrent_entry_is_refused(store, name):
    model, _, fp, _ = load_fixture(name)
    t = sample_tokens(30)
    longer = t + sample_tokens(10, seed=4)
    store.put(fp, longer, prefill(model, longer))
    assert store.lookup(fp, t + [7]) is None  # would need a trim the state cannot do
    assert store.lookup(fp, t) is None
    hit = store.lookup(fp, longer + [9, 9])
    assert (hit.matched, hit.trimmed) == (40, 0)
    store.put(fp, t, prefill(model, t))
    assert store.lookup(fp, t + [7]).matched == 30


def _tiny(n, trimmable=True):
    """A one-layer cache covering n tokens, cheap to store."""
    if trimmable:
        c = KVCache()
        c.keys = mx.zeros((1, 1, n, 4), mx.float16)
        c.values = mx.ones((1, 1, n, 4), mx.float16)
        c.offset = n
        return [c]
    a = ArraysCache(2)
    a[0] = mx.array([n], mx.int32)
    return [a]


def test_across_index_blocks(store):
    base = sample_tokens(900, seed=5)
    store.put("m", base[:300], _tiny(300))
    store.put("m", base[:520], _tiny(520))
    assert store.lookup("m", base[:700]).matched == 520
    assert store.lookup("m", base[:520]).matched == 520
    assert store.lookup("m", base[:519]).matched == 519  # 520 entry trimmed by one
    diverge = base[:400] + [1] + base[401:700]
    hit = store.lookup("m", diverge)
    assert (hit.matched, hit.trimmed) == (400, 120)
    assert store.lookup("m", base[:299] + [2]).matched == 299


def test_exact_prefix_matches_brute_force(store):
    """Random tree-shaped prompts: lookup finds the longest stored exact prefix."""
    rng = random.Random(7)
    stems = [sample_tokens(rng.randrange(200, 700), seed=100 + i) for i in range(4)]
    stored = []
    for i in range(80):
        stem = rng.choice(stems)
        cut = rng.randrange(1, len(stem))
        toks = stem[:cut] + (sample_tokens(rng.randrange(0, 300), seed=1000 + i) if rng.random() < 0.5 else [])
        if toks in stored:
            continue
        store.put("m", toks, _tiny(len(toks), trimmable=False), coverage=len(toks))
        stored.append(toks)
    for q in range(120):
        stem = rng.choice(stems)
        query = stem[: rng.randrange(1, len(stem) + 1)] + sample_tokens(rng.randrange(0, 50), seed=5000 + q)
        best = max((len(s) for s in stored if len(s) <= len(query) and query[: len(s)] == s), default=0)
        hit = store.lookup("m", query)
        assert (hit.matched if hit else 0) == best
        if hit:
            assert int(hit.cache[0][0].item()) == best  # the entry itself, not another


def test_delete_removes_from_index(store):
    t = sample_tokens(300, seed=9)
    store.put("m", t, _tiny(300, trimmable=False), coverage=300)
    store.put("m", t[:100], _tiny(100, trimmable=False), coverage=100)
    assert store.lookup("m", t + [3]).matched == 300
    assert store.delete("m", t)
    assert store.lookup("m", t + [3]).matched == 100
    assert not store.delete("m", t)
    assert store.delete("m", t[:100])
    assert store.lookup("m", t) is None
    assert list(store.entries()) == []


def test_replace_keeps_one_entry(store):
    t = sample_tokens(50, seed=10)
    store.put("m", t, _tiny(50))
    store.put("m", t, _tiny(50))
    assert len(list(store.entries())) == 1
    assert store.lookup("m", t + [4]).matched == 50
    assert store.delete("m", t)
    assert store.lookup("m", t) is None


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_trimmed_prefix_matches_brute_force(store):
    """Trimmable and recurrent entries mixed: lookup finds the true best usable prefix."""
    rng = random.Random(11)
    stems = [sample_tokens(rng.randrange(100, 400), seed=200 + i) for i in range(3)]
    stored = []  # (tokens, trimmable)
    for i in range(120):
        stem = rng.choice(stems)
        toks = stem[: rng.randrange(1, len(stem))] + sample_tokens(rng.randrange(0, 80), seed=3000 + i)
        if any(toks == t for t, _ in stored):
            continue
        trimmable = rng.random() < 0.6
        store.put("m", toks, _tiny(len(toks), trimmable=trimmable), coverage=len(toks))
        stored.append((toks, trimmable))
    for q in range(150):
        stem = rng.choice(stems)
        query = stem[: rng.randrange(1, len(stem) + 1)] + sample_tokens(rng.randrange(0, 40), seed=7000 + q)
        best = 0
        for toks, trimmable in stored:
            if len(toks) <= len(query) and query[: len(toks)] == toks:
                best = max(best, len(toks))
            elif trimmable:
                best = max(best, _lcp(toks, query))
        hit = store.lookup("m", query)
        assert (hit.matched if hit else 0) == best, q
        if hit:
            assert isinstance(hit.cache[0], ArraysCache) or hit.cache[0].offset == best


def test_longer_recurrent_entry_does_not_hide_a_trimmable_one(store):
    base = sample_tokens(400, seed=12)
    store.put("m", base[:260], _tiny(260, trimmable=False), coverage=260)  # reaches deeper, cannot trim
    store.put("m", base[:140] + [3] * 10, _tiny(150))  # shares 140 tokens, can trim
    query = base[:200]
    assert store.peek("m", query) == 140
    hit = store.lookup("m", query)
    assert (hit.matched, hit.trimmed) == (140, 10)


def test_many_short_entries_under_one_node(store):
    """Hundreds of entries ending in the query's first block: probed by length, all found right."""
    base = sample_tokens(60, seed=13)
    for i in range(300):
        store.put("m", [base[0], 600 + i] + base[2:40], _tiny(40, trimmable=False), coverage=40)
    store.put("m", base[:30], _tiny(30, trimmable=False), coverage=30)
    assert store.lookup("m", base).matched == 30
    assert store.lookup("m", [base[0], 600 + 299] + base[2:50]).matched == 40
    assert store.lookup("m", [base[0], 1000] + base[2:50]) is None


# -- every usable candidate, best first: a candidate that fails hides no other --------


def _kv(n, seed):
    """A one-layer KV cache of ``n`` tokens, its content its own (no block shared by chance)."""
    a = mx.array(np.random.default_rng(seed).standard_normal((1, 1, n, 2)).astype(np.float16))
    c = KVCache()
    c.keys, c.values, c.offset = a, a + 1, n
    return [c]


def _chunked(n, start):
    """A kv.chunked layer of ``n`` tokens that keeps only those from ``start``
    (past its first chunk when ``start`` > 0: it cannot be trimmed below it)."""
    c = ChunkedKVCache(64)
    a = mx.array(np.arange((n - start) * 2, dtype=np.float16).reshape(1, 1, n - start, 2))
    c.keys, c.values, c.offset, c.start_position = a, a + 1, n, start
    return [c]


def _unchecked(store, tokens):
    """Flip the last byte of the manifest of ``tokens`` (its checksum): it
    still parses, but is no longer intact."""
    ekey = _keys.entry_key(_keys.model_id("m"), _keys.as_tokens(tokens))

    def damage(txn):
        raw = bytearray(txn.get(ekey, db=store._db.entries))
        raw[-1] ^= 0xFF
        txn.put(ekey, bytes(raw), db=store._db.entries)

    store.env.write(damage)


@pytest.mark.parametrize("far", [3, 9], ids=["before", "after"])
def test_a_chunked_entry_that_cannot_trim_so_far_does_not_hide_a_sibling(store, far):
    """Two trimmable entries share the query's 100 tokens; the one the index
    finds first is a chunked window past its first chunk (it holds tokens from
    128 on only): the other one serves (whichever side of the query it sorts)."""
    p = [5] * 100
    blocked, good = p + [far] * 100, p + [12 - far] * 30
    store.put("m", blocked, _chunked(200, 128))
    store.put("m", good, _chunked(130, 0))
    query = p + [7] * 10
    assert store.peek("m", query) == 100
    hit = store.lookup("m", query)
    assert hit is not None and (hit.matched, hit.info.n_tokens) == (100, 130)


@pytest.mark.parametrize("damage", ["manifest", "block"])
def test_a_damaged_trimmable_entry_does_not_hide_an_intact_sibling(store, damage):
    """The README's promise: a damaged candidate is skipped, to the next one,
    here an entry that serves exactly as much."""
    p = [5] * 100
    bad, good = p + [9] * 100, p + [3] * 30
    bad_id = store.put("m", bad, _kv(200, 1)).id
    good_id = store.put("m", good, _kv(130, 2)).id
    query = p + [7] * 10
    assert store.lookup("m", query).info.id == bad_id  # found first: the test would prove nothing otherwise
    if damage == "manifest":
        _unchecked(store, bad)
    else:
        own = set(blocks_of(store, bad_id)) - set(blocks_of(store, good_id))
        set_block(store, sorted(own)[0], None)
    hit = store.lookup("m", query)
    assert hit is not None and (hit.matched, hit.info.id) == (100, good_id)
    assert hit.cache[0].offset == 100
    assert store.peek("m", query) == 100


def test_a_damaged_exact_prefix_falls_back_to_a_trimmable_entry_covering_as_much(store):
    """A conversation stored turn by turn: its shorter entry went bad; the
    longer one, trimmed, serves the same 100 tokens."""
    t = list(range(3, 303))
    store.put("m", t, _kv(300, 1))
    store.put("m", t[:100], _kv(100, 2))
    query = t[:100] + [999]
    assert store.lookup("m", query).info.n_tokens == 100
    _unchecked(store, t[:100])
    assert store.peek("m", query) == 100
    hit = store.lookup("m", query)
    assert hit is not None and (hit.matched, hit.trimmed, hit.info.n_tokens) == (100, 200, 300)


def test_a_damaged_exact_prefix_falls_back_to_the_next_best_in_order(store):
    """Candidates in order of tokens usable, exact and trimmed alike: with the
    100-token exact prefix damaged, the trimmable entry sharing 80 tokens comes
    before the 20-token exact prefix; peek says what lookup will serve."""
    p = list(range(3, 103))
    store.put("m", p, _kv(100, 1))
    store.put("m", p[:20], _kv(20, 2))
    store.put("m", p[:80] + [999] * 50, _kv(130, 3))
    query = p + [5]
    assert store.lookup("m", query).matched == 100
    _unchecked(store, p)
    assert store.peek("m", query) == 80
    hit = store.lookup("m", query)
    assert hit is not None and (hit.matched, hit.info.n_tokens) == (80, 130)


def test_fallback_matches_brute_force(store):
    """Trimmable, chunked (some past their first chunk) and recurrent entries,
    some of them damaged: lookup restores the best entry that can serve, and
    peek says as much."""
    rng = random.Random(17)
    stems = [sample_tokens(rng.randrange(150, 400), seed=300 + i) for i in range(3)]
    stored = []  # (tokens, kind, floor, damaged)
    for i in range(90):
        toks = rng.choice(stems)
        toks = toks[: rng.randrange(1, len(toks))] + sample_tokens(rng.randrange(0, 150), seed=4000 + i)
        if any(toks == t for t, *_ in stored):
            continue
        kind = rng.choice(["kv", "chunked", "recurrent"])
        floor = rng.choice([0, 64, 128]) if kind == "chunked" and len(toks) > 128 else 0
        if kind == "kv":
            store.put("m", toks, _kv(len(toks), i))
        elif kind == "chunked":
            store.put("m", toks, _chunked(len(toks), floor))
        else:
            store.put("m", toks, _tiny(len(toks), trimmable=False), coverage=len(toks))
        damaged = rng.random() < 0.25
        if damaged:
            _unchecked(store, toks)
        stored.append((toks, kind, floor, damaged))
    for q in range(150):
        stem = rng.choice(stems) if q % 2 else rng.choice(stored)[0]  # or into one entry's own tokens
        query = stem[: rng.randrange(1, len(stem) + 1)] + sample_tokens(rng.randrange(0, 40), seed=8000 + q)
        best = 0
        for toks, kind, floor, damaged in stored:
            if damaged:
                continue
            if len(toks) <= len(query) and query[: len(toks)] == toks:
                best = max(best, len(toks))
            elif kind != "recurrent" and _lcp(toks, query) >= floor:
                best = max(best, _lcp(toks, query))
        assert store.peek("m", query) == best, q
        hit = store.lookup("m", query)
        assert (hit.matched if hit else 0) == best, q


def test_further_trimmable_candidates_are_read_on_demand_and_bounded(store, monkeypatch):
    """Siblings sharing a prefix with the query: a lookup whose first candidate
    serves reads its manifest alone; when every one fails, it gives up after
    TRIM_READS manifests, however many share the prefix."""
    from promptstore.store._index import TRIM_READS

    p = [5] * 100
    for i in range(TRIM_READS + 8):
        store.put("m", p + [10 + i] * 100, _chunked(200, 128))  # cannot serve 100 tokens
    query = p + [7] * 10
    read = []
    safe = store._reader.safe_manifest
    monkeypatch.setattr(store._reader, "safe_manifest", lambda txn, ekey: read.append(ekey) or safe(txn, ekey))
    assert store.lookup("m", query) is None and store.peek("m", query) == 0
    assert len(read) == 2 * TRIM_READS
    store.put("m", p + [8] * 30, _kv(130, 1))  # sorts next to the query: found first
    read.clear()
    hit = store.lookup("m", query)
    assert (hit.matched, hit.info.n_tokens) == (100, 130) and len(read) == 1


def test_peek_passes_over_an_entry_a_read_found_damaged(store):
    """Once a restore found a block of an entry damaged, peek no longer
    promises what lookup will skip."""
    t = sample_tokens(200, seed=21)
    short_id = store.put("m", t[:100], _kv(100, 1)).id
    long_id = store.put("m", t, _kv(200, 2)).id
    set_block(store, sorted(set(blocks_of(store, long_id)) - set(blocks_of(store, short_id)))[0], None)
    query = t + [1]
    assert store.peek("m", query) == 200  # nothing read yet: the manifest is whole
    assert store.lookup("m", query).matched == 100
    assert store.peek("m", query) == 100
