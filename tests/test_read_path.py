"""The large-entry read path: pread on two threads into unwritten mlx
buffers, with chunk offsets remembered between restores of one entry."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from promptstore import CorruptEntry, PromptStore
from promptstore.format import _blank, _blobs, _entry, _fill, _pages, _payload
from promptstore.store import _keys
from promptstore.bench import _data as data
from _bits import bits_equal

MODEL = "m@1"


@pytest.fixture(autouse=True)
def payload_in_lmdb(monkeypatch):
    """Large entries go to blob files now; these tests read large entries
    kept in LMDB, as promptstore wrote them before blob files (and still
    reads them)."""
    monkeypatch.setattr(_blobs, "MIN_PAYLOAD", 1 << 62)


@pytest.fixture()
def entry(tmp_path):
    cache = data.hybrid_cache(data.QUICK, 1024, seed=11)
    tokens = list(range(1, 1025))
    store = PromptStore(tmp_path / "s", shared_blocks=False)  # all of it in the payload, KV included (format 1)
    info = store.put(MODEL, tokens, cache)
    assert info.nbytes >= _pages.MIN_PAYLOAD
    ekey = _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens))
    yield store, cache, tokens, ekey
    store.close()


def _same(cache, restored):
    for x, y in zip(cache, restored, strict=True):
        for a, b in zip(data._layer_arrays(x), data._layer_arrays(y), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and bits_equal(a, b).item()


def _located(store):
    with store.env.read():
        return dict(store.env.data_file().located)


def test_the_fast_path_is_available_here(entry):
    store = entry[0]
    assert _fill.available()  # else every large restore silently takes the mapped copy
    with store.env.read():
        assert store.env.data_file().fd is not None


def test_a_second_restore_reads_the_remembered_offsets(entry):
    store, cache, tokens, _ = entry
    assert _located(store) == {}
    _same(cache, store.get(MODEL, tokens))
    first = _located(store)
    assert len(first) == 1
    _same(cache, store.get(MODEL, tokens))
    assert _located(store) == first


def test_stale_offsets_fall_back_to_lmdb_and_are_found_again(entry):
    store, cache, tokens, _ = entry
    store.get(MODEL, tokens)
    ((key, offsets),) = _located(store).items()
    with store.env.read():
        data_file = store.env.data_file()
        data_file.remember(key, [o + 4096 for o in offsets])  # as if the entry had moved
    _same(cache, store.get(MODEL, tokens))
    assert _located(store) == {key: offsets}


def test_a_rewritten_entry_is_not_read_at_its_old_offsets(entry):
    store, cache, tokens, _ = entry
    store.get(MODEL, tokens)
    other = data.hybrid_cache(data.QUICK, 1024, seed=12)
    store.put(MODEL, tokens, other)
    _same(other, store.get(MODEL, tokens))


def test_bytes_damaged_on_disk_are_caught_after_offsets_are_remembered(entry):
    store, _, tokens, ekey = entry
    store.get(MODEL, tokens)
    ((_, offsets),) = _located(store).items()
    path = store.env.dir / "data.mdb"
    fd = os.open(path, os.O_RDWR)
    try:
        at = offsets[1] + 12345
        (byte,) = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([byte ^ 0x04]), at)
    finally:
        os.close(fd)
    with pytest.raises(CorruptEntry, match="checksum mismatch"):
        store.get(MODEL, tokens)
    with pytest.raises(CorruptEntry, match="checksum mismatch"):  # and again, through LMDB
        store.get(MODEL, tokens)


@pytest.mark.parametrize("restore", ["direct", "staged"])  # written after mlx's loader, or inside it (the CUDA way)
def test_pread_and_mapped_copy_give_the_same_arrays(entry, monkeypatch, restore):
    monkeypatch.setenv("PROMPTSTORE_RESTORE", restore)
    store, cache, tokens, ekey = entry
    with store.env.read(buffers=True) as txn:
        man = store._manifest(txn, ekey)
        data_file = store.env.data_file()
        bufs = _payload.chunk_buffers(man, lambda i: txn.get(ekey + _keys.u32(i), db=store._db[b"chunks"]), "t")
        via_file = _payload.read_file(man, data_file.fd, [data_file.offset(b) for b in bufs], "t")
        via_map = _payload.read_mapped(man, bufs, "t")
        mx.eval([a for d in via_file + via_map for a in d.values()])
    assert any(_payload._spans(rec) for layer in man.layers for rec in layer.arrays)  # the mapped copy's loader path
    for x, y in zip(via_file, via_map, strict=True):
        assert x.keys() == y.keys()
        for name in x:
            assert bits_equal(x[name], y[name]).item()
    _same(cache, store.get(MODEL, tokens))


def test_a_short_file_is_a_corrupt_entry(entry):
    store, _, tokens, _ = entry
    store.get(MODEL, tokens)
    ((key, offsets),) = _located(store).items()
    size = os.path.getsize(store.env.dir / "data.mdb")
    man_key = key
    with store.env.read(buffers=True) as txn:
        man = store._manifest(txn, man_key[0])
        with pytest.raises(CorruptEntry, match="ends inside"):
            _payload.read_file(man, store.env.data_file().fd, [size - 100] * len(offsets), "t")


def test_blank_buffers_have_their_sizes_and_take_writes():
    sizes = [1, 63, 4096, 5 << 20]
    out = _blank.blank(sizes)
    assert [a.size for a in out] == sizes and all(a.dtype == mx.uint8 for a in out)
    for n, a in zip(sizes, out):
        host = np.asarray(a)
        host[:] = np.arange(n) % 251
        assert np.array_equal(np.asarray(a), np.arange(n) % 251)
    assert _blank.blank([]) == []


def test_offsets_from_a_stale_mapping_never_make_a_healthy_entry_corrupt(entry):
    store, cache, tokens, _ = entry
    with store.env.read():
        data_file = store.env.data_file()
        # As if LMDB had mapped the file again over other addresses (a resize):
        # every buffer still falls inside the spans, at the wrong file offset.
        data_file.spans = [(lo, hi, off + 8192, dev, ino) for lo, hi, off, dev, ino in data_file.spans]
    _same(cache, store.get(MODEL, tokens))  # read_file fails its checksums, the mapped copy is exact
    assert _located(store) == {}  # and nothing wrong was remembered


def test_a_map_resize_rereads_the_mapping(entry):
    store, cache, tokens, _ = entry
    store.get(MODEL, tokens)
    with store.env.read():
        before = store.env.data_file().map_size
    store.env.env.set_mapsize(before * 2)  # what a MapFullError in a write does
    with store.env.read():
        data_file = store.env.data_file()
        assert data_file.map_size == before * 2
        assert data_file.spans == _pages._spans(data_file.path)
    _same(cache, store.get(MODEL, tokens))


def test_an_entry_with_a_small_last_chunk_is_not_remembered(tmp_path):
    # A value shorter than a page lives in a leaf page, which any later write may copy elsewhere.
    arrays = mx.array(np.arange(3 * (_entry.CHUNK + 16) // 2, dtype=np.uint16))
    from mlx_lm.models.cache import ArraysCache

    layer = ArraysCache(size=1)
    layer[0] = arrays.reshape(1, -1)
    with PromptStore(tmp_path / "s") as store:
        info = store.put(MODEL, [1, 2, 3], [layer], coverage=3)
        assert info.nbytes % _entry.CHUNK < 4096 and info.nbytes >= _pages.MIN_PAYLOAD
        restored = store.get(MODEL, [1, 2, 3])
        assert bits_equal(restored[0][0], layer[0]).item()
        assert _located(store) == {}


def test_verify_reads_through_lmdb_even_with_remembered_offsets(entry):
    store, _, tokens, ekey = entry
    store.get(MODEL, tokens)
    assert len(_located(store)) == 1
    key = ekey + _keys.u32(1)

    def damage(txn):  # rewritten in LMDB (new pages), manifest untouched
        raw = bytearray(txn.get(key, db=store._db[b"chunks"]))
        raw[100] ^= 0x01
        txn.put(key, bytes(raw), db=store._db[b"chunks"])

    store.env.write(damage)
    report = store.verify()
    assert len(report.problems) == 1 and "checksum mismatch" in str(report.problems[0])
