"""Blob files under concurrency: a read whose snapshot names a file that a
replacing put or a delete unlinks looks again; reader threads and processes
beside a replacing writer see a miss or one whole version, bit for bit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from _raw import audit_blocks
from _content import MODEL, make_entry, same_cache
from test_blobs import HERE, SMALL, _files, payload_layout, small_blobs  # noqa: F401 (fixtures)
from promptstore import PromptStore
from promptstore.format import _blobs


def test_a_blob_replaced_during_a_read_is_read_again(tmp_path, small_blobs, monkeypatch):
    """The reader's snapshot names a file that a put replacing the entry
    unlinks before the reader opens it: the reader looks again and returns
    the new entry (not an error, not a miss)."""
    tokens, old = make_entry(8, 0, big_every=1)
    new = make_entry(8, 1, big_every=1)[1]
    new[0].offset = old[0].offset  # same coverage, other arrays
    new[0].keys, new[0].values = new[0].keys[..., : old[0].offset, :], new[0].values[..., : old[0].offset, :]
    store = PromptStore(tmp_path / "s")
    store.put(MODEL, tokens, old)
    race = _Race(monkeypatch)
    got = race.read(lambda: store.get(MODEL, tokens), lambda: store.put(MODEL, tokens, new))
    assert same_cache(got, new)
    assert len(race.calls) == 2 and race.calls[0] != race.calls[1]
    assert race.read(lambda: store.get(MODEL, tokens), lambda: store.delete(MODEL, tokens)) is None  # a miss
    assert len(race.calls) == 1
    store.close()


class _Race:
    """Runs a read on a thread and, once the read's snapshot names a blob file
    but before it opens it, a write on this thread (mlx arrays belong to the
    thread that made them, so the write, with its cache, stays here)."""

    def __init__(self, monkeypatch):
        self.real = _blobs.Blobs.read
        self.calls = []
        self.ready, self.done = threading.Event(), threading.Event()
        monkeypatch.setattr(_blobs.Blobs, "read", lambda blobs, man, where: self._racing(blobs, man, where))

    def _racing(self, blobs, man, where):
        self.calls.append(man.blob)
        if len(self.calls) == 1:
            self.ready.set()
            self.done.wait()
        return self.real(blobs, man, where)

    def read(self, read, write):
        """``read()``'s result, or the exception it raised."""
        self.calls.clear()
        self.ready.clear()
        self.done.clear()
        out = []

        def run():
            try:
                out.append(read())
            except Exception as err:  # noqa: BLE001
                out.append(err)

        t = threading.Thread(target=run)
        t.start()
        assert self.ready.wait(30), out
        write()
        self.done.set()
        t.join()
        return out[0]


@pytest.mark.parametrize("shared_blocks", [False, True], ids=["payload", "shared-blocks"])
def test_readers_and_a_replacing_writer_in_threads(tmp_path, small_blobs, shared_blocks, monkeypatch):
    """With shared blocks: the KV in blocks that a replacing put releases (and
    removes) in the transaction that commits the other version, the
    recurrent state in a blob file."""
    tokens = make_entry(9, 0, big_every=1)[0]
    n = len(tokens)
    variants = []
    for seed in (9, 10):
        c = make_entry(seed, 1, big_every=1)[1]  # a KV layer and an ArraysCache layer
        c[0].keys, c[0].values = c[0].keys[..., :n, :], c[0].values[..., :n, :]
        c[0].offset = n
        variants.append(c if shared_blocks else c[:1])
    if shared_blocks:
        monkeypatch.setattr(_blobs, "MIN_PAYLOAD", 256)  # the 320-byte state goes to a blob
    store = PromptStore(tmp_path / "s", shared_blocks=shared_blocks, block_tokens=256)  # 4400 tokens: 18 blocks
    stop = time.monotonic() + 3
    errors, reads = [], [0, 0]

    def writer():
        i = 0
        try:
            while time.monotonic() < stop:
                if i % 3 == 2:
                    store.delete(MODEL, tokens)
                else:
                    store.put(MODEL, tokens, variants[i % 2])
                i += 1
        except BaseException as err:  # noqa: BLE001
            errors.append(repr(err))

    def reader(k):
        try:
            while time.monotonic() < stop:
                got = store.get(MODEL, tokens) if k == 0 else getattr(store.lookup(MODEL, tokens), "cache", None)
                if got is not None:
                    assert any(same_cache(got, v) for v in variants)
                reads[k] += 1
        except BaseException as err:  # noqa: BLE001
            errors.append(repr(err))

    threads = [threading.Thread(target=reader, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    writer()  # on this thread, which made the caches' arrays
    for t in threads:
        t.join()
    assert errors == [] and min(reads) > 3
    assert len(_files(tmp_path / "s")) <= 1 and store.verify().orphan_blobs == 0
    there = store.get(MODEL, tokens) is not None  # the writer's last step may have been a delete
    assert store.verify().ok and audit_blocks(store) == (2 * 18 if shared_blocks and there else 0)  # 4400 tokens: 18 blocks
    store.close()


@pytest.mark.parametrize("shared_blocks", [False, True], ids=["payload", "shared-blocks"])
def test_a_replacing_writer_process_and_a_reader_process(tmp_path, shared_blocks, monkeypatch):
    """A writer process replaces and deletes blob entries while this process
    reads them: every read is a miss or one of the versions, bit for bit.
    With shared blocks the KV is in blocks (released and removed by the
    replacing puts), and each entry with an ArraysCache layer keeps its state
    in a blob file."""
    path = tmp_path / "s"
    blob_min = 256 if shared_blocks else SMALL
    monkeypatch.setenv("PROMPTSTORE_SHARED_BLOCKS", "1" if shared_blocks else "0")
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(HERE)!r})
        from promptstore import PromptStore
        from promptstore.format import _blobs
        from _content import make_entry
        _blobs.MIN_PAYLOAD = {blob_min}
        store = PromptStore({str(path)!r})
        keys = [make_entry(11, k, big_every=1)[0] for k in range(3)]
        end, i = time.monotonic() + 4, 0
        while time.monotonic() < end:
            k = i % 3
            if i % 5 == 4:
                store.delete("{MODEL}", keys[k])
            else:
                store.put("{MODEL}", keys[k], make_entry(11, k + 3 * (i % 2), big_every=1)[1])
            i += 1
        print(i)
        """
    )
    PromptStore(path).close()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    versions = {}
    for k in range(3):
        toks = make_entry(11, k, big_every=1)[0]
        versions[k] = (toks, [make_entry(11, k + 3 * j, big_every=1)[1] for j in (0, 1)])
    reads = hits = 0
    with PromptStore(path) as store:
        while proc.poll() is None:
            for toks, caches in versions.values():
                got = store.get(MODEL, toks)
                reads += 1
                if got is not None:
                    hits += 1
                    assert any(same_cache(got, c) for c in caches)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert int(out) > 10 and reads > 10 and hits > 0
    with PromptStore(path) as store:
        assert store.verify().ok and store.verify().orphan_blobs == 0
        assert (audit_blocks(store) > 0) == shared_blocks  # (three entries, all with KV)


def test_load_by_id_racing_a_replace_or_delete(tmp_path, small_blobs, monkeypatch):
    """load(id) (export, `promptstore get KEY`) looks again like get does."""
    from promptstore import EntryNotFound

    tokens, old = make_entry(17, 0, big_every=1)
    new = make_entry(17, 2, big_every=1)[1]
    n = len(tokens)
    new[0].keys, new[0].values, new[0].offset = new[0].keys[..., :n, :], new[0].values[..., :n, :], n
    store = PromptStore(tmp_path / "s")
    eid = store.put(MODEL, tokens, old).id
    race = _Race(monkeypatch)
    assert same_cache(race.read(lambda: store.load(eid)[0], lambda: store.put(MODEL, tokens, new)), new)
    assert isinstance(race.read(lambda: store.load(eid)[0], lambda: store.delete(MODEL, tokens)), EntryNotFound)
    store.close()
