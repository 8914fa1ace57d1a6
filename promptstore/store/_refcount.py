"""The shared blocks' reference counts, recounted from the manifests.

A removed entry releases its blocks as it goes (``_write.EntryWriter.unlink``)
only when its manifest can be read; one that cannot be read (damaged) leaves
them counted. :func:`recount_blocks` sets every count to the references the
manifests make, for ``verify --fix`` and for whatever removed such an entry
(gc, and a put that evicted or replaced it), in the same write transaction.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Set, Tuple

from promptstore.errors import PromptStoreError
from promptstore.format import _entry
from promptstore.store import _budget, _keys, _packing
from promptstore.store._schema import PACKS, PLACES, Tables


def references(txn, db: Tables, sizes: Optional[Dict[bytes, int]] = None) -> Tuple[Dict[bytes, int], bool]:
    """References to each block from every readable manifest, and whether
    some manifest could not be read (then nothing may be freed: it may
    reference blocks too). ``sizes``, if given, gets each referenced block's
    bytes as the manifests give them (one pass over the manifests)."""
    want: Dict[bytes, int] = {}
    unreadable = False
    for k, raw in txn.cursor(db=db.entries):
        try:
            man = _entry.unpack_manifest(bytes(raw), _keys.entry_id(bytes(k)))
        except PromptStoreError:
            unreadable = True
            continue
        for key, size in man.blocks():
            want[key] = want.get(key, 0) + 1
            if sizes is not None:
                sizes[key] = size
    return want, unreadable


def stored(txn, db: Tables) -> Set[bytes]:
    """The addresses of every stored block: LMDB values and blocks in packs."""
    found = {bytes(k) for k in txn.cursor(db=db.blocks).iternext(keys=True, values=False)}
    if PLACES in db:
        found.update(bytes(k) for k in txn.cursor(db=db.places).iternext(keys=True, values=False))
    return found


def recount_blocks(txn, db: Tables, free_block: Callable[[Any, bytes, int], None], unlink_pack_later: Callable[[int], None]) -> None:
    """Set every block's reference count to the references the manifests
    make; remove blocks no manifest references (``free_block(txn, address,
    size)``). While a manifest cannot be read (it may reference blocks too)
    no count is lowered and no block removed. A block referenced but not
    stored keeps its count at zero: its entries read as damaged. Packs none
    of whose blocks is referenced any more are dropped
    (``unlink_pack_later(number)``)."""
    sizes: Dict[bytes, int] = {}
    want, unreadable = references(txn, db, sizes)
    have = stored(txn, db)
    for key in [bytes(k) for k in txn.cursor(db=db.refs).iternext(keys=True, values=False)]:
        if key not in want and not unreadable:
            txn.delete(key, db=db.refs)
    for key, count in want.items():
        if key not in have:
            txn.delete(key, db=db.refs)
            continue
        raw = txn.get(key, db=db.refs)
        size = _budget.ref_size(raw)  # a block's size is in its refs record,
        if not size:  # unless that record is missing or damaged: then what the manifests say
            size = sizes.get(key, 0)
        if unreadable and raw is not None:
            count = max(count, _budget.ref_count(raw))
        txn.put(key, _budget.ref_value(count, size), db=db.refs)
    if not unreadable:
        for key in have:
            if key not in want:
                free_block(txn, key, 0)
    _recount_packs(txn, db, unlink_pack_later)


def _recount_packs(txn, db: Tables, unlink_pack_later: Callable[[int], None]) -> None:
    """Rebuild the packs' records from where the blocks are; drop (and,
    after the commit, unlink) the packs none of whose blocks is referenced."""
    if PACKS not in db:
        return
    for pack in _packing.rebuild(txn, db, lambda key: _budget.ref_size(txn.get(key, db=db.refs))):
        unlink_pack_later(pack)
