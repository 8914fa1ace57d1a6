"""Prefix hits on longer trimmable entries read only the shared blocks they need.

A lookup that trims a stored entry down to the query's common prefix reads
the entry's blocks up to the first bound that covers the prefix (not the
whole entry), then trims the rest of that block. The result must equal the
stored cache's prefix bit for bit, and continue like it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import CacheList, ChunkedKVCache, ConcatenateKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from _bits import bits_equal
from _raw import flip_block
from conftest import greedy, load_fixture, sample_tokens
from promptstore import PromptStore
from promptstore.jobs.prefill import prefill
from promptstore.store import _keys

MODEL = "m@0123456789abcdef"


def kv(n: int, cls=KVCache, seed: int = 0):
    c = cls()
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
    c.update_and_fetch(k, k * 3)
    return c


def arrays_of(layer):
    if isinstance(layer, CacheList):
        return [a for c in layer.caches for a in arrays_of(c)]
    if isinstance(layer.keys, tuple):
        return list(layer.keys) + list(layer.values)
    return [layer.keys, layer.values]


def prefix_of(a, n):
    return a[..., :n, :]


def block_damage(store: PromptStore, tokens, index: int) -> None:
    """Flip one byte in the ``index``-th block of the entry at ``tokens``."""
    with store.env.read() as txn:
        man = store._manifest(txn, _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens)))
    flip_block(store, man.layers[0].arrays[0].parts[index], bit=0x40)


@pytest.mark.parametrize(
    "make",
    [
        lambda n: [kv(n), kv(n, seed=1)],
        lambda n: [kv(n, ConcatenateKVCache)],
        lambda n: [_quantized(n)],
        lambda n: [kv(n, lambda: ChunkedKVCache(4096))],
        lambda n: [CacheList(kv(n), kv(n, ConcatenateKVCache, seed=2))],
    ],
    ids=["kv", "kv.concat", "kv.quantized", "kv.chunked", "list"],
)
def test_prefix_hit_reads_only_the_blocks_it_needs(tmp_path, make):
    store = PromptStore(tmp_path / "s", block_tokens=256)
    n, want = 4000, 1000
    cache = make(n)
    tokens = list(range(n))
    whole = store.put(MODEL, tokens, cache).nbytes
    hit = store.lookup(MODEL, tokens[:want] + [9] * 5)
    assert hit.matched == want and hit.trimmed == n - want
    # Bounds of a first put fall on multiples of 256: 1000 tokens need 4 blocks (1024 tokens).
    assert hit.bytes_read == whole * 1024 // n
    for got, ref in zip(hit.cache, cache):
        assert all(c.offset == want for c in (got.caches if isinstance(got, CacheList) else [got]))
        for a, b in zip(arrays_of(got), arrays_of(ref)):
            # mlx-lm's ChunkedKVCache trims by lowering its offset alone; the rest trim their arrays.
            assert a.shape[-2] == (1024 if isinstance(got, ChunkedKVCache) else want)
            assert bits_equal(prefix_of(a, want), prefix_of(b, want))
    store.close()


def _quantized(n):
    c = QuantizedKVCache(group_size=32, bits=4)
    x = mx.random.normal((1, 2, n, 64), key=mx.random.key(5))
    c.update_and_fetch(x, -x)
    return c


def test_exact_hit_and_whole_reads_count_every_byte(tmp_path):
    store = PromptStore(tmp_path / "s", block_tokens=256)
    tokens = list(range(600))
    info = store.put(MODEL, tokens, [kv(600)])
    hit = store.lookup(MODEL, tokens + [1])
    assert hit.matched == 600 and hit.bytes_read == info.nbytes
    # A prefix that ends inside the last block reads it all: nothing to save.
    hit = store.lookup(MODEL, tokens[:590] + [7])
    assert hit.matched == 590 and hit.bytes_read == info.nbytes
    store.close()


def test_chunked_window_not_from_token_zero_is_read_whole(tmp_path):
    store = PromptStore(tmp_path / "s", block_tokens=256)
    c = ChunkedKVCache(512)
    x = mx.random.normal((1, 2, 1000, 8))
    c.update_and_fetch(x, x)
    c.maybe_trim_front()  # keeps the last chunk: start_position > 0
    assert c.start_position > 0
    tokens = list(range(1000))
    info = store.put(MODEL, tokens, [c])
    assert info.shared == 0  # its arrays do not span the entry's tokens: they stay in its own payload
    hit = store.lookup(MODEL, tokens[:990] + [3])
    assert hit.matched == 990 and hit.bytes_read == info.nbytes
    store.close()


def test_damage_past_the_prefix_does_not_touch_a_prefix_hit(tmp_path):
    """Everything a prefix hit reads is checked; what it does not need it
    does not read. The whole entry still fails closed."""
    store = PromptStore(tmp_path / "s", block_tokens=256)
    tokens = list(range(3000))
    cache = [kv(3000)]
    store.put(MODEL, tokens, cache)
    block_damage(store, tokens, 10)  # tokens 2560..3000
    hit = store.lookup(MODEL, tokens[:1000] + [4])
    assert hit is not None and hit.matched == 1000
    assert bits_equal(hit.cache[0].keys, cache[0].keys[..., :1000, :])
    assert store.lookup(MODEL, tokens + [4]) is None  # the whole entry is damaged: skipped
    block_damage(store, tokens, 1)  # now inside the prefix's blocks too
    assert store.lookup(MODEL, tokens[:1000] + [4]) is None
    assert len(store.verify().problems) == 1
    store.close()


@pytest.mark.shape_dependent
def test_prefix_hit_continues_like_a_fresh_prefill():
    """On the dense fixture: a 700-token prefix of a stored 2000-token entry,
    read block-wise, generates what the stored cache's own prefix generates."""
    model, _, _, _ = load_fixture("llama")
    tokens = sample_tokens(2000, seed=3)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache=cache)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        store = PromptStore(d, block_tokens=256)
        store.put(MODEL, tokens, cache)
        query = tokens[:700] + [5, 6]
        hit = store.lookup(MODEL, query)
        assert hit.matched == 700 and hit.bytes_read < store.info(hit.info.id).nbytes // 2
        ref = make_prompt_cache(model)
        prefill(model, tokens[:700], cache=ref)
        for a, b in zip(hit.cache, ref):
            assert bits_equal(a.keys[..., :700, :], b.keys[..., :700, :])
        logits = model(mx.array([query[700:]]), cache=hit.cache)
        ref_logits = model(mx.array([query[700:]]), cache=ref)
        assert bits_equal(logits, ref_logits)
        got_toks, got_logits = greedy(model, hit.cache, logits, 6)
        ref_toks, ref_logits_ = greedy(model, ref, ref_logits, 6)
        assert got_toks == ref_toks
        assert all(bits_equal(a, b) for a, b in zip(got_logits, ref_logits_))
        store.close()
