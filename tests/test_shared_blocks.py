"""Shared blocks (entry format 3): KV arrays cut along the token axis into
content-addressed blocks, stored once, reference-counted with the manifests.

Real fixture models, real LMDB files, real SIGKILLs.
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from _bits import bits_equal
from _raw import audit_blocks, block_place, damage_manifest, ekey_of, flip_block, shared_block, stored_block_sizes, stored_bytes
from _content import MODEL, chat_entry, same_cache
from _workers import _drain, _say
from conftest import load_fixture, sample_tokens
from promptstore import PromptStore, UnsupportedVersion, salvage
from promptstore.format import _blocks, _entry, _payload
from promptstore.jobs.prefill import prefill
from promptstore.store import _keys

TURN = 150
HERE = Path(__file__).resolve().parent


def kv_bytes(cache) -> int:
    return sum(a.nbytes for layer in cache for a in (layer.keys, layer.values) if a is not None)


def block_bytes(store) -> int:
    return sum(stored_block_sizes(store).values())


def manifest(store, tokens):
    with store.env.read() as txn:
        return store._manifest(txn, _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens)))


@pytest.fixture(scope="module")
def chat():
    """A conversation served turn by turn: each turn restores the previous
    entry, prefills only its new tokens and stores the whole cache."""
    model, _, _, _ = load_fixture("llama")
    tokens = sample_tokens(8 * TURN, seed=11)
    caches = []
    cache = make_prompt_cache(model)
    for turn in range(1, 9):
        prefill(model, tokens[(turn - 1) * TURN : turn * TURN], cache=cache)
        caches.append([_copy(layer) for layer in cache])
    return tokens, caches


def _copy(layer):
    from mlx_lm.models.cache import KVCache

    out = KVCache()
    out.keys, out.values, out.offset = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :], layer.offset
    return out


def test_a_growing_conversation_stores_every_token_once(tmp_path, chat):
    tokens, caches = chat
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        before = 0
        for turn, cache in enumerate(caches, start=1):
            info = store.put(MODEL, tokens[: turn * TURN], cache)
            assert info.shared == info.nbytes == kv_bytes(cache)
            grew = block_bytes(store) - before
            assert grew == kv_bytes(cache) - kv_bytes(caches[turn - 2]) if turn > 1 else grew == kv_bytes(cache)
            before += grew
        assert block_bytes(store) == kv_bytes(caches[-1])  # 8 entries, the final cache's bytes once
        for turn, cache in enumerate(caches, start=1):
            assert same_cache(store.get(MODEL, tokens[: turn * TURN]), cache)
        bounds = manifest(store, tokens).bounds
        assert set(range(TURN, 8 * TURN + 1, TURN)) <= set(bounds)  # every earlier entry's end is a bound
        assert store.verify().ok


def test_blocks_hashed_on_the_fill_threads_get_the_same_addresses(tmp_path, chat, monkeypatch):
    """A large put hashes its blocks on the fill threads, each a run of
    blocks: the addresses are those hashed one by one here, in order, so a
    store written either way shares every block with the other."""
    from promptstore.store import _write

    tokens, caches = chat
    with PromptStore(tmp_path / "serial", shared_blocks=True) as store:
        store.put(MODEL, tokens[:TURN], caches[0])
        store.put(MODEL, tokens, caches[-1])
        serial = manifest(store, tokens)
    monkeypatch.setattr(_write, "_PARALLEL_HASH", 0)
    monkeypatch.setattr(_write._fill, "WORKERS", 3)
    with PromptStore(tmp_path / "threads", shared_blocks=True) as store:
        store.put(MODEL, tokens[:TURN], caches[0])
        store.put(MODEL, tokens, caches[-1])
        threaded = manifest(store, tokens)
        assert block_bytes(store) == kv_bytes(caches[-1])
        assert same_cache(store.get(MODEL, tokens), caches[-1])
    assert threaded.bounds == serial.bounds and len(serial.bounds) > 3
    parts = [r.parts for _, r in threaded.parted()]
    assert parts == [r.parts for _, r in serial.parted()]
    for (li, rec), keys in zip(serial.parted(), parts):  # each address is the block's own hash
        layer = serial.layers[li]
        whole = np.frombuffer(_payload.host_bytes(mx.contiguous(getattr(caches[-1][li], rec.name))), dtype=np.uint8)
        rows = whole.reshape(-1, rec.shape[-2], rec.nbytes // math.prod(rec.shape[:-1]))
        start = 0
        for key, end in zip(keys, serial.bounds):
            shape = _blocks.block_shape(rec.shape, start, end)
            assert key == _blocks.address(layer.kind, layer.version, rec.dtype, shape, rows[:, start:end, :])
            start = end


def test_the_same_entry_from_two_stores_layouts_reads_the_same(tmp_path, chat):
    tokens, caches = chat
    with PromptStore(tmp_path / "s", shared_blocks=False) as plain:
        plain.put(MODEL, tokens[:TURN], caches[0])
    with PromptStore(tmp_path / "s", shared_blocks=True, block_tokens=256) as store:
        store.put(MODEL, tokens[: 2 * TURN], caches[1])
        assert manifest(store, tokens[:TURN]).bounds == ()  # format 1 as it was
        assert len(manifest(store, tokens[: 2 * TURN]).bounds) >= 2
        assert same_cache(store.get(MODEL, tokens[:TURN]), caches[0])
        assert same_cache(store.get(MODEL, tokens[: 2 * TURN]), caches[1])


def test_an_older_reader_refuses_shared_entries(tmp_path, chat, monkeypatch):
    tokens, caches = chat
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        store.put(MODEL, tokens[:TURN], caches[0])
        monkeypatch.setattr(_entry, "FORMAT", 2)
        with pytest.raises(UnsupportedVersion, match="entry format 4"):
            store.get(MODEL, tokens[:TURN])
        monkeypatch.setattr(_entry, "FORMAT", 3)  # the release before pack files: its blocks were in LMDB only
        with pytest.raises(UnsupportedVersion, match="entry format 4"):
            store.get(MODEL, tokens[:TURN])


def test_lookup_trims_a_longer_shared_entry(tmp_path, chat):
    tokens, caches = chat
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        store.put(MODEL, tokens[: 4 * TURN], caches[3])
        query = tokens[: 2 * TURN] + [7, 8, 9]
        hit = store.lookup(MODEL, query)
        assert hit.matched == 2 * TURN and hit.trimmed == 2 * TURN
        assert same_cache(hit.cache, caches[1])


def test_blocks_are_freed_with_their_last_reference(tmp_path, chat):
    tokens, caches = chat
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        for turn in (1, 2, 3):
            store.put(MODEL, tokens[: turn * TURN], caches[turn - 1])
        assert store.delete(MODEL, tokens[: 3 * TURN])
        assert block_bytes(store) == kv_bytes(caches[1])
        assert same_cache(store.get(MODEL, tokens[:TURN]), caches[0])
        assert store.delete(MODEL, tokens[:TURN])
        assert same_cache(store.get(MODEL, tokens[: 2 * TURN]), caches[1])  # its blocks stayed
        assert store.delete(MODEL, tokens[: 2 * TURN])
        assert block_bytes(store) == 0 and store.usage() == 0
        with store.env.read() as txn:
            assert txn.stat(store._db.refs)["entries"] == 0
        assert store.verify().ok


def test_the_budget_counts_shared_bytes_once(tmp_path, chat):
    tokens, caches = chat
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        for turn in range(1, 9):
            store.put(MODEL, tokens[: turn * TURN], caches[turn - 1])
        total = store.usage()
        assert total < 1.1 * kv_bytes(caches[-1]) + 8 * 4096  # the final cache once, plus manifests
        report = store.gc(budget=total // 2)
        assert report.evicted and store.usage() <= total // 2
        assert store.usage() == report.usage
        rep = store.verify()
        assert rep.ok, rep
        for info in store.entries():
            turn = info.n_tokens // TURN
            assert same_cache(store.get(MODEL, tokens[: info.n_tokens]), caches[turn - 1])


def test_a_put_that_evicts_an_entry_whose_manifest_was_damaged_frees_its_blocks(tmp_path, monkeypatch):
    """Such an entry cannot release its blocks as it goes: a put that evicted
    it to stay in the budget left them counted (its own block stored, the
    shared ones over-counted: verify's wrong counts and orphan blocks) until
    gc or `verify --fix`. The put now recounts them, as gc does; the intact
    entry's blocks stay, and a put that evicts only intact entries recounts nothing."""
    first, second, other = chat_entry(0, 0), chat_entry(0, 1), chat_entry(1, 0)
    with PromptStore(tmp_path / "t", shared_blocks=True) as scratch:  # what the last put adds
        scratch.put(MODEL, *first)
        adds = scratch.put(MODEL, *other).added
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        recounts = []
        monkeypatch.setattr(store._writer, "recount", lambda txn, real=store._writer.recount: recounts.append(real(txn)))
        a = store.put(MODEL, *first)
        b = store.put(MODEL, *second)  # shares the first's blocks, and has one of its own
        damage_manifest(store, ekey_of(store, b.id))
        store.touch(MODEL, first[0])  # the damaged entry is the least recently used
        budget = store.usage() + adds - 1
        store.set_budget(budget)
        c = store.put(MODEL, *other)  # shares the system prompt's block with both
        assert {e.id for e in store.entries()} == {a.id, c.id}
        assert audit_blocks(store) and store.verify().ok
        assert store.usage() == stored_bytes(store) <= budget
        for tokens, cache in (first, other):
            assert same_cache(store.get(MODEL, tokens), cache)
        assert len(recounts) == 1
        d = store.put(MODEL, *chat_entry(2, 0))  # evicts the first entry, intact
        assert {e.id for e in store.entries()} == {c.id, d.id} and len(recounts) == 1
        assert audit_blocks(store) and store.verify().ok and store.usage() == stored_bytes(store) <= budget


def test_a_put_that_replaces_an_entry_whose_manifest_was_damaged_frees_its_blocks(tmp_path):
    """The same for a put of that entry's tokens (a serving loop's, after the
    miss): the replaced manifest's references stayed counted, so its blocks
    were never freed, not even once every entry was deleted."""
    first, second = chat_entry(0, 0), chat_entry(0, 1)
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        store.put(MODEL, *first)
        b = store.put(MODEL, *second)
        damage_manifest(store, ekey_of(store, b.id))
        store.put(MODEL, *second)
        assert audit_blocks(store) and store.verify().ok and store.usage() == stored_bytes(store)
        for tokens, cache in (first, second):
            assert same_cache(store.get(MODEL, tokens), cache)
        assert store.delete(MODEL, second[0]) and store.delete(MODEL, first[0])
        assert block_bytes(store) == 0 and store.usage() == 0


def test_deleting_an_entry_whose_manifest_was_damaged_frees_its_blocks(tmp_path):
    first, second = chat_entry(0, 0), chat_entry(0, 1)
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        store.put(MODEL, *first)
        b = store.put(MODEL, *second)
        damage_manifest(store, ekey_of(store, b.id))
        assert store.delete(MODEL, second[0])
        assert audit_blocks(store) and store.verify().ok and store.usage() == stored_bytes(store)
        assert same_cache(store.get(MODEL, first[0]), first[1])
        assert store.delete(MODEL, first[0])
        assert block_bytes(store) == 0 and store.usage() == 0


def _flip_block(store, at: int = 0):
    """Flip a byte of a block that more than one entry references."""
    from promptstore.store import _budget

    with store.env.read() as txn:
        key = next(bytes(k) for k, v in txn.cursor(db=store._db.refs) if _budget.ref_count(v) > 1)
    flip_block(store, key, at, 0x40)


def test_a_damaged_block_is_detected_and_a_wrong_count_repaired(tmp_path, chat):
    from promptstore import CorruptEntry

    tokens, caches = chat
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        for turn in (1, 2):
            store.put(MODEL, tokens[: turn * TURN], caches[turn - 1])
        # a wrong count and an orphan block: reported, repaired, no entry deleted
        def skew(txn):
            key, raw = next(iter(txn.cursor(db=store._db.refs)))
            txn.put(bytes(key), (99).to_bytes(8, "big") + bytes(raw)[8:], db=store._db.refs)
            txn.put(b"\x01" * _blocks.ADDRESS, b"stray", db=store._db.blocks)

        store.env.write(skew)
        rep = store.verify()
        assert not rep.ok and rep.bad_counts == 1 and rep.orphan_blocks == 1 and not rep.problems
        rep = store.verify(fix=True)
        assert store.verify().ok and len(list(store.entries())) == 2
        # a flipped byte in a block: both entries that share it fail closed
        _flip_block(store)
        with pytest.raises(CorruptEntry, match="does not match its address"):
            store.get(MODEL, tokens[:TURN])
        rep = store.verify()
        assert len(rep.problems) == 2


def test_salvage_copies_the_shared_blocks(tmp_path, chat):
    tokens, caches = chat
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        for turn in (1, 2, 3):
            store.put(MODEL, tokens[: turn * TURN], caches[turn - 1])
    report = salvage(tmp_path / "s", tmp_path / "copy")
    assert len(report.copied) == 3 and not report.skipped
    with PromptStore(tmp_path / "copy") as copy:
        assert copy.verify().ok
        assert block_bytes(copy) == kv_bytes(caches[2])
        for turn in (1, 2, 3):
            assert same_cache(copy.get(MODEL, tokens[: turn * TURN]), caches[turn - 1])


# -- SIGKILL during puts, deletes and evictions of entries that share blocks --------


def _conversation(conv: int):
    """Tokens and KV arrays of conversation ``conv`` (140 positions)."""
    import mlx.core as mx

    rng = np.random.default_rng([conv, 99])
    keys = mx.array(rng.standard_normal((1, 2, 140, 64)).astype(np.float32))
    values = mx.array(rng.standard_normal((1, 2, 140, 64)).astype(np.float16))
    return list(range(conv * 1000, conv * 1000 + 140)), keys, values


def _chain(seed: int, i: int):
    """An entry of conversation ``seed % 3``: a prefix of its tokens with its
    KV a prefix of its arrays, so entries of one conversation share blocks."""
    from mlx_lm.models.cache import KVCache

    tokens, keys, values = _conversation(seed % 3)
    n = 8 + (i * 37) % 130
    layer = KVCache()
    layer.keys, layer.values, layer.offset = keys[..., :n, :], values[..., :n, :], n
    return tokens[:n], [layer]


def _shared_child(path: str, seed: int, fd: int) -> None:
    import traceback

    try:
        store = PromptStore(path, map_size=1 << 22, shared_blocks=True, budget=250_000)
        for i in range(10_000):
            tokens, cache = _chain(seed + i, i)
            _say(fd, f"S {seed + i} {i}")
            store.put(MODEL, tokens, cache)
            _say(fd, f"D {seed + i} {i}")
            if i % 4 == 3:
                victim, _ = _chain(seed + i - 1, i - 1)
                store.delete(MODEL, victim)
    except BaseException:
        _say(fd, "E " + traceback.format_exc().replace("\n", " | "))
        os._exit(1)


def test_sigkill_during_shared_puts_deletes_and_evictions(tmp_path):
    """A writer process (a fresh interpreter) puts entries of three
    conversations that share blocks, deletes some, and evicts under a budget;
    it is killed with SIGKILL at a random moment, over and over. After every
    kill verify finds every reference count right and no orphan block, and
    every entry restores bit-exact."""
    path = str(tmp_path / "s")
    rng = random.Random(5)
    kills = 10 if os.environ.get("PROMPTSTORE_STRESS") != "1" else 60
    done = 0
    code = "import sys; sys.path.insert(0, sys.argv[1]); import test_shared_blocks as t; t._shared_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))"
    for k in range(kills):
        r, w = os.pipe()
        proc = subprocess.Popen([sys.executable, "-c", code, str(HERE), path, str(k * 1000), str(w)], pass_fds=(w,))
        os.close(w)
        seen = b""
        while b"D " not in seen:  # killed only once it has committed something
            chunk = os.read(r, 4096)
            if not chunk:
                break
            seen += chunk
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        lines = (seen.decode() + _drain(r)).splitlines()
        assert not [x for x in lines if x.startswith("E")], lines
        done += sum(1 for x in lines if x.startswith("D"))
        with PromptStore(path, shared_blocks=True) as store:
            rep = store.verify()
            assert rep.ok, rep  # every count right, no orphan block, nothing partial
            assert store.usage() <= 250_000
            for info in store.entries():
                toks = store.tokens(info.id)
                n = len(toks)
                _, keys, values = _conversation(toks[0] // 1000)
                (got,) = store.get(MODEL, toks)
                assert got.offset == n
                assert bits_equal(got.keys, keys[..., :n, :]).item() and bits_equal(got.values, values[..., :n, :]).item()
    assert done >= kills  # the writers got work done between the kills


def test_conversations_that_cannot_trim_share_a_short_system_prompt(tmp_path):
    """Entries that cannot be trimmed (here: a recurrent layer) serve only
    as exact prefixes, so a conversation that shares nothing but a system
    prompt shorter than a block with the stored ones finds no entry to cut
    like. It is cut at the longest prefix the index holds (whole 64-token
    nodes), so from the second such conversation on the prompt's blocks are
    shared; every entry still restores bit-exact."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    from _raw import referrers

    rng = np.random.default_rng(5)
    system = 300  # under one block (512 tokens): only the node bound at 256 is known
    sys_tokens = rng.integers(3, 30000, system).tolist()
    sys_kv = [rng.standard_normal((1, 2, system, 32)).astype(np.float16) for _ in range(2)]

    def conversation(i: int):
        own = np.random.default_rng(100 + i)
        n = 150
        tokens = sys_tokens + own.integers(3, 30000, n).tolist()
        kv = KVCache()
        kv.update_and_fetch(*(mx.array(np.concatenate([s, own.standard_normal((1, 2, n, 32)).astype(np.float16)], axis=2))
                              for s in sys_kv))
        state = ArraysCache(1)
        state[0] = mx.array(own.standard_normal((1, 4, 8)).astype(np.float32))
        return tokens, [kv, state]

    convs = [conversation(i) for i in range(3)]
    with PromptStore(tmp_path / "s") as store:
        for tokens, cache in convs:
            assert not store.put(MODEL, tokens, cache).trimmable
        with store.env.read() as txn:
            bounds = [store._manifest(txn, _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(t))).bounds
                      for t, _ in convs]
        assert bounds == [(450,), (256, 450), (256, 450)]
        shared = [who for who in referrers(store).values() if len(who) > 1]
        assert len(shared) == 2  # the prompt's first 256 tokens' keys and values, named by conversations 2 and 3
        for tokens, cache in convs:
            assert same_cache(store.get(MODEL, tokens), cache)
        assert store.verify().ok


@pytest.mark.parametrize("conv", [0, 4])
@pytest.mark.parametrize("delete_first", [True, False])
def test_a_put_of_the_same_content_rewrites_a_shared_block_a_read_found_damaged(tmp_path, conv, delete_first):
    """A damaged block two entries share stayed damaged for good: a put of an
    intact cache of the same tokens found the block referenced, wrote nothing,
    and its entry read as damaged again (a serving loop missed on that prefix
    forever). A read that finds a block damaged now remembers it, and the next
    put in the process that references it writes it again, for both entries."""
    from promptstore import CorruptEntry

    first, second = chat_entry(conv, 0), chat_entry(conv, 1)
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        a = store.put(MODEL, *first)
        b = store.put(MODEL, *second)
        key = shared_block(store, {a.id, b.id})
        flip_block(store, key)
        for tokens, _ in (first, second):
            with pytest.raises(CorruptEntry, match=key.hex()):
                store.get(MODEL, tokens)
        if delete_first:
            assert store.delete(MODEL, second[0])
        store.put(MODEL, *second)
        for tokens, cache in (first, second):
            assert same_cache(store.get(MODEL, tokens), cache)
        assert store.verify().ok and audit_blocks(store) and store.usage() == stored_bytes(store)


def test_a_block_kept_in_lmdb_is_rewritten_too(tmp_path):
    """The same for a block small enough to be an LMDB value rather than part of a pack file."""
    from promptstore import CorruptEntry

    first = chat_entry(0, 0)
    with PromptStore(tmp_path / "s", shared_blocks=True, block_tokens=16) as store:
        a = store.put(MODEL, first[0][:40], _cut(first[1], 40))
        b = store.put(MODEL, first[0][:70], _cut(first[1], 70))
        key = shared_block(store, {a.id, b.id})
        assert block_place(store, key) is None
        flip_block(store, key)
        with pytest.raises(CorruptEntry, match=key.hex()):
            store.get(MODEL, first[0][:70])
        store.put(MODEL, first[0][:70], _cut(first[1], 70))
        assert same_cache(store.get(MODEL, first[0][:40]), _cut(first[1], 40))
        assert store.verify().ok and audit_blocks(store) and store.usage() == stored_bytes(store)


def _cut(cache, n):
    """A copy of a one-KVCache cache cut to its first ``n`` positions."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    kv = KVCache()
    kv.update_and_fetch(mx.array(cache[0].keys[..., :n, :]), mx.array(cache[0].values[..., :n, :]))
    return [kv]


def test_a_lost_pack_file_is_mended_by_a_put_of_the_same_content(tmp_path):
    """A pack file lost (not unlinked by a commit) read as Vanished, which the damaged
    blocks' bookkeeping left out (a blob file vanishes in a race, a pack file was taken
    for the same): the put wrote nothing and both entries stayed unreadable."""
    from promptstore import CorruptEntry

    first, second = chat_entry(0, 0), chat_entry(0, 1)
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        a = store.put(MODEL, *first)
        b = store.put(MODEL, *second)
        key = shared_block(store, {a.id, b.id})
        block_place(store, key)[0].unlink()
        for tokens, _ in (first, second):
            with pytest.raises(CorruptEntry, match="is missing"):
                store.get(MODEL, tokens)
        assert not store.exists(MODEL, second[0])
        store.put(MODEL, *second)
        for tokens, cache in (first, second):
            assert same_cache(store.get(MODEL, tokens), cache)
        assert store.verify().ok and audit_blocks(store) and store.usage() == stored_bytes(store)


def test_a_block_found_damaged_on_an_old_snapshot_is_not_written_again_once_intact(tmp_path):
    """A read that failed on a snapshot older than the put that mended the block marks it
    again; the next put that references it checks the stored copy and writes nothing."""
    first, second = chat_entry(0, 0), chat_entry(0, 1)
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        a = store.put(MODEL, *first)
        b = store.put(MODEL, *second)
        key = shared_block(store, {a.id, b.id})
        store._reader.damaged.add(key)  # what such a stale read leaves
        before = block_place(store, key)
        store.put(MODEL, *second)
        assert block_place(store, key) == before and key not in store._reader.damaged
        assert store.verify().ok and audit_blocks(store) and store.usage() == stored_bytes(store)


def test_a_pack_file_missed_at_a_first_look_only_is_not_taken_for_damage(tmp_path):
    """A read whose snapshot names a pack file that a repack (or compact) has
    since unlinked meets Vanished, and looks again on a newer snapshot, which
    finds the blocks where they went. That first look marked them damaged,
    so exists() said False for the intact entry for the rest of the process
    (a concurrency reviewer's finding, with compact in another process; a
    serving writer then re-put it). Only a pack missed again at the second
    look is lost."""
    from promptstore.format import _blobs
    from promptstore.store import _keys

    first, second = chat_entry(0, 0), chat_entry(0, 1)
    with PromptStore(tmp_path / "s", shared_blocks=True) as store:
        a = store.put(MODEL, *first)
        b = store.put(MODEL, *second)
        key = shared_block(store, {a.id, b.id})
        path = block_place(store, key)[0]
        ekey = _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(second[0]))
        saved = path.read_bytes()
        path.unlink()  # as a repack leaves it for a snapshot taken before its commit
        with store.env.read(buffers=True) as txn:
            man = store._reader.manifest(txn, ekey)
            with pytest.raises(_blobs.Vanished):
                store._reader.restore(txn, ekey, man)
            assert not store._reader.damaged
            path.write_bytes(saved)  # the newer snapshot finds the blocks
        assert store.exists(MODEL, second[0]) and same_cache(store.get(MODEL, second[0]), second[1])
        path.unlink()
        with store.env.read(buffers=True) as txn:  # missed at the second look too: lost
            with pytest.raises(_blobs.Vanished):
                store._reader.restore(txn, ekey, man, lost={path.name})
        assert key in store._reader.damaged and not store.exists(MODEL, second[0])
