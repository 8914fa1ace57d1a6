"""Every kind of bad entry raises its own typed error; the store keeps serving the rest."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import KVCache

from conftest import load_fixture, sample_tokens
from _raw import get_chunk, raw_manifest, set_chunk, write_manifest
from _samples import visible_state, assert_same
from promptstore import (
    CorruptEntry,
    CoverageMismatch,
    InvalidInput,
    ModelMismatch,
    PromptStore,
    UnknownStorageKind,
    UnsupportedVersion,
)
from promptstore.format import _entry
from promptstore.jobs.prefill import prefill


@pytest.fixture
def two_entries(store):
    """A damaged-to-be entry and a healthy neighbour sharing its prefix."""
    model, _, fp, _ = load_fixture("llama")
    healthy = sample_tokens(30, seed=1)
    victim = healthy + sample_tokens(20, seed=2)
    good_cache = prefill(model, healthy)
    store.put(fp, healthy, good_cache)
    info = store.put(fp, victim, prefill(model, victim))
    return store, fp, healthy, victim, info.id, good_cache


def _still_serves(store, fp, healthy, good_cache):
    back = store.get(fp, healthy)
    for a, b in zip(good_cache, back):
        assert_same(visible_state(a), visible_state(b))
    hit = store.lookup(fp, healthy + [5])
    assert hit.matched == len(healthy)


def _damage_layer(store, eid, **changes):
    doc = raw_manifest(store, eid)
    doc["layers"][0].update(changes)
    write_manifest(store, eid, doc)


def test_unknown_kind(two_entries):
    store, fp, healthy, victim, eid, good = two_entries
    _damage_layer(store, eid, kind="kv.from_the_future")
    with pytest.raises(UnknownStorageKind, match="kv.from_the_future"):
        store.get(fp, victim)
    _still_serves(store, fp, healthy, good)


def test_newer_codec_version(two_entries):
    store, fp, healthy, victim, eid, good = two_entries
    _damage_layer(store, eid, version=2)
    with pytest.raises(UnsupportedVersion, match="upgrade"):
        store.get(fp, victim)
    _still_serves(store, fp, healthy, good)


def test_newer_entry_format(two_entries):
    store, fp, healthy, victim, eid, good = two_entries
    doc = raw_manifest(store, eid)
    doc["format"] = _entry.FORMAT + 1
    write_manifest(store, eid, doc)
    with pytest.raises(UnsupportedVersion, match=f"entry format {_entry.FORMAT + 1}"):
        store.get(fp, victim)
    _still_serves(store, fp, healthy, good)


def test_unregistered_subclass_writes_nothing(store):
    class Mine(KVCache):
        pass

    layer = Mine()
    with pytest.raises(UnknownStorageKind):
        store.put("m", [1, 2, 3], [layer])
    assert list(store.entries()) == []


def test_other_fingerprint(two_entries):
    store, fp, healthy, victim, eid, good = two_entries
    _, _, other_fp, _ = load_fixture("gemma3_text")
    assert store.get(other_fp, victim) is None
    assert store.lookup(other_fp, victim) is None
    with pytest.raises(ModelMismatch):
        store.load(eid, model=other_fp)
    cache, info, tokens = store.load(eid, model=fp)
    assert tokens == victim and info.n_tokens == len(victim)


def test_coverage_mismatch_writes_nothing(store):
    model, _, fp, _ = load_fixture("llama")
    t = sample_tokens(20)
    cache = prefill(model, t)
    with pytest.raises(CoverageMismatch, match="covers 20 tokens but 19"):
        store.put(fp, t[:19], cache)
    with pytest.raises(CoverageMismatch):
        store.put(fp, t + [4], cache)
    assert list(store.entries()) == []


def test_bad_arguments(store):
    with pytest.raises(InvalidInput):
        store.put("", [1], [KVCache()])
    with pytest.raises(InvalidInput):
        store.put("m", [], [KVCache()])
    with pytest.raises(InvalidInput):
        store.lookup("m", [-1, 2])
    with pytest.raises(InvalidInput):
        store.get("m", [[1, 2]])


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_payload_damage(two_entries, damage):
    store, fp, healthy, victim, eid, good = two_entries
    chunk = get_chunk(store, eid, 0)
    if damage == "flip":
        pos = len(chunk) // 2
        set_chunk(store, eid, 0, chunk[:pos] + bytes([chunk[pos] ^ 0x10]) + chunk[pos + 1 :])
        match = "checksum"
    elif damage == "truncate":
        set_chunk(store, eid, 0, chunk[:-1])
        match = "bytes, expected"
    else:
        set_chunk(store, eid, 0, None)
        match = "missing"
    with pytest.raises(CorruptEntry, match=match):
        store.get(fp, victim)
    # lookup skips the damaged longer entry and falls back to the healthy prefix
    assert store.lookup(fp, victim).matched == len(healthy)
    _still_serves(store, fp, healthy, good)
    report = store.verify()
    assert [p[0] for p in report.problems] == [eid]
    fixed = store.verify(fix=True)
    assert fixed.fixed and len(fixed.problems) == 1
    assert store.verify().ok
    assert store.get(fp, victim) is None
    _still_serves(store, fp, healthy, good)


def test_damaged_manifest(two_entries):
    store, fp, healthy, victim, eid, good = two_entries
    doc = raw_manifest(store, eid)
    doc["payload"] += 1
    write_manifest(store, eid, doc)
    with pytest.raises(CorruptEntry, match="payload says"):
        store.get(fp, victim)
    assert len(list(store.entries())) == 1  # the damaged one is skipped with a warning
    _still_serves(store, fp, healthy, good)


def test_manifest_without_its_checksum_is_damaged(two_entries):
    store, fp, healthy, victim, eid, good = two_entries
    doc = raw_manifest(store, eid)
    del doc["check"]
    write_manifest(store, eid, doc)
    with pytest.raises(CorruptEntry, match="manifest checksum"):
        store.get(fp, victim)
    assert not store.exists(fp, victim)
    _still_serves(store, fp, healthy, good)


def test_reopened_store_refuses_newer_store_format(store_path):
    with PromptStore(store_path) as s:
        s.env.write(lambda t: t.put(b"format", (9).to_bytes(8, "big"), db=s._db[b"info"]))
    with pytest.raises(UnsupportedVersion, match="store format 9"):
        PromptStore(store_path)
