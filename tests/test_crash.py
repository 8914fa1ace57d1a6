"""kill -9 during puts: nothing committed is lost, nothing partial is visible.

A zygote subprocess (tests/_workers.py) forks writer children and SIGKILLs
each at a random moment; a child reports ``D a b`` on a pipe only after
``put`` returned. On the default layout the children put the turns of chats
that share blocks (each child extends and replaces the entries of the one
before), so kills land between a block's write and its count, a replaced
entry's release and its new references. PROMPTSTORE_STRESS=1 multiplies the kills.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


import pytest

from _raw import audit_blocks, audit_packs, referrers, stored_bytes
from _content import MODEL, entry_of, same_cache
from promptstore import PromptStore

HERE = Path(__file__).resolve().parent
STRESS = os.environ.get("PROMPTSTORE_STRESS") == "1"


def run_worker(*args, timeout=600, blob_min=None, shared_blocks=None, maint=False) -> dict:
    """Run a _workers.py mode; ``blob_min``: payloads from this size on go to
    blob files; ``shared_blocks``: the layout its stores write (None: the default)."""
    env = dict(os.environ)
    if blob_min is not None:
        env["PROMPTSTORE_TEST_BLOB_MIN"] = str(blob_min)
    if shared_blocks is not None:
        env["PROMPTSTORE_SHARED_BLOCKS"] = "1" if shared_blocks else "0"
    if maint:
        env["PROMPTSTORE_TEST_MAINT"] = "1"  # deletes, gc (pack rewrites) and compaction between the puts
    out = subprocess.run(
        [sys.executable, str(HERE / "_workers.py"), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, check=False, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_after_crashes(path: Path, done, content: str = "entries") -> PromptStore:
    store = PromptStore(path)
    rep = store.verify()
    assert rep.ok, rep  # no damaged entry, no orphan chunk, no wrong block count, no orphan block
    audit_blocks(store)  # the same, counted here: every named block stored, every count exact
    for a, b in done:
        tokens, cache = entry_of(content, a, b)
        got = store.get(MODEL, tokens)
        assert got is not None, f"put ({a}, {b}) returned before the kill but is gone"
        assert same_cache(got, cache), f"put ({a}, {b}) is not bit-exact"
    # every listed entry is whole: it loads and covers its tokens
    for info in store.entries():
        cache, _, tokens = store.load(info.id)
        assert cache[0].offset == len(tokens) == info.n_tokens
    return store


@pytest.mark.parametrize(
    "content, shared_blocks, kills",
    [("chats", True, 300 if STRESS else 50), ("entries", False, 300 if STRESS else 20)],
    ids=["shared-blocks", "payload"],
)
def test_sigkill_during_puts(tmp_path, content, shared_blocks, kills):
    res = run_worker("crash", tmp_path / "store", kills, 1, content, shared_blocks=shared_blocks)
    assert res["errors"] == []
    assert res["kills"] == kills
    assert res["inflight_at_kill"] >= kills // 5, res["inflight_at_kill"]  # most kills land inside a put
    assert len(res["done"]) >= kills // 2  # the children did commit work between kills (every other one waits for it)
    store = check_after_crashes(tmp_path / "store", res["done"], content)
    shared = sum(1 for who in referrers(store).values() if len(who) > 1)
    if shared_blocks:
        assert shared > 2, shared  # entries of a chat share blocks, every chat the system prompt's
    else:
        assert not referrers(store)  # format 1: no entry names a block
    print(f"\ncrash: {kills} SIGKILLs, {res['inflight_at_kill']} inside a put, {len(res['done'])} puts returned, "
          f"{len(list(store.entries()))} entries after, {shared} blocks shared")
    store.close()


def test_sigkill_with_workers_that_import_after_their_fork(tmp_path, monkeypatch):
    """The workers' cold start (``PROMPTSTORE_TEST_FORK=cold``), which mlx's
    CUDA backend needs (tests/_workers.py): the zygote imports neither mlx nor
    promptstore, each worker does after its fork, and the kill timer starts
    once the worker is warm, so kills still land inside puts."""
    monkeypatch.setenv("PROMPTSTORE_TEST_FORK", "cold")
    kills = 8
    res = run_worker("crash", tmp_path / "store", kills, 3, "chats", shared_blocks=True)
    assert res["errors"] == [] and res["kills"] == kills
    assert res["inflight_at_kill"] >= kills // 5, res["inflight_at_kill"]
    assert len(res["done"]) > kills
    check_after_crashes(tmp_path / "store", res["done"], "chats").close()


def test_sigkill_during_deletes_pack_rewrites_and_compaction(tmp_path):
    """Kills land in puts, deletes, gc's pack rewrites and compactions: no
    entry points at a missing block, every count is exact, nothing that was
    committed and not deleted is lost."""
    kills = 150 if STRESS else 30
    res = run_worker("crash", tmp_path / "store", kills, 3, "chats", maint=True)
    assert res["errors"] == []
    assert len(res["done"]) > kills // 2
    store = check_after_crashes(tmp_path / "store", res["done"], "chats")
    packs = audit_packs(store)
    store.gc()  # strays of killed puts and rewrites go
    after = store.verify()
    assert after.ok and after.orphan_blobs == 0 and after.orphan_packs == 0
    audit_blocks(store), audit_packs(store)
    print(f"\ncrash (maintenance): {kills} SIGKILLs, {res['inflight_at_kill']} inside a put, "
          f"{len(res['done'])} puts kept, {packs} packs")
    store.close()


def test_sigkill_during_puts_with_eviction(tmp_path):
    """Kills land inside puts that evict entries whose blocks other entries
    share: the size accounting stays exact, each block counted once."""
    kills = 60 if STRESS else 12
    budget = 5_000_000  # above the largest entry (~4.3 MB), below two long chats
    path = tmp_path / "store"
    PromptStore(path, budget=budget).close()
    res = run_worker("crash", path, kills, 2, "chats")
    assert res["errors"] == []
    with PromptStore(path) as store:
        assert store.verify().ok
        audit_blocks(store)
        assert store.budget == budget
        sizes = stored_bytes(store)
        assert store.usage() == sizes  # the running total matches the entries and blocks
        assert sizes <= budget  # every put evicts down to the budget before it commits
        assert len(list(store.entries())) < len({tuple(d) for d in res["done"]})  # entries were evicted
        # a put that returned is there unless a later put evicted it
        for a, b in res["done"][-1:]:
            assert store.get(MODEL, entry_of("chats", a, b)[0]) is not None
