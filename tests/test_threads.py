"""Restores from several threads of one process.

Large entries are read on one shared two-thread pool into buffers mlx's
loader allocates on the calling thread's stream; small ones are copied out
of the map on the calling thread. An mlx stream belongs to the thread that
made it (an earlier read path that kept its own streams failed from a second
thread with "There is no Stream(cpu, 1) in current thread"). A forked child
cannot restore once the parent has evaluated anything in mlx: mlx's own
threads do not survive fork() and its first eval hangs, with or without
promptstore.
"""

from __future__ import annotations

import threading

import pytest

from _raw import audit_blocks, referrers
from _content import MODEL, same_cache
from promptstore import PromptStore
from promptstore.format import _entry, _pages
from promptstore.bench import _data as data


def _sharing(caches):
    """``caches`` with the KV of the first in every one (cut to its length):
    their entries then reference the same shared blocks."""
    from mlx_lm.models.cache import KVCache

    out = [caches[0]]
    for cache in caches[1:]:
        layers = []
        for mine, first in zip(cache, caches[0]):
            if type(mine) is KVCache:
                kv = KVCache()
                kv.keys, kv.values = first.keys[..., : mine.offset, :], first.values[..., : mine.offset, :]
                kv.offset = mine.offset
                mine = kv
            layers.append(mine)
        out.append(layers)
    return out


@pytest.mark.parametrize("shared_blocks", [True, False], ids=["shared-blocks", "payload"])
def test_gets_from_several_threads_at_once_are_exact(tmp_path, shared_blocks):
    """With shared blocks every entry's KV is in the same blocks, which the
    threads read at once; the recurrent state of each is its own payload."""
    lengths = (4096, 4096, 4096, 512)
    caches = [data.hybrid_cache(data.QUICK, n, seed=s) for s, n in enumerate(lengths)]
    if shared_blocks:
        caches = _sharing(caches)
    toks = [[s + 1] + list(range(2, n + 1)) for s, n in enumerate(lengths)]
    with PromptStore(tmp_path / "s", shared_blocks=shared_blocks, block_tokens=256) as store:  # the block counts below
        sizes = [store.put(MODEL, t, c).nbytes for t, c in zip(toks, caches)]
        assert min(sizes[:3]) >= _pages.MIN_PAYLOAD > sizes[3]  # three read with pread, one copied from the map
        assert min(sizes) > _entry.CHUNK  # arrays spanning chunks in both paths
        if shared_blocks:  # the 512-token entry's blocks are the first two of the others'
            assert audit_blocks(store) == 3 * 2 * 16 + 2 * 2 and len(referrers(store)) == 2 * 16
        errors = []

        def reader(k):
            try:
                for r in range(4):
                    j = (k + r) % 4
                    assert same_cache(store.get(MODEL, toks[j]), caches[j])
            except BaseException as err:  # noqa: BLE001
                errors.append(err)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def test_compacting_in_one_thread_while_others_get(tmp_path):
    """A compaction waits for this process's open transactions, dropping its
    lock meanwhile; a reader that switched generations in that window made the
    compacting thread open the new generation twice ("already open")."""
    import time

    caches = [data.hybrid_cache(data.QUICK, 1024, seed=s) for s in range(2)]
    toks = [[s + 1] + list(range(2, 1025)) for s in range(2)]
    with PromptStore(tmp_path / "s") as store:
        for t, c in zip(toks, caches):
            store.put(MODEL, t, c)
        stop = time.monotonic() + 5
        errors, gets, compactions = [], [0], [0]

        def reader(k):
            try:
                while time.monotonic() < stop:
                    assert same_cache(store.get(MODEL, toks[k % 2]), caches[k % 2])
                    gets[0] += 1
            except BaseException as err:  # noqa: BLE001
                errors.append(err)

        def compacter():
            try:
                while time.monotonic() < stop:
                    store.env.compact()
                    compactions[0] += 1
            except BaseException as err:  # noqa: BLE001
                errors.append(err)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(3)] + [threading.Thread(target=compacter)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert compactions[0] >= 3 and gets[0] >= 10


def test_prefix_hashes_from_threads_growing_the_power_tables(monkeypatch):
    """The power tables behind the index hashes grow on demand; threads that
    race to grow them (puts and lookups of ever longer prompts) each hash
    with a consistent pair of tables: the same hashes one thread computes."""
    import numpy as np

    from promptstore.store import _keys

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, size=n, dtype=np.uint32) for n in range(1, 6000, 37)]
    expected = [_keys.prefix_hashes(p) for p in prompts]
    for _attempt in range(10):
        monkeypatch.setattr(_keys, "_tables", (np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64)))
        errors, start = [], threading.Barrier(4)

        def hasher(k):
            try:
                start.wait()
                for i in range(k, len(prompts), 2):
                    assert np.array_equal(_keys.prefix_hashes(prompts[i]), expected[i])
            except BaseException as err:  # noqa: BLE001
                errors.append(err)

        threads = [threading.Thread(target=hasher, args=(k % 2,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []


def test_puts_that_grow_the_map_while_other_threads_get(tmp_path):
    """A put that finds the map full doubles it, and py-lmdb invalidates every
    open transaction of the environment it resizes: the put waits until the
    other threads' reads are done, so they never fail ("Attempt to operate
    on closed/deleted/dropped object"), and it is not starved by them."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    def kv(i, n):
        c = KVCache()
        k = mx.random.normal((1, 4, n, 128), key=mx.random.key(i))
        c.update_and_fetch(k, -k)
        return c

    store = PromptStore(tmp_path / "s", map_size=1 << 20, shared_blocks=False)
    first = kv(0, 64)
    store.put(MODEL, [0] * 64, [first])
    stop, errors, reads = threading.Event(), [], [0]

    def reader():
        while not stop.is_set():
            try:
                got = store.get(MODEL, [0] * 64)
                assert same_cache(got, [first])
                reads[0] += 1
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(repr(err))
                return

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(1, 60):  # 256 KiB payloads, kept in LMDB: the 1 MiB map doubles several times
            store.put(MODEL, [i] * 128, [kv(i, 128)])
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert errors == [] and reads[0] > 0
    assert store.env.env.info()["map_size"] >= 16 << 20
    assert same_cache(store.get(MODEL, [59] * 128), [kv(59, 128)])
    store.close()


def test_hits_and_misses_counted_once_while_threads_put(tmp_path):
    """Each write transaction writes the hits and misses recorded so far.
    Kept recorded until the commit's callback, they were written again by
    another thread's transaction begun in between (6,865 misses stored for
    6,000 lookups): taken at once, they are put back only if it aborts."""
    from mlx_lm.models.cache import KVCache
    import mlx.core as mx

    def kv(n, v):
        c = KVCache()
        k = mx.full((1, 1, n, 8), v, dtype=mx.float16)
        c.update_and_fetch(k, k)
        return c

    lookups, puts = 1500, 150
    with PromptStore(tmp_path / "s", shared_blocks=False) as store:
        def reader(i):
            for j in range(lookups):
                assert store.lookup(MODEL, [10_000 + i, j]) is None

        def writer(i):
            for j in range(puts):
                store.put(MODEL, [i, j, 1, 2], [kv(4, float(j))])
                store.flush()

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
        threads += [threading.Thread(target=writer, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.counters() == {"hits": 0, "misses": 2 * lookups}
