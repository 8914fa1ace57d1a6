"""Every kind of bad entry raises its own typed error; the store keeps serving the rest."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import KVCache

from conftest import continued, load_fixture, sample_tokens
from _raw import audit_blocks, blocks_of, get_block, get_chunk, raw_manifest, set_block, set_chunk, shared_block, write_manifest
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
from promptstore.format import _blocks, _entry
from promptstore.jobs.prefill import prefill


@pytest.fixture(params=["shared-blocks", "payload"])
def two_entries(request, tmp_path):
    """A damaged-to-be entry and a healthy neighbour sharing its prefix: the
    victim continues the healthy entry's cache, so with shared blocks it
    references the healthy entry's block and one of its own."""
    model, _, fp, _ = load_fixture("llama")
    healthy = sample_tokens(30, seed=1)
    victim = healthy + sample_tokens(20, seed=2)
    good_cache = prefill(model, healthy)
    with PromptStore(tmp_path / "store", shared_blocks=request.param == "shared-blocks") as store:
        store.put(fp, healthy, good_cache)
        info = store.put(fp, victim, prefill(model, victim[30:], cache=continued(good_cache)))
        yield store, fp, healthy, victim, info.id, good_cache


def _still_serves(store, fp, healthy, good_cache):
    back = store.get(fp, healthy)
    for a, b in zip(good_cache, back):
        assert_same(visible_state(a), visible_state(b))
    hit = store.lookup(fp, healthy + [5])
    assert hit.matched == len(healthy)


def _damage_layer(store, eid, **changes):
    """Layer 0 of the entry as a newer promptstore would write it: in its
    manifest and, for arrays in shared blocks, in their blocks' addresses
    (which hash the kind and version), with the counts to match."""
    doc = raw_manifest(store, eid)
    layer = doc["layers"][0]
    layer.update(changes)
    blocks, refs = store._db[b"blocks"], store._db[b"refs"]

    def readdress(txn):
        for a in layer["arrays"]:
            if len(a) < 7:
                continue
            parts, start = [], 0
            for key, end in zip(a[6], doc["bounds"]):
                data = bytes(txn.get(key, db=blocks))
                new = _blocks.address(layer["kind"], layer["version"], a[1], _blocks.block_shape(a[2], start, end), data)
                old = bytes(txn.get(key, db=refs))
                txn.put(key, (int.from_bytes(old[:8], "big") - 1).to_bytes(8, "big") + old[8:], db=refs)
                txn.put(new, data, db=blocks)
                txn.put(new, (1).to_bytes(8, "big") + old[8:], db=refs)
                parts.append(new)
                start = end
            a[6] = parts

    store.env.write(readdress)
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


def test_an_edited_kind_reports_the_kind_first_with_shared_blocks(tmp_path):
    """A manifest edited on purpose reports its structural error (unknown
    kind) first, before its blocks, which no longer match its kind, are read."""
    model, _, fp, _ = load_fixture("llama")
    tokens = sample_tokens(30, seed=1)
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        eid = store.put(fp, tokens, prefill(model, tokens)).id
        doc = raw_manifest(store, eid)
        doc["layers"][0]["kind"] = "kv.from_the_future"
        write_manifest(store, eid, doc)
        with pytest.raises(UnknownStorageKind, match="kv.from_the_future"):
            store.get(fp, tokens)


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


def _hurt(damage, get, put, block: bool):
    """Damage one stored value (a payload chunk, or a block): flip a byte, cut
    its last byte, or delete it; returns what the error must say."""
    data = get()
    if damage == "flip":
        pos = len(data) // 2
        put(data[:pos] + bytes([data[pos] ^ 0x10]) + data[pos + 1 :])
        return "does not match its address" if block else "checksum mismatch"
    if damage == "truncate":
        put(data[:-1])
        return "bytes, expected shape" if block else "bytes, expected"
    put(None)
    return "block .* is missing" if block else "chunk 0 of 1 is missing"


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_payload_damage(two_entries, damage):
    """The victim's own bytes: its first payload chunk, or the block that
    only it references (its last 20 tokens)."""
    store, fp, healthy, victim, eid, good = two_entries
    if "bounds" not in raw_manifest(store, eid):  # format 1
        match = _hurt(damage, lambda: get_chunk(store, eid, 0), lambda d: set_chunk(store, eid, 0, d), block=False)
    else:
        key = shared_block(store, [eid])
        assert len(blocks_of(store, eid)) == 8 and key in blocks_of(store, eid)  # 2 layers x (keys, values) x 2 blocks
        match = _hurt(damage, lambda: get_block(store, key), lambda d: set_block(store, key, d), block=True)
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


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_shared_block_damage(tmp_path, damage):
    """A block two entries share, damaged: both fail closed (get raises,
    lookup skips them, verify reports both, --fix removes both), while an
    entry that does not reference it restores bit-exactly throughout."""
    model, _, fp, _ = load_fixture("llama")
    short = sample_tokens(30, seed=1)
    long_ = short + sample_tokens(20, seed=2)
    other = sample_tokens(40, seed=3)
    short_cache, other_cache = prefill(model, short), prefill(model, other)
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        a = store.put(fp, short, short_cache).id
        b = store.put(fp, long_, prefill(model, long_[30:], cache=continued(short_cache))).id
        c = store.put(fp, other, other_cache).id
        key = shared_block(store, [a, b])  # the first 30 tokens' keys (or values) of one layer
        assert not set(blocks_of(store, c)) & set(blocks_of(store, a))
        match = _hurt(damage, lambda: get_block(store, key), lambda d: set_block(store, key, d), block=True)
        for tokens in (short, long_):
            with pytest.raises(CorruptEntry, match=match):
                store.get(fp, tokens)
            assert store.lookup(fp, tokens + [5]) is None  # both candidates skipped
        _still_serves(store, fp, other, other_cache)
        assert sorted(eid for eid, _ in store.verify().problems) == sorted([a, b])
        fixed = store.verify(fix=True)
        assert fixed.fixed and len(fixed.problems) == 2
        assert store.verify().ok and audit_blocks(store) == 4  # c's blocks, counted once each
        assert [i.id for i in store.entries()] == [c]
        assert store.get(fp, short) is None and store.get(fp, long_) is None
        _still_serves(store, fp, other, other_cache)


def test_damaged_manifest(two_entries):
    store, fp, healthy, victim, eid, good = two_entries
    doc = raw_manifest(store, eid)
    doc["payload"] += 1
    doc["chunks"] = _entry.n_chunks(doc["payload"])  # format 3: a payload of 1 byte takes a chunk
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
