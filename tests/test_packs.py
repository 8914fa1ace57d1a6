"""Pack files: the shared blocks a put adds, written together to one file
beside LMDB (entry format 4). Real LMDB files, real pack files, real SIGKILLs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from _bits import bits_equal
from _raw import audit_blocks, audit_packs, block_place, blocks_of, flip_block, get_block, pack_file, referrers, set_block, stored_bytes
from promptstore import CorruptEntry, PromptStore, salvage
from promptstore.format import _entry, _packs

MODEL = "packs@0123456789abcdef"
HERE = Path(__file__).resolve().parent


def chat(n: int, seed: int = 0):
    """Tokens and a one-layer KVCache of ``n`` positions (512 bytes a token),
    the first positions of one long conversation whatever ``n``."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50000, 4096).tolist()[:n]
    keys = rng.standard_normal((1, 2, 4096, 64)).astype(np.float16)[..., :n, :]
    values = rng.standard_normal((1, 2, 4096, 64)).astype(np.float16)[..., :n, :]
    kv = KVCache()
    kv.update_and_fetch(mx.array(keys), mx.array(values))
    return tokens, [kv]


def packs(store) -> list:
    d = store.path / _packs.DIRNAME
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def lmdb_blocks(store) -> int:
    with store.env.read() as txn:
        return sum(1 for _ in txn.cursor(db=store._db[b"blocks"]))


def same(a, b) -> bool:
    return all(bits_equal(x.keys[..., : x.offset, :], y.keys[..., : y.offset, :]) and bits_equal(x.values[..., : x.offset, :], y.values[..., : y.offset, :]) for x, y in zip(a, b))


def test_a_put_writes_its_new_blocks_to_one_pack_and_nothing_else(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        t1, c1 = chat(600)
        info = store.put(MODEL, t1, c1)
        assert len(packs(store)) == 1 and lmdb_blocks(store) == 0
        pack = store.path / _packs.DIRNAME / packs(store)[0]
        held = store._packs.contents(_packs.pack_of(pack.name), "test")  # its footer: what it holds
        assert sum(size for _, _, size in held) == 600 * 512 == info.nbytes  # the KV bytes, once
        assert pack.stat().st_size == 600 * 512 + len(_packs.footer([(k, n) for k, _, n in held]))  # and its footer
        t2, c2 = chat(1500)
        store.put(MODEL, t2, c2)
        assert len(packs(store)) == 2
        second = [p for p in packs(store) if p != pack.name][0]
        held = store._packs.contents(_packs.pack_of(second), "test")
        assert sum(size for _, _, size in held) == 900 * 512  # only what the first lacks
        assert same(store.get(MODEL, t1), c1) and same(store.get(MODEL, t2), c2)
        hit = store.lookup(MODEL, t2[:1000] + [7])  # a prefix of the longer entry: read from both packs
        assert hit.matched == 1000
        audit_blocks(store)
        assert audit_packs(store) == 2 and store.usage() == stored_bytes(store)


def test_a_small_put_keeps_its_blocks_in_lmdb(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        t, c = chat(100)  # 51 kB of new blocks: below MIN_BYTES
        assert 100 * 512 < _packs.MIN_BYTES
        store.put(MODEL, t, c)
        assert packs(store) == [] and lmdb_blocks(store) > 0
        assert same(store.get(MODEL, t), c)


def test_manifests_with_blocks_are_format_4(tmp_path):
    """Older readers look for blocks in LMDB only: format 4 makes them refuse
    such an entry as newer (fail closed) instead of calling it damaged."""
    with PromptStore(tmp_path / "s") as store:
        t, c = chat(600)
        store.put(MODEL, t, c)
        with store.env.read() as txn:
            (_, raw), = list(txn.cursor(db=store._db[b"entries"]))
        import msgpack

        assert msgpack.unpackb(bytes(raw), raw=False)["format"] == _entry.PACKS_FORMAT == 4


def test_a_pack_goes_when_its_last_block_does(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        t1, c1 = chat(600)
        t2, c2 = chat(1500)
        store.put(MODEL, t1, c1)
        store.put(MODEL, t2, c2)
        store.delete(MODEL, t1)  # its blocks are the longer entry's too: both packs stay
        assert len(packs(store)) == 2 and same(store.get(MODEL, t2), c2)
        audit_blocks(store), audit_packs(store)
        store.delete(MODEL, t2)
        assert packs(store) == [] and store.usage() == 0
        assert store.verify().ok


def pack_live(store) -> tuple:
    """(bytes of blocks still referenced in pack files, number of such blocks)."""
    with store.env.read() as txn:
        live = sum(int.from_bytes(bytes(v[:8]), "big") for k, v in txn.cursor(db=store._db[b"packs"]) if bytes(k)[:1] == b"p")
        placed = sum(1 for _ in txn.cursor(db=store._db[b"places"]))
    return live, placed


def test_compact_rewrites_packs_that_hold_dead_blocks(tmp_path):
    """A pack keeps the blocks of a deleted entry that others do not use
    until its dead bytes pass the repack threshold (4 MiB); ``compact``
    rewrites every such pack (it left them: over a third of the packs' bytes here)."""
    with PromptStore(tmp_path / "s") as store:
        t_long, c_long = chat(2048)
        t_half, c_half = chat(1024)
        t_other, c_other = chat(700, seed=5)
        store.put(MODEL, t_long, c_long)
        store.put(MODEL, t_half, c_half)  # its blocks are the longer entry's first ones
        store.put(MODEL, t_other, c_other)
        store.delete(MODEL, t_long)
        store.gc()
        held = store._packs.nbytes()
        live, _ = pack_live(store)
        assert held - live > 0.3 * held  # gc leaves them (under the threshold)
        before, after = store.compact()
        assert before >= held and after < before
        live, placed = pack_live(store)
        footers = 24 * placed + 16 * len(packs(store))  # format._packs: per block and per pack
        assert store._packs.nbytes() - live <= footers, (store._packs.nbytes(), live, footers)
        assert same(store.get(MODEL, t_half), c_half) and same(store.get(MODEL, t_other), c_other)
        audit_blocks(store), audit_packs(store)
        assert store.usage() == stored_bytes(store) and store.verify().ok


def test_a_compaction_retried_after_map_growth_leaves_no_pack_behind(tmp_path, monkeypatch):
    """The repack transaction of ``compact`` is run again when the map must
    grow: the packs its first attempt wrote were left on disk, recorded
    nowhere (verify counted them as orphans until a gc removed them)."""
    from promptstore.store import _packing

    path = tmp_path / "s"
    with PromptStore(path) as store:
        t_long, c_long = chat(2048)
        t_half, c_half = chat(1024)
        t_other, c_other = chat(700, seed=5)
        for t, c in ((t_long, c_long), (t_half, c_half), (t_other, c_other)):
            store.put(MODEL, t, c)
        store.delete(MODEL, t_long)
        store.gc()
        store.env.compact()  # the LMDB file alone, copied compactly: no free page left in it
    attempts = []
    real = _packing.repack
    monkeypatch.setattr(_packing, "repack", lambda *a, **k: attempts.append(1) or real(*a, **k))
    with PromptStore(path, map_size=1 << 12) as store:  # LMDB raises it to the pages in use, no more
        store.compact(upgrade=False)
        assert len(attempts) == 2  # the first attempt found the map full, the map grew, the second committed
        rep = store.verify()
        assert rep.ok and rep.orphan_packs == 0, packs(store)
        assert same(store.get(MODEL, t_half), c_half) and same(store.get(MODEL, t_other), c_other)
        assert audit_packs(store) == len(packs(store))
        audit_blocks(store)
        assert store.usage() == stored_bytes(store)


def test_a_compaction_that_fails_after_writing_a_pack_removes_it(tmp_path, monkeypatch):
    from promptstore.store import _packing

    with PromptStore(tmp_path / "s") as store:
        t_long, c_long = chat(2048)
        t_half, c_half = chat(1024)
        store.put(MODEL, t_long, c_long)
        store.put(MODEL, t_half, c_half)
        store.delete(MODEL, t_long)
        before = packs(store)

        def record(*a, **k):
            raise RuntimeError("after the new pack is written")

        monkeypatch.setattr(_packing, "record", record)
        with pytest.raises(RuntimeError):
            store.compact(upgrade=False)
        monkeypatch.undo()
        assert packs(store) == before and store.verify().orphan_packs == 0
        assert same(store.get(MODEL, t_half), c_half)


def test_eviction_removes_packs_and_keeps_the_budget(tmp_path):
    budget = 2_000_000
    with PromptStore(tmp_path / "s", budget=budget) as store:
        for seed in range(8):  # unrelated conversations of ~0.6 MB each
            t, c = chat(1200, seed=seed)
            store.put(MODEL, t, c)
            assert store.usage() == stored_bytes(store) <= budget
            audit_blocks(store), audit_packs(store)
        assert len(list(store.entries())) == len(packs(store)) == 3
        assert store.file_size() <= 1.25 * budget + (1 << 20)


def test_flipped_truncated_and_missing_packs_fail_closed(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        t1, c1 = chat(600)
        t2, c2 = chat(1500)
        t3, c3 = chat(700, seed=5)  # another conversation: its own pack
        store.put(MODEL, t1, c1)
        store.put(MODEL, t2, c2)
        store.put(MODEL, t3, c3)
        ids = {e.n_tokens: e.id for e in store.entries()}
        shared = [k for k, who in referrers(store).items() if who == {ids[600], ids[1500]}][0]
        good = get_block(store, shared)
        raw = bytearray(good)
        raw[len(raw) // 2] ^= 0x08
        set_block(store, shared, raw)
        for t in (t1, t2):
            with pytest.raises(CorruptEntry, match="does not match its address"):
                store.get(MODEL, t)
        assert same(store.get(MODEL, t3), c3)
        rep = store.verify()
        assert {p[0] for p in rep.problems} == {ids[600], ids[1500]}
        set_block(store, shared, good)
        assert store.verify().ok
        # truncated: the file ends inside a block
        path = pack_file(store, shared)
        os.truncate(path, path.stat().st_size // 2)  # into its blocks, past the shared one
        with pytest.raises(CorruptEntry, match="ends inside"):
            store.get(MODEL, t1)
        # missing: a lost file, told from a deleted entry by a second snapshot
        path.unlink()
        with pytest.raises(CorruptEntry, match="missing"):
            store.get(MODEL, t2)
        assert store.lookup(MODEL, t2 + [1]) is None or store.lookup(MODEL, t2 + [1]).matched == 0
        rep = store.verify(fix=True)
        assert sorted(e.n_tokens for e in store.entries()) == [700]  # only the damaged ones went
        assert same(store.get(MODEL, t3), c3) and store.verify().ok
        audit_blocks(store), audit_packs(store)


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_blocks_read_together_are_each_checked_and_named(tmp_path, monkeypatch, mode):
    """A large get reads blocks that lie back to back in a pack with one
    read (on the fill threads, and inside mlx's loader where restores are
    staged), then checks each against its address: a damaged block in the
    middle of such a run, or a file that ends inside one, is named in the
    error, and nothing stored is lost."""
    monkeypatch.setenv("PROMPTSTORE_RESTORE", mode)
    rng = np.random.default_rng(3)
    n = 4096  # 16 blocks of 256 tokens (512 KiB) per array: 16 MiB, a large entry
    tokens = rng.integers(0, 50000, n).tolist()
    kv = KVCache()
    kv.update_and_fetch(*(mx.array(rng.standard_normal((1, 8, n, 128)).astype(np.float16)) for _ in range(2)))
    with PromptStore(tmp_path / "s", block_tokens=256) as store:
        store.put(MODEL, tokens, [kv])
        (eid,) = [e.id for e in store.entries()]
        places = sorted((block_place(store, key)[1], key) for key in blocks_of(store, eid))
        assert [b - a for (a, _), (b, _) in zip(places, places[1:])] == [512 << 10] * 31  # one run after another
        inside = places[5][1]  # in the middle of a run (all 32 blocks lie back to back)
        flip_block(store, inside)
        with pytest.raises(CorruptEntry, match=f"block {inside.hex()} does not match its address"):
            store.get(MODEL, tokens)
        flip_block(store, inside)  # flipped back
        assert same(store.get(MODEL, tokens), [kv])
        last_at, last = places[-1]
        os.truncate(pack_file(store, last), last_at + 1000)
        with pytest.raises(CorruptEntry, match=f"the file ends inside block {last.hex()}"):
            store.get(MODEL, tokens)
        assert [e.id for e in store.entries()] == [eid]


KILLER = """
import os, signal, sys
sys.path.insert(0, {here!r})
from test_packs import chat, MODEL
from promptstore import PromptStore
from promptstore.format import _packs

real = _packs.Packs.write
def write(self, pack, views, blocks):
    real(self, pack, views, blocks)
    os.kill(os.getpid(), signal.SIGKILL)  # the pack is on disk, its records are not
_packs.Packs.write = write
with PromptStore({path!r}) as store:
    t, c = chat(2000)
    store.put(MODEL, t, c)
"""


def test_a_put_killed_after_writing_its_pack_leaves_a_stray_file_that_gc_removes(tmp_path):
    path = tmp_path / "s"
    with PromptStore(path) as store:
        t, c = chat(600)
        store.put(MODEL, t, c)
    proc = subprocess.run([sys.executable, "-c", KILLER.format(here=str(HERE), path=str(path))], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    with PromptStore(path) as store:
        assert len(packs(store)) == 2  # the killed put's pack, on disk, recorded nowhere
        rep = store.verify()
        assert rep.ok and rep.orphan_packs == 1 and rep.orphan_blobs == 0 and len(list(store.entries())) == 1
        store.gc()
        assert len(packs(store)) == 1 and store.verify().ok and store.verify().orphan_packs == 0
        assert same(store.get(MODEL, t), c) and store.get(MODEL, chat(2000)[0]) is None
        audit_blocks(store), audit_packs(store)


def test_salvage_copies_entries_whose_blocks_are_in_packs(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        t1, c1 = chat(600)
        t2, c2 = chat(1500)
        store.put(MODEL, t1, c1)
        store.put(MODEL, t2, c2)
    rep = salvage(tmp_path / "s", tmp_path / "out")
    assert len(rep.copied) == 2 and not rep.skipped
    with PromptStore(tmp_path / "out") as out:
        assert same(out.get(MODEL, t1), c1) and same(out.get(MODEL, t2), c2)
        assert packs(out) and out.verify().ok
        audit_blocks(out), audit_packs(out)


def test_salvage_of_a_store_this_process_holds_open(tmp_path):
    """``store.salvage(dst)`` on an open PromptStore (as the README shows it)
    copies every entry: it reads a consistent copy of the data file. It used to
    open the folder a second time, which LMDB refuses in one process, and
    report the header pages damaged, advising to remove the store.
    ``promptstore.salvage(path, dst)`` on a store this process holds says so."""
    from promptstore import StoreUnavailable

    with PromptStore(tmp_path / "s") as store:
        t1, c1 = chat(600)
        t2, c2 = chat(1500)
        store.put(MODEL, t1, c1)
        store.put(MODEL, t2, c2)
        rep = store.salvage(tmp_path / "out")
        assert len(rep.copied) == 2 and not rep.skipped and not rep.scanned
        with pytest.raises(StoreUnavailable, match="open in this process") as err:
            salvage(tmp_path / "s", tmp_path / "other")
        assert "damaged" not in str(err.value) and not (tmp_path / "other").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s"]  # no snapshot left behind
        assert same(store.get(MODEL, t2), c2) and store.verify().ok
    with PromptStore(tmp_path / "out") as out:
        assert same(out.get(MODEL, t1), c1) and same(out.get(MODEL, t2), c2)
        assert packs(out) and out.verify().ok
        audit_blocks(out), audit_packs(out)


def test_salvage_of_a_damaged_entry_does_not_bring_back_deleted_ones(tmp_path):
    """One unreadable entry makes salvage scan the data file's bytes for it;
    manifests of entries deleted before, left in freed pages, stay deleted."""
    with PromptStore(tmp_path / "s") as store:
        kept = [chat(300, seed) for seed in (1, 2)]
        gone = [chat(300, seed) for seed in (3, 4, 5)]
        infos = [store.put(MODEL, t, c) for t, c in kept + gone]
        for info in infos[2:]:
            store.remove(info.id)
        flip_block(store, blocks_of(store, infos[1].id)[0])
    rep = salvage(tmp_path / "s", tmp_path / "out")
    assert rep.copied == (infos[0].id,) and [e for e, _ in rep.skipped] == [infos[1].id]
    assert not rep.scanned
    with PromptStore(tmp_path / "out") as out:
        assert [e.id for e in out.entries()] == [infos[0].id]
        assert same(out.get(MODEL, kept[0][0]), kept[0][1]) and out.verify().ok
