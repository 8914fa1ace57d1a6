"""A lookup whose best remote entries are damaged or evicted falls back to
the next entry still whole, on a real server (more of it: ``test_remote_faults``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from _redis import redis_binary, redis_root, redis_single  # noqa: F401
from promptstore import PromptStore
from promptstore.remote._layout import NODE
from promptstore.store._fetched import remote_key
from test_remote import MODEL, same, toks, url_of
from test_remote_faults import noise_cache

_ns = itertools.count()


@pytest.mark.parametrize("damaged", ["manifest", "ends", "trims"])
def test_a_key_of_another_type_hides_no_other_entry(tmp_path, redis_single, damaged):
    """One key of another Redis type among those a lookup reads in one
    pipelined batch (its candidates' manifests, its index's ``e:`` or
    ``t:`` keys) failed the whole batch (WRONGTYPE): the lookup missed,
    although a manifest damaged any other way falls back to the next
    entry. The batch is read again key by key, that key counted corrupt."""
    ns = f"fb{next(_ns)}"
    url = url_of(redis_single, ns)
    long = toks(600, seed=1)
    caches = {300: noise_cache(300, 1), 600: noise_cache(600, 2)}
    with PromptStore(tmp_path / "a", remote=url) as a:
        for n, cache in caches.items():
            a.put(MODEL, long[:n], cache)
        assert a.remote.flush(10) and a.remote.stats().get("errors", 0) == 0
        layout = a.remote.remote.layout
    k = remote_key(MODEL, np.asarray(long, dtype=np.uint32))
    top = len(long) // NODE
    bad = {"manifest": layout.manifest(k.ekey), "ends": layout.ends(k.mid, int(k.hashes[top * NODE]), top),
           "trims": layout.trims(k.mid, int(k.hashes[top * NODE]), top)}[damaged]
    r = redis_single.client()
    was = r.type(bad)
    assert r.delete(bad) == 1
    if was == b"hash":
        r.set(bad, b"x")
    else:
        r.hset(bad, b"x", b"y")
    with PromptStore(tmp_path / "b", remote=url) as b:
        hit = b.lookup(MODEL, long + [7, 8])
        # Without its manifest the 600-token entry is lost; without one index key it is still found
        # through the other (its e: record, or the t: records of its other nodes).
        want = 300 if damaged == "manifest" else 600
        assert hit is not None and hit.matched == want
        same(hit.cache, caches[want])
        st = b.remote.stats()
        assert "errors.unavailable" not in st and st.get("skipped", 0) == 0, st
        assert st.get("errors.corrupt" if damaged == "manifest" else "errors.corrupt_index", 0) == 1, st


def test_a_lookup_falls_back_past_a_round_of_entries_that_lost_blocks(tmp_path, redis_single):
    """Five nested entries, each of the four longest missing a block (as
    eviction leaves them): the lookup read one round of four manifests,
    failed to fetch all four and missed. It reads the next round and
    restores the fifth."""
    ns = f"fb{next(_ns)}"
    url = url_of(redis_single, ns)
    t = toks(500, seed=6)
    caches = {n: noise_cache(n, n) for n in range(100, 501, 100)}  # no block shared between entries
    with PromptStore(tmp_path / "a", remote=url) as a:
        for n, cache in caches.items():
            a.put(MODEL, t[:n], cache)
        assert a.remote.flush(10) and a.remote.stats().get("errors", 0) == 0
        rem = a.remote.remote
        for n in range(200, 501, 100):
            found = rem.get(remote_key(MODEL, np.asarray(t[:n], dtype=np.uint32)))
            assert redis_single.client().delete(rem.layout.block(found.manifest.parts()[0][0])) == 1
    with PromptStore(tmp_path / "b", remote=url) as b:
        hit = b.lookup(MODEL, t + [1])
        assert hit is not None and hit.matched == 100
        same(hit.cache, caches[100])
        st = b.remote.stats()
        assert st["errors.missing"] == 4 and st["hits"] == 1 and "misses" not in st, st
