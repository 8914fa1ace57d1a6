"""Edge states of mlx-lm's caches and damaged manifests that once slipped
through: a chunked cache past its first chunk trimmed below its start, arrays
with no elements, a list layer's record without its kind, an unreadable time."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, trim_prompt_cache

from promptstore import CorruptEntry, PromptStore
from promptstore.codecs import trim_cache
from promptstore.errors import MissingCapability
from _raw import raw_manifest, write_manifest
from _samples import assert_same, det, visible_state

MODEL = "m@edges"


def _chunked_past_first_chunk() -> ChunkedKVCache:
    """30 tokens through a 16-token chunk, then the front dropped, as llama4's
    prefill leaves it: offset 30, start_position 14."""
    c = ChunkedKVCache(16)
    k = det((1, 2, 30, 64), mx.float16, 0)
    c.update_and_fetch(k, det((1, 2, 30, 64), mx.float16, 1))
    c.maybe_trim_front()
    assert (c.offset, c.start_position) == (30, 14)
    return c


def test_a_chunked_cache_past_its_first_chunk_is_trimmed_only_down_to_its_start(tmp_path):
    # Below start_position mlx-lm's trim stops there without saying so: a lookup
    # of 10 tokens handed out a cache of 14 (offset 14, start_position 14).
    toks = list(range(100, 130))
    layer = _chunked_past_first_chunk()
    keys, values = (np.asarray(a[..., :6, :]).tobytes() for a in layer.keys_and_values())
    with PromptStore(tmp_path / "s") as s:
        s.put(MODEL, toks, [layer])
        assert s.lookup(MODEL, toks[:10] + [999, 998]) is None
        assert s.peek(MODEL, toks[:10] + [999, 998]) == 0
        hit = s.lookup(MODEL, toks[:20] + [999])  # inside the kept chunk: trimmed as before
        assert s.peek(MODEL, toks[:20] + [999]) == 20
        assert hit.matched == 20 and (hit.cache[0].offset, hit.cache[0].start_position) == (20, 14)
        k, v = hit.cache[0].keys_and_values()
        assert k.shape[-2] == 6
        assert np.asarray(k).tobytes() == keys and np.asarray(v).tobytes() == values  # the first 6 of 16 kept
        short = KVCache()
        short.update_and_fetch(det((1, 2, 8, 64), mx.float16, 2), det((1, 2, 8, 64), mx.float16, 3))
        s.put(MODEL, toks[:8], [short])
        hit = s.lookup(MODEL, toks[:10] + [999])
        assert hit.matched == 8 and hit.cache[0].offset == 8  # the next candidate, not the chunked entry


def test_a_chunked_trim_past_its_start_is_refused_and_changes_nothing():
    layer = _chunked_past_first_chunk()
    with pytest.raises(MissingCapability, match="position 14"):
        trim_cache([layer], 20)
    assert (layer.offset, layer.start_position) == (30, 14)


@pytest.mark.parametrize("wrap", ["layers", "cache-list"])
def test_a_trim_that_a_later_layer_refuses_trims_no_layer(wrap):
    """trim_cache checks every layer for this ``n`` before trimming any: the
    chunked layer trims, but not 20 tokens, and it came after a KV layer that
    had already dropped them (a CacheList of the two did the same)."""
    kv = KVCache()
    kv.update_and_fetch(det((1, 2, 30, 64), mx.float16, 2), det((1, 2, 30, 64), mx.float16, 3))
    chunked = _chunked_past_first_chunk()
    cache = [kv, chunked] if wrap == "layers" else [CacheList(kv, chunked)]
    kept = kv.keys.shape
    with pytest.raises(MissingCapability, match="kv.chunked.*position 14.*nothing was trimmed"):
        trim_cache(cache, 20)
    assert kv.offset == 30 and kv.keys.shape == kept
    assert (chunked.offset, chunked.start_position) == (30, 14)
    trim_cache(cache, 16)  # within the kept chunk: both trim
    assert (kv.offset, kv.keys.shape[2], chunked.offset) == (14, 14, 14)


def test_a_chunked_cache_from_its_first_chunk_still_serves_prefixes(tmp_path):
    c = ChunkedKVCache(64)
    k, v = det((1, 2, 30, 64), mx.float16, 0), det((1, 2, 30, 64), mx.float16, 1)
    c.update_and_fetch(k, v)
    toks = list(range(100, 130))
    with PromptStore(tmp_path / "s") as s:
        assert s.put(MODEL, toks, [c]).trimmable
        hit = s.lookup(MODEL, toks[:10] + [999])
        assert hit.matched == 10 and hit.cache[0].offset == 10
        got_k, got_v = hit.cache[0].keys_and_values()
        assert np.asarray(got_k).tobytes() == np.asarray(k[..., :10, :]).tobytes()
        assert np.asarray(got_v).tobytes() == np.asarray(v[..., :10, :]).tobytes()


@pytest.mark.parametrize("case", ["chunked-at-its-start", "arrays-slot-of-no-elements"])
def test_a_cache_holding_an_array_of_no_elements_round_trips(tmp_path, case):
    if case == "chunked-at-its-start":
        layer = _chunked_past_first_chunk()
        trim_prompt_cache([layer], 100)  # back to start_position: offset 14, no live keys
        toks, coverage = list(range(14)), None
        assert layer.keys_and_values()[0].shape[-2] == 0
    else:
        layer = ArraysCache(2)
        layer[0] = mx.zeros((1, 0, 8), mx.float16)
        layer[1] = det((1, 2, 4, 4), mx.float32, 4)
        toks, coverage = [1, 2, 3], 3
    with PromptStore(tmp_path / "s") as s:
        s.put(MODEL, toks, [layer], coverage=coverage)
        (back,) = s.get(MODEL, toks)
    assert type(back) is type(layer)
    assert_same(visible_state(layer), visible_state(back))


def test_a_list_record_without_its_kind_is_skipped_by_lookup(tmp_path):
    def kv(n):
        c = KVCache()
        c.update_and_fetch(det((1, 2, n, 64), mx.float16, 0), det((1, 2, n, 64), mx.float16, 1))
        return c

    toks = list(range(1000, 1040))
    with PromptStore(tmp_path / "s", block_tokens=16) as s:
        damaged = s.put(MODEL, toks, [CacheList(kv(40), kv(40))]).id
        s.put(MODEL, toks[:5], [kv(5)])
        doc = raw_manifest(s, damaged)
        doc["layers"][0]["meta"]["inner"][0].pop("kind")
        write_manifest(s, damaged, doc)
        hit = s.lookup(MODEL, toks[:20] + [5, 5])  # was a KeyError out of the lookup
        assert hit is not None and hit.matched == 5
        with pytest.raises(CorruptEntry):
            s.get(MODEL, toks)


@pytest.mark.parametrize("created", [float("nan"), 1e300, -1.0])
def test_a_manifest_with_an_unreadable_time_does_not_break_the_listing(tmp_path, created):
    def kv(n):
        c = KVCache()
        c.update_and_fetch(det((1, 2, n, 8), mx.float16, 0), det((1, 2, n, 8), mx.float16, 1))
        return c

    path = tmp_path / "s"
    with PromptStore(path) as s:
        damaged = s.put(MODEL, [1, 2, 3, 4], [kv(4)]).id
        kept = s.put(MODEL, [7, 8, 9], [kv(3)]).id
        doc = raw_manifest(s, damaged)
        doc["created"] = created
        write_manifest(s, damaged, doc)
        assert [e.id for e in s.entries()] == [kept]  # raised OverflowError / ValueError for the whole store
        with pytest.raises(CorruptEntry, match="'created'"):
            s.get(MODEL, [1, 2, 3, 4])
        assert s.lookup(MODEL, [7, 8, 9, 10]).matched == 3
    out = subprocess.run([sys.executable, "-m", "promptstore", "ls", "--store", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert kept[:12] in out.stdout and "'created'" in out.stderr
