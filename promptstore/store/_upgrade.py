"""Rewriting entries of an older layout into shared blocks (``promptstore compact``).

Entries written before shared blocks (entry formats 1 and 2) keep every KV
byte in their own payload; they stay readable as they are. An upgrade
restores each such entry whose KV arrays could be shared and puts it again
through the one write path, keeping its dates and pin: the rewrite is
checked against the manifest it read, so an entry replaced or deleted
meanwhile is left alone, and it never evicts. Entries are rewritten
shortest first, so a longer entry's blocks continue the bounds of the
shorter ones it extends and share them.

Entries that cannot be read (damaged, or written by a newer promptstore)
are never rewritten: ``verify`` reports them.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

from promptstore.codecs import codec_for_kind, encode_layer
from promptstore.errors import PromptStoreError
from promptstore.format import _entry, _payload
from promptstore.store import _keys
from promptstore.store._env import Env
from promptstore.store._read import Reader
from promptstore.store._schema import F64, Tables
from promptstore.store._write import Changed, EntryWriter

log = logging.getLogger("promptstore")


def shareable(man: _entry.Manifest) -> bool:
    """Whether ``man`` (an entry without blocks) holds arrays that could live in shared blocks."""
    n = len(man.tokens)
    for layer in man.layers:
        try:
            if not codec_for_kind(layer.kind).shared_blocks:
                continue
        except PromptStoreError:
            return False
        if any(_payload.spans_tokens(r.shape, r.nbytes, n) for r in layer.arrays):
            return True
    return False


def upgrade(env: Env, db: Tables, reader: Reader, writer: EntryWriter) -> int:
    """Rewrite every readable older entry with shareable arrays into shared
    blocks; returns how many were rewritten (0 when ``writer`` does not
    write shared blocks)."""
    if not writer.shared_blocks:
        return 0
    todo: List[Tuple[int, bytes]] = []
    with env.read() as txn:
        for key, raw in txn.cursor(db=db.entries):
            try:
                man = _entry.unpack_manifest(bytes(raw), _keys.entry_id(bytes(key)))
            except PromptStoreError:
                continue
            if not man.bounds and shareable(man):
                todo.append((len(man.tokens), bytes(key)))
    done = 0
    for _, ekey in sorted(todo):
        try:
            done += _rewrite(env, db, reader, writer, ekey)
        except Changed:
            continue
        except PromptStoreError as err:
            log.warning("promptstore: not upgrading entry %s: %s", _keys.entry_id(ekey), err)
    return done


def _rewrite(env: Env, db: Tables, reader: Reader, writer: EntryWriter, ekey: bytes) -> int:
    with env.read(buffers=True) as txn:
        found = txn.get(ekey, db=db.entries)
        if found is None:
            return 0  # deleted since
        raw = bytes(found)
        man = reader.manifest(txn, ekey)
        if man is None or man.bounds or not man.intact:
            return 0
        cache = reader.restore(txn, ekey, man)
        used_raw = txn.get(ekey, db=db.used)
        used: Optional[float] = F64.unpack(bytes(used_raw))[0] if used_raw is not None else None
    encoded = [encode_layer(layer) for layer in cache]
    toks = _keys.as_tokens(man.tokens)
    writer.put(man.model, man.model_name, toks, encoded, man.trimmable, man.meta, created=man.created, used=used, expect=raw)
    return 1
