"""Batch rows: typed errors, empty slots, extract_cache results, SSMCache and
CacheList rows, and merge_rows joining restored rows to a batch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    RotatingKVCache,
)

from conftest import HYBRIDS, MODEL_NAMES, load_fixture, sample_tokens
from promptstore import CoverageMismatch, InvalidInput
from promptstore.jobs.prefill import prefill
from promptstore.rows import extract_row, merge_rows, row_count, row_coverage
from test_rows import _batch_state, run_batch
from _bits import bits_equal


def _kv(n: int, seed: int, heads: int = 2, dim: int = 16) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, heads, n, dim), key=mx.random.key(seed))
    v = mx.random.normal((1, heads, n, dim), key=mx.random.key(seed + 1000))
    c.update_and_fetch(k, v)
    return c


def _payload(cache):
    """The covered arrays of every layer, as the codecs write them."""
    from promptstore.codecs import encode_layer

    return [a for layer in cache for a in encode_layer(layer).arrays.values()]


def _running(name: str, k_save: int = 3):
    """A BatchGenerator of 4 rows stopped after ``k_save`` tokens: (gen, fp, model)."""
    model, _, fp, _ = load_fixture(name)
    gen = BatchGenerator(model, max_tokens=20)
    gen.insert([sample_tokens(n, seed=40 + i) for i, n in enumerate((6, 13, 21, 9))])
    for _ in range(k_save):
        gen.next_generated()
    return gen, fp, model


# -- typed errors -----------------------------------------------------------------------


def test_row_out_of_range_is_invalid_input(store):
    gen, fp, _ = _running("qwen3_next")
    batch = gen._generation_batch
    for bad in (4, 17, -1):
        with pytest.raises(InvalidInput, match="out of range for a batch of 4 rows"):
            store.put_row(fp, list(batch.tokens[0]), batch.prompt_cache, bad)
    for bad in (True, "0", 1.0):
        with pytest.raises(InvalidInput, match="row must be an integer index"):
            store.put_row(fp, list(batch.tokens[0]), batch.prompt_cache, bad)
    with pytest.raises(InvalidInput, match="out of range"):
        extract_row(batch.prompt_cache, 4)
    assert list(store.entries()) == []


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_coverage_mismatch_writes_nothing(name, store):
    gen, fp, _ = _running(name)
    batch = gen._generation_batch
    tokens = list(batch.tokens[2])
    for wrong in (tokens[:-1], tokens + [7], list(batch.tokens[1])):
        with pytest.raises(CoverageMismatch, match=rf"row 2: layer \d+ \(\w+\) covers {len(tokens)} tokens but {len(wrong)}"):
            store.put_row(fp, wrong, batch.prompt_cache, 2)
    with pytest.raises(InvalidInput, match="tokens"):
        store.put_row(fp, [], batch.prompt_cache, 2)
    assert list(store.entries()) == []
    info = store.put_row(fp, tokens, batch.prompt_cache, 2)
    assert info.n_tokens == len(tokens)


def test_rows_from_other_kinds_refused():
    class MyKV(KVCache):
        pass

    with pytest.raises(InvalidInput, match="cannot take a row of a .*MyKV"):
        row_count([MyKV()])
    with pytest.raises(InvalidInput, match="different numbers of rows"):
        row_count([BatchKVCache([0, 0]), BatchKVCache([0, 0, 0])])
    with pytest.raises(InvalidInput, match="list of layer caches"):
        extract_row(BatchKVCache([0]), 0)


def test_batch_between_prepare_and_finalize_refused():
    batch = merge_rows(None, [[_kv(5, 1)], [_kv(9, 2)]])
    batch[0].prepare(lengths=[3, 1], right_padding=[0, 2])
    with pytest.raises(InvalidInput, match="between prepare\\(\\) and finalize\\(\\)"):
        row_coverage(batch, 0)


# -- ArraysCache empty slots: mlx-lm's TypeError never reaches a user ----------------------


def test_arrays_cache_empty_slots(store):
    empty = ArraysCache(2, left_padding=[0, 0, 0])
    with pytest.raises(TypeError):
        empty.extract(1)  # mlx-lm's own extract slices None
    row = extract_row([empty], 1)
    assert type(row[0]) is ArraysCache and row[0].cache == [None, None]
    assert row[0].left_padding is None and row[0].lengths is None
    with pytest.raises(CoverageMismatch, match="no layer of this batch can tell"):
        store.put_row("m@x", [1, 2], [empty], 1)

    half = ArraysCache(2)
    half[0] = mx.arange(3 * 2 * 4, dtype=mx.float32).reshape(3, 2, 4)
    kv = merge_rows(None, [[_kv(4, i)] for i in range(3)])[0]
    info = store.put_row("m@x", [5, 6, 7, 8], [half, kv], 2)
    cache = store.get("m@x", [5, 6, 7, 8])
    assert cache[0].cache[1] is None
    assert bits_equal(cache[0].cache[0], half[0][2:3])
    assert info.kinds == ("arrays", "kv")


def test_rows_with_a_slot_none_of_them_holds_merge(store):
    """mlx-lm's ArraysCache.merge stops (StopIteration) at a slot no row
    holds; merge_rows joins the others and leaves that one empty."""
    rows = []
    for i in range(3):
        half = ArraysCache(2)
        half[0] = mx.full((1, 2, 4), float(i))
        rows.append([half, _kv(4, i)])
    batch = merge_rows(None, rows)
    assert batch[0].cache[1] is None and batch[0].cache[0].shape == (3, 2, 4)
    for i in range(3):
        row = extract_row(batch, i)
        assert row[0].cache[1] is None and bits_equal(row[0].cache[0], rows[i][0][0])
    store.put_row("m@x", [5, 6, 7, 8], batch, 1)
    got = store.get("m@x", [5, 6, 7, 8])
    assert got[0].cache[1] is None and bits_equal(got[0].cache[0], rows[1][0][0])
    joined = merge_rows(batch, [rows[0]])  # a row joins a running batch the same way
    assert joined[0].cache[1] is None and bits_equal(joined[0].cache[0][3:], rows[0][0][0])
    firsts = []  # slot 0 unused: mlx-lm's merge took every row for empty and dropped slot 1
    for i in range(3):
        later = ArraysCache(2)
        later[1] = mx.full((1, 2, 4), float(i + 1))
        firsts.append([later, _kv(4, i)])
    batch = merge_rows(None, firsts)
    assert batch[0].cache[0] is None and bits_equal(extract_row(batch, 1)[0].cache[1], firsts[1][0][1])
    listed = merge_rows(None, [[CacheList(r[0], r[1])] for r in rows])  # the same inside a CacheList
    assert listed[0].caches[0].cache[1] is None and bits_equal(listed[0].caches[0].cache[0][2:], rows[2][0][0])


# -- BatchGenerator.extract_cache results store directly ------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_extract_cache_results_store_directly(name, store):
    gen, fp, model = _running(name)
    uids = list(gen._generation_batch.uids)
    extracted = gen.extract_cache(uids)  # {uid: (serial cache, tokens)}
    for uid, (cache, tokens) in extracted.items():
        info = store.put(fp, tokens, cache)
        assert info.n_tokens == len(tokens)
        got = store.get(fp, tokens)
        assert all(bits_equal(a, b) for a, b in zip(_batch_state(cache), _batch_state(got)))
    # A row inserted with a cache but without all_tokens: its token list misses the
    # cached prefix, and the store says so instead of writing a wrong entry.
    cache, tokens = extracted[uids[0]]
    g2 = BatchGenerator(model, max_tokens=5)
    [u] = g2.insert([[3, 4, 5]], caches=[store.get(fp, tokens)])
    g2.next_generated()
    c2, t2 = g2.extract_cache([u])[u]
    assert len(t2) < len(tokens)
    with pytest.raises(CoverageMismatch):
        store.put(fp, t2, c2)


# -- SSMCache rows (duck typed on row_offset / extract) ---------------------------------------


@pytest.mark.parametrize("name", HYBRIDS)
def test_ssm_cache_rows_save_and_continue(name, store):
    from promptstore.ssm import SSMCache, make_prompt_cache

    model, _, fp, _ = load_fixture(name)
    prompts = [sample_tokens(n, seed=50 + i) for i, n in enumerate((5, 12, 20, 9))]
    saved = {}

    def on_step(k, gen):
        if k == 3:
            batch = gen._generation_batch
            assert any(type(c) is SSMCache for c in batch.prompt_cache)
            for i in range(4):
                covs = row_coverage(batch.prompt_cache, i)
                assert set(covs) == {len(batch.tokens[i])}  # SSM rows report their own coverage
                saved[i] = (list(batch.tokens[i]), store.put_row(fp, list(batch.tokens[i]), batch.prompt_cache, i))

    gen = BatchGenerator(model, max_tokens=9)
    gen.insert(prompts, caches=[make_prompt_cache(model) for _ in prompts])
    toks = {i: [] for i in range(4)}
    k = 0
    while rs := gen.next_generated():
        k += 1
        for r in rs:
            toks[r.uid].append(r.token)
        on_step(k, gen)
    assert toks == run_batch(model, prompts, 9)[0]  # SSMCache is a drop-in
    for i, (tokens, info) in saved.items():
        assert "ssm.gated_delta" in info.kinds
        cache = store.get(fp, tokens)
        g = BatchGenerator(model, max_tokens=5)
        g.insert([[toks[i][3]]], caches=[cache], all_tokens=[tokens])
        out = []
        while rs := g.next_generated():
            out += [r.token for r in rs]
        assert out == toks[i][4:]


# -- CacheList and serial classes with several rows -------------------------------------------


def test_cache_list_rows_round_trip(store):
    serial = [[CacheList(_kv(n, 10 * n), _kv(n, 10 * n + 1, heads=1))] for n in (3, 8, 5)]
    batch = merge_rows(None, serial)
    assert type(batch[0]) is CacheList and type(batch[0].caches[0]) is BatchKVCache
    assert row_coverage(batch, 1) == [8]
    row = extract_row(batch, 2)
    assert all(bits_equal(a, b) for a, b in zip(_payload(row), _payload(serial[2])))
    assert row[0].caches[0].keys.shape[2] == 5  # compact: no capacity padding
    info = store.put_row("m@x", list(range(5)), batch, 2)
    assert info.kinds == ("list(kv,kv)",)


def test_plain_batched_kv_rows():
    keys = mx.random.normal((3, 2, 7, 16))
    c = KVCache()
    c.update_and_fetch(keys, keys + 1)
    r = RotatingKVCache(4)
    r.update_and_fetch(keys, keys * 2)
    assert row_count([c, r]) == 3 and row_coverage([c, r], 1) == [7, 7]
    row = extract_row([c, r], 1)
    assert bits_equal(row[0].keys, keys[1:2]) and row[0].offset == 7
    assert row[1].offset == 7 and row[1].keys.shape[2] == r.keys.shape[2]


# -- merge_rows ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_merge_rows_into_running_batch(name, store):
    """merge_rows(batch, [restored]) continues exactly like merging the live row."""
    model, _, fp, _ = load_fixture(name)
    live_gen, _, _ = _running(name)
    src = live_gen._generation_batch
    tokens = list(src.tokens[1])
    store.put_row(fp, tokens, src.prompt_cache, 1)
    live = extract_row(src.prompt_cache, 1)
    restored = store.get(fp, tokens)

    def running():
        prompts = [sample_tokens(n, seed=60 + i) for i, n in enumerate((4, 10, 7))]
        batch = merge_rows(None, [prefill(model, p) for p in prompts])
        assert row_coverage(batch, 2) == [c if c is None else 7 for c in row_coverage(batch, 2)]
        y = mx.array([p[-1] for p in prompts])
        for _ in range(2):
            y = mx.argmax(model(y[:, None], cache=batch)[:, -1, :], axis=-1)
        return batch, y

    out = []
    for row in (restored, live):
        batch, y = running()
        same = merge_rows(batch, [row])
        assert same is batch and row_count(batch) == 4
        assert [c for c in row_coverage(batch, 3) if c is not None][0] == len(tokens)
        y = mx.concatenate([y, mx.array([tokens[-1] + 1])])
        logits = []
        for _ in range(4):
            lg = model(y[:, None], cache=batch)[:, -1, :]
            mx.eval(lg)
            logits.append(lg)
            y = mx.argmax(lg, axis=-1)
        out.append(logits)
    assert all(bits_equal(a, b) for a, b in zip(*out))


def test_merge_rows_refuses_mismatched_rows():
    rows = [[_kv(3, 1)], [_kv(5, 2)]]
    batch = merge_rows(None, rows)
    assert type(batch[0]) is BatchKVCache and row_coverage(batch, 0) == [3]
    rot = RotatingKVCache(16)
    rot.update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))
    with pytest.raises(InvalidInput, match="cannot join a BatchKVCache"):
        merge_rows(batch, [[rot]])
    with pytest.raises(InvalidInput, match="max_size 8 cannot join a batch of max_size 16"):
        merge_rows(merge_rows(None, [[rot]]), [[RotatingKVCache(8)]])
    assert type(merge_rows(None, [[rot]])[0]) is BatchRotatingKVCache
    wide = RotatingKVCache(32)
    wide.update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))
    with pytest.raises(InvalidInput, match="cannot be merged into one batch: .*same maximum size"):
        merge_rows(None, [[rot], [wide]])  # a new batch: mlx-lm's ValueError escaped untyped
    assert row_coverage(extract_row(batch, np.int64(1)), 0) == [5]  # numpy's integers index rows too
    with pytest.raises(InvalidInput, match="row must be an integer index, not float"):
        extract_row(batch, 1.0)
    with pytest.raises(InvalidInput, match="has 2 layers, expected 1"):
        merge_rows(batch, [[_kv(3, 1), _kv(3, 2)]])
    with pytest.raises(InvalidInput, match="is a BatchKVCache: pass serial caches"):
        merge_rows(None, [merge_rows(None, [[_kv(3, 1)]])])
    with pytest.raises(InvalidInput, match="not a serial"):
        merge_rows(None, [[ArraysCache(2, left_padding=[0, 0])]])
    with pytest.raises(InvalidInput, match="heads, head dims or dtype"):
        merge_rows(batch, [[_kv(3, 7, heads=4)]])
    with pytest.raises(InvalidInput, match="non-empty list"):
        merge_rows(batch, [])
    assert row_count(batch) == 2  # refusals leave the batch as it was


def test_merge_rows_refuses_recurrent_rows_of_other_shapes():
    from promptstore.ssm import SSMCache

    def arrays(d):
        c = ArraysCache(2)
        c[0], c[1] = mx.zeros((1, 3, d)), mx.zeros((1, 2, 4, 4))
        return c

    with pytest.raises(InvalidInput, match="recurrent state shapes"):
        merge_rows(None, [[arrays(8)], [arrays(16)]])
    batch = SSMCache.from_parts(mx.zeros((2, 3, 8)), mx.zeros((2, 2, 4, 4)), [5, 6])
    solo = SSMCache.from_parts(mx.zeros((1, 3, 16)), mx.zeros((1, 2, 4, 4)), [7])
    with pytest.raises(InvalidInput, match="recurrent state shapes"):
        merge_rows([batch], [[solo]])
    assert batch.offsets == [5, 6]


# -- rows taken mid-prefill (the prompt batch) ----------------------------------------------


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next"])
def test_rows_saved_mid_prefill_continue(name, store):
    """Rows saved from BatchGenerator's prompt batch between prefill windows (gemma's
    rotating buffer then holds more than its 16-token window) finish their prompt
    from the restored cache and generate what the uninterrupted batch generated."""
    model, _, fp, _ = load_fixture(name)
    prompts = [sample_tokens(n, seed=70 + i) for i, n in enumerate((40, 30, 12))]
    want = {}
    gen = BatchGenerator(model, max_tokens=6, prefill_step_size=12)
    gen.insert(prompts)
    gen.next()
    gen.next()
    pb = gen._prompt_batch
    assert list(pb.uids) == [0, 1]
    saved = {}
    for i in range(2):
        tokens = list(pb.tokens[i])
        assert tokens == prompts[i][:24]
        saved[i] = store.put_row(fp, tokens, pb.prompt_cache, i)
    if name == "gemma3_text":
        rot = [c for c in pb.prompt_cache if type(c) is BatchRotatingKVCache]
        assert rot and rot[0].keys.shape[2] > rot[0].max_size
    while True:
        prs, grs = gen.next()
        if not prs and not grs:
            break
        for r in grs:
            want.setdefault(r.uid, []).append(r.token)
    for i, info in saved.items():
        cache = store.get(fp, prompts[i][:24])
        g = BatchGenerator(model, max_tokens=6, prefill_step_size=12)
        g.insert([prompts[i][24:]], caches=[cache], all_tokens=[prompts[i][:24]])
        out = []
        while rs := g.next_generated():
            out += [r.token for r in rs]
        assert out == want[i], (i, out, want[i])


def _arrays_row(slots, seed: int) -> ArraysCache:
    """A serial ArraysCache whose slots are arrays of these ``(shape, dtype)``."""
    layer = ArraysCache(len(slots))
    for i, (shape, dtype) in enumerate(slots):
        layer[i] = mx.random.normal((1, *shape), key=mx.random.key(seed + i)).astype(dtype)
    return layer


def test_merge_rows_joins_single_slot_arrays_rows(store):
    """LFM2-style layers (ArraysCache(size=1) conv + KVCache): slot_signature
    read a second slot that is not there (a raw IndexError)."""
    conv = [((64, 3), mx.float16)]
    rows = []
    for r in range(3):
        toks = list(range(100, 105 + r))
        store.put("m@lfm2-like", toks, [_arrays_row(conv, r), _kv(5 + r, r)])
        rows.append(store.get("m@lfm2-like", toks))
    batch = merge_rows(None, rows[:2])
    assert type(batch[0]) is ArraysCache and len(batch[0].cache) == 1 and row_count(batch) == 2
    merge_rows(batch, rows[2:])
    assert row_count(batch) == 3 and row_coverage(batch, 2) == [None, 7]
    assert bits_equal(extract_row(batch, 2)[0][0], rows[2][0][0])
    with pytest.raises(InvalidInput, match="recurrent state shapes"):
        merge_rows(batch, [[_arrays_row([((64, 4), mx.float16)], 9), _kv(4, 9)]])
    assert row_count(batch) == 3


def _unchanged(batch, before) -> bool:
    """Whether ``batch`` holds exactly the arrays ``before`` (from ``_batch_state``)."""
    after = _batch_state(batch)
    return len(after) == len(before) and all(
        a.shape == b.shape and a.dtype == b.dtype and bool(bits_equal(a, b)) for a, b in zip(after, before)
    )


FOUR_SLOTS = [((3, 8), mx.float32), ((2, 4, 4), mx.float32), ((3, 8), mx.bfloat16), ((2, 4, 4), mx.float32)]


@pytest.mark.parametrize("odd", [((3, 9), mx.bfloat16), ((3, 8), mx.float32)], ids=["shape", "dtype"])
def test_merge_rows_compares_every_recurrent_slot(odd):
    """ArraysCache(size=4) rows (kimi_linear / olmo_hybrid style) that differ
    only in slot 2: a shape raised mlx's ValueError after the KV layer was
    extended, a dtype joined silently and promoted the batch's slot."""
    batch = merge_rows(None, [[_kv(4, s), _arrays_row(FOUR_SLOTS, s)] for s in (0, 10)])
    before = _batch_state(batch)
    other = FOUR_SLOTS[:2] + [odd] + FOUR_SLOTS[3:]
    with pytest.raises(InvalidInput, match="layer 1: rows disagree on recurrent state shapes or dtypes"):
        merge_rows(batch, [[_kv(4, 20), _arrays_row(other, 20)]])
    assert _unchanged(batch, before) and batch[1].cache[2].dtype == mx.bfloat16
    with pytest.raises(InvalidInput, match="recurrent state shapes or dtypes"):
        merge_rows(None, [[_kv(4, 0), _arrays_row(FOUR_SLOTS, 0)], [_kv(4, 20), _arrays_row(other, 20)]])
    with pytest.raises(InvalidInput, match="recurrent state shapes or dtypes"):  # another number of slots
        merge_rows(batch, [[_kv(4, 20), _arrays_row(FOUR_SLOTS[:3], 20)]])
    assert _unchanged(batch, before)


def test_a_join_mlx_lm_refuses_on_a_later_layer_changes_no_layer():
    """A batch layer whose own state mlx-lm's extend refuses (values of other
    heads than its keys): the layers before it are left as they were."""
    batch = merge_rows(None, [[_kv(4, s), _kv(4, s + 1)] for s in (0, 10)])
    batch[1].values = mx.zeros((2, 4, batch[1].values.shape[2], 16))
    before = _batch_state(batch)
    with pytest.raises(InvalidInput, match="layer 1: .*cannot join"):
        merge_rows(batch, [[_kv(4, 20), _kv(4, 21)]])
    assert _unchanged(batch, before) and row_count(batch) == 2
    # a serial KVCache run with B > 1 has no extend: refused before the first layer is extended
    plain = merge_rows(None, [[_kv(4, s)] for s in (0, 10)]) + [KVCache()]
    plain[1].update_and_fetch(mx.zeros((2, 2, 4, 16)), mx.zeros((2, 2, 4, 16)))
    before = _batch_state(plain)
    with pytest.raises(InvalidInput, match="layer 1: a KVCache holding the rows of a plain batched forward"):
        merge_rows(plain, [[_kv(4, 20), _kv(4, 21)]])
    assert _unchanged(plain, before) and row_count(plain) == 2
