"""Two spawned processes write and read one store at the same time.

Each process puts the turns of its own conversation (entries whose tokens
and KV are prefixes of one another, so each shares the blocks of the ones
before), both conversations opening with the same system prompt (blocks the
two processes share)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from _raw import audit_blocks, referrers
from promptstore import PromptStore, StoreUnavailable



def _worker(path: str, me: int, other: int, n: int, queue) -> None:
    import time

    from mlx_lm.models.cache import KVCache

    from _bits import bits_equal
    from promptstore import PromptStore

    def cache(i, who):
        c = KVCache()
        c.keys, c.values = _kv(64 + 8 * i, who)
        c.offset = 64 + 8 * i
        return [c]

    def toks(i, who):
        return _tokens(64 + 8 * i, who)

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
                        want = cache(j, other)[0]
                        for a, b in ((got[0].keys, want.keys), (got[0].values, want.values)):
                            if a.shape != b.shape or not bits_equal(a, b).item():
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


SYSTEM = 48  # tokens both conversations open with


def _tokens(n: int, who: int) -> list:
    return list(range(5, 5 + SYSTEM)) + [1000 * (who + 1) + t for t in range(n - SYSTEM)]


def _kv(n: int, who: int):
    """Keys and values of a conversation's first ``n`` tokens: the system
    prompt's (the same bytes in both conversations), then its own."""
    import mlx.core as mx

    sys_k, own_k = mx.random.normal((1, 2, SYSTEM, 32), key=mx.random.key(0)), mx.random.normal((1, 2, 512, 32), key=mx.random.key(who + 1))
    keys = mx.concatenate([sys_k, own_k], axis=2)[..., :n, :].astype(mx.float16)
    return keys, -keys


def test_two_processes_share_a_store(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    path = str(tmp_path / "store")
    n = 25
    from mlx_lm.models.cache import KVCache

    with PromptStore(path) as store:  # the system prompt's entry: both conversations' first block
        c = KVCache()
        c.keys, c.values = _kv(SYSTEM, 0)
        c.offset = SYSTEM
        store.put("m", _tokens(SYSTEM, 0), [c])
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
    with PromptStore(path) as store:
        assert store.verify().ok and audit_blocks(store)
        # the system prompt's blocks: named by all 2n + 1 entries; a turn's, by the turns after it
        assert max(len(who) for who in referrers(store).values()) == 2 * n + 1


def test_opening_a_store_while_another_process_commits(tmp_path, monkeypatch):
    """Another process commits (growing data.mdb) while this one opens the
    store: the open succeeds. The commit is made to land inside the open's
    size check, where a real one lands now and then under load."""
    import subprocess
    import sys
    import textwrap

    from promptstore.store import _faults

    path = tmp_path / "s"
    PromptStore(path).close()
    grow = textwrap.dedent(
        f"""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache
        from promptstore import PromptStore
        c = KVCache()
        k = mx.random.normal((1, 8, 1024, 128), key=mx.random.key(1))
        c.update_and_fetch(k, -k)
        with PromptStore({str(path)!r}) as s:
            s.put("m", list(range(1, 1025)), [c])  # 8 MiB more of data.mdb
        """
    )
    real = _faults.pages_needed

    def committed_meanwhile(env):
        subprocess.run([sys.executable, "-c", grow], check=True, timeout=120)
        return real(env)

    monkeypatch.setattr(_faults, "pages_needed", committed_meanwhile)
    PromptStore(path).close()


def test_store_refuses_use_across_fork(tmp_path):
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


def test_a_map_resize_waits_for_the_other_threads_reads(tmp_path):
    """Another process grows the map while a thread of this one is inside a
    read. Another thread's next transaction sees MapResizedError and must
    adopt the new size; py-lmdb invalidates every open transaction of an
    environment it resizes, so the adoption waits until the first thread's
    read is done, which then reads to its end ("Attempt to operate on
    closed/deleted/dropped object" before)."""
    import subprocess
    import sys
    import textwrap
    import threading
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    path = tmp_path / "s"
    store = PromptStore(path, map_size=4 << 20)
    small = KVCache()
    k = mx.random.normal((1, 2, 16, 8), key=mx.random.key(0))
    small.update_and_fetch(k, k)
    for i in range(20):
        store.put("m", [i] * 16, [small])
    grow = textwrap.dedent(
        f"""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache
        from promptstore import PromptStore
        with PromptStore({str(path)!r}, shared_blocks=False) as s:
            for i in range(32):  # 512 KiB payloads stay in LMDB (blob files start at 1 MiB): 16 MiB, past the 4 MiB map
                c = KVCache()
                k = mx.random.normal((1, 4, 128, 128), key=mx.random.key(i))
                c.update_and_fetch(k, -k)
                s.put("m", [100 + i] + list(range(1, 128)), [c])
        """
    )
    inside, grown, done = threading.Event(), threading.Event(), {}

    def hold_a_read():
        try:
            with store.env.read() as txn:
                first = sum(1 for _ in txn.cursor(db=store.env.db.entries))
                inside.set()
                grown.wait(60)
                time.sleep(0.5)  # the other thread is waiting to resize meanwhile
                done["reader"] = (first, sum(1 for _ in txn.cursor(db=store.env.db.entries)))
        except BaseException as err:  # noqa: BLE001 - reported below
            done["reader"] = err

    def get_after_growth():
        try:
            done["get"] = store.get("m", [3] * 16)
        except BaseException as err:  # noqa: BLE001 - reported below
            done["get"] = err

    reader = threading.Thread(target=hold_a_read)
    reader.start()
    assert inside.wait(30)
    subprocess.run([sys.executable, "-c", grow], check=True, timeout=300)
    getter = threading.Thread(target=get_after_growth)
    getter.start()
    grown.set()
    reader.join(60)
    getter.join(60)
    assert done["reader"] == (20, 20), done["reader"]
    assert isinstance(done["get"], list) and done["get"][0].offset == 16, done["get"]
    assert len(list(store.entries())) == 52
    store.close()
