"""How a blob's bytes move: every array read to the address its bytes have
in the file (modulo 64), into buffers the arrays share, populated only when
fresh; the disk write started as the file is written; and the read and
checksum pool at interpreter exit."""

from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from _content import MODEL, make_entry, same_cache
from test_blobs import HERE, SMALL, _files, _man, payload_layout, small_blobs  # noqa: F401 (fixtures)
from conftest import backend
from promptstore import PromptStore
from promptstore.format import _blobs, _fill, _pages, _payload
from promptstore.codecs import encode_layer


def test_restored_arrays_sit_at_their_file_alignment(tmp_path, small_blobs, monkeypatch):
    """Each array read from a blob starts at the address its bytes have in the
    file, modulo 64 (the kernel then copies whole cache lines), whatever the
    sizes before it; and the arrays are still bit-exact. (Restores written
    after mlx's loader; staged ones land where the loader puts them.)"""
    monkeypatch.setenv("PROMPTSTORE_RESTORE", "direct")
    from mlx_lm.models.cache import KVCache

    cache = []
    for i, dim in enumerate((24, 8, 40, 16, 64)):  # 1204 * dim bytes: offsets off 64
        layer = KVCache()
        k = mx.random.normal((1, 2, 301, dim), key=mx.random.key(i)).astype(mx.bfloat16)
        layer.update_and_fetch(k, k * 3)
        cache.append(layer)
    tokens = list(range(1, 302))
    with PromptStore(tmp_path / "s") as store:
        store.put(MODEL, tokens, cache)
        man = _man(store, tokens)
        assert man.blob is not None and len({rec.offset % 64 for layer in man.layers for rec in layer.arrays}) > 1
        arrays = store._blobs.read(man, "test")
        for layer, got in zip(man.layers, arrays, strict=True):
            for rec in layer.arrays:
                a = got[rec.name]
                mx.eval(a)
                assert np.asarray(a.view(mx.uint16)).ctypes.data % 64 == rec.offset % 64
        assert same_cache(store.get(MODEL, tokens), cache)


def _kv_cache(dims, n=301):
    from mlx_lm.models.cache import KVCache

    cache = []
    for i, dim in enumerate(dims):
        layer = KVCache()
        k = mx.random.normal((1, 2, n, dim), key=mx.random.key(i)).astype(mx.bfloat16)
        layer.update_and_fetch(k, k * 3)
        cache.append(layer)
    return cache


def test_an_update_in_place_leaves_the_arrays_sharing_its_buffer_alone(tmp_path, small_blobs):
    """Restored arrays are views of a few shared buffers; writing into one
    (as a full RotatingKVCache does) changes that array only."""
    cache = _kv_cache((64, 64, 32))
    tokens = list(range(1, 302))
    with PromptStore(tmp_path / "s") as store:
        store.put(MODEL, tokens, cache)
        got = store.get(MODEL, tokens)
    mx.eval([a for layer in got for a in (layer.keys, layer.values)])
    addrs = sorted(np.asarray(a.view(mx.uint16)).ctypes.data for layer in got for a in (layer.keys, layer.values))
    assert addrs[-1] - addrs[0] < 2 * sum(layer.keys.nbytes + layer.values.nbytes for layer in got)  # one buffer
    want = [tuple(np.array(a[..., : layer.offset, :].view(mx.uint16)) for a in (layer.keys, layer.values)) for layer in cache]
    got[1].keys[..., 5:9, :] = mx.zeros((1, 2, 4, 64), dtype=mx.bfloat16)
    mx.eval(got[1].keys)
    want[1][0][..., 5:9, :] = 0
    for (k, v), layer in zip(want, got, strict=True):
        assert np.array_equal(np.asarray(layer.keys.view(mx.uint16)), k)
        assert np.array_equal(np.asarray(layer.values.view(mx.uint16)), v)


def test_resident_tells_touched_pages_from_fresh_ones():
    m = mmap.mmap(-1, 8 << 20)
    host = np.frombuffer(m, dtype=np.uint8)
    try:
        assert not _fill.resident(host)
        host[: 4 << 20] = 1
        assert not _fill.resident(host) and _fill.resident(host[: 4 << 20])
        host[:] = 2
        assert _fill.resident(host) and _fill.resident(host[7:-7])
    finally:
        del host
        m.close()


@pytest.mark.skipif(backend() != "cpu", reason="host residency of mlx's buffer cache: on a GPU backend its buffers move to the device")
def test_only_fresh_buffers_are_populated(tmp_path, small_blobs, monkeypatch):
    """A get into buffers mlx's cache hands back (resident) skips
    MADV_POPULATE_WRITE; one into fresh buffers populates each array.
    (Restores written after mlx's loader: staged ones write the loader's buffer.)"""
    monkeypatch.setenv("PROMPTSTORE_RESTORE", "direct")
    calls, seen = [], []
    real_populate, real_resident = _fill._populate, _fill.resident
    monkeypatch.setattr(_fill, "_populate", lambda addr, n: calls.append(n) or real_populate(addr, n))
    monkeypatch.setattr(_fill, "resident", lambda host: seen.append(real_resident(host)) or seen[-1])
    # 12 MiB arrays, one 48 MiB buffer: over glibc's largest mmap threshold,
    # so a fresh one is a new mapping, never recycled heap memory.
    cache = _kv_cache((256, 256), n=12288)
    tokens = list(range(1, 12289))
    limit = mx.set_cache_limit(1 << 30)
    try:
        with PromptStore(tmp_path / "s") as store:
            store.put(MODEL, tokens, cache)
            mx.clear_cache()
            assert same_cache(store.get(MODEL, tokens), cache)
            assert seen == [False] and len(calls) == 4
            del calls[:], seen[:]
            assert same_cache(store.get(MODEL, tokens), cache)  # the buffer of the first, from mlx's cache
            assert seen == [True] and calls == []
    finally:
        mx.set_cache_limit(limit)
        mx.clear_cache()


def test_writeback_in_small_steps_keeps_every_byte(tmp_path, small_blobs, monkeypatch):
    """The blob write starts the disk write of each step as it goes; with
    steps that split arrays at odd places the file is still the payload,
    byte for byte, and the entry restores bit-exactly."""
    calls = []
    real = _pages._sync_file_range
    if real is None:
        pytest.skip("no sync_file_range here")
    monkeypatch.setattr(_pages, "_sync_file_range", lambda *a: calls.append(a[1:3]) or real(*a))
    monkeypatch.setattr(_blobs, "WRITEBACK", 4099)
    tokens, cache = make_entry(4, 0, big_every=1)
    with PromptStore(tmp_path / "s") as store:
        store.put(MODEL, tokens, cache)
        man = _man(store, tokens)
        (name,) = _files(tmp_path / "s")
        assert len(calls) > 10 and calls[0] == (0, 4099) and all(n >= 4099 for _, n in calls)
        assert all(a + n == b for (a, n), (b, _) in zip(calls, calls[1:]))  # contiguous ranges
        _, views, _ = _payload.prepare([encode_layer(layer) for layer in cache])
        assert (tmp_path / "s" / "blobs" / name).read_bytes() == b"".join(bytes(v) for v in views)
        assert man.payload == sum(v.nbytes for v in views)
        assert same_cache(store.get(MODEL, tokens), cache)


def test_short_writes_and_many_small_pieces_keep_every_byte(tmp_path, monkeypatch):
    """Files are written with writev in batches; a writev that writes less
    than it was given (a signal, a full pipe) is resumed where it stopped,
    inside a piece or between pieces, and the views keep their order, also
    past the per-call piece limit and views of other item sizes."""
    calls, cut = [], []
    real = _blobs.os.writev

    def short(fd, views):
        calls.append(len(views))
        cap = 1 + (len(calls) * 7919) % 5000  # 1..5000 bytes, varying
        out, left = [], cap
        for v in views:
            if left <= 0:
                break
            out.append(v[:left])
            left -= len(out[-1])
        cut.append(sum(len(v) for v in out) < sum(len(memoryview(v).cast("B")) for v in views))
        return real(fd, out)

    monkeypatch.setattr(_blobs.os, "writev", short)
    monkeypatch.setattr(_blobs, "_IOV_MAX", 5)
    rng = np.random.default_rng(3)
    pieces = [rng.integers(0, 255, int(n), dtype=np.uint8) for n in rng.integers(0, 3000, 40)]
    views = [p.data for p in pieces] + [np.arange(1000, dtype=np.float32).data]
    path = tmp_path / "f"
    with open(path, "wb", buffering=0) as f:
        _blobs._write_all(f.fileno(), views)
    assert path.read_bytes() == b"".join(bytes(v) for v in views)
    assert max(calls) <= 5 and sum(cut) > 10  # resumed many times, never more than 5 pieces a call


def test_get_and_put_from_an_atexit_handler(tmp_path):
    """At interpreter exit the thread pool takes no more work: reads and the
    put's checksums then run on the calling thread, with the same results."""
    code = textwrap.dedent(
        f"""
        import atexit, sys
        sys.path.insert(0, {str(HERE)!r})
        from promptstore import PromptStore
        from promptstore.format import _blobs
        from _content import make_entry, same_cache
        _blobs.MIN_PAYLOAD = {SMALL}
        store = PromptStore({str(tmp_path / "s")!r})
        (t0, c0), (t1, c1) = make_entry(7, 5), make_entry(7, 11)
        store.put("m", t0, c0)
        store.get("m", t0)  # the pool exists and has threads

        def at_exit():
            assert same_cache(store.get("m", t0), c0)
            store.put("m", t1, c1)
            assert same_cache(store.get("m", t1), c1)
            store.close()
            print("exit ok", flush=True)

        atexit.register(at_exit)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "exit ok", proc.stderr
    assert len(_files(tmp_path / "s")) == 2
    with PromptStore(tmp_path / "s") as store:
        assert same_cache(store.get("m", make_entry(7, 11)[0]), make_entry(7, 11)[1])
        assert store.verify().ok
