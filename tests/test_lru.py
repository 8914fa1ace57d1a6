"""Eviction order (issue 23): an ordered last-use index that eviction walks
from the oldest entry, and reads of every process reaching it within
``Usage.FLUSH_EVERY`` seconds, without that process writing on every read.

Real LMDB files, real processes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from promptstore import PromptStore
from promptstore.store import _budget, _usage
from promptstore.store._schema import F64

MODEL = "lru@0123456789abcdef"
HERE = Path(__file__).resolve().parent


def kv(n, seed):
    k = np.random.default_rng(seed).standard_normal((1, 2, n, 64)).astype(np.float16)
    c = KVCache()
    c.update_and_fetch(mx.array(k), mx.array(k + 1))
    return [c]


def toks(i, n=300):
    return [1000 * (i + 1) + j for j in range(n)]


def lru_order(store):
    with store.env.read() as txn:
        return [bytes(k)[F64.size :] for k in txn.cursor(db=store._db.lru).iternext(keys=True, values=False)]


def ekeys(store):
    with store.env.read() as txn:
        return {bytes(k): F64.unpack(bytes(v))[0] for k, v in txn.cursor(db=store._db.used)}


def test_the_lru_index_orders_every_entry_by_last_use(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        for i in range(6):
            store.put(MODEL, toks(i), kv(300, i))
        store.get(MODEL, toks(0))
        store.flush()
        used = ekeys(store)
        order = lru_order(store)
        assert sorted(order) == sorted(used) and order == sorted(used, key=lambda k: used[k])
        assert order[-1] == next(k for k in used if k.endswith((300).to_bytes(4, "big")) and used[k] == max(used.values()))
        store.delete(MODEL, toks(3))
        assert len(lru_order(store)) == 5


def test_eviction_takes_the_least_recently_used_and_reads_the_order_only(tmp_path):
    one = 300 * 2 * 2 * 64 * 2  # bytes of one entry's KV
    with PromptStore(tmp_path / "s", budget=int(4.5 * one)) as store:
        for i in range(4):
            store.put(MODEL, toks(i), kv(300, i))
        store.get(MODEL, toks(0))  # 0 is now the most recent
        store.flush()
        store.put(MODEL, toks(4), kv(300, 4))  # over budget: 1, the oldest, goes
        assert len(list(store.entries())) == 4
        assert store.get(MODEL, toks(1)) is None and store.get(MODEL, toks(0)) is not None
        # eviction found its victim in the order without looking at the others' sizes
        with store.env.read() as txn:
            seen = []
            real = _budget.size_of
            try:
                _budget.size_of = lambda t, d, k: seen.append(k) or real(t, d, k)
                victims, _ = _budget.plan(txn, store._db, store.usage() - 1, set())
            finally:
                _budget.size_of = real
            assert len(victims) == 1 and seen == [victims[0][0]]


READER = """
import sys, time
sys.path.insert(0, {here!r})
from test_lru import MODEL, toks
from promptstore import PromptStore
store = PromptStore({path!r})
assert store.get(MODEL, toks(0)) is not None
print("read", flush=True)
time.sleep({hold})  # neither writes nor closes meanwhile
store.close()
"""


def test_reads_in_another_process_reach_the_eviction_order_within_the_flush_delay(tmp_path):
    path = tmp_path / "s"
    with PromptStore(path) as store:
        for i in range(3):
            store.put(MODEL, toks(i), kv(300, i))
        before = ekeys(store)
    hold = _usage.FLUSH_EVERY + 6
    proc = subprocess.Popen([sys.executable, "-c", READER.format(here=str(HERE), path=str(path), hold=hold)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "read"
        read_at = time.time()
        deadline = read_at + _usage.FLUSH_EVERY + 4
        with PromptStore(path) as store:
            while time.time() < deadline:
                now = ekeys(store)
                if now != before:
                    break
                time.sleep(0.1)
            changed = [k for k in now if now[k] != before[k]]
            assert len(changed) == 1, "the reader's last use did not arrive while it stayed open"
            assert time.time() - read_at <= _usage.FLUSH_EVERY + 2
            assert lru_order(store)[-1] == changed[0]  # now the most recently used
        assert proc.poll() is None  # it arrived while the reader was still open, not at its close
    finally:
        proc.wait(timeout=hold + 30)
    assert proc.returncode == 0


def test_set_budget_and_a_gc_plan_see_this_processs_recent_uses(tmp_path):
    """gc wrote the uses this process recorded before it chose, set_budget and
    gc's dry run did not: right after a use of ``a``, both chose ``a``, the
    most recently used entry, over ``b``."""
    with PromptStore(tmp_path / "s") as s:
        a, b = s.put(MODEL, toks(0), kv(300, 0)), s.put(MODEL, toks(1), kv(300, 1))
        time.sleep(0.01)
        assert s.lookup(MODEL, toks(0)) is not None  # a: the latest use
        plan = s.gc(budget=a.nbytes + 10_000, dry_run=True)
        assert plan.evicted == (b.id,)
        s.touch(MODEL, toks(1))  # b now
        time.sleep(0.01)
        s.touch(MODEL, toks(0))  # then a again
        assert s.set_budget(a.nbytes + 10_000).evicted == (b.id,)
        assert [e.id for e in s.entries()] == [a.id]


def test_a_refused_set_budget_keeps_the_uses_recorded_before_it(tmp_path):
    """set_budget wrote the recorded uses in the transaction its StoreFull
    then aborted: the hit recorded before it was lost (a reviewer's finding)."""
    from promptstore import StoreFull

    with PromptStore(tmp_path / "s") as s:
        a = s.put(MODEL, toks(0), kv(300, 0))
        s.put(MODEL, toks(1), kv(300, 1))
        s.pin(a.id)
        assert s.lookup(MODEL, toks(1)) is not None
        with pytest.raises(StoreFull):
            s.set_budget(10)
        assert s.counters()["hits"] == 1


def test_a_read_only_gc_plan_on_a_store_older_than_the_lru_order_follows_the_last_uses(tmp_path):
    """A store of format 1 or 2 has no ``lru`` table until it is opened for
    writing; a plan on it opened read-only (``gc --dry-run``) raised
    KeyError b'lru' once the budget was below its usage (a reviewer's
    finding). It plans by the last uses, as the upgraded store does."""
    import json
    import shutil

    from click.testing import CliRunner

    from promptstore.cli import main
    from promptstore.store._schema import LRU

    path = tmp_path / "old"
    shutil.copytree(HERE.parent / "fixtures" / "golden" / "store-format-1", path)
    with PromptStore(path, readonly=True) as ro:
        assert LRU not in ro._db and ro.usage() > 20_000
        plan = ro.gc(budget=20_000, dry_run=True)
    assert plan.evicted and plan.usage <= 20_000
    r = CliRunner().invoke(main, ["--store", str(path), "gc", "--dry-run", "--budget", "20kB", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["evict"] == list(plan.evicted)
    with PromptStore(path) as store:  # opened for writing: upgraded, the lru order built
        assert LRU in store._db
        assert store.gc(budget=20_000, dry_run=True).evicted == plan.evicted
