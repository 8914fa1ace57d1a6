"""Races between processes that once lost data (found in review), kept fixed."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from _raw import audit_blocks, referrers
from _content import same_cache
from promptstore import PromptStore


def _kv(n: int, seed: int):
    c = KVCache()
    k = mx.full((1, 2, n, 16), seed, mx.bfloat16)
    c.update_and_fetch(k, k + 1)
    return [c]


def _turn(n: int):
    """The first ``n`` tokens of one conversation and their KV: entries of
    it share the blocks of the shorter ones stored before them."""
    k = mx.random.normal((1, 2, 1024, 16), key=mx.random.key(3)).astype(mx.bfloat16)[..., :n, :]
    c = KVCache()
    c.update_and_fetch(k, -k)
    return list(range(1, n + 1)), [c]


def _compactor(path: str, rounds: int, queue) -> None:
    try:
        with PromptStore(path) as s:
            for _ in range(rounds):
                s.compact()
        queue.put("ok")
    except Exception as err:  # reported to the parent, which asserts on it
        queue.put(f"{type(err).__name__}: {err}")


def test_two_concurrent_compactions_keep_the_live_generation(tmp_path):
    path = str(tmp_path / "s")
    with PromptStore(path) as s:
        for i in range(5):  # a conversation's turns: they share blocks
            s.put("m", *_turn(49 + 10 * i))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_compactor, args=(path, 5, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert results == ["ok", "ok"]
    live = open(os.path.join(path, "CURRENT")).read().strip()
    assert sorted(d for d in os.listdir(path) if d.startswith("gen-")) == [live]
    with PromptStore(path) as s:
        assert len(list(s.entries())) == 5
        assert s.verify().ok and audit_blocks(s)
        assert max(len(who) for who in referrers(s).values()) == 5  # the first turn's blocks
        for i in range(5):
            tokens, cache = _turn(49 + 10 * i)
            assert same_cache(s.get("m", tokens), cache)


def _writer(path: str, n: int, queue) -> None:
    """Puts the turns of a conversation (each sharing the blocks of the ones
    before) and, every third put, deletes an earlier turn: references to
    shared blocks come and go while the other process verifies and fixes."""
    done = []
    with PromptStore(path) as s:
        for i in range(n):
            s.put("m", *_turn(3 + 5 * i))
            done.append(i)
            if i % 3 == 2:
                s.delete("m", _turn(3 + 5 * (i - 1))[0])
                done.remove(i - 1)
    queue.put(done)


def test_verify_fix_never_removes_entries_committed_meanwhile(tmp_path):
    path = str(tmp_path / "s")
    with PromptStore(path) as s:
        for i in range(20):
            s.put("m", [i + 1, 2, 3], _kv(3, i))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_writer, args=(path, 90, queue))
    p.start()
    passes = 0
    with PromptStore(path) as s:
        while p.is_alive() or passes == 0:
            report = s.verify(fix=True)
            assert report.problems == () and report.orphan_chunks == 0
            assert report.bad_counts == 0 and report.orphan_blocks == 0  # no count "fixed" under a writer
            passes += 1
        done = queue.get(timeout=120)
        p.join(timeout=60)
        assert len(done) == 60 and passes > 1
        for i in done:
            tokens, cache = _turn(3 + 5 * i)
            assert same_cache(s.get("m", tokens), cache)
        for i in range(20):
            (layer,) = s.get("m", [i + 1, 2, 3])
            assert layer.offset == 3
        assert s.verify().ok and audit_blocks(s)
        assert max(len(who) for who in referrers(s).values()) == 60  # the first turn's block: in every turn since


def _long(n: int):
    """The first ``n`` of 16384 tokens of one conversation and their KV
    (512 bytes a token: 8 MiB for all of them, which go to one pack file)."""
    k = mx.random.normal((1, 2, 16384, 64), key=mx.random.key(5)).astype(mx.float16)[..., :n, :]
    c = KVCache()
    c.update_and_fetch(k, -k)
    return list(range(1, n + 1)), [c]


# Verifies (and fixes) the store at PATH, its first pack file opened only once
# the test process has repacked that pack, so its snapshot names a file gone.
_SLOW_VERIFIER = """
import json, os, sys, time
from promptstore import PromptStore
from promptstore.format import _packs

path, opening, repacked = sys.argv[1:]
real = _packs.Packs.open
def open_later(self, pack, where):
    if not os.path.exists(opening):
        open(opening, "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(repacked) and time.monotonic() < deadline:
            time.sleep(0.02)
    return real(self, pack, where)
_packs.Packs.open = open_later
with PromptStore(path) as s:
    r = s.verify(fix=True)
print(json.dumps({"checked": r.checked, "problems": [list(p) for p in r.problems]}))
"""


def test_verify_fix_keeps_an_entry_whose_pack_another_process_repacked(tmp_path):
    """A repack moves live blocks to a new pack and unlinks the old one
    without touching a manifest: a verify whose snapshot names the old pack
    must look where the blocks are now, not remove the intact entry."""
    path, opening, repacked = str(tmp_path / "s"), str(tmp_path / "opening"), str(tmp_path / "repacked")
    with PromptStore(path) as s:
        s.put("m", *_long(16384))
        s.put("m", *_long(8192))  # shares the first half of the pack's blocks
        s.delete("m", _long(16384)[0])  # the other half is dead: 4 MiB, a repack is due
        before = sorted(os.listdir(os.path.join(path, "packs")))
    verifier = subprocess.Popen([sys.executable, "-c", _SLOW_VERIFIER, path, opening, repacked], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(opening) and verifier.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.path.exists(opening), verifier.stderr.read() if verifier.poll() is not None else "verifier never opened a pack"
        with PromptStore(path) as s:
            s.gc()
            after = sorted(os.listdir(os.path.join(path, "packs")))
            assert len(after) == 1 and after != before  # repacked: the verifier's pack file is gone
        open(repacked, "w").close()
        out, err = verifier.communicate(timeout=120)
    finally:
        if verifier.poll() is None:
            verifier.kill()
    assert verifier.returncode == 0, err[-2000:]
    assert json.loads(out) == {"checked": 1, "problems": []}
    with PromptStore(path) as s:
        tokens, cache = _long(8192)
        assert [e.n_tokens for e in s.entries()] == [8192]
        assert same_cache(s.get("m", tokens), cache)
        assert s.verify().ok and audit_blocks(s)


@contextmanager
def _read_held(store, seconds: float = 60.0):
    """A read of ``store`` held open on another thread, from entering the
    block until ``seconds`` have passed or the block is left."""
    holding, done = threading.Event(), threading.Event()

    def hold():
        with store.env.read():
            holding.set()
            done.wait(seconds)

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait()
    try:
        yield
    finally:
        done.set()
        holder.join()


@pytest.mark.parametrize("stuck", [False, True], ids=["follows", "held-past-the-wait"])
def test_a_busy_process_follows_a_compaction_and_keeps_its_intact_entries(tmp_path, monkeypatch, stuck):
    """Process A keeps a read open while process B compacts, deletes an entry
    and gc rewrites the pack it shared with another. A used to stay on the old
    generation (frozen at the compaction) as long as its reads overlapped: its
    get of the intact entry raised "pack file ... is missing", and its
    ``verify(fix=True)`` deleted that entry. ``stuck``: A's reads cannot wait
    for the held one (as if it were held past the wait), so they read the old
    generation; verify may report the entry, but its fix deletes only what it
    found damaged in the generation it writes to."""
    from promptstore.store import _env

    if stuck:
        monkeypatch.setattr(_env, "_READ_SWITCH_WAIT", 0.0)

    def wide(conv: int, n: int):  # 16 KV heads: 8 KiB a token, so the dead bytes pass gc's 4 MiB floor
        system, own = np.random.default_rng(7), np.random.default_rng(conv)
        tokens = system.integers(0, 50000, 600).tolist() + own.integers(0, 50000, n - 600).tolist()
        k = np.concatenate([system.standard_normal((1, 16, 600, 64)), own.standard_normal((1, 16, n - 600, 64))], axis=2)
        c = KVCache()
        c.update_and_fetch(mx.array(k.astype(np.float32)), mx.array((k * 2).astype(np.float32)))
        return tokens, [c]

    path = tmp_path / "s"
    MODEL = "m@races"
    gone, kept = wide(1, 2000), wide(2, 800)  # kept shares the first block of the system prompt, in gone's pack
    with PromptStore(path) as s:
        gone_id = s.put(MODEL, *gone).id
        s.put(MODEL, *kept)
    packs = set(os.listdir(path / "packs"))
    store = PromptStore(path)
    try:
        with _read_held(store, seconds=2.0):
            code = f"from promptstore import PromptStore\nwith PromptStore({str(path)!r}) as s:\n    s.compact(); s.remove({gone_id!r}); s.gc()\n"
            subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
            assert not packs <= set(os.listdir(path / "packs"))  # the shared pack was rewritten, the old one unlinked
            if not stuck:
                assert same_cache(store.get(MODEL, kept[0]), kept[1])  # waits for the held read, then follows
            report = store.verify(fix=True)
            assert stuck or report.problems == ()
            assert store.env.generation == "gen-1"
    finally:
        store.close()
    with PromptStore(path) as s:
        assert same_cache(s.get(MODEL, kept[0]), kept[1])
        assert s.get(MODEL, gone[0]) is None and s.verify().ok


def test_opening_a_store_while_another_process_grows_its_map(tmp_path):
    """LMDB's MDB_MAP_RESIZED between opening a store and its first write
    transaction failed the open (StoreError "open: MapResizedError")."""
    path = tmp_path / "s"
    PromptStore(path, map_size=1 << 21).close()
    code = (
        "import sys, mlx.core as mx; from mlx_lm.models.cache import KVCache; from promptstore import PromptStore\n"
        f"s = PromptStore({str(path)!r}, map_size=1 << 21); print('R', flush=True); i = 0\n"
        "while True:\n"
        "    c = KVCache(); k = mx.full((1, 2, 600, 64), i % 100, mx.float32); c.update_and_fetch(k, k)\n"
        "    s.put('m@grow', [i, i + 1] + list(range(598)), [c]); i += 1\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "R"
        for _ in range(60):
            PromptStore(path, map_size=1 << 21).close()
            time.sleep(0.02)
    finally:
        writer.kill()
        writer.wait()
    with PromptStore(path) as s:
        assert s.verify().ok and len(list(s.entries())) > 0


def _compact_and_put(path, tokens) -> None:
    """Another process compacts the store, then puts ``tokens``."""
    code = (
        "import sys, mlx.core as mx; from mlx_lm.models.cache import KVCache; from promptstore import PromptStore\n"
        f"with PromptStore({str(path)!r}) as s:\n"
        "    s.compact(); c = KVCache(); k = mx.ones((1, 2, " + str(len(tokens)) + ", 8)); c.update_and_fetch(k, k)\n"
        f"    s.put('m@races', {list(tokens)!r}, [c])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_read_that_ends_on_another_thread_does_not_pin_the_old_generation(tmp_path):
    """A generator over a read, started on one thread and closed on another:
    the count of transactions each thread holds went wrong (one at 1, the
    other at -1, or an AttributeError), and both threads then read the old
    generation for good after a compaction."""
    path = tmp_path / "s"
    with PromptStore(path) as s:
        s.put("m@races", [1, 2, 3], _kv(3, 1))
        s.put("m@races", [4, 5, 6], _kv(3, 2))
    store = PromptStore(path)
    try:
        def keys():
            with store.env.read() as txn:
                yield from txn.cursor(db=store.env.db.entries).iternext(values=False)

        walk = keys()
        next(walk)  # begun here
        other = threading.Thread(target=walk.close)  # ended there
        other.start()
        other.join()
        _compact_and_put(path, [7, 8, 9])
        assert store.get("m@races", [7, 8, 9]) is not None and store.env.generation == "gen-1"
        seen = []
        other = threading.Thread(target=lambda: seen.append(store.get("m@races", [7, 8, 9]) is not None))
        other.start()
        other.join()
        assert seen == [True]
    finally:
        store.close()


def test_reads_wait_once_for_a_read_held_past_the_wait(tmp_path, monkeypatch):
    """A read held open on one thread keeps the process on the old generation;
    another thread's read waits for it at most ``_READ_SWITCH_WAIT`` seconds,
    once: every read waited the full time again."""
    from promptstore.store import _env

    monkeypatch.setattr(_env, "_READ_SWITCH_WAIT", 1.0)
    path = tmp_path / "s"
    with PromptStore(path) as s:
        s.put("m@races", [1, 2, 3], _kv(3, 1))
    store = PromptStore(path)
    with _read_held(store):
        _compact_and_put(path, [7, 8, 9])
        times = []
        for _ in range(3):
            t = time.monotonic()
            assert store.get("m@races", [1, 2, 3]) is not None  # the old snapshot, consistent
            times.append(time.monotonic() - t)
        assert times[0] >= 1.0 and max(times[1:]) < 0.5, times
    assert store.get("m@races", [7, 8, 9]) is not None and store.env.generation == "gen-1"
    store.close()
