"""Restores from several threads of one process.

Each restore faults in its destinations on two mlx CPU streams; an mlx
stream belongs to the thread that made it, so each thread gets its own (a
get from a second thread used to fail with "There is no Stream(cpu, 1) in
current thread"). A forked child cannot restore once the parent has
evaluated anything in mlx: mlx's own threads do not survive fork() and its
first eval hangs, with or without promptstore.
"""

from __future__ import annotations

import threading

from _workers import MODEL, same_cache
from promptstore import PromptStore, _entry
from promptstore import _bench_data as data


def test_gets_from_several_threads_at_once_are_exact(tmp_path):
    caches = [data.hybrid_cache(data.QUICK, 4096, seed=s) for s in range(3)]
    toks = [[s + 1] + list(range(2, 4097)) for s in range(3)]
    with PromptStore(tmp_path / "s") as store:
        for t, c in zip(toks, caches):
            assert store.put(MODEL, t, c).nbytes > 2 * _entry.CHUNK  # arrays spanning chunks: the streams run
        errors = []

        def reader(k):
            try:
                for r in range(4):
                    j = (k + r) % 3
                    assert same_cache(store.get(MODEL, toks[j]), caches[j])
            except BaseException as err:  # noqa: BLE001
                errors.append(err)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
