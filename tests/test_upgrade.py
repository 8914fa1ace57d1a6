"""``promptstore compact`` rewrites a store of the older layouts into shared blocks.

A store written before shared prefixes (entry formats 1 and 2: every KV byte
in each entry's own payload) keeps working as it is; compact rewrites its
entries so each shared prefix is stored once, keeping dates and pins, and
every entry restores bit for bit as before.
"""

from __future__ import annotations

import json

import mlx.core as mx
from click.testing import CliRunner
from mlx_lm.models.cache import ArraysCache, KVCache

from _bits import bits_equal
from promptstore import PromptStore
from promptstore.cli import main
from promptstore.store import _keys

MODEL = "m@0123456789abcdef"


def chat_caches(turns: int, step: int):
    """A conversation's caches turn by turn: each extends the previous one's bytes."""
    k = mx.random.normal((1, 2, turns * step, 16), key=mx.random.key(1))
    out = []
    for t in range(1, turns + 1):
        layers = []
        for i in range(2):
            c = KVCache()
            c.update_and_fetch(k[..., : t * step, :] + i, k[..., : t * step, :] - i)
            layers.append(c)
        out.append(layers)
    return out


def same(a, b) -> bool:
    if isinstance(a, ArraysCache):
        return all(bits_equal(x, y) for x, y in zip(a.cache, b.cache))
    n = b.offset
    return a.offset == n and bits_equal(a.keys[..., :n, :], b.keys[..., :n, :]) and bits_equal(a.values[..., :n, :], b.values[..., :n, :])


def manifest(store, tokens):
    with store.env.read() as txn:
        return store._manifest(txn, _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens)))


def test_compact_rewrites_an_old_store_into_shared_blocks(tmp_path):
    path = tmp_path / "s"
    tokens = list(range(6 * 300))
    caches = chat_caches(6, 300)
    old = PromptStore(path, shared_blocks=False)  # what the previous release wrote
    infos = [old.put(MODEL, tokens[: (t + 1) * 300], c, meta={"turn": t}) for t, c in enumerate(caches)]
    rec = ArraysCache(2)
    rec[0], rec[1] = mx.ones((1, 3, 4)), mx.zeros((1, 8))
    old.put(MODEL, [7, 7, 7], [rec], coverage=3)  # nothing to share: stays as it is
    old.pin(infos[2].id)
    # A big entry too, so the blob-file layout (format 2) is upgraded as well.
    big = chat_caches(1, 17000)[0]
    old.put(MODEL, [5] * 17000, big)
    assert manifest(old, [5] * 17000).blob is not None
    before_usage = old.usage()
    dates = {i.id: (i.created, i.last_used) for i in old.entries()}
    old.close()

    r = CliRunner().invoke(main, ["--store", str(path), "compact", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["upgraded"] == 7
    store = PromptStore(path)
    assert {i.id: (i.created, i.last_used) for i in store.entries()} == dates
    for t, c in enumerate(caches):
        man = manifest(store, tokens[: (t + 1) * 300])
        assert man.bounds and man.payload == 0
        got = store.get(MODEL, tokens[: (t + 1) * 300])
        assert all(same(a, b) for a, b in zip(got, c))
    assert all(same(a, b) for a, b in zip(store.get(MODEL, [5] * 17000), big))
    assert manifest(store, [5] * 17000).blob is None
    assert same(store.get(MODEL, [7, 7, 7])[0], rec) and not manifest(store, [7, 7, 7]).bounds
    # Each turn's KV is stored once: the chat now takes about its last turn's bytes.
    chat = sum(i.nbytes for i in infos)
    assert store.usage() < before_usage - chat + infos[-1].nbytes * 1.1
    assert store.pinned() == [infos[2].id]
    assert store.verify().ok
    # Again: nothing left to upgrade.
    assert store.upgrade() == 0
    store.close()


def test_compact_reports_the_bytes_before_its_upgrade_wrote_anything(tmp_path):
    """compact measured "before" after its own upgrade had rewritten the old
    entries (the CLI upgraded first, the API read the data file after its
    upgrade and repack): it reported more than the store ever held before
    the command (a reviewer's finding)."""
    tokens = list(range(6 * 300))
    for how in ("cli", "api"):
        path = tmp_path / how
        with PromptStore(path, shared_blocks=False) as old:  # what the previous release wrote
            for t, c in enumerate(chat_caches(6, 300)):
                old.put(MODEL, tokens[: (t + 1) * 300], c)
        with PromptStore(path, readonly=True) as ro:
            size = ro.file_size()
        if how == "cli":
            r = CliRunner().invoke(main, ["--store", str(path), "compact", "--json"])
            assert r.exit_code == 0, r.output
            out = json.loads(r.output)
            assert out["upgraded"] == 6
            before, after = out["before_bytes"], out["after_bytes"]
        else:
            with PromptStore(path) as store:
                assert store.file_size() == size
                before, after = store.compact()
                assert store.upgrade() == 0  # compact upgraded them
                assert after == store.file_size()
        assert before == size, how
        assert after < before


def test_upgrade_leaves_damaged_entries_and_is_off_without_shared_blocks(tmp_path):
    path = tmp_path / "s"
    old = PromptStore(path, shared_blocks=False)
    (c1,), (c2,) = [chat_caches(1, 300)[0][:1], chat_caches(2, 300)[1][:1]]
    old.put(MODEL, list(range(300)), [c1])
    old.put(MODEL, list(range(600)), [c2])
    assert old.upgrade() == 0  # this instance writes the old layout
    ekey = _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(list(range(300))))

    def damage(txn):
        key = next(k for k, _ in txn.cursor(db=old._db.chunks) if bytes(k).startswith(ekey))
        raw = bytearray(txn.get(key, db=old._db.chunks))
        raw[100] ^= 1
        txn.put(key, bytes(raw), db=old._db.chunks)

    old.env.write(damage)
    old.close()
    store = PromptStore(path)
    assert store.upgrade() == 1  # the damaged entry is not rewritten (nor deleted)
    report = store.verify()
    assert len(report.problems) == 1 and not report.bad_counts
    assert same(store.get(MODEL, list(range(600)))[0], c2)
    store.close()


def test_compact_sweeps_the_pointer_file_a_killed_compaction_left(tmp_path):
    """A compaction killed between writing ``CURRENT.<pid>.tmp`` and renaming
    it left that file for good; the next compaction removes those of dead
    processes, never one of a live process."""
    import subprocess

    path = tmp_path / "s"
    kv = KVCache()
    kv.update_and_fetch(mx.ones((1, 2, 3, 8)), mx.ones((1, 2, 3, 8)))
    with PromptStore(path) as s:
        s.put("m@x", [1, 2, 3], [kv])
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        (path / f"CURRENT.{dead.pid}.tmp").write_text("gen-9\n")
        (path / f"CURRENT.{live.pid}.tmp").write_text("gen-9\n")  # a live process's: left alone
        with PromptStore(path) as s:
            s.compact()
            assert s.get("m@x", [1, 2, 3]) is not None
        assert not (path / f"CURRENT.{dead.pid}.tmp").exists()
        assert (path / f"CURRENT.{live.pid}.tmp").exists()
    finally:
        live.kill()
        live.wait()
