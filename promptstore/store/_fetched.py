"""Entries the remote tier gave: their keys there, and writing them here."""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

import numpy as np

from promptstore.codecs import codec_for_layer, trim_cache
from promptstore.errors import InvalidInput, StoreError
from promptstore.remote import Key as RemoteKey
from promptstore.remote import Remote
from promptstore.store import _keys
from promptstore.store._results import EntryInfo, Hit, utc

log = logging.getLogger("promptstore")


def remote_key(model: str, toks: np.ndarray) -> RemoteKey:
    """How the remote tier names the entry of ``toks`` under ``model``."""
    mid = _keys.model_id(model)
    return RemoteKey(model, mid, _keys.entry_key(mid, toks), toks, _keys.prefix_hashes(toks))


def adopt(model: str, man: Any, cache: List[Any], matched: int, put: Optional[Callable[..., EntryInfo]],
          tier: Optional[Remote]) -> Optional[Hit]:
    """A fetched remote entry, written to this store through ``put`` (None:
    the store is read-only; ``put(model, tokens, cache, meta, coverage)``
    stores without publishing it again) and returned as the Hit of
    ``matched`` tokens (trimmed to them). None when its layers do not cover
    the entry's tokens (never used; counted corrupt on ``tier``)."""
    toks = man.tokens
    n = len(toks)
    if any(codec_for_layer(layer).coverage(layer) not in (None, n) for layer in cache):
        if tier is not None:
            tier.count("errors.corrupt")
        return None
    ekey = _keys.entry_key(_keys.model_id(model), toks)
    info = EntryInfo(id=_keys.entry_id(ekey), model=model, model_name=man.name, n_tokens=n, kinds=man.kinds,
                     nbytes=man.nbytes, created=utc(man.created), last_used=utc(man.created),
                     trimmable=man.trimmable, meta=dict(man.meta))
    if put is not None:
        try:
            info = put(model, toks, cache, dict(man.meta), n)
        except (StoreError, InvalidInput) as err:  # checked cache: serve it, keep nothing (InvalidInput: meta an older writer allowed)
            log.warning("promptstore: a remote entry was not stored locally: %s", err)
    if n > matched:
        trim_cache(cache, n - matched)
    return Hit(cache, matched, info, n - matched, man.nbytes)
