"""Byte budget: remembered by the store, LRU eviction by last use, pins, gc,
compact, map full and disk full.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from _raw import audit_blocks, damage_manifest, ekey_of, stored_bytes
from _content import MODEL, chat_entry, entry_of, make_entry, same_cache
from promptstore import InvalidInput, PromptStore, StoreFull
from promptstore.store import _env
from promptstore.format import _entry

HERE = Path(__file__).resolve().parent
STRESS = os.environ.get("PROMPTSTORE_STRESS") == "1"


def true_usage(store) -> int:
    """Bytes of every entry's payload and manifest and of every stored block,
    once however many entries share it: from the records themselves (not the counter)."""
    return stored_bytes(store)


def ids(store):
    return {e.id for e in store.entries()}


def footprint(store, eid: str):
    """An entry's own bytes (payload and manifest) and its blocks: ``{address: bytes}``."""
    ekey = ekey_of(store, eid)
    with store.env.read() as txn:
        raw = bytes(txn.get(ekey, db=store._db[b"entries"]))
    man = _entry.unpack_manifest(raw, eid)
    return man.payload + len(raw), dict(man.blocks())


def _halved(tokens, cache):
    """The first half of an entry: a prefix of its tokens and KV (its other layers as they are)."""
    from mlx_lm.models.cache import KVCache

    n = len(tokens) // 2
    kv = KVCache()
    kv.keys, kv.values, kv.offset = cache[0].keys[..., :n, :], cache[0].values[..., :n, :], n
    return tokens[:n], [kv] + cache[1:]


def _total(entries) -> int:
    """What a set of entries stores: each one's own bytes, and every block once."""
    blocks = {}
    for _, own, _, refs in entries:
        blocks.update(refs)
    return sum(own for _, own, _, _ in entries) + sum(blocks.values())


def test_random_workload_lru_and_pins(tmp_path):
    """Random puts/gets/pins under a budget, against a model of LRU eviction.
    Some puts store the first half of an entry, so the whole entry put later
    shares its blocks: evicting one of the two then frees only its own bytes."""
    steps = 600 if STRESS else 150
    budget = 3_000_000
    rng = random.Random(4)
    store = PromptStore(tmp_path / "s", budget=budget)
    model = {}  # id -> (last use order, own size, key tokens, {block: size})
    pinned = set()
    clock = 0
    shared = 0  # puts that share blocks with a stored entry
    halves = []  # (i, big) of entries whose first half was put
    evicted = 0
    for step in range(steps):
        clock += 1
        op = rng.random()
        if op < 0.55 or not model:
            if halves and rng.random() < 0.4:  # the whole of an entry whose first half was put
                i, big = halves.pop(rng.randrange(len(halves)))
                half = False
            else:
                i, big, half = rng.randrange(400), rng.random() < 0.1, rng.random() < 0.3
            tokens, cache = make_entry(21, i, big_every=0)
            if big:  # a few big ones: ~1.2 MB
                tokens, cache = make_entry(22, i, big_every=1)
                cache[0].keys, cache[0].values = cache[0].keys[..., :1200, :], cache[0].values[..., :1200, :]
                cache[0].offset = 1200
                tokens = tokens[:1200]
            if half:
                tokens, cache = _halved(tokens, cache)
                halves.append((i, big))
            info = store.put(MODEL, tokens, cache)
            own, refs = footprint(store, info.id)
            assert sum(refs.values()) == info.shared  # its KV, in blocks
            shared += any(refs.keys() & other for eid, (_, _, _, other) in model.items() if eid != info.id)
            model[info.id] = (clock, own, tokens, refs)
            # the model evicts LRU unpinned entries, never the new one, until what stays fits;
            # then keeps back every victim, the most recently used first, that still fits
            victims = {}
            for eid, _ in sorted(model.items(), key=lambda kv: kv[1][0]):
                if _total(model.values()) <= budget:
                    break
                if eid in pinned or eid == info.id:
                    continue
                victims[eid] = model.pop(eid)
            if _total(model.values()) <= budget:
                for eid in reversed(list(victims)):
                    if _total([*model.values(), victims[eid]]) <= budget:
                        model[eid] = victims.pop(eid)
            evicted += len(victims)
            assert ids(store) == set(model), f"step {step}: the store did not evict least-recently-used first"
            assert true_usage(store) == store.usage() == _total(model.values())
            assert store.usage() <= budget + own + sum(refs.values())  # never over the budget plus the entry being written
        elif op < 0.85:
            eid = rng.choice(sorted(model))
            t, own, tokens, refs = model[eid]
            assert store.get(MODEL, tokens) is not None
            model[eid] = (clock, own, tokens, refs)
        elif op < 0.93 and len(pinned) < 3:
            eid = rng.choice(sorted(model))
            if _total([model[p] for p in pinned | {eid}]) <= budget // 2:
                store.pin(eid)
                pinned.add(eid)
        elif pinned:
            eid = rng.choice(sorted(pinned))
            assert store.unpin(eid) is True
            pinned.discard(eid)
        assert pinned <= ids(store), "a pinned entry was evicted"
    assert set(store.pinned()) == pinned
    assert shared >= 3 and evicted >= 10, (shared, evicted)  # it shared blocks, and evicted
    audit_blocks(store)
    print(f"\nbudget: {steps} random ops, {shared} puts sharing blocks, {evicted} evicted, {len(ids(store))} entries left, "
          f"usage {store.usage()} of {budget}, file {store.file_size()} bytes")
    # LMDB reuses freed pages: the file stays within a small multiple of the budget
    assert store.file_size() < 4 * budget + (4 << 20)
    store.close()
    with PromptStore(tmp_path / "s") as again:  # remembered by the store
        assert again.budget == budget
        assert set(again.pinned()) == pinned


def test_budget_refusals_and_gc(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        with pytest.raises(InvalidInput):
            store.set_budget(-1)
        items = [make_entry(31, i, big_every=0) for i in range(12)]
        infos = [store.put(MODEL, t, c) for t, c in items]
        assert store.budget is None and store.gc().evicted == ()
        total = store.usage()
        assert total == true_usage(store)
        store.pin(infos[0].id)
        plan = store.gc(budget=total // 2, dry_run=True)
        assert plan.dry_run and plan.evicted and len(ids(store)) == 12  # a plan changes nothing
        assert infos[0].id not in plan.evicted
        assert plan.evicted[0] == infos[1].id  # least recently used first (0 is pinned)
        done = store.gc(budget=total // 2)
        assert done.evicted == plan.evicted and store.usage() == done.usage <= total // 2
        assert store.budget is None  # gc(budget=) does not change the stored budget
        assert infos[0].id in ids(store)
        # an entry larger than the whole budget is refused, nothing written
        store.set_budget(store.usage())
        big_t, big_c = make_entry(32, 5, big_every=1)
        with pytest.raises(StoreFull, match="budget"):
            store.put(MODEL, big_t, big_c)
        assert store.get(MODEL, big_t) is None
        # pinned bytes above the budget are refused
        with pytest.raises(StoreFull, match="pinned"):
            store.set_budget(1)
        store.set_budget(None)
        assert store.budget is None
        # deleting a pinned entry drops its pin
        store.remove(infos[0].id)
        assert store.pinned() == []


@pytest.mark.parametrize("shared_blocks", [False, True], ids=["payload", "shared-blocks"])
def test_a_budget_below_the_pinned_bytes_is_refused(tmp_path, shared_blocks):
    """A pinned entry is never evicted: a budget below what it stores (its
    KV included, wherever it is kept) could never be met, so it is refused."""
    with PromptStore(tmp_path / "s", shared_blocks=shared_blocks) as store:
        tokens, cache = make_entry(34, 0, big_every=1)  # 4400 tokens, ~3.4 MB of KV
        info = store.put(MODEL, tokens, cache)
        store.pin(info.id)
        assert store.usage() == true_usage(store) > info.nbytes
        with pytest.raises(StoreFull, match="pinned"):
            store.set_budget(store.usage() // 2)
        assert store.budget is None and store.usage() == true_usage(store)


def test_compact_shrinks_and_keeps_everything(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        items = [make_entry(41, i) for i in range(12)]  # two big (~4.5 MB) ones
        for t, c in items:
            store.put(MODEL, t, c)
        for t, _ in items[:10]:
            store.delete(MODEL, t)
        before, data_before = store.file_size(), (store.env.dir / "data.mdb").stat().st_size
        b, a = store.compact()
        assert b == before and a == store.file_size() < before
        assert (store.env.dir / "data.mdb").stat().st_size < data_before / 2  # packs of deleted entries went at delete
        assert store.env.generation == "gen-1" and not (tmp_path / "s" / "data.mdb").exists()
        for t, c in items[10:]:
            assert same_cache(store.get(MODEL, t), c)
        assert store.verify().ok
        store.put(MODEL, *items[0])
    with PromptStore(tmp_path / "s") as store:
        assert len(ids(store)) == 3 and store.verify().ok


def test_compact_while_another_process_writes(tmp_path):
    """A peer process puts (the turns of chats, sharing blocks) and reads while
    this one compacts twice; it moves to each new generation, loses nothing,
    and sees no error."""
    path, report = tmp_path / "s", tmp_path / "peer.txt"
    with PromptStore(path) as store:
        for i in range(30):
            store.put(MODEL, *make_entry(42, i))
        for i in range(25):
            store.delete(MODEL, make_entry(42, i)[0])
    seconds = 12 if STRESS else 3
    proc = subprocess.Popen([sys.executable, str(HERE / "_workers.py"), "compact_peer", str(path), str(seconds), str(report)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline())["ready"]
    import time

    with PromptStore(path) as store:
        sizes = []
        for _ in range(2):
            time.sleep(seconds / 3)
            sizes.append(store.compact())
    out, err = proc.communicate(timeout=120)
    doc = json.loads(out.strip().splitlines()[-1])
    assert proc.returncode == 0 and doc["status"] == 0 and "error" not in doc, err[-2000:] + out[-2000:]
    assert doc["puts"] > 10 and len(doc["generations"]) >= 2, doc
    with PromptStore(path) as store:
        assert store.verify().ok
        audit_blocks(store)  # the peer's chats share blocks: every count survived both copies
        lines = report.read_text().split()
        done = [(int(a), int(b)) for a, b in zip(lines[::2], lines[1::2])]
        for conv, turn in done:
            assert store.get(MODEL, chat_entry(conv, turn)[0]) is not None, (conv, turn)
        for i in range(25, 30):
            assert same_cache(store.get(MODEL, make_entry(42, i)[0]), make_entry(42, i)[1])
    assert sorted(p.name for p in path.iterdir() if p.name not in ("packs", "STORE_ID")) == ["CURRENT", "gen-2"]
    print(f"\ncompact: 2 compactions while a peer made {doc['puts']} puts across generations {doc['generations']}")


def test_map_full_is_store_full(tmp_path, monkeypatch):
    monkeypatch.setattr(_env, "MAX_MAP_SIZE", 1 << 21)
    with PromptStore(tmp_path / "s", map_size=1 << 20) as store:
        kept = []
        with pytest.raises(StoreFull, match="map") as exc:
            for i in range(100):  # the turns of chats: each shares blocks with the turns before
                t, c = chat_entry(5100 + i // 4, i % 4)
                store.put(MODEL, t, c)
                kept.append((t, c))
        assert "promptstore gc" in str(exc.value) and str(tmp_path) in str(exc.value)
        assert kept and store.verify().ok and audit_blocks(store)
        for t, c in kept:
            assert same_cache(store.get(MODEL, t), c)


def test_file_size_limit_is_store_full(tmp_path):
    """RLIMIT_FSIZE (EFBIG) in a child: StoreFull with a hint; nothing committed lost."""
    path = tmp_path / "s"
    res = _run("fsize", path, 6_000_000, "chats")
    assert res["outcome"] == "error" and res["type"] == "StoreFull", res
    assert "ulimit" in res["message"] or "no room" in res["message"], res["message"]
    assert res["done"] and res["read_after"] is True
    _check_done(path, res["done"], "chats")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="needs root to mount a small tmpfs")
def test_disk_full_is_store_full(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        res = _run("fsize", mnt / "s", 1 << 40, "chats")  # no file limit: the disk itself fills
        assert res["outcome"] == "error" and res["type"] == "StoreFull", res
        assert "disk" in res["message"] or "no room" in res["message"], res["message"]
        assert res["done"] and res["read_after"] is True
        _check_done(mnt / "s", res["done"], "chats")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _run(*args):
    out = subprocess.run([sys.executable, str(HERE / "_workers.py"), *map(str, args)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_done(path, done, content="entries"):
    with PromptStore(path) as store:
        assert store.verify().ok
        audit_blocks(store)  # the failed put left no count or block behind
        for a, b in done:
            t, c = entry_of(content, a, b, big_every=3)
            assert same_cache(store.get(MODEL, t), c)


# -- scan, plan, execute: the plan shown is the plan executed -----------------------


def test_gc_executes_the_plan_it_showed_not_a_new_one(tmp_path):
    """A dry run plans to evict the least recently used entry; then that entry
    is used and another one is added. gc(plan=...) evicts exactly the planned
    entry, and nothing else, though a fresh plan would now pick others."""
    with PromptStore(tmp_path / "s") as store:
        puts = [make_entry(31, i, big_every=0) for i in range(4)]
        infos = [store.put(MODEL, t, c) for t, c in puts]
        budget = store.usage() - infos[0].nbytes // 2  # one eviction is enough
        plan = store.gc(budget=budget, dry_run=True)
        assert plan.dry_run and plan.evicted == (infos[0].id,)
        store.get(MODEL, puts[0][0])  # now the most recently used: a new plan would spare it
        store.flush()
        t5, c5 = make_entry(31, 9, big_every=0)
        store.put(MODEL, t5, c5)
        assert store.gc(budget=budget, dry_run=True).evicted != plan.evicted
        done = store.gc(plan=plan)
        assert done.evicted == plan.evicted and not done.dry_run
        assert infos[0].id not in ids(store) and {i.id for i in infos[1:]} <= ids(store)
        assert true_usage(store) == store.usage()


def test_gc_plan_spares_what_was_pinned_or_deleted_since(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        infos = [store.put(MODEL, *make_entry(32, i, big_every=0)) for i in range(3)]
        plan = store.gc(budget=0, dry_run=True)
        assert set(plan.evicted) == {i.id for i in infos}
        store.pin(infos[1].id)
        store.remove(infos[2].id)
        done = store.set_budget(None, plan=plan)
        assert done.evicted == (infos[0].id,)
        assert ids(store) == {infos[1].id}


def test_gc_plan_spares_an_entry_put_again_since(tmp_path):
    """The plan names entries by id, and a put of the same tokens gets the
    same id: an entry evicted (or deleted) after the plan and put again is not
    the planned one. `gc --budget` evicted it so, silently, in its second
    call (a concurrency reviewer's finding, with a put from another process)."""
    with PromptStore(tmp_path / "s") as store:
        puts = [make_entry(34, i, big_every=0) for i in range(4)]
        infos = [store.put(MODEL, t, c) for t, c in puts]
        budget = store.usage() - infos[0].nbytes // 2
        plan = store.gc(budget=budget, dry_run=True)
        assert plan.evicted == (infos[0].id,) and len(plan.created) == 1
        assert store.set_budget(budget, plan=plan).evicted == (infos[0].id,)
        again = store.put(MODEL, *puts[0])  # meanwhile, as by another process
        assert again.id == infos[0].id
        assert store.gc(plan=plan).evicted == ()  # the CLI's second call
        assert same_cache(store.get(MODEL, puts[0][0]), puts[0][1])


def test_remove_planned_leaves_an_entry_replaced_since_the_plan(tmp_path):
    """rm's plan names entries as they were; one replaced by a newer put (same
    tokens, so same id) after the plan is reported, not deleted."""
    with PromptStore(tmp_path / "s") as store:
        (t0, c0), (t1, c1) = make_entry(33, 0, big_every=0), make_entry(33, 1, big_every=0)
        store.put(MODEL, t0, c0)
        store.put(MODEL, t1, c1)
        plan = list(store.entries())
        time.sleep(0.01)
        replaced = store.put(MODEL, t0, c0)
        removed, vanished = store.remove_planned(plan)
        assert vanished == [replaced.id]
        assert [i.id for i in removed] == [e.id for e in plan if e.id != replaced.id]
        assert ids(store) == {replaced.id}
        assert same_cache(store.get(MODEL, t0), c0)


@pytest.mark.parametrize("plan_evicts", ["all", "oldest turns"])
def test_an_executed_plan_reports_the_shared_blocks_it_freed(tmp_path, plan_evicts):
    """The turns of one chat share blocks; an executed plan (``gc(plan=...)``
    and ``set_budget(..., plan=...)``) reports as freed what the dry run
    planned and what usage really lost: a shared block counts when its last
    referrer goes, and only then."""
    with PromptStore(tmp_path / "s") as store:
        for turn in range(4):
            store.put(MODEL, *chat_entry(7, turn))
        before = store.usage()
        budget = 0 if plan_evicts == "all" else before - 1  # "oldest turns": the later ones keep the shared blocks
        plan = store.gc(budget=budget, dry_run=True)
        assert plan.evicted and plan.freed == before - plan.usage
        half = len(plan.evicted) // 2 or 1  # the plan's first victims by gc, the rest by set_budget
        first = store.gc(plan=replace(plan, evicted=plan.evicted[:half]))
        middle = store.usage()
        assert first.freed == before - middle
        rest = store.set_budget(None, plan=replace(plan, evicted=plan.evicted[half:]))
        assert rest.freed == middle - store.usage()
        assert first.freed + rest.freed == plan.freed and store.usage() == plan.usage == true_usage(store)


def _kv(n: int, seed: int, layers: int, heads: int, dim: int):
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    out = []
    for i in range(layers):
        rng = np.random.default_rng([seed, i])
        kv = KVCache()
        kv.update_and_fetch(*(mx.array(rng.standard_normal((1, heads, n, dim)).astype(np.float16)) for _ in "kv"))
        out.append(kv)
    return out


@pytest.mark.parametrize("shared_blocks", [False, True], ids=["payload", "shared-blocks"])
def test_a_put_over_a_pinned_entry_cannot_take_pins_past_the_budget(tmp_path, shared_blocks):
    """A put that replaces a pinned entry keeps the pin; when the new bytes
    would make the pinned entries take more than the budget it is refused
    (StoreFull) and the pinned entry stays as it was, as pin() refuses."""
    with PromptStore(tmp_path / "s", shared_blocks=shared_blocks) as store:
        other = store.put(MODEL, list(range(200, 300)), _kv(100, 0, layers=4, heads=4, dim=64))  # 410 KB
        tokens = list(range(3, 103))
        info = store.put(MODEL, tokens, _kv(100, 1, layers=4, heads=2, dim=64))  # 205 KB
        store.pin(other.id)
        store.pin(info.id)
        store.set_budget(1_500_000)
        grown = _kv(100, 2, layers=4, heads=8, dim=64)  # 819 KB: both pins still fit
        assert store.put(MODEL, tokens, grown).id == info.id and set(store.pinned()) == {info.id, other.id}
        assert store.usage() <= 1_500_000
        bigger = _kv(100, 3, layers=4, heads=12, dim=64)  # 1.23 MB: fits alone, not beside the other pin
        with pytest.raises(StoreFull, match="pinned entries would then take"):
            store.put(MODEL, tokens, bigger)
        assert same_cache(store.get(MODEL, tokens), grown) and set(store.pinned()) == {info.id, other.id}
        assert store.usage() == true_usage(store) <= 1_500_000
        report = store.verify()
        assert report.ok, report
        if shared_blocks:
            audit_blocks(store)


def test_file_size_follows_a_compaction_by_another_process(tmp_path):
    """``file_size`` reads the live generation's data file, not the one this
    process last used: another process's ``compact`` moved it (it raised
    FileNotFoundError)."""
    with PromptStore(tmp_path / "s") as store:
        tokens, cache = make_entry(43, 5, big_every=1)
        store.put(MODEL, tokens, cache)
        store.file_size()
        exe = Path(sys.executable).parent / "promptstore"
        proc = subprocess.run([str(exe), "--store", str(tmp_path / "s"), "compact"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "s" / "gen-1" / "data.mdb").exists() and not (tmp_path / "s" / "data.mdb").exists()
        live = (tmp_path / "s" / "gen-1" / "data.mdb").stat().st_size
        assert store.file_size() == live + sum(p.stat().st_size for p in (tmp_path / "s").rglob("*") if p.suffix in (".pack", ".blob"))
        assert same_cache(store.get(MODEL, tokens), cache)


@pytest.mark.parametrize("damage", ["usage", "size", "stray size"])
def test_verify_finds_and_fix_recounts_wrong_byte_counts(tmp_path, damage):
    """The usage counter and the entries' size records are checked by
    verify against what is stored, and --fix recounts them; gc recounts a
    size record from the manifest (it trusted a wrong one: usage 17x too high
    after a gc, so the budget would have evicted for nothing). Reviewer's finding."""
    from promptstore.store._schema import U64, USAGE_KEY

    with PromptStore(tmp_path / "s", block_tokens=64) as store:
        for turn in (1, 2):
            store.put(MODEL, *chat_entry(0, turn))
        true = store.usage()
        assert true == true_usage(store) and store.verify().ok
        first = min(store.entries(), key=lambda e: e.n_tokens)
        ekey = ekey_of(store, first.id)
        if damage == "usage":
            store.env.write(lambda txn: txn.put(USAGE_KEY, U64.pack(true * 10), db=store._db.info))
        elif damage == "size":
            store.env.write(lambda txn: txn.put(ekey, U64.pack(5_000_000), db=store._db.sizes))
        else:
            store.env.write(lambda txn: txn.put(b"\x01" * len(ekey), U64.pack(7), db=store._db.sizes))
        report = store.verify()
        assert not report.ok and report.bad_accounting == 1 and not report.problems
        fixed = store.verify(fix=True)
        assert fixed.bad_accounting == 1 and store.verify().ok
        assert store.usage() == true == true_usage(store)
        store.gc()
        assert store.usage() == true and len(ids(store)) == 2
        if damage == "size":  # gc alone recounts it too
            store.env.write(lambda txn: txn.put(ekey, U64.pack(5_000_000), db=store._db.sizes))
            store.gc()
            assert store.usage() == true and store.verify().ok


def test_eviction_keeps_back_prefix_entries_it_turned_out_not_to_need(tmp_path):
    """A conversation's entries of 600, 1200 and 1800 tokens share their
    blocks, so evicting the older two first frees their manifests only; the
    1800-token entry then frees everything. The put that needed room evicted
    all three where evicting the longest alone fits (and set_budget emptied a
    store that one eviction brings under it)."""
    from promptstore.bench import _data as data
    import numpy as np

    def conversation(store, seed, turns, per):
        grower, rng = data.Grower(data.DENSE, seed), np.random.default_rng(seed)
        cache, toks, out = grower.empty(), [], []
        for _ in range(turns):
            grower.extend(cache, per)
            toks += data.token_ids(rng, per)
            out.append(store.put(MODEL, list(toks), cache))
        return out

    with PromptStore(tmp_path / "s", budget=2_500_000) as s:
        a = conversation(s, 1, 3, 600)
        (b,) = conversation(s, 2, 1, 600)
        (c,) = conversation(s, 3, 1, 100)
        assert ids(s) == {a[0].id, a[1].id, b.id, c.id}  # the longest alone went
        assert s.usage() == true_usage(s) <= 2_500_000
        audit_blocks(s)
    with PromptStore(tmp_path / "t") as s:
        a = conversation(s, 1, 3, 600)
        plan = s.gc(budget=1_300_000, dry_run=True)
        assert plan.evicted == (a[2].id,) and plan.usage == s.usage() - plan.freed
        report = s.set_budget(1_300_000)
        assert report.evicted == (a[2].id,) and report.freed == plan.freed
        assert ids(s) == {a[0].id, a[1].id} and s.usage() == true_usage(s) <= 1_300_000
        audit_blocks(s)


def test_gc_frees_the_blocks_of_an_evicted_entry_whose_manifest_was_damaged(tmp_path):
    """Such an entry cannot release its blocks as it goes: gc evicted it and
    left its blocks counted, in usage and against the budget, until a
    `verify --fix`; gc now recounts them once it has evicted."""
    from promptstore.bench import _data as data
    from promptstore.store import _keys
    import numpy as np

    with PromptStore(tmp_path / "s") as s:
        grower, rng = data.Grower(data.DENSE, 5), np.random.default_rng(5)
        cache, toks = grower.empty(), []
        for _ in range(2):
            grower.extend(cache, 600)
            toks += data.token_ids(rng, 600)
            s.put(MODEL, list(toks), cache)
        damage_manifest(s, _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(toks)))
        report = s.gc(budget=1000)
        assert len(report.evicted) == 2 and report.usage == s.usage() == true_usage(s) == 0
        assert s.verify().ok


def test_cli_verify_with_only_wrong_counts_says_nothing_is_damaged(tmp_path):
    # It ended with "0 damaged of 2 checked; run `promptstore verify --fix` to remove them".
    from click.testing import CliRunner

    from promptstore.cli import main
    from promptstore.store._schema import U64, USAGE_KEY

    with PromptStore(tmp_path / "s") as store:
        for turn in (1, 2):
            store.put(MODEL, *chat_entry(0, turn))
        store.env.write(lambda txn: txn.put(USAGE_KEY, U64.pack(7), db=store._db.info))
    res = CliRunner().invoke(main, ["--store", str(tmp_path / "s"), "verify"])
    assert res.exit_code == 1
    assert "2 entries checked, none damaged; `promptstore verify --fix` repairs what is listed above" in res.stderr
    assert "remove" not in res.stderr


def test_cli_rm_of_a_damaged_entry_points_at_verify_fix(tmp_path):
    from click.testing import CliRunner

    from promptstore.cli import main

    with PromptStore(tmp_path / "s") as store:
        info = store.put(MODEL, *chat_entry(0, 1))
        damage_manifest(store, ekey_of(store, info.id))
    res = CliRunner().invoke(main, ["--store", str(tmp_path / "s"), "rm", info.id, "--yes"])
    assert res.exit_code == 1 and "`promptstore verify --fix` removes damaged entries" in res.stderr
