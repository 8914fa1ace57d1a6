"""Large payloads in blob files beside LMDB: written durably under the writer
lock, unlinked only after the commit that drops them, damage detected like
damage inside LMDB, leftovers of killed puts removed by gc and verify --fix."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from _raw import audit_blocks, get_block, raw_manifest, shared_block, write_manifest
from _content import MODEL, chat_entry, make_entry, same_cache
from test_crash import check_after_crashes, run_worker
from promptstore import CorruptEntry, PromptStore, UnsupportedVersion
from promptstore.format import _blobs, _entry, _payload
from promptstore.store import _keys
from promptstore.bench import _data as data

HERE = Path(__file__).resolve().parent
SMALL = 50_000  # blob threshold for the tests with small entries


def _files(path: Path):
    return sorted(os.listdir(path / "blobs")) if (path / "blobs").is_dir() else []


def _man(store, tokens):
    with store.env.read() as txn:
        return store._manifest(txn, _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens)))


@pytest.fixture
def small_blobs(monkeypatch):
    monkeypatch.setattr(_blobs, "MIN_PAYLOAD", SMALL)


@pytest.fixture(autouse=True)
def payload_layout(monkeypatch):
    """A blob file holds an entry's own payload, which shared blocks leave a KV
    cache without: these tests of the blob path write entries without shared
    blocks (format 2), as do the processes they start. Blob files of entries
    with shared blocks: the tests that pass ``shared_blocks=True``."""
    monkeypatch.setenv("PROMPTSTORE_SHARED_BLOCKS", "0")


def test_a_large_entry_is_one_blob_file_and_restores_bit_exactly(tmp_path):
    cache = data.hybrid_cache(data.QUICK, 1024, seed=3)
    tokens = list(range(1, 1025))
    with PromptStore(tmp_path / "s") as store:
        info = store.put(MODEL, tokens, cache)
        assert info.nbytes >= _blobs.MIN_PAYLOAD  # the real threshold, not a lowered one
        (name,) = _files(tmp_path / "s")
        man = _man(store, tokens)
        assert man.blob == name and man.payload == info.nbytes
        assert (tmp_path / "s" / "blobs" / name).stat().st_size == info.nbytes
        with store.env.read() as txn:  # nothing of the payload in LMDB
            assert txn.stat(store._db[b"chunks"])["entries"] == 0
        assert store.file_size() >= info.nbytes
        for _ in range(2):
            assert same_cache(store.get(MODEL, tokens), cache)
        hit = store.lookup(MODEL, tokens + [5, 6])
        assert hit.matched == 1024 and same_cache(hit.cache, cache)
        assert store.verify().ok and store.verify().orphan_blobs == 0
    with PromptStore(tmp_path / "s", readonly=True) as ro:
        assert same_cache(ro.get(MODEL, tokens), cache)


def test_small_entries_stay_in_lmdb(store):
    tokens, cache = make_entry(1, 1)
    store.put(MODEL, tokens, cache)
    assert _man(store, tokens).blob is None and _files(store.path) == []


def test_replace_delete_and_eviction_unlink_the_files(tmp_path, small_blobs):
    path = tmp_path / "s"
    (t0, c0), (t1, c1), (t2, c2) = (make_entry(4, i, big_every=1) for i in range(3))
    with PromptStore(path) as store:
        store.put(MODEL, t0, c0)
        first = _files(path)
        store.put(MODEL, t0, c1)  # replaced: a new file, the old one gone after the commit
        second = _files(path)
        assert len(first) == len(second) == 1 and first != second
        assert same_cache(store.get(MODEL, t0), c1)
        assert store.delete(MODEL, t0) and _files(path) == []
        store.put(MODEL, t1, c1)
        size = store.usage()
        store.set_budget(size + size // 2)  # room for one entry: the next put evicts t1
        store.put(MODEL, t2, c2)
        assert store.get(MODEL, t1) is None
        assert _files(path) == [_man(store, t2).blob]
        store.remove(_man(store, t2).entry_id)
        assert _files(path) == []


@pytest.mark.parametrize("spanning", [True, False])
def test_a_flipped_byte_in_a_blob_is_caught(tmp_path, spanning, caplog):
    cache = data.hybrid_cache(data.QUICK, 1024, seed=5)
    tokens = list(range(1, 1025))
    with PromptStore(tmp_path / "s") as store:
        store.put(MODEL, tokens, cache)
        man = _man(store, tokens)
        rec = next(r for layer in man.layers for r in layer.arrays if _payload._spans(r) == spanning and r.nbytes > 4096)
        with open(tmp_path / "s" / "blobs" / man.blob, "r+b") as f:
            f.seek(rec.offset + rec.nbytes - 7)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
        with pytest.raises(CorruptEntry, match=rf"checksum mismatch in layer \d+ array {rec.name!r}"):
            store.get(MODEL, tokens)
        with caplog.at_level(logging.WARNING, logger="promptstore"):
            assert store.lookup(MODEL, tokens) is None
        assert "skipping entry" in caplog.text
        rep = store.verify()
        assert not rep.ok and rep.problems[0][0] == man.entry_id
        store.verify(fix=True)
        assert store.get(MODEL, tokens) is None and _files(tmp_path / "s") == []


@pytest.mark.parametrize("change", [-1, +1])
def test_a_blob_of_the_wrong_size_is_corrupt(tmp_path, small_blobs, change):
    tokens, cache = make_entry(6, 0, big_every=1)
    with PromptStore(tmp_path / "s") as store:
        store.put(MODEL, tokens, cache)
        blob = tmp_path / "s" / "blobs" / _man(store, tokens).blob
        size = blob.stat().st_size
        os.truncate(blob, size + change)
        with pytest.raises(CorruptEntry, match=rf"has {size + change} bytes, the manifest says {size}"):
            store.get(MODEL, tokens)
        assert not store.verify().ok


def test_a_lost_blob_is_corrupt_not_a_miss(tmp_path, small_blobs, caplog):
    (t0, c0), (t1, c1) = make_entry(7, 0, big_every=1), make_entry(7, 1, big_every=1)
    with PromptStore(tmp_path / "s") as store:
        store.put(MODEL, t0, c0)
        store.put(MODEL, t1, c1)
        os.unlink(tmp_path / "s" / "blobs" / _man(store, t0).blob)
        with pytest.raises(CorruptEntry, match="is missing"):
            store.get(MODEL, t0)
        with caplog.at_level(logging.WARNING, logger="promptstore"):
            assert store.lookup(MODEL, t0) is None  # skipped, as any damaged candidate
        assert "is missing" in caplog.text
        rep = store.verify()
        assert [eid for eid, _ in rep.problems] == [_man(store, t0).entry_id]
        store.verify(fix=True)
        assert store.get(MODEL, t0) is None and same_cache(store.get(MODEL, t1), c1)
        assert store.verify().ok


@pytest.mark.parametrize("shared_blocks", [False, True], ids=["payload", "shared-blocks"])
def test_sigkill_during_puts_to_blob_files(tmp_path, shared_blocks):
    """With shared blocks: chats whose KV is in blocks they share and whose
    recurrent state (320 bytes, over the lowered threshold) is in a blob file."""
    kills = 150 if os.environ.get("PROMPTSTORE_STRESS") == "1" else 25
    content, blob_min = ("chats", 256) if shared_blocks else ("entries", SMALL)
    res = run_worker("crash", tmp_path / "store", kills, 3, content, blob_min=blob_min, shared_blocks=shared_blocks)
    assert res["errors"] == [] and res["inflight_at_kill"] >= 5
    store = check_after_crashes(tmp_path / "store", res["done"], content)
    with store.env.read() as txn:
        mans = [_entry.unpack_manifest(bytes(r), "x") for _, r in txn.cursor(db=store._db[b"entries"])]
    named = {m.blob for m in mans if m.blob}
    assert named  # blob entries were committed between the kills
    assert any(m.blob and m.bounds for m in mans) == shared_blocks  # format 3 with a blob file
    assert named <= set(_files(tmp_path / "store"))
    store.gc()  # leftovers of the killed puts go; every committed file stays
    assert set(_files(tmp_path / "store")) == named and store.verify().orphan_blobs == 0
    store.close()


def test_a_shared_block_entry_keeps_its_own_payload_in_a_blob(tmp_path, monkeypatch):
    """Format 3 with a blob file: the KV arrays in blocks that the turns of a
    chat share, each turn's recurrent state (its own payload) in a blob file.
    A flipped byte in one blob fails that entry only: the turns sharing its
    blocks restore bit-exactly, and verify --fix removes the entry and its
    file but not the blocks the others reference."""
    monkeypatch.setattr(_blobs, "MIN_PAYLOAD", 256)  # the 320-byte state goes to a blob
    path = tmp_path / "s"
    items = [chat_entry(1, turn) for turn in range(3)]  # chat 1: a KV and an ArraysCache layer
    with PromptStore(path, shared_blocks=True) as store:
        for tokens, cache in items:
            store.put(MODEL, tokens, cache)
        mans = [_man(store, tokens) for tokens, _ in items]
        assert all(m.blob and m.bounds for m in mans) and sorted(_files(path)) == sorted(m.blob for m in mans)
        shared = shared_block(store, [m.entry_id for m in mans])  # the system prompt's first block
        victim = mans[1]
        with open(path / "blobs" / victim.blob, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0x08]))
        with pytest.raises(CorruptEntry, match="checksum mismatch"):
            store.get(MODEL, items[1][0])
        for i in (0, 2):
            assert same_cache(store.get(MODEL, items[i][0]), items[i][1])
        rep = store.verify()
        assert [eid for eid, _ in rep.problems] == [victim.entry_id] and not rep.bad_counts
        store.verify(fix=True)
        assert store.get(MODEL, items[1][0]) is None and store.verify().ok
        assert sorted(_files(path)) == sorted([mans[0].blob, mans[2].blob])
        assert get_block(store, shared) is not None and audit_blocks(store)
        for i in (0, 2):
            assert same_cache(store.get(MODEL, items[i][0]), items[i][1])


def _killed(path: Path, patch: str, body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(HERE)!r})
        from promptstore import PromptStore
        from promptstore.format import _blobs
        from promptstore.store import _env
        from _content import make_entry
        _blobs.MIN_PAYLOAD = {SMALL}
        store = PromptStore({str(path)!r})
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        """
    ) + textwrap.dedent(patch) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_sigkill_between_blob_write_and_commit(tmp_path, small_blobs):
    path = tmp_path / "s"
    tokens, cache = make_entry(12, 0, big_every=1)
    out = _killed(
        path,
        """
        real = _blobs.Blobs.write
        _blobs.Blobs.write = lambda self, name, views: (real(self, name, views), die())
        """,
        f"store.put({MODEL!r}, {tokens!r}, make_entry(12, 0, big_every=1)[1])\n",
    )
    assert out.returncode == -9, out.stderr
    assert len(_files(path)) == 1  # written and fsynced, never committed
    with PromptStore(path) as store:
        assert store.get(MODEL, tokens) is None
        rep = store.verify()
        assert rep.ok and rep.orphan_blobs == 1
        store.gc()
        assert _files(path) == []
        store.put(MODEL, tokens, cache)
        assert same_cache(store.get(MODEL, tokens), cache)


def test_sigkill_between_commit_and_unlink(tmp_path, small_blobs):
    path = tmp_path / "s"
    tokens, old = make_entry(13, 0, big_every=1)
    new = make_entry(13, 1, big_every=1)[1]
    n = len(tokens)
    new[0].keys, new[0].values, new[0].offset = new[0].keys[..., :n, :], new[0].values[..., :n, :], n
    with PromptStore(path) as store:
        store.put(MODEL, tokens, old)
    out = _killed(
        path,
        "_env.Env._run_pending = lambda self: die()\n",
        textwrap.dedent(
            f"""
            c = make_entry(13, 1, big_every=1)[1]
            n = {n}
            c[0].keys, c[0].values, c[0].offset = c[0].keys[..., :n, :], c[0].values[..., :n, :], n
            store.put({MODEL!r}, {tokens!r}, c)
            """
        ),
    )
    assert out.returncode == -9, out.stderr
    assert len(_files(path)) == 2  # the replaced entry's file outlived the commit
    with PromptStore(path) as store:
        assert same_cache(store.get(MODEL, tokens), new)
        assert store.verify().orphan_blobs == 1
        store.verify(fix=True)
        assert _files(path) == [_man(store, tokens).blob]


def test_a_file_size_limit_on_a_blob_is_store_full(tmp_path):
    res = run_worker("fsize", tmp_path / "s", 3_000_000, blob_min=1_000_000)
    assert res["outcome"] == "error" and res["type"] == "StoreFull", res
    assert "ulimit" in res["message"] and "nothing was written" in res["message"]
    assert res["done"] and res["read_after"] is True
    assert _files(tmp_path / "s") == []  # the partial file is gone
    with PromptStore(tmp_path / "s") as store:
        assert store.verify().ok
        for seed, i in res["done"]:
            t, c = make_entry(seed, i, big_every=3)
            assert same_cache(store.get(MODEL, t), c)


def test_a_retried_transaction_leaves_one_file(tmp_path, small_blobs):
    """A put that meets a full map aborts, grows the map and runs again: the
    first attempt's file goes, the second attempt writes a new one."""
    tokens, cache = make_entry(14, 0, big_every=1)
    tokens = tokens * 8  # many index records: more than the tiny map holds
    cache[0].keys, cache[0].values = mx.concatenate([cache[0].keys] * 8, axis=2), mx.concatenate([cache[0].values] * 8, axis=2)
    cache[0].offset = len(tokens)
    cache = cache[:1]
    writes = []
    real = _blobs.Blobs.write

    def counting(self, name, views):
        writes.append(name)
        return real(self, name, views)

    with PromptStore(tmp_path / "s", map_size=1 << 16) as store:
        before = store.env.env.info()["map_size"]
        _blobs.Blobs.write = counting
        try:
            store.put(MODEL, tokens, cache)
        finally:
            _blobs.Blobs.write = real
        assert store.env.env.info()["map_size"] > before and len(writes) >= 2
        assert _files(tmp_path / "s") == [writes[-1]] == [_man(store, tokens).blob]
        assert same_cache(store.get(MODEL, tokens), cache)


def test_manifests_naming_blobs_fail_closed(tmp_path, small_blobs, monkeypatch):
    tokens, cache = make_entry(15, 0, big_every=1)
    small_toks, small = [1, 2, 3], data.tiny_kv(3)
    with PromptStore(tmp_path / "s") as store:
        store.put(MODEL, tokens, cache)
        store.put(MODEL, small_toks, small)
        eid = _man(store, tokens).entry_id
        monkeypatch.setattr(_entry, "FORMAT", 1)  # a reader from before blob files
        with pytest.raises(UnsupportedVersion, match="entry format 2"):
            store.get(MODEL, tokens)
        assert same_cache(store.get(MODEL, small_toks), small)  # LMDB entries stay format 1
        monkeypatch.setattr(_entry, "FORMAT", 2)
        doc = raw_manifest(store, eid)
        for bad in ("../../data.mdb", "/etc/passwd", doc["blob"][:-1], doc["blob"].upper(), ""):
            write_manifest(store, eid, dict(doc, blob=bad))
            with pytest.raises(CorruptEntry, match="not a blob name"):
                store.get(MODEL, tokens)
        write_manifest(store, eid, {k: v for k, v in doc.items() if k != "blob"})
        with pytest.raises(CorruptEntry, match="'blob' is missing"):
            store.get(MODEL, tokens)
        write_manifest(store, eid, dict(doc, format=1))
        with pytest.raises(CorruptEntry, match="names a blob file"):
            store.get(MODEL, tokens)
        store.gc()  # a manifest it cannot read may be the file's: the file stays
        assert _files(tmp_path / "s") == [doc["blob"]]
        write_manifest(store, eid, dict(doc, format=_entry.FORMAT + 1))  # a newer promptstore's entry
        store.gc()
        assert _files(tmp_path / "s") == [doc["blob"]]
        assert store.delete(MODEL, tokens)  # the entry goes; its file is then nobody's
        store.gc()
        assert _files(tmp_path / "s") == []


def test_compact_and_salvage_keep_blob_entries(tmp_path, small_blobs):
    from promptstore.store import _salvage

    (t0, c0), (t1, c1) = make_entry(16, 0, big_every=1), make_entry(16, 1, big_every=0)
    src = tmp_path / "src"
    with PromptStore(src) as store:
        store.put(MODEL, t0, c0)
        store.put(MODEL, t1, c1)
        store.compact()
        assert same_cache(store.get(MODEL, t0), c0) and len(_files(src)) == 1
    rep = _salvage.salvage(src, tmp_path / "dst")
    assert len(rep.copied) == 2 and not rep.skipped
    assert _files(tmp_path / "dst") == _files(src)
    with PromptStore(tmp_path / "dst") as out:
        assert same_cache(out.get(MODEL, t0), c0) and same_cache(out.get(MODEL, t1), c1)
        assert out.verify().ok


def test_an_interrupt_after_the_commit_keeps_the_committed_file(tmp_path, small_blobs, monkeypatch):
    """A signal handled just after the commit (here: raised by the after-commit
    step) must not make put remove the file its committed manifest names."""
    from promptstore.store import _env

    tokens, cache = make_entry(18, 0, big_every=1)
    with PromptStore(tmp_path / "s") as store:
        def interrupted(self):
            self._pending.calls = None
            raise KeyboardInterrupt

        monkeypatch.setattr(_env.Env, "_run_pending", interrupted)
        with pytest.raises(KeyboardInterrupt):
            store.put(MODEL, tokens, cache)
        monkeypatch.undo()
        assert _files(tmp_path / "s") == [_man(store, tokens).blob]
        assert same_cache(store.get(MODEL, tokens), cache)


def test_a_manifest_naming_another_entrys_blob_is_corrupt_and_harmless(tmp_path, small_blobs):
    (ta, ca), (tb, cb) = make_entry(19, 0, big_every=1), make_entry(19, 1, big_every=1)
    with PromptStore(tmp_path / "s") as store:
        store.put(MODEL, ta, ca)
        b = store.put(MODEL, tb, cb).id
        doc = raw_manifest(store, b)
        write_manifest(store, b, dict(doc, blob=_man(store, ta).blob))
        with pytest.raises(CorruptEntry, match="of another entry"):
            store.get(MODEL, tb)
        assert not store.exists(MODEL, tb)
        store.put(MODEL, tb, cb)  # replacing the damaged entry leaves A's file alone
        assert same_cache(store.get(MODEL, ta), ca) and same_cache(store.get(MODEL, tb), cb)
        store.gc()  # B's first file, which no manifest names any more, goes
        assert sorted(_files(tmp_path / "s")) == sorted([_man(store, ta).blob, _man(store, tb).blob])


def test_a_blobs_path_that_is_not_a_directory_gives_typed_errors(tmp_path, small_blobs):
    from promptstore import StoreError

    path = tmp_path / "s"
    tokens, cache = make_entry(20, 0, big_every=1)
    with PromptStore(path) as store:
        small_toks, small = [1, 2, 3], data.tiny_kv(3)
        store.put(MODEL, small_toks, small)
        (path / "blobs").write_bytes(b"not a directory")
        with pytest.raises(StoreError, match="cannot create a blob file"):
            store.put(MODEL, tokens, cache)
        for call in (store.verify, lambda: store.verify(fix=True), store.gc, store.file_size):
            with pytest.raises(StoreError, match="cannot list blob files"):
                call()
        assert same_cache(store.get(MODEL, small_toks), small) and store.get(MODEL, tokens) is None


def test_verify_fix_keeps_an_entry_whose_file_cannot_be_read(tmp_path, small_blobs, monkeypatch):
    """A read that fails (permissions, I/O) is reported, but is not damage: --fix keeps the entry."""
    from promptstore import StoreError

    tokens, cache = make_entry(21, 0, big_every=1)
    with PromptStore(tmp_path / "s") as store:
        store.put(MODEL, tokens, cache)

        def failing(self, man, where):
            raise StoreError(f"{where}: cannot open blob file {man.blob} ([Errno 13] Permission denied)")

        monkeypatch.setattr(_blobs.Blobs, "read", failing)
        rep = store.verify(fix=True)
        assert not rep.ok and "Permission denied" in rep.problems[0][1]
        monkeypatch.undo()
        assert same_cache(store.get(MODEL, tokens), cache) and len(_files(tmp_path / "s")) == 1
