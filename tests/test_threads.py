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

from _workers import MODEL, same_cache
from promptstore import PromptStore, _entry, _pages
from promptstore import _bench_data as data


def test_gets_from_several_threads_at_once_are_exact(tmp_path):
    lengths = (4096, 4096, 4096, 512)
    caches = [data.hybrid_cache(data.QUICK, n, seed=s) for s, n in enumerate(lengths)]
    toks = [[s + 1] + list(range(2, n + 1)) for s, n in enumerate(lengths)]
    with PromptStore(tmp_path / "s") as store:
        sizes = [store.put(MODEL, t, c).nbytes for t, c in zip(toks, caches)]
        assert min(sizes[:3]) >= _pages.MIN_PAYLOAD > sizes[3]  # three read with pread, one copied from the map
        assert min(sizes) > _entry.CHUNK  # arrays spanning chunks in both paths
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
