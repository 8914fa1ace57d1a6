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
from pathlib import Path

import pytest

from _workers import MODEL, make_entry, same_cache
from promptstore import InvalidInput, PromptStore, StoreFull
from promptstore.store import _budget, _env, _keys
from promptstore.format import _entry

HERE = Path(__file__).resolve().parent
STRESS = os.environ.get("PROMPTSTORE_STRESS") == "1"


def true_usage(store) -> int:
    """Bytes of every entry, from the manifests themselves (not the counter)."""
    total = 0
    with store.env.read() as txn:
        for k, raw in txn.cursor(db=store._db[b"entries"]):
            total += _entry.unpack_manifest(bytes(raw), "t").payload + len(raw)
    return total


def ids(store):
    return {e.id for e in store.entries()}


def test_random_workload_lru_and_pins(tmp_path):
    """Random puts/gets/pins under a budget, against a model of LRU eviction."""
    steps = 600 if STRESS else 150
    budget = 3_000_000
    rng = random.Random(4)
    store = PromptStore(tmp_path / "s", budget=budget)
    model = {}  # id -> (last use order, size, key tokens)
    pinned = set()
    clock = 0
    sizes_seen = []
    for step in range(steps):
        clock += 1
        op = rng.random()
        if op < 0.55 or not model:
            i = rng.randrange(400)
            tokens, cache = make_entry(21, i, big_every=0)
            if rng.random() < 0.1:  # a few big ones: ~1.2 MB
                tokens, cache = make_entry(22, i, big_every=1)
                cache[0].keys, cache[0].values = cache[0].keys[..., :1200, :], cache[0].values[..., :1200, :]
                cache[0].offset = 1200
                tokens = tokens[:1200]
            info = store.put(MODEL, tokens, cache)
            with store.env.read() as txn:
                size = _budget.size_of(txn, store._db, _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens)))
            sizes_seen.append(size)
            model[info.id] = (clock, size, tokens)
            # the model evicts LRU unpinned entries, never the new one
            total = sum(s for _, s, _ in model.values())
            for eid, (t, s, _) in sorted(model.items(), key=lambda kv: kv[1][0]):
                if total <= budget:
                    break
                if eid in pinned or eid == info.id:
                    continue
                del model[eid]
                total -= s
            assert ids(store) == set(model), f"step {step}: the store did not evict least-recently-used first"
            assert true_usage(store) == store.usage() == total
            assert store.usage() <= budget + size  # never over the budget plus the entry being written
        elif op < 0.85:
            eid = rng.choice(sorted(model))
            t, s, tokens = model[eid]
            assert store.get(MODEL, tokens) is not None
            model[eid] = (clock, s, tokens)
        elif op < 0.93 and len(pinned) < 3:
            eid = rng.choice(sorted(model))
            if sum(model[p][1] for p in pinned | {eid}) <= budget // 2:
                store.pin(eid)
                pinned.add(eid)
        elif pinned:
            eid = rng.choice(sorted(pinned))
            assert store.unpin(eid) is True
            pinned.discard(eid)
        assert pinned <= ids(store), "a pinned entry was evicted"
    assert set(store.pinned()) == pinned
    print(f"\nbudget: {steps} random ops, {len(ids(store))} entries left, usage {store.usage()} of {budget}, "
          f"file {store.file_size()} bytes")
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


def test_compact_shrinks_and_keeps_everything(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        items = [make_entry(41, i) for i in range(12)]  # two big (~4.5 MB) ones
        for t, c in items:
            store.put(MODEL, t, c)
        for t, _ in items[:10]:
            store.delete(MODEL, t)
        before = store.file_size()
        b, a = store.compact()
        assert b == before and a == store.file_size() < before / 2
        assert store.env.generation == "gen-1" and not (tmp_path / "s" / "data.mdb").exists()
        for t, c in items[10:]:
            assert same_cache(store.get(MODEL, t), c)
        assert store.verify().ok
        store.put(MODEL, *items[0])
    with PromptStore(tmp_path / "s") as store:
        assert len(ids(store)) == 3 and store.verify().ok


def test_compact_while_another_process_writes(tmp_path):
    """A peer process puts and reads while this one compacts twice; it moves
    to each new generation, loses nothing, and sees no error."""
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
        lines = report.read_text().split()
        done = [(int(a), int(b)) for a, b in zip(lines[::2], lines[1::2])]
        for seed, i in done:
            assert store.get(MODEL, make_entry(seed, i, big_every=0)[0]) is not None, (seed, i)
        for i in range(25, 30):
            assert same_cache(store.get(MODEL, make_entry(42, i)[0]), make_entry(42, i)[1])
    assert sorted(p.name for p in path.iterdir()) == ["CURRENT", "gen-2"]
    print(f"\ncompact: 2 compactions while a peer made {doc['puts']} puts across generations {doc['generations']}")


def test_map_full_is_store_full(tmp_path, monkeypatch):
    monkeypatch.setattr(_env, "MAX_MAP_SIZE", 1 << 21)
    with PromptStore(tmp_path / "s", map_size=1 << 20) as store:
        kept = []
        with pytest.raises(StoreFull, match="map") as exc:
            for i in range(100):
                t, c = make_entry(51, i, big_every=0)
                store.put(MODEL, t, c)
                kept.append((t, c))
        assert "promptstore gc" in str(exc.value) and str(tmp_path) in str(exc.value)
        assert kept and store.verify().ok
        for t, c in kept:
            assert same_cache(store.get(MODEL, t), c)


def test_file_size_limit_is_store_full(tmp_path):
    """RLIMIT_FSIZE (EFBIG) in a child: StoreFull with a hint; nothing committed lost."""
    path = tmp_path / "s"
    res = _run("fsize", path, 6_000_000)
    assert res["outcome"] == "error" and res["type"] == "StoreFull", res
    assert "ulimit" in res["message"] or "no room" in res["message"], res["message"]
    assert res["done"] and res["read_after"] is True
    _check_done(path, res["done"])


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="needs root to mount a small tmpfs")
def test_disk_full_is_store_full(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        res = _run("fsize", mnt / "s", 1 << 40)  # no file limit: the disk itself fills
        assert res["outcome"] == "error" and res["type"] == "StoreFull", res
        assert "disk" in res["message"] or "no room" in res["message"], res["message"]
        assert res["done"] and res["read_after"] is True
        _check_done(mnt / "s", res["done"])
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _run(*args):
    out = subprocess.run([sys.executable, str(HERE / "_workers.py"), *map(str, args)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_done(path, done):
    with PromptStore(path) as store:
        assert store.verify().ok
        for seed, i in done:
            t, c = make_entry(seed, i, big_every=3)
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
