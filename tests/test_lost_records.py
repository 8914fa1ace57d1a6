"""verify on a store older than shared blocks, opened read-only, and what
verify --fix says it removed. Real LMDB files: tables are dropped with the
lmdb module's own calls."""

from __future__ import annotations

import json

import lmdb
from click.testing import CliRunner

from _content import MODEL, make_entry, same_cache
from _raw import damage_manifest, ekey_of
from promptstore import PromptStore, StoreError
from promptstore.cli import main
from promptstore.format import _blobs
from promptstore.store._schema import FORMAT_KEY, U64


def all_intact(store, items) -> bool:
    return all(same_cache(store.get(MODEL, toks), cache) for toks, cache in items)


def test_verify_reads_a_store_older_than_shared_blocks_read_only(tmp_path):
    """Read-only verify of a store the release before shared blocks wrote
    (format 1: no ``blocks``, ``refs``, ``places``, ``packs``, ``trims``,
    ``lru`` tables) raised KeyError b'refs'."""
    path = tmp_path / "s"
    items = [make_entry(3, i) for i in range(3)]
    with PromptStore(path, shared_blocks=False) as store:
        for toks, cache in items:
            store.put(MODEL, toks, cache)
    env = lmdb.open(str(path), max_dbs=32)
    with env.begin(write=True) as txn:
        for name in (b"blocks", b"refs", b"places", b"packs", b"trims", b"lru"):
            txn.drop(env.open_db(name, txn=txn), delete=True)
        txn.put(FORMAT_KEY, U64.pack(1), db=env.open_db(b"info", txn=txn))
    env.close()
    with PromptStore(path, readonly=True) as ro:
        rep = ro.verify()
        assert rep.ok and rep.checked == 3, rep
    res = CliRunner().invoke(main, ["--store", str(path), "verify"])
    assert res.exit_code == 0 and "ok: 3 entries checked" in res.output, res.output
    with PromptStore(path) as store:  # opened for writing: brought to this layout
        assert store.verify(fix=True).ok and all_intact(store, items)


def test_verify_fix_reports_the_entries_it_removed_not_those_it_kept(tmp_path, monkeypatch):
    """verify --fix said it removed every entry it listed, those it kept too
    (one whose file could not be read: not damage)."""
    monkeypatch.setattr(_blobs, "MIN_PAYLOAD", 50_000)
    path = tmp_path / "s"
    big = make_entry(8, 0, big_every=1)
    with PromptStore(path, shared_blocks=False) as store:
        kept = store.put(MODEL, *big).id  # its payload in a blob file
        damaged = store.put(MODEL, *make_entry(8, 1, big_every=0)).id
        damage_manifest(store, ekey_of(store, damaged))

    def failing(self, man, where):
        raise StoreError(f"{where}: cannot open blob file {man.blob} ([Errno 13] Permission denied)")

    monkeypatch.setattr(_blobs.Blobs, "read", failing)
    res = CliRunner().invoke(main, ["--store", str(path), "verify", "--fix"])
    assert res.exit_code == 1 and "removed 1 damaged entry " in res.output and "kept 1 entry" in res.output, res.output
    res = CliRunner().invoke(main, ["--store", str(path), "verify", "--fix", "--json"])
    doc = json.loads(res.output)
    assert doc["removed"] == [] and [p["id"] for p in doc["problems"]] == [kept], doc
    monkeypatch.undo()
    with PromptStore(path) as store:
        rep = store.verify()
        assert rep.ok and rep.checked == 1 and same_cache(store.get(MODEL, big[0]), big[1])
