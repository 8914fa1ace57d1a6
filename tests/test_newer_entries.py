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
        doc = msgpack.unpackb(bytes(txn.get(ekey, db=store._db.entries)), raw=False)
        change(doc)
        raw = msgpack.packb(doc, use_bin_type=True)
        if reseal:
            raw = raw[:-8] + xxhash.xxh3_64_digest(raw[:-8])
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
