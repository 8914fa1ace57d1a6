"""The prefix index as tries (store format 2): a put indexes only the blocks
no stored entry has indexed, the counts stay exact through any sequence of
puts and deletes, and a store of format 1 is read as it is and upgraded once.

Real LMDB files; the format-1 store is one the previous release wrote
(fixtures/golden/store-format-1, made by fixtures/make_golden_store.py).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from _bits import bits_equal
from promptstore import PromptStore
from promptstore.store import _index
from promptstore.store._schema import FORMAT_KEY, STORE_FORMAT, U64

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden"
MODEL = "trie@0123456789abcdef"


def kv(n, seed=0, width=8):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, 1, n, width)).astype(np.float16)
    c = KVCache()
    c.update_and_fetch(mx.array(k), mx.array(k * 2))
    return [c]


def index_tables(store) -> dict:
    out = {}
    with store.env.read() as txn:
        for name in (b"nodes", b"trims", b"ends"):
            out[name] = sorted((bytes(k), bytes(v)) for k, v in txn.cursor(db=store._db[name]))
    return out


def rebuilt(store) -> dict:
    store.env.write(store._maintenance.rebuild_index)
    return index_tables(store)


def test_counts_stay_exact_through_random_puts_and_deletes(tmp_path):
    """After every step the index is what a rebuild from the manifests makes:
    each record's count is its children plus the entries ending there."""
    rng = random.Random(5)
    trunk = np.random.default_rng(9).integers(0, 50000, 600).tolist()
    with PromptStore(tmp_path / "s") as store:
        stored = []
        for step in range(60):
            if stored and rng.random() < 0.35:
                toks = stored.pop(rng.randrange(len(stored)))
                assert store.delete(MODEL, toks)
            else:
                n = rng.choice([1, 63, 64, 65, 127, 128, 200, rng.randrange(1, 600)])
                cut = rng.randrange(0, n + 1)  # a branch of the trunk after `cut` tokens
                toks = trunk[:cut] + [50000 + rng.randrange(3) for _ in range(n - cut)]
                trimmable = rng.random() < 0.7
                if trimmable:
                    store.put(MODEL, toks, kv(n, step))
                else:
                    a = ArraysCache(1)
                    a[0] = mx.array([[float(step)]])
                    store.put(MODEL, toks, [a], coverage=n)
                if toks not in stored:
                    stored.append(toks)
            if step % 6 == 5:
                now = index_tables(store)
                assert now == rebuilt(store), f"step {step}"
        for toks in stored:
            store.delete(MODEL, toks)
        assert all(not recs for recs in index_tables(store).values())  # nothing left behind


def test_a_growing_conversation_writes_index_records_only_for_its_new_blocks(tmp_path):
    tokens = np.random.default_rng(3).integers(0, 50000, 20 * 512).tolist()
    with PromptStore(tmp_path / "s") as store:
        before = index_tables(store)
        for turn in range(1, 21):
            n = turn * 512
            store.put(MODEL, tokens[:n], kv(n, 0, width=2))
            after = index_tables(store)
            for name in (b"nodes", b"trims"):
                changed = set(after[name]) - set(before[name])
                # 512 new tokens are 8 new blocks of 64: a record for each (and, in
                # trims, for the new end: the block the last entry ended before),
                # and one count above them
                assert len(changed) <= 8 + 2, (turn, name.decode(), len(changed))
            before = after
        hit = store.lookup(MODEL, tokens[:3000] + [1, 2, 3])
        assert hit.matched == 3000 and hit.info.n_tokens == 3072 and hit.trimmed == 72  # the shortest entry that covers it


@pytest.fixture()
def old_store(tmp_path):
    path = tmp_path / "old"
    shutil.copytree(GOLDEN / "store-format-1", path)
    entries = json.loads((GOLDEN / "store-format-1.json").read_text())
    return path, entries


def _golden_cache(e):
    """The cache fixtures/make_golden_store.py stored for entry ``e``."""
    n = len(e["tokens"])
    if e.get("arrays"):
        return None
    rng = np.random.default_rng(e["seed"])
    k = rng.standard_normal((1, 1, 700, 8)).astype(np.float16)[..., :n, :]
    return k, k * 2


def _answers(store, entries):
    base = entries[-3]["tokens"]  # the 700-token trunk
    queries = [base[:280] + [7], base[:500], base + [1], base[:100], base[:64] + [9], entries[5]["tokens"] + [3], base[:210] + [4]]
    out = []
    for q in queries:
        hit = store.lookup("golden@store1", q)
        out.append(None if hit is None else (hit.matched, hit.trimmed, hit.info.n_tokens))
    return out


def test_a_format_1_store_is_read_as_it_is_and_upgraded_once(old_store):
    path, entries = old_store
    with PromptStore(path, readonly=True) as ro:
        with ro.env.read() as txn:
            assert U64.unpack(bytes(txn.get(FORMAT_KEY, db=ro._db.info)))[0] == 1
        answers = _answers(ro, entries)  # searched through the old per-entry records
    assert answers[0] == (280, 20, 300) and answers[2] == (700, 0, 700) and answers[5] == (330, 0, 330) and answers[6] == (210, 90, 300)
    with PromptStore(path) as store:  # opened for writing: the index is rebuilt as tries, once
        with store.env.read() as txn:
            assert U64.unpack(bytes(txn.get(FORMAT_KEY, db=store._db.info)))[0] == STORE_FORMAT == 3
            assert txn.stat(store._db.segs)["entries"] == 0 and txn.stat(store._db.trims)["entries"] > 0
        # The same tokens matched (of two entries sharing them, the trie finds the shorter)
        assert [a and a[0] for a in _answers(store, entries)] == [a and a[0] for a in answers]
        assert _answers(store, entries)[6] == (210, 50, 260)
        upgraded = _answers(store, entries)
        assert store.verify().ok and index_tables(store) == rebuilt(store)
        for e in entries:
            want = _golden_cache(e)
            got = store.get("golden@store1", e["tokens"])
            assert got is not None
            if want is not None:
                assert bits_equal(got[0].keys[..., : got[0].offset, :], mx.array(want[0]))
                assert bits_equal(got[0].values[..., : got[0].offset, :], mx.array(want[1]))
    with PromptStore(path) as again:  # a second open finds format 2 and changes nothing
        assert _answers(again, entries) == upgraded


def test_a_prefix_hash_collision_does_not_hide_a_trimmable_match(tmp_path):
    """The prefix hash is not collision-resistant: a 512-token Thue-Morse
    sequence over two ids 2048 apart hashes like its complement. An entry on
    the colliding path made lookup stop at the node it reached by the
    collision, whose candidates failed the token check, and miss a real
    trimmed match further up (None, peek 0)."""
    from promptstore.store import _keys

    bits = [bin(i).count("1") & 1 for i in range(512)]
    a = [1000 if b == 0 else 3048 for b in bits]
    a_bar = [3048 if b == 0 else 1000 for b in bits]
    assert a != a_bar and _keys.prefix_hashes(np.array(a, dtype=np.uint32))[-1] == _keys.prefix_hashes(np.array(a_bar, dtype=np.uint32))[-1]
    near = a_bar[:500] + [42] * 30  # shares 500 tokens with the query
    query = a_bar + [9] * 10
    with PromptStore(tmp_path / "s") as store:
        store.put("m@0123456789abcdef", near, kv(len(near)))
        store.put("m@0123456789abcdef", a + [7] * 10, kv(522, seed=1))  # on the colliding path, shares nothing
        hit = store.lookup("m@0123456789abcdef", query)
        assert hit is not None and hit.matched == 500 and store.peek("m@0123456789abcdef", query) == 500
        want = kv(len(near))[0]
        assert bits_equal(hit.cache[0].keys[..., :500, :], want.keys[..., :500, :])
