"""Entries written by a newer promptstore are refused on read, never deleted.

A store shared by two releases (a rolling upgrade, a CLI older than the
server) holds entries the older one cannot read: a newer entry format, a
storage kind it does not know, a codec version above its own. Their
manifests are intact; fail closed means refusing to read them, and nothing
else: ``verify`` lists them as newer (not damaged), ``--fix`` keeps them, a
lookup skips them without recommending their deletion, and eviction treats
them by last use like any other entry. A manifest that only looks newer
because it is damaged (its checksum fails) is still damage.
"""

from __future__ import annotations

import json
import logging

import mlx.core as mx
import msgpack
import pytest
import xxhash
from click.testing import CliRunner
from mlx_lm.models.cache import KVCache

from promptstore import PromptStore, UnknownStorageKind, UnsupportedVersion
from promptstore.cli import main
from promptstore.store import _keys
from promptstore.store._schema import U64

MODEL = "m@0123456789abcdef"


def kv(n: int, seed: int):
    c = KVCache()
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
    c.update_and_fetch(k, k + 1)
    return [c]


def rewrite(store, tokens, change, reseal: bool = True) -> None:
    """Edit the manifest of the entry at ``tokens`` as a newer writer would
    (``reseal``: with a valid checksum) or as damage would (without)."""
    ekey = _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens))

    def write(txn):
        old = bytes(txn.get(ekey, db=store._db.entries))
        doc = msgpack.unpackb(old, raw=False)
        change(doc)
        raw = msgpack.packb(doc, use_bin_type=True)
        if reseal:
            raw = raw[:-8] + xxhash.xxh3_64_digest(raw[:-8])
            # a writer counts its manifest's bytes in the entry's size and the store's usage
            grown = len(raw) - len(old)
            for table, key in ((store._db.sizes, ekey), (store._db.info, b"usage")):
                txn.put(key, U64.pack(U64.unpack(bytes(txn.get(key, db=table)))[0] + grown), db=table)
        txn.put(ekey, raw, db=store._db.entries)

    store.env.write(write)


def kind(doc):
    doc["layers"][0]["kind"] = "kv.from-the-future"


def version(doc):
    doc["layers"][0]["version"] = 99


def fmt(doc):
    doc["format"] = 99


@pytest.fixture
def store(tmp_path):
    s = PromptStore(tmp_path / "s")
    yield s
    s.close()


@pytest.mark.parametrize("change", [kind, version, fmt], ids=["kind", "codec-version", "entry-format"])
def test_verify_lists_newer_entries_and_fix_keeps_them(store, change, caplog):
    for i in range(3):
        store.put(MODEL, list(range(100 * (i + 1))), kv(100 * (i + 1), i))
    eid = store.prefixes(MODEL, list(range(200)))[0].id
    rewrite(store, list(range(200)), change)
    report = store.verify()
    assert report.ok and not report.problems and [e for e, _ in report.newer] == [eid]
    fixed = store.verify(fix=True)
    assert len(fixed.newer) == 1 and not fixed.problems
    assert store.verify().newer == fixed.newer  # still there
    with pytest.raises((UnknownStorageKind, UnsupportedVersion)):
        store.get(MODEL, list(range(200)))
    caplog.set_level(logging.WARNING, logger="promptstore")
    hit = store.lookup(MODEL, list(range(200)) + [9999])
    assert hit is not None and hit.info.id != eid  # the newer entry is skipped; another one serves
    if change is not fmt:  # (a newer entry format is skipped when its manifest is read)
        assert "written by a newer promptstore" in caplog.text
    assert "verify --fix" not in caplog.text
    assert len(list(store.entries())) == (3 if change is not fmt else 2)  # ls cannot read a newer format


@pytest.mark.parametrize("change", [kind, version, fmt], ids=["kind", "codec-version", "entry-format"])
def test_peek_passes_over_a_newer_entry_as_lookup_does(store, change):
    store.put(MODEL, list(range(100)), kv(100, 0))
    store.put(MODEL, list(range(200)), kv(200, 1))
    rewrite(store, list(range(200)), change)
    query = list(range(200)) + [9999]
    assert store.peek(MODEL, query) == store.lookup(MODEL, query).matched == 100


def test_a_damaged_manifest_that_looks_newer_is_damage(store):
    store.put(MODEL, list(range(100)), kv(100, 0))
    store.put(MODEL, list(range(200)), kv(200, 1))
    rewrite(store, list(range(200)), fmt, reseal=False)
    report = store.verify()
    assert not report.ok and len(report.problems) == 1 and not report.newer
    store.verify(fix=True)
    assert store.verify().ok and len(list(store.entries())) == 1


def test_eviction_treats_newer_entries_by_last_use(store):
    store.put(MODEL, [1] * 100, kv(100, 0))  # oldest
    store.put(MODEL, [2] * 100, kv(100, 1))
    store.put(MODEL, [3] * 100, kv(100, 2))
    oldest = store.prefixes(MODEL, [1] * 100)[0].id
    rewrite(store, [1] * 100, kind)
    usage = store.usage()
    report = store.gc(budget=usage * 2 // 3 + 100)
    assert report.evicted == (oldest,)  # the least recently used one, though this promptstore cannot read it
    assert not store.verify().newer and store.get(MODEL, [2] * 100) is not None


def test_cli_verify_fix_keeps_newer_entries(tmp_path):
    path = tmp_path / "s"
    with PromptStore(path) as s:
        s.put(MODEL, list(range(100)), kv(100, 0))
        s.put(MODEL, list(range(200)), kv(200, 1))
        rewrite(s, list(range(200)), version)
    r = CliRunner().invoke(main, ["--store", str(path), "verify", "--fix", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["ok"] and doc["problems"] == [] and len(doc["newer"]) == 1
    r = CliRunner().invoke(main, ["--store", str(path), "verify"])
    assert r.exit_code == 0 and "newer" in r.output and "kept" in r.output
    with PromptStore(path) as s:
        assert len(list(s.entries())) == 2


NEWER_RELEASE = """
import sys
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from promptstore import PromptStore
from promptstore.codecs import codec_for_kind

codec_for_kind("kv").version += 1  # this process is a newer release: kv entries at the next codec version
with PromptStore({path!r}) as s:
    for i in range({n}):
        c = KVCache()
        k = mx.random.normal((1, 2, 120 + i, 8), key=mx.random.key(50 + i))
        c.update_and_fetch(k, k + 1)
        s.put({model!r}, [7000 + i] * (120 + i), [c])
"""


def test_a_newer_release_writing_to_the_same_store_loses_nothing_to_verify_fix(tmp_path):
    """A second process, a newer release (its kv codec one version up), writes
    entries into a store this release also writes: this release's verify
    lists them as newer and --fix keeps every one; its own entries stay."""
    import subprocess
    import sys

    path, n = tmp_path / "s", 6
    with PromptStore(path) as s:
        for i in range(3):
            s.put(MODEL, list(range(10 * (i + 1))), kv(10 * (i + 1), i))
    proc = subprocess.run([sys.executable, "-c", NEWER_RELEASE.format(path=str(path), n=n, model=MODEL)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with PromptStore(path) as s:
        report = s.verify(fix=True)
        assert report.ok and len(report.newer) == n and not report.problems
        assert len(list(s.entries())) == 3 + n  # n of n kept, and this release's 3
        for i in range(3):
            assert s.get(MODEL, list(range(10 * (i + 1)))) is not None
        with pytest.raises(UnsupportedVersion):
            s.get(MODEL, [7000] * 120)
        s.put(MODEL, list(range(40)), kv(40, 9))  # and this release goes on writing beside them
        assert s.verify().ok and len(s.verify().newer) == n
    print(f"\nnewer release: {n} of {n} entries kept by verify --fix")


def test_a_newer_entry_sharing_blocks_keeps_them_through_verify_fix_and_rm(tmp_path):
    """A conversation of 16, 32 and 48 tokens shares its blocks; the 48-token
    entry is a newer release's. verify counted its references as missing
    ("wrong reference counts"), --fix lowered the counts to the readable
    entries' and dropped it from the prefix index, and rm of the two
    shorter entries then freed the blocks it still uses."""
    path = tmp_path / "s"
    toks = list(range(100, 148))

    def conversation(n):
        c = kv(48, 3)
        c[0].trim(48 - n)
        return c

    with PromptStore(path, block_tokens=16) as s:
        ids = [s.put(MODEL, toks[:n], conversation(n)).id for n in (16, 32, 48)]
        rewrite(s, toks, fmt)
        report = s.verify()
        assert report.ok and report.bad_counts == 0 and len(report.newer) == 1
        fixed = s.verify(fix=True)
        assert fixed.ok and len(fixed.newer) == 1
        s.remove(ids[0])
        s.remove(ids[1])
        assert s.verify().ok
    with PromptStore(path, block_tokens=16) as s:
        rewrite(s, toks, lambda doc: doc.update(format=4))  # the newer release, reading its own entry
        hit = s.lookup(MODEL, toks + [1])
        assert hit is not None and hit.matched == 48  # still in the prefix index, every block still stored
        got, want = hit.cache[0], conversation(48)[0]
        assert all(mx.array_equal(a[..., :48, :], b[..., :48, :]).item() for a, b in ((got.keys, want.keys), (got.values, want.values)))
        assert s.verify().ok


def test_salvage_leaves_a_newer_entry_behind_and_never_brings_back_an_older_copy(tmp_path):
    """Its manifest refused as newer, salvage treated it as damage: the byte
    scan then found the entry's earlier manifest in a freed page and copied
    that, reporting nothing left behind."""
    from promptstore.store import salvage

    src = tmp_path / "s"
    with PromptStore(src) as s:
        s.put(MODEL, list(range(10)), kv(10, 1))
        s.put(MODEL, list(range(20)), kv(20, 2))
        rewrite(s, list(range(20)), fmt)
    report = salvage(src, tmp_path / "d")
    assert len(report.copied) == 1 and not report.scanned
    (left,) = report.skipped
    assert "newer promptstore" in left[1]
    with PromptStore(tmp_path / "d") as d:
        assert [e.n_tokens for e in d.entries()] == [10]
