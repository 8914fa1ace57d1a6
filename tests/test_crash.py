"""kill -9 during puts: nothing committed is lost, nothing partial is visible.

A zygote subprocess (tests/_workers.py) forks writer children and SIGKILLs
each at a random moment; a child reports ``D seed i`` on a pipe only after
``put`` returned. PROMPTSTORE_STRESS=1 multiplies the kills.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from _workers import MODEL, make_entry, same_cache
from promptstore import PromptStore
from promptstore.format import _entry
from promptstore.store import _keys

HERE = Path(__file__).resolve().parent
STRESS = os.environ.get("PROMPTSTORE_STRESS") == "1"


def run_worker(*args, timeout=600, blob_min=None) -> dict:
    """Run a _workers.py mode; ``blob_min``: payloads from this size on go to blob files."""
    env = dict(os.environ)
    if blob_min is not None:
        env["PROMPTSTORE_TEST_BLOB_MIN"] = str(blob_min)
    out = subprocess.run(
        [sys.executable, str(HERE / "_workers.py"), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, check=False, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_after_crashes(path: Path, done) -> PromptStore:
    store = PromptStore(path)
    rep = store.verify()
    assert rep.ok, rep  # no damaged entry, no orphan chunk of a half-written entry
    for seed, i in done:
        tokens, cache = make_entry(seed, i)
        got = store.get(MODEL, tokens)
        assert got is not None, f"put ({seed}, {i}) returned before the kill but is gone"
        assert same_cache(got, cache), f"put ({seed}, {i}) is not bit-exact"
    # every listed entry is whole: it loads and covers its tokens
    for info in store.entries():
        cache, _, tokens = store.load(info.id)
        assert cache[0].offset == len(tokens) == info.n_tokens
    return store


def test_sigkill_during_puts(tmp_path):
    kills = 300 if STRESS else 50
    res = run_worker("crash", tmp_path / "store", kills, 1, "none")
    assert res["errors"] == []
    assert res["kills"] == kills
    assert res["inflight_at_kill"] >= kills // 5, res["inflight_at_kill"]  # most kills land inside a put
    assert len(res["done"]) > kills  # the children did commit work between kills
    store = check_after_crashes(tmp_path / "store", res["done"])
    print(f"\ncrash: {kills} SIGKILLs, {res['inflight_at_kill']} inside a put, {len(res['done'])} puts returned, "
          f"{len(list(store.entries()))} entries after")
    store.close()


def test_sigkill_during_puts_with_eviction(tmp_path):
    """Kills land inside puts that evict: the size accounting stays exact."""
    kills = 60 if STRESS else 12
    budget = 12_000_000
    path = tmp_path / "store"
    PromptStore(path, budget=budget).close()
    res = run_worker("crash", path, kills, 2, budget)
    assert res["errors"] == []
    with PromptStore(path) as store:
        assert store.verify().ok
        assert store.budget == budget
        sizes, biggest = 0, 0
        with store.env.read() as txn:
            for k, raw in txn.cursor(db=store._db[b"entries"]):
                man = _entry.unpack_manifest(bytes(raw), _keys.entry_id(bytes(k)))
                sizes += man.payload + len(raw)
                biggest = max(biggest, man.payload + len(raw))
        assert store.usage() == sizes  # the running total matches the entries
        assert sizes <= budget  # every put evicts down to the budget before it commits
        # a put that returned is there unless a later put evicted it
        for seed, i in res["done"][-1:]:
            assert store.get(MODEL, make_entry(seed, i)[0]) is not None
