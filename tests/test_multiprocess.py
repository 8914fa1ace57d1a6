"""Two spawned processes write and read one store at the same time."""

from __future__ import annotations

import multiprocessing as mp
import os



def _worker(path: str, me: int, other: int, n: int, queue) -> None:
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from promptstore import PromptStore

    def cache(i, who):
        c = KVCache()
        c.keys = mx.full((1, 2, 64 + i, 32), who * 1000 + i, mx.float16)
        c.values = mx.full((1, 2, 64 + i, 32), -(who * 1000 + i), mx.float16)
        c.offset = 64 + i
        return [c]

    def toks(i, who):
        return [who + 3] * 10 + list(range(5, 5 + 54 + i))

    errors = []
    seen = set()
    try:
        with PromptStore(path) as store:
            for i in range(n):
                store.put("m", toks(i, me), cache(i, me))
                for j in range(n):
                    if j in seen:
                        continue
                    got = store.get("m", toks(j, other))
                    if got is not None:
                        k = got[0].keys
                        if k.shape[2] != 64 + j or not mx.all(k == other * 1000 + j).item():
                            errors.append(f"entry {j} of {other} read back wrong")
                        seen.add(j)
            deadline = time.time() + 60
            while len(seen) < n and time.time() < deadline:
                for j in range(n):
                    if j not in seen and store.get("m", toks(j, other)) is not None:
                        seen.add(j)
                time.sleep(0.01)
    except Exception as err:  # report, don't hide: the parent asserts on it
        errors.append(f"{type(err).__name__}: {err}")
    queue.put((me, len(seen), errors))


def test_two_processes_share_a_store(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    path = str(tmp_path / "store")
    n = 25
    procs = [ctx.Process(target=_worker, args=(path, me, 1 - me, n, queue)) for me in (0, 1)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for me, seen, errors in results:
        assert errors == [], errors
        assert seen == n, f"process {me} saw {seen} of {n} entries of the other"


def test_store_refuses_use_across_fork(tmp_path):
    from promptstore import PromptStore, StoreUnavailable

    store = PromptStore(tmp_path / "s")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            store.lookup("m", [1, 2])
        except StoreUnavailable:
            code = 0
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    store.put("m", [1, 2], _one())  # the parent's handle still works
    store.close()


def _one():
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    c.keys = c.values = mx.zeros((1, 1, 2, 4))
    c.offset = 2
    return [c]
