"""close() while other threads use the store.

Closing the LMDB environment (or the data file's descriptor that restores
``pread``) under a transaction in flight crashed the process (SIGSEGV or
SIGBUS: py-lmdb works without the GIL inside some calls) or failed healthy
reads (EBADF, reported as a damaged entry, which lookup skipped). close()
now refuses new operations, waits for those in flight, then closes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from _content import MODEL, make_entry, same_cache
from promptstore import PromptStore, PromptStoreError, StoreUnavailable

HERE = Path(__file__).resolve().parent
CLOSED = "the store is closed"

# Runs in a child, so that a crash is a return code rather than the end of the
# test session. Each round opens the store, runs getters, a lookup, a writer
# (or, read-only, a second getter) and sometimes a compaction on threads,
# closes it from the main thread after a random delay, then reopens and verifies.
_STRESS = """
import json, random, sys, threading, time, traceback
from collections import Counter
sys.path.insert(0, {here!r})
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache
from _content import make_entry, same_cache
from promptstore import PromptStore, PromptStoreError
from promptstore.format import _blobs, _pages

_blobs.MIN_PAYLOAD = 1 << 62  # large payloads stay in LMDB: their restores pread data.mdb
MODEL, CLOSED = "close@0", "the store is closed"
path, rounds, rng = {path!r}, {rounds}, random.Random({seed})

def large_entry():
    gen = np.random.default_rng(9)
    k, v = (mx.array(gen.standard_normal((1, 4, 4096, 64)).astype(np.float32)) for _ in range(2))
    kv = KVCache()
    kv.update_and_fetch(k, v)
    return [9, 9] + gen.integers(0, 50000, 4094).tolist(), [kv]

small = [make_entry(1, i) for i in range(12)]  # two of them 4.5 MB, copied out of the map
large = large_entry()
with PromptStore(path) as s:
    for t, c in small:
        s.put(MODEL, t, c)
    assert s.put(MODEL, *large).nbytes >= _pages.MIN_PAYLOAD

report = []
for r in range(rounds):
    readonly, compacting = r % 3 == 2, r % 3 == 1
    store = PromptStore(path, readonly=readonly)
    lock, stop = threading.Lock(), threading.Event()
    res = {{"readonly": readonly, "errors": [], "wrong": [], "missed": [], "closed": Counter(), "ops": 0}}

    def note(key, what):
        with lock:
            if len(res[key]) < 5:
                res[key].append(what)

    def get_small(k, g):
        t, c = small[g.randrange(len(small))]
        got = store.get(MODEL, t)
        if got is None:
            note("missed", "get small")
        elif not same_cache(got, c):
            note("wrong", "get small")

    def get_large(k, g):
        got = store.get(MODEL, large[0])
        if got is None:
            note("missed", "get large")
        elif not same_cache(got, large[1]):
            note("wrong", "get large")

    def lookup(k, g):
        t, c = large if k % 2 else small[g.randrange(len(small))]
        hit = store.lookup(MODEL, t + [1, 2, 3])
        if hit is None:
            note("missed", "lookup")
        elif hit.matched != len(t) or not same_cache(hit.cache, c):
            note("wrong", "lookup")

    def put(k, g):
        store.put(MODEL, *make_entry(2, k % 30, big_every=0))

    def compact(k, g):
        store.compact()
        time.sleep(0.05)

    ops = [get_small, get_large, lookup] + ([get_small] if readonly else [put]) + ([compact] if compacting else [])
    started = threading.Barrier(len(ops) + 1)

    def loop(op, seed):
        g = random.Random(seed)
        started.wait()
        k = 0
        while not stop.is_set():
            try:
                op(k, g)
                with lock:
                    res["ops"] += 1
            except PromptStoreError as err:
                if CLOSED in str(err):
                    with lock:
                        res["closed"][op.__name__] += 1
                    return
                note("errors", f"{{op.__name__}}: {{type(err).__name__}}: {{err}}")
            except BaseException as err:
                note("errors", f"{{op.__name__}}: UNTYPED {{type(err).__name__}}: {{err}}")
                return
            k += 1

    threads = [threading.Thread(target=loop, args=(op, rng.random())) for op in ops]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(rng.uniform(0.05, 0.3))
    t0 = time.monotonic()
    store.close()
    res["close_s"] = time.monotonic() - t0
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(20)
    res["threads"], res["hung"] = len(threads), sum(t.is_alive() for t in threads)
    with PromptStore(path) as again:
        rep = again.verify()
        res["verify"] = [rep.ok, [p[1] for p in rep.problems[:3]]]
        res["large_after"] = same_cache(again.get(MODEL, large[0]), large[1])
    print(f"round {{r}} done", file=sys.stderr, flush=True)
    report.append(res)
print(json.dumps(report))
"""


def test_close_while_threads_get_lookup_put_and_compact(tmp_path):
    code = textwrap.dedent(_STRESS).format(here=str(HERE), path=str(tmp_path / "s"), rounds=6, seed=5)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"the process ended with {out.returncode}: {out.stderr[-3000:]}"
    rounds = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rounds) == 6
    for r, res in enumerate(rounds):
        where = f"round {r} (readonly={res['readonly']})"
        # Every error an operation saw is the closed error, raised by an operation
        # that started after close() began; those in flight finished normally.
        assert res["errors"] == [], where
        assert res["wrong"] == [] and res["missed"] == [], where
        assert res["hung"] == 0 and sum(res["closed"].values()) == res["threads"], (where, res["closed"])
        assert res["ops"] > 0, where
        assert res["verify"] == [True, []], where
        assert res["large_after"], where


@pytest.fixture
def filled(tmp_path):
    """A store holding two small entries, nothing touched since (no flush pending)."""
    store = PromptStore(tmp_path / "s")
    entries = [make_entry(3, i, big_every=0) for i in range(2)]
    for tokens, cache in entries:
        store.put(MODEL, tokens, cache)
    yield store, entries
    try:
        store.close(timeout=5)
    except Exception:  # noqa: BLE001 - the test has said what went wrong
        pass


def _closed_soon(store, tokens) -> bool:
    """Whether a new operation is refused within 5 s (close() has begun)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            store.exists(MODEL, tokens)
        except PromptStoreError as err:
            return CLOSED in str(err)
        time.sleep(0.01)
    return False


def test_operations_after_close_raise_the_closed_error(filled):
    store, entries = filled
    tokens, cache = entries[0]
    env = store.env  # kept across close(), as a caller may
    store.close()
    for call in (
        lambda: store.get(MODEL, tokens),
        lambda: store.lookup(MODEL, tokens),
        lambda: store.put(MODEL, tokens, cache),
        lambda: list(store.entries()),
        lambda: store.verify(),
        lambda: store.compact(),
        lambda: env.read().__enter__(),
        lambda: env.write(lambda txn: None),
        lambda: env.compact(),
    ):
        with pytest.raises(PromptStoreError, match=CLOSED):
            call()
    assert env.closed
    store.close()  # again: nothing to do


def _holder(store, nested=None):
    """A thread holding a read transaction until ``proceed`` is set; it then
    records the entry count through it and runs ``nested()`` inside it."""
    env = store.env
    opened, proceed, seen = threading.Event(), threading.Event(), {}

    def hold():
        with env.read() as txn:
            opened.set()
            proceed.wait(10)
            seen["stat"] = txn.stat(store._db[b"entries"])["entries"]
            if nested is not None:
                seen["nested"] = nested()

    h = threading.Thread(target=hold)
    h.start()
    assert opened.wait(10)
    return h, proceed, seen


def test_close_waits_for_a_transaction_in_flight(filled):
    store, entries = filled
    tokens, cache = entries[0]
    env = store.env
    # Still usable, and an operation nested in it runs, though close() has begun.
    h, proceed, seen = _holder(store, lambda: same_cache(store.get(MODEL, tokens), cache))
    closer = threading.Thread(target=store.close)
    closer.start()
    assert _closed_soon(store, tokens)
    time.sleep(0.2)
    assert closer.is_alive() and not env.closed  # waiting for the holder
    proceed.set()
    h.join(10)
    closer.join(10)
    assert not closer.is_alive() and env.closed
    assert seen == {"stat": 2, "nested": True}
    with PromptStore(store.path) as again:
        assert again.verify().ok
        assert same_cache(again.get(MODEL, tokens), cache)


def test_close_gives_up_after_its_timeout_and_the_last_transaction_closes(filled):
    store, entries = filled
    tokens, _ = entries[0]
    env = store.env
    opened, proceed = threading.Event(), threading.Event()

    def holder():
        with env.read() as txn:
            opened.set()
            proceed.wait(10)
            txn.stat(store._db[b"entries"])

    h = threading.Thread(target=holder)
    h.start()
    assert opened.wait(10)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"waited 0.2 s for 1 operation\(s\) in flight in 1 other thread"):
        store.close(timeout=0.2)
    assert time.monotonic() - t0 < 2
    assert not env.closed
    with pytest.raises(PromptStoreError, match=CLOSED):
        store.get(MODEL, tokens)
    proceed.set()
    h.join(10)
    assert env.closed  # closed by the holder's transaction as it ended
    store.close()  # returns at once now
    with pytest.raises(PromptStoreError, match=CLOSED):
        store.env


def test_close_from_inside_an_operation_of_the_same_thread_raises(filled):
    store, entries = filled
    tokens, cache = entries[0]
    env = store.env
    t0 = time.monotonic()
    with env.read() as txn:
        with pytest.raises(StoreUnavailable, match="this thread has a transaction of the store open"):
            store.close()
        # The transaction and operations nested in it still work...
        assert txn.stat(store._db[b"entries"])["entries"] == 2
        assert same_cache(store.get(MODEL, tokens), cache)
        assert not env.closed
    assert time.monotonic() - t0 < 5  # no wait for itself
    assert env.closed  # ...and its end closed the store
    with pytest.raises(PromptStoreError, match=CLOSED):
        store.get(MODEL, tokens)


def test_close_from_a_write_callback_raises_and_writes_nothing(filled):
    store, entries = filled
    tokens, cache = entries[0]
    env = store.env

    def write(txn):
        txn.delete(b"format", db=store._db[b"info"])
        store.close()

    with pytest.raises(StoreUnavailable, match="this thread"):
        env.write(write)
    assert env.closed
    with PromptStore(store.path) as again:  # the write was aborted
        assert again.verify().ok and same_cache(again.get(MODEL, tokens), cache)


def test_an_iterator_half_consumed_on_another_thread(filled):
    """A generator holding a read transaction, left suspended by a worker
    thread: close() waits its timeout and raises; closing the generator (here
    on the main thread) ends the transaction, which closes the store."""
    store, entries = filled
    env = store.env

    def ids():
        with env.read() as txn:
            for key in txn.cursor(db=store._db[b"ids"]).iternext(keys=True, values=False):
                yield bytes(key)

    it = ids()
    worker = threading.Thread(target=lambda: next(it))
    worker.start()
    worker.join(10)
    with pytest.raises(StoreUnavailable, match="waited"):
        store.close(timeout=0.2)
    assert not env.closed
    it.close()
    assert env.closed
    store.close()


def test_del_never_waits_and_leaves_a_transaction_in_flight_intact(filled):
    store, _ = filled
    env = store.env
    h, proceed, seen = _holder(store)
    t0 = time.monotonic()
    store.__del__()  # what garbage collection runs
    assert time.monotonic() - t0 < 1
    proceed.set()
    h.join(10)
    assert seen == {"stat": 2}  # the transaction outlived __del__ intact
    assert env.closed  # and closed the store as it ended


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_close_in_a_forked_child_touches_nothing_of_the_parent(filled):
    """The child gets the parent's environment, and its lock as it was at the
    fork (here held by a parent thread forever): close() there must neither
    wait for that lock nor close the parent's files."""
    store, entries = filled
    tokens, cache = entries[0]
    env = store.env
    held, release = threading.Event(), threading.Event()

    def hold():
        with env._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            store.close()
            try:
                store.get(MODEL, tokens)
                msg = "get worked"
            except PromptStoreError as err:
                msg = f"{type(err).__name__}: {err}"
        except BaseException as err:
            msg = f"close failed: {err!r}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    ended, deadline = False, time.monotonic() + 10
    while not ended and time.monotonic() < deadline:
        ended = os.waitpid(pid, os.WNOHANG)[0] == pid
        time.sleep(0.02)
    if not ended:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    msg = os.read(r, 4096).decode()
    os.close(r)
    release.set()
    t.join(10)
    assert ended, "close() in the forked child hung on the parent's lock"
    assert CLOSED in msg, msg
    assert same_cache(store.get(MODEL, tokens), cache)  # the parent's store still works


def test_close_during_verify_stops_it_rather_than_reporting_damage(filled, monkeypatch):
    """verify() reads entry after entry, each in a transaction of its own; a
    close() between two of them ends it with StoreClosed, instead of listing
    the healthy entries it did not get to as problems."""
    from promptstore import StoreClosed
    from promptstore.store._read import Reader

    store, entries = filled
    tokens, _ = entries[0]
    inside, proceed, out = threading.Event(), threading.Event(), {}
    real = Reader.restore

    def slow_restore(self, *args, **kwargs):
        inside.set()
        proceed.wait(10)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Reader, "restore", slow_restore)

    def verifier():
        try:
            out["report"] = store.verify()
        except PromptStoreError as err:
            out["error"] = err

    v = threading.Thread(target=verifier)
    v.start()
    assert inside.wait(10)
    closer = threading.Thread(target=store.close)
    closer.start()
    assert _closed_soon(store, tokens)
    proceed.set()
    v.join(10)
    closer.join(10)
    assert isinstance(out.get("error"), StoreClosed), out
    monkeypatch.undo()
    with PromptStore(store.path) as again:
        assert again.verify().ok


def test_a_second_open_in_one_process_is_refused_with_what_to_do(filled):
    """py-lmdb refuses to open a store's files twice in one process: a second
    PromptStore on the folder is StoreUnavailable saying to share the open
    one (it was a StoreError quoting py-lmdb), and the first is unharmed."""
    store, entries = filled
    tokens, cache = entries[0]
    with pytest.raises(StoreUnavailable, match="already open in this process.*share that PromptStore"):
        PromptStore(store.path)
    assert same_cache(store.get(MODEL, tokens), cache)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_is_told_why_it_cannot_open_the_parents_store(filled):
    """A child forked while the parent had the store open cannot open it (the
    old message told it to open a new PromptStore, which failed with
    py-lmdb's "already open"): both ways say to open stores after the fork
    or to use spawn; the parent's store still works."""
    store, entries = filled
    tokens, cache = entries[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        msgs = []
        for attempt in (lambda: PromptStore(store.path), lambda: store.get(MODEL, tokens)):
            try:
                attempt()
                msgs.append("opened")
            except PromptStoreError as err:
                msgs.append(f"{type(err).__name__}: {err}")
            except BaseException as err:
                msgs.append(f"other: {err!r}")
        os.write(w, json.dumps(msgs).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    opened, used = json.loads(os.read(r, 65536).decode())
    os.close(r)
    assert opened.startswith("StoreUnavailable") and f"fork of process {os.getpid()}" in opened, opened
    for msg in (opened, used):
        assert "'spawn'" in msg and "open a new PromptStore in the child" not in msg, msg
    assert same_cache(store.get(MODEL, tokens), cache)
