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
