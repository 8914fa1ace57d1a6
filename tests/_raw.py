"""Raw access to a store's LMDB records, for tests that plant damage."""

from __future__ import annotations

import msgpack

from promptstore.store import _keys


def ekey_of(store, entry_id: str) -> bytes:
    with store.env.read() as txn:
        return bytes(txn.get(entry_id.encode(), db=store._db[b"ids"]))


def raw_manifest(store, entry_id: str) -> dict:
    ekey = ekey_of(store, entry_id)
    with store.env.read() as txn:
        return msgpack.unpackb(bytes(txn.get(ekey, db=store._db[b"entries"])), raw=False)


def write_manifest(store, entry_id: str, doc: dict) -> None:
    ekey = ekey_of(store, entry_id)
    store.env.write(lambda t: t.put(ekey, msgpack.packb(doc, use_bin_type=True), db=store._db[b"entries"]))


def damage_manifest(store, ekey: bytes) -> None:
    """Flip two bytes of the manifest at ``ekey``: it no longer parses."""
    def damage(txn):
        raw = bytearray(txn.get(ekey, db=store._db.entries))
        raw[5] ^= 0xFF
        raw[6] ^= 0xFF
        txn.put(ekey, bytes(raw), db=store._db.entries)

    store.env.write(damage)


def chunk_key(store, entry_id: str, i: int) -> bytes:
    return ekey_of(store, entry_id) + _keys.u32(i)


def get_chunk(store, entry_id: str, i: int) -> bytes:
    with store.env.read() as txn:
        raw = txn.get(chunk_key(store, entry_id, i), db=store._db[b"chunks"])
        return None if raw is None else bytes(raw)


def set_chunk(store, entry_id: str, i: int, data) -> None:
    key = chunk_key(store, entry_id, i)
    if data is None:
        store.env.write(lambda t: t.delete(key, db=store._db[b"chunks"]))
    else:
        store.env.write(lambda t: t.put(key, bytes(data), db=store._db[b"chunks"]))


# -- shared blocks (entry format 3) ---------------------------------------------------


def blocks_of(store, entry_id: str) -> list:
    """The block addresses an entry's manifest names, in order, repeats included."""
    from promptstore.format import _entry

    ekey = ekey_of(store, entry_id)
    with store.env.read() as txn:
        man = _entry.unpack_manifest(bytes(txn.get(ekey, db=store._db[b"entries"])), entry_id)
    return [key for key, _ in man.blocks()]


def referrers(store) -> dict:
    """Every block address any manifest names -> the ids of the entries naming it."""
    from promptstore.format import _entry

    out: dict = {}
    with store.env.read() as txn:
        for k, raw in txn.cursor(db=store._db[b"entries"]):
            eid = _keys.entry_id(bytes(k))
            for key, _ in _entry.unpack_manifest(bytes(raw), eid).blocks():
                out.setdefault(key, set()).add(eid)
    return out


def shared_block(store, ids) -> bytes:
    """A block that exactly the entries ``ids`` reference (fails when there is none)."""
    want = set(ids)
    found = [key for key, who in sorted(referrers(store).items()) if who == want]
    assert found, f"no block is shared by exactly {sorted(want)}"
    return found[0]


def _place(txn, store, address: bytes):
    """``(pack file path, offset)`` of a block kept in a pack file, or None."""
    from promptstore.format import _packs

    raw = txn.get(address, db=store._db[b"places"])
    if raw is None:
        return None
    pack, offset = int.from_bytes(bytes(raw[:8]), "big"), int.from_bytes(bytes(raw[8:]), "big")
    return store.path / _packs.DIRNAME / _packs.name(pack), offset


def _size(txn, store, address: bytes) -> int:
    return int.from_bytes(bytes(txn.get(address, db=store._db[b"refs"]))[8:16], "big")


def get_block(store, address: bytes):
    """A block's bytes, from LMDB or its pack file (None: not stored)."""
    with store.env.read() as txn:
        place = _place(txn, store, address)
        if place is not None:
            with open(place[0], "rb") as f:
                f.seek(place[1])
                return f.read(_size(txn, store, address))
        raw = txn.get(address, db=store._db[b"blocks"])
        return None if raw is None else bytes(raw)


def set_block(store, address: bytes, data) -> None:
    """Overwrite a block's bytes in place (its address and count unchanged),
    in LMDB or in its pack file; None deletes it (the pack's bytes stay, its
    place record goes)."""
    with store.env.read() as txn:
        place = _place(txn, store, address)
    if place is not None:
        if data is None:
            store.env.write(lambda t: t.delete(address, db=store._db[b"places"]))
            return
        with open(place[0], "r+b") as f:
            f.seek(place[1])
            f.write(bytes(data))
        return
    db = store._db[b"blocks"]
    if data is None:
        store.env.write(lambda t: t.delete(address, db=db))
    else:
        store.env.write(lambda t: t.put(address, bytes(data), db=db))


def pack_file(store, address: bytes):
    """The pack file holding a block, or None when it is an LMDB value."""
    place = block_place(store, address)
    return None if place is None else place[0]


def block_place(store, address: bytes):
    """``(pack file path, offset)`` of a block kept in a pack file, or None."""
    with store.env.read() as txn:
        return _place(txn, store, address)


def stored_block_sizes(store) -> dict:
    """address -> bytes of every stored block: LMDB values, and blocks in pack
    files (checked to lie inside their file)."""
    import os

    with store.env.read() as txn:
        stored = {bytes(k): len(v) for k, v in txn.cursor(db=store._db[b"blocks"])}
        for k, _ in txn.cursor(db=store._db[b"places"]):
            path, offset = _place(txn, store, bytes(k))
            size = _size(txn, store, bytes(k))
            assert os.path.getsize(path) >= offset + size, f"block {bytes(k).hex()} lies outside {path.name}"
            stored[bytes(k)] = size
    return stored


def audit_packs(store) -> int:
    """Every pack record's live bytes equal its placed blocks' sizes, and its
    file exists; returns the number of packs."""
    from promptstore.format import _packs

    live: dict = {}
    with store.env.read() as txn:
        for k, raw in txn.cursor(db=store._db[b"places"]):
            pack = int.from_bytes(bytes(raw[:8]), "big")
            live[pack] = live.get(pack, 0) + _size(txn, store, bytes(k))
        records = {int.from_bytes(bytes(k)[1:], "big"): int.from_bytes(bytes(v[:8]), "big") for k, v in txn.cursor(db=store._db[b"packs"]) if bytes(k)[:1] == b"p"}
        members = {(int.from_bytes(bytes(k)[1:9], "big"), int.from_bytes(bytes(k)[9:], "big")): bytes(v) for k, v in txn.cursor(db=store._db[b"packs"]) if bytes(k)[:1] == b"m"}
        placed = {(int.from_bytes(bytes(v[:8]), "big"), int.from_bytes(bytes(v[8:]), "big")): bytes(k) for k, v in txn.cursor(db=store._db[b"places"])}
    assert records == live, f"pack records {records} differ from the blocks placed in them {live}"
    assert members == placed, "the packs' member records differ from the blocks placed in them"
    for pack in records:
        assert (store.path / _packs.DIRNAME / _packs.name(pack)).exists(), f"pack {pack:016x} is recorded but missing"
    return len(records)


def flip_block(store, address: bytes, at: int = None, bit: int = 0x10) -> None:
    raw = bytearray(get_block(store, address))
    raw[len(raw) // 2 if at is None else at] ^= bit
    set_block(store, address, raw)


def audit_blocks(store) -> int:
    """Check the shared blocks against the manifests, independently of
    ``verify``: every block a manifest names is stored, with its reference
    count equal to the references the manifests make and its size equal to
    its bytes; no block or count record is stored that no manifest names.
    Returns the number of references checked."""
    from collections import Counter

    from promptstore.format import _entry

    want: Counter = Counter()
    size: dict = {}
    with store.env.read() as txn:
        for k, raw in txn.cursor(db=store._db[b"entries"]):
            for key, n in _entry.unpack_manifest(bytes(raw), _keys.entry_id(bytes(k))).blocks():
                want[key] += 1
                size[key] = n
        refs = {bytes(k): bytes(v) for k, v in txn.cursor(db=store._db[b"refs"])}
    stored = stored_block_sizes(store)
    audit_packs(store)
    missing = set(want) - set(stored)
    assert not missing, f"{len(missing)} blocks named by entries are missing"
    assert set(stored) == set(want), f"{len(set(stored) - set(want))} blocks stored that no entry names"
    assert set(refs) == set(want), "reference records differ from the blocks the entries name"
    for key, count in want.items():
        rec = refs[key]
        assert len(rec) == 16 and int.from_bytes(rec[:8], "big") == count, f"block {key.hex()}: count {rec[:8].hex()}, {count} references"
        assert int.from_bytes(rec[8:], "big") == stored[key] == size[key], f"block {key.hex()}: size"
    return sum(want.values())


def stored_bytes(store) -> int:
    """What the budget counts, from the records themselves (not the counter):
    each entry's payload and manifest, plus every stored block once."""
    from promptstore.format import _entry

    total = 0
    with store.env.read() as txn:
        for k, raw in txn.cursor(db=store._db[b"entries"]):
            total += _entry.unpack_manifest(bytes(raw), "t").payload + len(raw)
    return total + sum(stored_block_sizes(store).values())
