"""One bookkeeping record lost (a ``packs`` record, a pack's member record,
an ``ids`` record, a ``places`` record): the entries it indexes are intact, so gc, compact and
verify --fix keep their files and blocks; verify reports the record, --fix
rebuilds it. Also verify on a store older than shared blocks, opened
read-only, and what verify --fix says it removed. Real LMDB files: records
and tables are deleted with the lmdb module's own calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lmdb
import pytest
from click.testing import CliRunner

from _content import MODEL, chat_entry, make_entry, same_cache
from _raw import audit_blocks, audit_packs, block_place, damage_manifest, ekey_of, flip_block, referrers
from promptstore import EntryNotFound, PromptStore, StoreError
from promptstore.cli import main
from promptstore.format import _blobs, _packs
from promptstore.store import _packing
from promptstore.store._schema import FORMAT_KEY, U64


def pack_files(path) -> list:
    d = path / _packs.DIRNAME
    return sorted(os.listdir(d)) if d.is_dir() else []


def chats(store, n: int = 3) -> list:
    """Put ``n`` chats of four turns; their (tokens, cache), in order."""
    out = []
    for c in range(n):
        for t in range(4):
            toks, cache = chat_entry(c, t)
            store.put(MODEL, toks, cache)
            out.append((toks, cache))
    return out


def all_intact(store, items) -> bool:
    return all(same_cache(store.get(MODEL, toks), cache) for toks, cache in items)


@pytest.mark.parametrize("repair", ["gc", "fix"])
def test_a_lost_pack_record_keeps_the_pack_and_is_rebuilt(tmp_path, repair):
    """gc and verify --fix unlinked a live pack whose ``packs`` record was
    lost (it counted as a file the store does not record: verify said ok)."""
    path = tmp_path / "s"
    with PromptStore(path) as store:
        items = chats(store)
        with store.env.read() as txn:
            victim = _packing.packs(txn, store._db)[0][0]
        files = pack_files(path)
        store.env.write(lambda txn: txn.delete(_packing.pack_key(victim), db=store._db.packs))
        rep = store.verify()
        assert not rep.ok and rep.bad_records == 1 and rep.orphan_packs == 0 and not rep.problems
        if repair == "gc":
            store.gc()
            assert pack_files(path) == files and all_intact(store, items)
        rep = store.verify(fix=True)
        assert rep.bad_records == 1 and rep.removed == ()
        assert pack_files(path) == files and all_intact(store, items)
        assert store.verify().ok and store.verify().bad_records == 0
        audit_blocks(store), audit_packs(store)


def test_a_lost_id_record_keeps_the_blob_and_is_rebuilt(tmp_path, monkeypatch):
    """gc and verify --fix deleted the blob file of an entry whose ``ids``
    record was lost (the file's entry was looked for through ``ids`` only)."""
    monkeypatch.setattr(_blobs, "MIN_PAYLOAD", 50_000)
    path = tmp_path / "s"
    toks, cache = make_entry(7, 0, big_every=1)
    with PromptStore(path, shared_blocks=False) as store:
        eid = store.put(MODEL, toks, cache).id
        other = store.put(MODEL, *make_entry(7, 1, big_every=1)).id
        blobs = sorted(os.listdir(path / "blobs"))
        assert len(blobs) == 2
        ekey = ekey_of(store, other)
        store.env.write(lambda txn: txn.delete(eid.encode(), db=store._db.ids))
        store.env.write(lambda txn: txn.put(b"0123456789abcdef", ekey, db=store._db.ids))  # and one that names no entry of its id
        rep = store.verify()
        assert not rep.ok and rep.bad_records == 2 and rep.orphan_blobs == 0 and not rep.problems
        store.gc()
        assert sorted(os.listdir(path / "blobs")) == blobs and same_cache(store.get(MODEL, toks), cache)
        rep = store.verify(fix=True)
        assert rep.bad_records == 2 and rep.removed == ()
        assert sorted(os.listdir(path / "blobs")) == blobs and same_cache(store.get(MODEL, toks), cache)
        assert store.info(eid).id == eid and store.verify().ok
        with pytest.raises(EntryNotFound):
            store.info("0123456789abcdef")


def test_compact_leaves_a_pack_whose_member_record_is_lost(tmp_path):
    """compact rewrote a pack without the block whose member record was lost
    and unlinked the old file: every entry sharing that block was damaged.
    Now it leaves that pack; verify reports the record, --fix rebuilds it from
    ``places``, and the next compact rewrites the pack whole."""
    path = tmp_path / "s"
    with PromptStore(path, block_tokens=64) as store:
        items = chats(store)
        for toks, _ in items[:4]:
            store.delete(MODEL, toks)  # chat 0's first pack keeps the blocks the other chats share
        items = items[4:]
        with store.env.read() as txn:
            sparse = [p for p, n, size in _packing.packs(txn, store._db)
                      if size - n > len(_packs.footer([(b"", 0)] * len(_packing.members(txn, store._db, p))))]
            pack = sparse[0]
            offset, _ = _packing.members(txn, store._db, pack)[0]
        store.env.write(lambda txn: txn.delete(_packing.member_key(pack, offset), db=store._db.packs))
        rep = store.verify()
        assert not rep.ok and rep.bad_records == 1 and not rep.problems
        store.compact()
        assert _packs.name(pack) in pack_files(path) and all_intact(store, items)
        assert not store.verify().problems
        store.verify(fix=True)
        assert store.verify().ok
        store.compact()
        assert _packs.name(pack) not in pack_files(path) and all_intact(store, items)
        assert store.verify().ok
        audit_blocks(store), audit_packs(store)


@pytest.mark.parametrize("lost", ["place", "place and member", "place of a damaged block"])
def test_a_lost_place_record_is_restored_from_the_pack(tmp_path, lost):
    """verify --fix deleted every entry sharing a block whose ``places``
    record was lost, its bytes intact in its pack file (salvage found them
    there by the footers), and dropped the block's member record too. Now
    verify reports the record, and --fix restores it first, from the member
    record or else the pack files' footers, where the bytes hash to the
    address: no entry is removed. A block found intact nowhere still makes
    its entries damaged, and only those are removed."""
    path = tmp_path / "s"
    with PromptStore(path, block_tokens=64) as store:
        items = chats(store)
        who = referrers(store)
        victim = min((k for k in who if block_place(store, k) is not None and len(who[k]) > 1), key=lambda k: (len(who[k]), k))
        users = who[victim]  # some entries share it, the others do not
        with store.env.read() as txn:
            pack, offset = _packing.place(txn, store._db, victim)
        if lost == "place of a damaged block":
            flip_block(store, victim)

        def drop(txn):
            txn.delete(victim, db=store._db.places)
            if lost == "place and member":
                txn.delete(_packing.member_key(pack, offset), db=store._db.packs)

        store.env.write(drop)
        files = pack_files(path)
        rep = store.verify()
        assert not rep.ok and {eid for eid, _ in rep.problems} == users  # unreadable until --fix
        records = {"place": 1, "place and member": 2, "place of a damaged block": 2}[lost]  # the last: its member and pack records
        assert rep.bad_records == records, rep
        if lost == "place":  # the CLI says --fix may make them readable, not only that it removes them
            res = subprocess.run([sys.executable, "-m", "promptstore.cli", "--store", str(path), "verify"],
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 1 and "rebuilds the wrong index records" in res.stderr, res.stderr
        rep = store.verify(fix=True)
        if lost == "place of a damaged block":
            assert set(rep.removed) == users
            kept = [(toks, cache) for toks, cache in items if store.exists(MODEL, toks)]
            assert len(kept) == len(items) - len(users) and all_intact(store, kept)
            assert store.verify().ok
        else:
            assert rep.bad_records == records and rep.removed == () and not rep.problems, rep
            assert all_intact(store, items)
            with store.env.read() as txn:
                assert _packing.place(txn, store._db, victim) == (pack, offset)
            assert pack_files(path) == files and store.verify().ok
        audit_blocks(store), audit_packs(store)


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
