"""PersistentPromptCache: the LRUPromptCache interface over memory and the store."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from _raw import flip_block, get_chunk, set_chunk, shared_block
from conftest import continued, load_fixture, sample_tokens
from promptstore import PromptStore, fingerprint
from promptstore.serving._memory import view
from promptstore.codecs import encode_layer
from promptstore.serving import PersistentPromptCache, model_identity
from _bits import bits_equal


def prefill(model, tokens):
    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return cache, logits


def states(cache):
    """Every array of a cache as its codec stores it (covered positions only)."""
    return [a for layer in cache for _, a in sorted(encode_layer(layer).arrays.items())]


def same(a, b) -> bool:
    sa, sb = states(a), states(b)
    return len(sa) == len(sb) and all(x.shape == y.shape and bits_equal(x, y).item() for x, y in zip(sa, sb))


def next_logits(model, cache, token: int):
    out = model(mx.array([[token]]), cache=cache)
    mx.eval(out)
    return out


@pytest.fixture
def llama():
    return load_fixture("llama")


@pytest.fixture
def hybrid():
    return load_fixture("qwen3_next")


def key(path):
    """The model key mlx-lm's server passes."""
    return (str(path), None, None)


def test_model_key_maps_to_the_cli_fingerprint(llama):
    _, _, fp, path = llama
    assert model_identity(key(path)) == fp == fingerprint(str(path))
    assert model_identity(fp) == fp


def test_insert_persists_and_a_restarted_cache_finds_it(store_path, llama):
    model, _, fp, path = llama
    toks = sample_tokens(40, seed=1)
    cache, _ = prefill(model, toks)
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(key(path), toks, cache, cache_type="user")
        assert len(pc) == 1 and pc.nbytes > 0
        assert pc.stats_by_type()["user"]["n_sequences"] == 1
    with PromptStore(store_path) as s:
        infos = list(s.entries())
        assert [(i.model, i.n_tokens, i.meta["cache_type"]) for i in infos] == [(fp, 40, "user")]
    query = toks + sample_tokens(5, seed=2)
    with PersistentPromptCache(store_path) as pc:
        got, rest = pc.fetch_nearest_cache(key(path), query)
        assert rest == query[40:]
        assert same(got, cache)
        again, rest2 = pc.fetch_nearest_cache(key(path), query)  # promoted: now from memory
        assert rest2 == rest and same(again, cache)
        st = pc.stats()
        assert (st["store_hits"], st["memory_hits"], st["written"]) == (1, 1, 0)
    # Continuing from the fetched cache is bit-identical to continuing from the original.
    assert bits_equal(next_logits(model, got, query[40]), next_logits(model, cache, query[40])).item()


def test_a_fetch_always_leaves_a_token_and_trims_dense_caches(store_path, llama):
    model, _, _, path = llama
    toks = sample_tokens(30, seed=3)
    cache, _ = prefill(model, toks)
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(key(path), toks, cache)
        got, rest = pc.fetch_nearest_cache(key(path), toks)  # exact: keep the last token to process
        assert rest == toks[-1:] and got[0].offset == 29
        short = toks[:20] + [7, 8, 9]  # diverges after 20: a trimmed view of the longer cache
        got, rest = pc.fetch_nearest_cache(key(path), short)
        assert rest == [7, 8, 9] and all(c.offset == 20 for c in got)
        ref, _ = prefill(model, toks[:20])
        assert bits_equal(next_logits(model, got, 7), next_logits(model, ref, 7)).item()
    with PersistentPromptCache(store_path) as pc:  # the same from the store
        got, rest = pc.fetch_nearest_cache(key(path), short)
        assert rest == [7, 8, 9] and all(c.offset == 20 for c in got)


def test_hybrid_entries_match_only_at_exact_coverage(store_path, hybrid):
    model, _, _, path = hybrid
    toks = sample_tokens(30, seed=4)
    cache, _ = prefill(model, toks)
    expect = next_logits(model, prefill(model, toks)[0], 11)
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(key(path), toks, cache)
    for fresh in (False, True):
        with PersistentPromptCache(store_path) as pc:
            if not fresh:
                pc.insert_cache(key(path), toks, cache)
            assert pc.fetch_nearest_cache(key(path), toks[:20] + [5, 6]) == (None, toks[:20] + [5, 6])
            assert pc.fetch_nearest_cache(key(path), toks)[0] is None  # would need a trim
            got, rest = pc.fetch_nearest_cache(key(path), toks + [11])
            assert rest == [11] and same(got, cache)
            assert bits_equal(next_logits(model, got, 11), expect).item()


def test_in_place_writes_after_insert_or_fetch_never_reach_held_or_stored_caches(store_path, llama):
    """mlx-lm's KVCache writes into its buffer in place; the cache must not see it."""
    model, _, fp, path = llama
    toks = sample_tokens(24, seed=5)
    cache, _ = prefill(model, toks)
    expect = [a + 0 for a in states(cache)]  # copies, taken before any write
    mx.eval(expect)
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(key(path), toks, cache)
        # The server keeps using its object: trim 4 and write 4 other tokens in place.
        for c in cache:
            c.trim(4)
        assert cache[0].keys.shape[2] > 24  # room in the buffer: update_and_fetch slice-assigns
        next_logits(model, cache, 1)
        next_logits(model, cache, 2)
        next_logits(model, cache, 3)
        next_logits(model, cache, 4)
        assert not bits_equal(states(cache)[0], expect[0]).item()
        got, _ = pc.fetch_nearest_cache(key(path), toks + [9])
        assert all(bits_equal(a, b).item() for a, b in zip(states(got), expect))
        # A fetched cache written in place leaves the held one alone.
        for c in got:
            c.trim(6)
        for t in (1, 2, 3):
            next_logits(model, got, t)
        again, _ = pc.fetch_nearest_cache(key(path), toks + [9])
        assert all(bits_equal(a, b).item() for a, b in zip(states(again), expect))
    with PromptStore(store_path) as s:
        stored = s.get(fp, toks)
    assert all(bits_equal(a, b).item() for a, b in zip(states(stored), expect))


LOCKER = r"""
import sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=32, map_size=1 << 36)
txn = env.begin(write=True)
print("locked", flush=True)
sys.stdin.readline()
txn.abort()
"""


def test_insert_never_waits_for_the_disk_and_close_flushes(store_path, llama):
    model, _, fp, path = llama
    toks = sample_tokens(64, seed=6)
    cache, _ = prefill(model, toks)
    pc = PersistentPromptCache(store_path)
    # Another process holds the LMDB write lock: every commit here must wait for it.
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(store_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        t0 = time.perf_counter()
        pc.insert_cache(key(path), toks, cache)
        took = time.perf_counter() - t0
        assert took < 0.5, f"insert_cache took {took:.3f}s while the disk was locked"
        time.sleep(1.0)
        assert pc.pending == 1 and pc.stats()["written"] == 0  # the writer really is blocked
        assert pc.flush(timeout=0.2) is False
        got, rest = pc.fetch_nearest_cache(key(path), toks + [3])  # memory serves meanwhile
        assert rest == [3] and same(got, cache)
        # Release the lock a moment after close() starts: close must wait, then commit.
        import threading

        threading.Timer(0.5, lambda: (locker.stdin.write("\n"), locker.stdin.flush())).start()
        t0 = time.perf_counter()
        pc.close()
        assert time.perf_counter() - t0 >= 0.3
    finally:
        if locker.poll() is None:
            locker.stdin.write("\n")
            locker.stdin.flush()
        locker.wait(10)
    assert pc.stats()["written"] == 1 and pc.pending == 0
    with PromptStore(store_path) as s:
        assert [i.n_tokens for i in s.entries()] == [64]
        assert same(s.get(fp, toks), cache)


def test_a_cache_evicted_from_memory_while_its_write_waits_is_still_served(store_path, llama):
    """With one cache in memory, a checkpoint evicted before its write was
    committed was in neither tier: the fetch missed it (a smaller hit)."""
    model, _, fp, path = llama
    first, other = sample_tokens(48, seed=61), sample_tokens(20, seed=62)
    a, _ = prefill(model, first)
    b, _ = prefill(model, other)
    pc = PersistentPromptCache(store_path, max_size=1)
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(store_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        pc.insert_cache(key(path), first, a, cache_type="user")
        pc.insert_cache(key(path), other, b)  # memory holds this one only now
        assert len(pc) == 1 and pc.pending == 2 and pc.stats()["written"] == 0
        got, rest = pc.fetch_nearest_cache(key(path), first + [3])
        assert rest == [3] and same(got, a)
        got, rest = pc.fetch_nearest_cache(key(path), first[:30] + [3])  # trimmed, as a held cache is
        expect = view(a)[0]
        trim_prompt_cache(expect, 48 - 30)
        assert rest == [3] and same(got, expect)
        assert pc.stats()["memory_hits"] == 2 and pc.stats()["misses"] == 0
        assert pc.stats_by_type()["user"]["n_sequences"] == 1  # held again, with its type
    finally:
        locker.stdin.write("\n")
        locker.stdin.flush()
        locker.wait(10)
    pc.close()
    with PromptStore(store_path) as s:
        assert sorted(i.n_tokens for i in s.entries()) == [20, 48]
        assert same(s.get(fp, first), a)


@pytest.mark.parametrize("shared_blocks", [True, False], ids=["shared-blocks", "payload"])
def test_damaged_entries_are_logged_misses(store_path, llama, caplog, shared_blocks):
    """A conversation's two turns: with shared blocks the second references
    the first's block, which is damaged (a payload chunk of both, without).
    Both are skipped, logged, and the fetch misses; another entry is served."""
    model, _, fp, path = llama
    toks = sample_tokens(40, seed=7)
    more = toks + sample_tokens(16, seed=9)
    other = sample_tokens(30, seed=10)
    cache, _ = prefill(model, toks)
    longer = continued(cache)
    mx.eval(model(mx.array(more[40:])[None], cache=longer), [c.state for c in longer])
    other_cache, _ = prefill(model, other)
    with PromptStore(store_path, shared_blocks=shared_blocks) as s:
        ids = [s.put(fp, t, c).id for t, c in ((toks, cache), (more, longer))]
        s.put(fp, other, other_cache)
        if shared_blocks:
            flip_block(s, shared_block(s, ids), bit=0xFF)
        else:
            for eid in ids:
                chunk = bytearray(get_chunk(s, eid, 0))
                chunk[len(chunk) // 2] ^= 0xFF
                set_chunk(s, eid, 0, chunk)
    caplog.set_level(logging.WARNING, logger="promptstore")
    with PersistentPromptCache(store_path) as pc:
        for query in (toks + [5], more + [5]):
            got, rest = pc.fetch_nearest_cache(key(path), query)
            assert got is None and rest == query
        got, rest = pc.fetch_nearest_cache(key(path), other + [5])
        assert rest == [5] and same(got, other_cache)
    skipped = {r.getMessage().split(":")[1].split()[-1] for r in caplog.records if "skipping entry" in r.getMessage()}
    assert skipped == set(ids)


def test_a_miss_on_a_damaged_block_is_mended_by_the_insert_that_follows(store_path, llama):
    """The serving loop misses on a conversation whose shared block is damaged,
    prefills it again and inserts it: that put writes the block again, so the
    conversation's both turns are hits from then on, in this process and the next."""
    model, _, fp, path = llama
    toks = sample_tokens(40, seed=7)
    more = toks + sample_tokens(16, seed=9)
    cache, _ = prefill(model, toks)
    longer = continued(cache)
    mx.eval(model(mx.array(more[40:])[None], cache=longer), [c.state for c in longer])
    with PromptStore(store_path, shared_blocks=True) as s:
        ids = [s.put(fp, t, c).id for t, c in ((toks, cache), (more, longer))]
        flip_block(s, shared_block(s, ids), bit=0xFF)
    with PersistentPromptCache(store_path) as pc:
        assert pc.fetch_nearest_cache(key(path), more + [5]) == (None, more + [5])
        again, _ = prefill(model, toks)  # what the server computes on the miss
        pc.insert_cache(key(path), toks, again)
    with PersistentPromptCache(store_path) as pc:
        for query, want in ((toks + [5], cache), (more + [5], longer)):
            got, rest = pc.fetch_nearest_cache(key(path), query)
            assert rest == [5] and same(got, want)
    with PromptStore(store_path) as s:
        assert s.verify().ok


def test_a_closed_store_is_a_logged_miss_not_a_crash(store_path, llama, caplog):
    model, _, _, path = llama
    toks = sample_tokens(20, seed=8)
    cache, _ = prefill(model, toks)
    s = PromptStore(store_path)
    pc = PersistentPromptCache(s)
    pc.insert_cache(key(path), toks, cache)
    pc.flush()
    pc.trim_to(n_sequences=0)
    s.close()
    caplog.set_level(logging.WARNING, logger="promptstore")
    assert pc.fetch_nearest_cache(key(path), toks + [1]) == (None, toks + [1])
    assert pc.stats()["errors"] == 1
    pc.insert_cache(key(path), toks + [1], prefill(model, toks + [1])[0])  # write fails: logged
    pc.close()
    assert pc.stats()["write_failed"] == 1
    assert any("closed" in r.getMessage() for r in caplog.records)


def test_coverage_mismatch_is_refused(store_path, llama, caplog):
    model, _, _, path = llama
    toks = sample_tokens(20, seed=9)
    cache, _ = prefill(model, toks)
    caplog.set_level(logging.WARNING, logger="promptstore")
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(key(path), toks[:-1], cache)  # the caller's accounting is off by one
        assert len(pc) == 0 and pc.pending == 0
    assert any("covers 20 tokens" in r.getMessage() for r in caplog.records)


def test_unpersistable_keys_are_served_from_memory(store_path, llama):
    model, _, _, path = llama
    toks = sample_tokens(20, seed=10)
    cache, _ = prefill(model, toks)
    adapted = (str(path), "some/adapter", None)
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(adapted, toks, cache)
        got, rest = pc.fetch_nearest_cache(adapted, toks + [1])
        assert rest == [1] and same(got, cache)
        assert pc.fetch_nearest_cache(key(path), toks + [1])[0] is None  # another identity
    with PromptStore(store_path) as s:
        assert list(s.entries()) == []


def test_memory_budget_and_lru(store_path, llama):
    model, _, _, path = llama
    caches = [(t, prefill(model, t)[0]) for t in (sample_tokens(16, seed=20 + i) for i in range(4))]
    one = view(caches[0][1])[1]
    with PersistentPromptCache(store_path, max_size=10, max_bytes=2 * one + one // 2, persist=False) as pc:
        for t, c in caches:
            pc.insert_cache(key(path), t, c)
            assert pc.nbytes <= pc.max_bytes
        assert len(pc) == 2
        assert pc.fetch_nearest_cache(key(path), caches[0][0] + [1])[0] is None  # evicted (and not persisted)
        assert pc.fetch_nearest_cache(key(path), caches[3][0] + [1])[1] == [1]
        pc.trim_to(n_sequences=1)
        assert len(pc) == 1 and pc.fetch_nearest_cache(key(path), caches[3][0] + [1])[1] == [1]
        pc.trim_to(n_bytes=0)
        assert len(pc) == 0 and pc.nbytes == 0
    with PromptStore(store_path) as s:
        assert list(s.entries()) == []


def test_a_longer_trimmable_insert_replaces_its_prefixes_in_memory(store_path, llama):
    model, _, _, path = llama
    toks = sample_tokens(30, seed=30)
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(key(path), toks[:10], prefill(model, toks[:10])[0], cache_type="system")
        pc.insert_cache(key(path), toks, prefill(model, toks)[0])
        assert len(pc) == 1 and pc.stats_by_type()["system"]["n_sequences"] == 0
    with PromptStore(store_path) as s:  # the store keeps both
        assert sorted(i.n_tokens for i in s.entries()) == [10, 30]


def test_a_memory_hit_restores_nothing_from_the_store(store_path, llama):
    """The index is peeked first: an entry that cannot beat memory is not read."""
    model, _, fp, path = llama
    toks = sample_tokens(40, seed=40)
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(key(path), toks, prefill(model, toks)[0])
        pc.flush()
        assert pc.store.peek(fp, toks + [1]) == 40
        before = pc.store.counters()
        got, rest = pc.fetch_nearest_cache(key(path), toks + [1])
        assert rest == [1]
        assert pc.store.counters() == before  # no store lookup ran
        assert (pc.stats()["memory_hits"], pc.stats()["store_hits"]) == (1, 0)


def test_insert_during_an_open_verify_round_is_refused_not_held(tmp_path, caplog):
    """A hybrid cache whose SSMCache layers are in an open verify round cannot
    be snapshotted (the round rolls back in place): the insert is refused and
    logged. It used to be held in memory as the caller's live layers, and a
    later fetch handed out the rolled-back, extended cache as the prompt's."""
    from mlx_lm import load

    from promptstore.ssm import SSMCache, adapt, make_prompt_cache as ssm_cache

    _, _, _, path = load_fixture("qwen3_next")
    model, _ = load(str(path))  # a private copy: adapt() changes the model
    adapt(model)
    key = (str(path), None, None)
    prompt = sample_tokens(8, seed=3)
    pc = PersistentPromptCache(tmp_path / "s", ssm_layers=True)
    try:
        cache = ssm_cache(model)
        mx.eval(model(mx.array([prompt]), cache=cache))
        for c in cache:
            if isinstance(c, SSMCache):
                c.begin_round()
        mx.eval(model(mx.array([[100, 101, 102]]), cache=cache))
        with caplog.at_level(logging.WARNING, logger="promptstore"):
            pc.insert_cache(key, prompt, cache)
        assert "speculative round is open" in caplog.text
        assert pc.stats()["errors"] == 1 and len(pc) == 0
        got, rest = pc.fetch_nearest_cache(key, prompt + [55])
        assert got is None and rest == prompt + [55]
    finally:
        pc.close()


def test_the_memory_tier_trims_through_the_codecs_as_the_store_does(store_path, llama):
    """It trimmed with mlx-lm's trim_prompt_cache: a ConcatenateKVCache kept
    every position with a lower offset (the next token then attended to the
    dropped ones), and a chunked window past its first chunk was "trimmed"
    below its start, claiming tokens it no longer held (a serving reviewer's
    findings). Both now serve what the store serves."""
    from mlx_lm.models.cache import ChunkedKVCache, ConcatenateKVCache

    model, _, _, path = llama
    toks = sample_tokens(30, seed=12)
    cache = [ConcatenateKVCache() for _ in model.layers]
    model(mx.array(toks)[None], cache=cache)
    mx.eval([c.state for c in cache])
    query = toks[:10] + [400, 401]
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(key(path), toks, cache)
        pc.flush()
        mem, rest = pc.fetch_nearest_cache(key(path), query)
        assert rest == [400, 401] and mem[0].keys.shape[2] == mem[0].offset == 10
    with PersistentPromptCache(store_path) as pc:
        stored, rest = pc.fetch_nearest_cache(key(path), query)
        assert rest == [400, 401] and same(mem, stored)

    chunked = [ChunkedKVCache(16) for _ in model.layers]
    for t in toks:  # llama4 moves the window before each forward
        for c in chunked:
            c.maybe_trim_front()
        model(mx.array([[t]]), cache=chunked)
    mx.eval([c.state[:2] for c in chunked])
    assert chunked[0].start_position > 10
    with PersistentPromptCache(store_path.parent / "chunked", persist=False) as pc:
        pc.insert_cache(key(path), toks, chunked)
        assert pc.fetch_nearest_cache(key(path), query) == (None, query)  # it holds none of the first 10 any more


def test_memory_counts_the_buffers_its_views_keep_alive(store_path, llama):
    """mlx-lm's KVCache grows 256 positions at a time; a view of 10 of them
    keeps the whole buffer alive. Only the 10 were counted: under a 1 MiB
    budget it held 26 MB (a serving reviewer's finding)."""
    model, _, _, path = llama
    cache = make_prompt_cache(model)
    model(mx.array(sample_tokens(10, seed=3))[None], cache=cache)
    mx.eval([c.state for c in cache])
    assert cache[0].keys.shape[2] == 256
    buffers = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    with PersistentPromptCache(store_path, persist=False) as pc:
        pc.insert_cache(key(path), sample_tokens(10, seed=3), cache)
        assert pc.nbytes == buffers and pc.stats_by_type()["assistant"]["n_bytes"] == buffers


def test_a_layer_without_a_codec_is_held_as_a_snapshot(store_path, llama):
    """Such layers (a model's own cache class) were held as the caller's own
    objects: generating on after a checkpoint insert grew the held entry, and
    a fetch claimed 19 tokens with layers covering 24 (a serving reviewer's finding)."""
    from mlx_lm.models.cache import KVCache

    class ModelKV(KVCache):  # no codec is registered for it
        pass

    model, _, _, path = llama
    prompt = sample_tokens(20, seed=5)
    cache = [ModelKV() for _ in model.layers]
    model(mx.array(prompt[:-1])[None], cache=cache)
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(key(path), prompt[:-1], cache, cache_type="user")
        model(mx.array(prompt[-1:] + [7, 8, 9, 10])[None], cache=cache)  # the loop goes on
        got, rest = pc.fetch_nearest_cache(key(path), prompt[:-1] + [42])
        assert rest == [42] and [c.offset for c in got] == [19] * len(got)


def test_close_with_a_timeout_returns_in_time_and_never_raises(store_path, llama):
    """Another process holds the LMDB write lock. With the writer waiting for
    it, close(timeout=1.0) took 62 s and then raised StoreUnavailable from the
    owned store's close; with only a use to record (a memory hit), it waited
    for the lock as long as the other process held it (reviewers' findings)."""
    import threading

    model, _, fp, path = llama
    first, toks = sample_tokens(12, seed=2), sample_tokens(20, seed=1)
    for pending_write in (False, True):
        where = store_path / str(pending_write)
        pc = PersistentPromptCache(where)
        pc.insert_cache(key(path), first, prefill(model, first)[0])
        assert pc.flush(30)
        locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(where)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        release = threading.Timer(4.0, lambda: (locker.stdin.write("\n"), locker.stdin.flush()))
        try:
            assert locker.stdout.readline().strip() == "locked"
            if pending_write:
                pc.insert_cache(key(path), toks, prefill(model, toks)[0])
            assert pc.fetch_nearest_cache(key(path), first + [5])[1] == [5]  # a memory hit: a use to record at close
            release.start()
            t0 = time.perf_counter()
            pc.close(timeout=1.0)
            assert time.perf_counter() - t0 < 3
        finally:
            release.join()
            locker.wait(10)
        for _ in range(100):  # what was pending goes through once the lock is free; the store then closes
            if pc.store._env is None or pc.store._env.closed:
                break
            time.sleep(0.1)
        with PromptStore(where) as s:
            assert sorted(i.n_tokens for i in s.entries()) == ([12, 20] if pending_write else [12])


def test_a_trimmable_insert_keeps_the_held_prefixes_below_its_floor(store_path, llama):
    """A chunked window past its start cannot be trimmed to a 12-token
    prefix, yet inserting it dropped the held 12-token checkpoint, as any
    trimmable cache drops its prefixes: the next fetch missed (a reviewer's finding)."""
    from mlx_lm.models.cache import ChunkedKVCache

    model, _, _, path = llama
    toks = sample_tokens(30, seed=12)
    chunked = [ChunkedKVCache(16) for _ in model.layers]
    with PersistentPromptCache(store_path, persist=False) as pc:
        for i, t in enumerate(toks):
            for c in chunked:
                c.maybe_trim_front()
            model(mx.array([[t]]), cache=chunked)
            mx.eval([c.state[:2] for c in chunked])
            if i == 11:
                pc.insert_cache(key(path), toks[:12], chunked)
        assert chunked[0].start_position > 12
        pc.insert_cache(key(path), toks, chunked)
        assert len(pc) == 2 and pc.fetch_nearest_cache(key(path), toks[:12] + [500])[1] == [500]
