"""The serving cache and the store's byte budget (found by a reviewer).

* A use served from the memory tier is a use of the stored entry: the
  entry a server hands out most is not the first one the budget evicts.
* An entry the budget evicted is written again when the server makes it
  again: the cache's record of what it has stored no longer stops it.
"""

from __future__ import annotations

from conftest import load_fixture, sample_tokens
from test_serving import key, prefill

from promptstore import PromptStore
from promptstore.serving import PersistentPromptCache


def _entry_bytes(store: PromptStore, fp, toks) -> int:
    return next(i.nbytes for i in store.entries() if i.model == fp and i.n_tokens == len(toks))


def test_an_entry_served_from_memory_is_not_evicted_first(store_path):
    model, _, fp, path = load_fixture("llama")
    hot = sample_tokens(40, seed=1)
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(key(path), hot, prefill(model, hot)[0])
        assert pc.flush(30)
    with PromptStore(store_path) as s:
        s.set_budget(int(2.5 * _entry_bytes(s, fp, hot)))  # the hot entry and one other
    with PersistentPromptCache(store_path) as pc:
        assert pc.fetch_nearest_cache(key(path), hot + [5])[0] is not None  # from the store, then held
        for i in range(4):
            got, rest = pc.fetch_nearest_cache(key(path), hot + [7 + i])  # from memory
            assert got is not None and rest == [7 + i]
            other = sample_tokens(40, seed=10 + i)
            pc.insert_cache(key(path), other, prefill(model, other)[0])
            assert pc.flush(30)
        assert pc.stats()["memory_hits"] >= 4
    with PromptStore(store_path) as s:
        kept = sorted(i.n_tokens for i in s.entries())
        assert s.exists(fp, hot), kept  # before: the oldest by the store's record, evicted first


def test_an_entry_the_budget_evicted_is_written_again(store_path):
    model, _, fp, path = load_fixture("llama")
    x = sample_tokens(40, seed=2)
    x_cache = prefill(model, x)[0]
    with PersistentPromptCache(store_path) as pc:
        pc.insert_cache(key(path), x, x_cache)
        assert pc.flush(30)
        pc.store.set_budget(int(2.5 * _entry_bytes(pc.store, fp, x)))
        for i in range(3):  # fillers: the budget evicts x, the oldest
            other = sample_tokens(40, seed=20 + i)
            pc.insert_cache(key(path), other, prefill(model, other)[0])
            assert pc.flush(30)
        assert not pc.store.exists(fp, x)
        written = pc.stats()["written"]
        pc.insert_cache(key(path), x, x_cache)  # the server made it again
        assert pc.flush(30)
        assert pc.stats()["written"] == written + 1
        assert pc.store.exists(fp, x)  # before: never written again while the server ran
