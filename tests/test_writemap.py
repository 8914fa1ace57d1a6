"""The writable map (Linux): puts write straight into LMDB's file mapping.

What comes with it, each checked on real stores: the map starts small and
grows ahead of a write; sizes are reported from the blocks the sparse file
holds; a truncated file is refused without being extended; the pages a large
put touched leave the process's RSS; stores written with and without it read
each other bit for bit; ``PROMPTSTORE_WRITEMAP=0`` turns it off. The full-disk
case (reserved blocks refused, no SIGBUS) is in test_budget.py.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import numpy as np
import pytest

from _workers import MODEL, make_entry, same_cache
from promptstore import PromptStore, StoreUnavailable
from promptstore import _env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the writable map is used on Linux only")


def big_entry(seed: int, mib: int):
    """``(tokens, cache)``: one KVCache layer of about ``mib`` MiB of random float16."""
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(seed)
    n = mib * (1 << 20) // (2 * 8 * 128 * 2)
    kv = KVCache()
    kv.update_and_fetch(*(mx.array(rng.standard_normal((1, 8, n, 128)).astype(np.float16)) for _ in range(2)))
    return [seed, *rng.integers(0, 50000, n - 1).tolist()], [kv]


def rss_file() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_map_starts_small_grows_ahead_and_sizes_count_blocks(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        assert store.env._gen.writemap
        data = store.env.dir / "data.mdb"
        assert os.path.getsize(data) == _env.WRITEMAP_MIN_MAP
        entries = [big_entry(i, 40) for i in range(3)]  # 120 MiB: past the first map
        for tokens, cache in entries:
            store.put(MODEL, tokens, cache)
        used = _env.pages_needed(store.env.env)
        apparent = os.path.getsize(data)
        assert used < apparent <= 4 * used  # grown by doubling, not to the 64 GiB default
        assert store.file_size() == _env.disk_bytes(data)
        assert used <= store.file_size() <= apparent
        for tokens, cache in entries:
            assert same_cache(store.get(MODEL, tokens), cache)


def test_a_write_that_does_not_fit_grows_the_map_first(tmp_path):
    """No MapFullError round: the write function runs once."""
    with PromptStore(tmp_path / "s") as store:
        env = store.env
        before = env.env.info()["map_size"]
        calls = []
        value = np.random.default_rng(1).integers(0, 256, 3 * before // 2, dtype=np.uint8).tobytes()

        def fn(txn):
            calls.append(1)
            txn.put(b"big", value, db=env.db[b"info"])

        env.write(fn, nbytes=len(value))
        assert len(calls) == 1 and env.env.info()["map_size"] >= 2 * before
        with env.read() as txn:
            assert txn.get(b"big", db=env.db[b"info"]) == value


@pytest.mark.parametrize("release", [True, False], ids=["released", "kept"])
def test_a_large_put_leaves_the_rss(tmp_path, monkeypatch, release):
    """After a 48 MiB put the pages it wrote are no longer mapped (the control
    run, with the release off, shows they would be)."""
    if not release:
        monkeypatch.setattr(_env, "_RELEASE_AFTER", 1 << 62)
    tokens, cache = big_entry(3, 48)
    nbytes = 48 << 20
    with PromptStore(tmp_path / "s") as store:
        store.put(MODEL, *make_entry(3, 0))
        before = rss_file()
        store.put(MODEL, tokens, cache)
        grew = rss_file() - before
        if release:
            assert grew < nbytes // 4, grew
        else:
            assert grew > nbytes // 2, grew
        assert same_cache(store.get(MODEL, tokens), cache)


def test_stores_written_with_and_without_it_read_each_other(tmp_path, monkeypatch):
    path = tmp_path / "s"
    a = [make_entry(5, i) for i in range(6)]
    b = [make_entry(6, i) for i in range(6)]
    with PromptStore(path) as store:
        assert store.env._gen.writemap
        for t, c in a:
            store.put(MODEL, t, c)
    monkeypatch.setenv("PROMPTSTORE_WRITEMAP", "0")
    with PromptStore(path) as store:
        assert not store.env._gen.writemap
        for t, c in a:
            assert same_cache(store.get(MODEL, t), c)
        for t, c in b:
            store.put(MODEL, t, c)
        store.delete(MODEL, a[0][0])
    monkeypatch.delenv("PROMPTSTORE_WRITEMAP")
    with PromptStore(path) as store:
        assert store.env._gen.writemap
        assert store.get(MODEL, a[0][0]) is None
        for t, c in a[1:] + b:
            assert same_cache(store.get(MODEL, t), c)
        assert store.verify().ok


def test_a_truncated_file_is_refused_and_keeps_its_length(tmp_path):
    path = tmp_path / "s"
    with PromptStore(path) as store:
        for i in range(6):
            store.put(MODEL, *make_entry(7, i, big_every=2))
        used = _env.pages_needed(store.env.env)
    data = path / "data.mdb"
    cut = used // 2 // 4096 * 4096
    os.truncate(data, cut)
    with pytest.raises(StoreUnavailable, match="truncated"):
        PromptStore(path)
    assert os.path.getsize(data) == cut  # not extended to the map by the refused open


def test_growing_the_map_never_cuts_a_longer_file(tmp_path):
    """Another process may have grown the map (and the file) further: a resize
    here adopts the file's length instead of truncating it to double ours."""
    with PromptStore(tmp_path / "s") as store:
        env = store.env
        data = env.dir / "data.mdb"
        ours = env.env.info()["map_size"]
        longer = 8 * ours
        os.truncate(data, longer)  # as a peer's resize would leave it
        value = bytes(ours)  # does not fit our map: it grows first

        env.write(lambda txn: txn.put(b"big", value, db=env.db[b"info"]), nbytes=len(value))
        assert os.path.getsize(data) == longer
        assert env.env.info()["map_size"] == longer
        with env.read() as txn:
            assert txn.get(b"big", db=env.db[b"info"]) == value


def test_no_writemap_where_blocks_cannot_be_reserved(tmp_path, monkeypatch):
    """A file system without fallocate: plain writes, and the store works."""
    def refuse(fd, offset, length):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(_env, "fallocate", refuse)
    t, c = make_entry(8, 5)
    with PromptStore(tmp_path / "s") as store:
        assert not store.env._gen.writemap
        store.put(MODEL, t, c)
        assert same_cache(store.get(MODEL, t), c)
    assert not list((tmp_path / "s").glob(".fallocate-probe*"))
