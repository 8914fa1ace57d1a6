"""The LMDB map grows on demand, and other processes adopt the new size."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from _bits import bits_equal
from promptstore import PromptStore


def _cache(n: int, value: float):
    c = KVCache()
    c.keys = mx.full((1, 4, n, 256), value, mx.float32)
    c.values = mx.full((1, 4, n, 256), -value, mx.float32)
    c.offset = n
    return [c]


def test_map_grows_and_other_process_adopts_it(tmp_path):
    path = tmp_path / "s"
    small = 1 << 20
    with PromptStore(path, map_size=small) as store:
        store.put("m", [1, 2, 3], _cache(3, 1.0))
        # Another process writes 24 MiB into the 1 MiB map: it must grow the map.
        # Random values: constant ones would make identical shared blocks, stored once.
        code = textwrap.dedent(
            f"""
            import mlx.core as mx
            from mlx_lm.models.cache import KVCache
            from promptstore import PromptStore
            from promptstore.format import _blobs, _packs
            _blobs.MIN_PAYLOAD = 1 << 62  # keep a payload in LMDB: it must grow the map
            _packs.MIN_BYTES = 1 << 62  # and the shared blocks too
            c = KVCache()
            c.keys = mx.random.normal((1, 4, 3000, 256), key=mx.random.key(2))
            c.values = -c.keys
            c.offset = 3000
            with PromptStore({str(path)!r}, map_size={small}) as s:
                s.put("m", list(range(5, 3005)), [c])
                print(s.env.env.info()["map_size"])
            """
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout.strip()) >= 24 << 20
        # This process still has the 1 MiB map: its next transaction adopts the new size.
        (got,) = store.get("m", list(range(5, 3005)))
        want = mx.random.normal((1, 4, 3000, 256), key=mx.random.key(2))
        assert got.keys.shape == (1, 4, 3000, 256) and bits_equal(got.keys, want).item() and bits_equal(got.values, -want).item()
        store.put("m", [9, 9], _cache(2, 3.0))  # and it can write after the growth
        assert store.env.env.info()["map_size"] >= 24 << 20


def test_a_writer_clears_the_reader_slot_of_a_process_killed_inside_a_read(tmp_path, monkeypatch):
    """reader_check ran only when a store was opened: in a process that had
    it open already, the slot of a reader SIGKILLed mid-read kept its old
    snapshot alive, so no freed page was reused and the data file grew with
    every write (2.1 MB to 23.8 MB in 40 replace cycles; a crash reviewer's
    finding)."""
    import os
    import signal

    from promptstore.store import _env

    monkeypatch.setattr(_env, "READER_CHECK_EVERY", 0.0, raising=False)
    path = tmp_path / "s"
    toks = list(range(100))
    with PromptStore(path, shared_blocks=False) as s:  # 800 kB payloads, kept in LMDB
        s.put("m@0123456789abcdef", toks, _cache(100, 1.0))
        holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from promptstore import PromptStore
            s = PromptStore({str(path)!r})
            txn = s.env.begin()  # a read transaction, left open
            txn.get(b"x")
            print("held", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        sizes = []
        for i in range(30):
            s.put("m@0123456789abcdef", toks, _cache(100, 2.0 + i % 5))  # a replace: its old pages are freed
            s.delete("m@0123456789abcdef", toks)
            sizes.append((path / "data.mdb").stat().st_size)
        assert sizes[-1] <= 2 * sizes[4], sizes


def test_hits_misses_and_last_uses_survive_a_retried_or_refused_put(tmp_path):
    """A put writes this process's recorded hits, misses and last uses in its
    own transaction: a retry after map growth wrote them no more (the first,
    aborted attempt had taken them), and a put refused by the budget lost them."""
    from promptstore import StoreFull

    with PromptStore(tmp_path / "s", map_size=1 << 20) as store:
        store.put("m", list(range(3, 103)), _cache(100, 1.0))
        for _ in range(5):
            assert store.lookup("m", list(range(3, 103)) + [1]) is not None
        for _ in range(3):
            assert store.lookup("m", [999, 998]) is None
        big = {f"k{j}": "x" * (1 << 19) for j in range(6)}  # a 3 MB manifest: the map grows after the flush
        store.put("m", list(range(1000, 1010)), _cache(10, 2.0), meta=big)
        assert store.counters() == {"hits": 5, "misses": 3}
    with PromptStore(tmp_path / "t") as store:
        first = store.put("m", list(range(3, 103)), _cache(100, 1.0))
        store.set_budget(first.nbytes * 2)
        for _ in range(2):
            store.lookup("m", list(range(3, 103)))
        store.lookup("m", [7])
        with pytest.raises(StoreFull):
            store.put("m", list(range(5, 1005)), _cache(1000, 2.0))
    with PromptStore(tmp_path / "t", readonly=True) as store:
        assert store.counters() == {"hits": 2, "misses": 1}  # written by close, as stored
        (info,) = store.entries()
        assert info.last_used > first.created
