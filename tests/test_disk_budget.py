"""Disk use bounded by the budget (issue 23): under churn the store's files
(data file, blob files, pack files) stay within 1.25x the budget plus a small
fixed overhead, because payloads of 1 MiB and more live in blob files that go
with their entry, blocks in pack files that go with their last block, and
sparse packs are rewritten once their dead bytes pass a share of the live.

Real LMDB files, real pack files, real SIGKILLs.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from _bits import bits_equal
from _raw import audit_blocks, audit_packs, stored_bytes
from promptstore import PromptStore
from promptstore.store import _packing

MODEL = "disk@0123456789abcdef"
HERE = Path(__file__).resolve().parent
FIXED = 2 << 20  # the data file's own pages, meta pages and free-page slack


def trunks(n=4, length=8000):
    rng = np.random.default_rng(0)
    toks = [rng.integers(0, 50000, length).tolist() for _ in range(n)]
    keys = [rng.standard_normal((1, 4, length, 64)).astype(np.float16) for _ in range(n)]
    return toks, keys


def entry(toks, keys, t, n, state=None):
    kv = KVCache()
    kv.update_and_fetch(mx.array(keys[t][..., :n, :]), mx.array(keys[t][..., :n, :] + 1))
    layers = [kv]
    if state is not None:
        a = ArraysCache(1)
        a[0] = mx.array(state)
        layers.append(a)
    return toks[t][:n], layers


def test_files_stay_within_the_budget_under_churn(tmp_path):
    budget = 24 << 20
    toks, keys = trunks()
    rng, pick = np.random.default_rng(1), random.Random(1)
    worst = 0.0
    with PromptStore(tmp_path / "s", budget=budget) as store:
        for i in range(60):  # 1-7 MB entries: conversations of four trunks, branching and growing
            t, n = pick.randrange(4), pick.randrange(1000, 7000)
            state = rng.standard_normal((1, 300_000)).astype(np.float32) if pick.random() < 0.3 else None
            tokens, cache = entry(toks, keys, t, n, state)
            store.put(MODEL, tokens, cache)
            if pick.random() < 0.2:
                store.remove(pick.choice(list(store.entries())).id)
            assert store.usage() == stored_bytes(store) <= budget
            worst = max(worst, store.file_size() / budget)
            if i % 10 == 9:
                audit_blocks(store), audit_packs(store)
        assert worst <= 1.25 + FIXED / budget, worst
        assert store.verify().ok
        for info in store.entries():  # every entry left restores bit-exact
            cache, _, tokens = store.load(info.id)
            t = next(j for j in range(4) if toks[j][: len(tokens)] == tokens)
            assert bits_equal(cache[0].keys[..., : cache[0].offset, :], mx.array(keys[t][..., : len(tokens), :]))
    print(f"\ndisk: files / budget at most {worst:.3f} over 60 puts and removals of 1-7 MB entries")


def test_sparse_packs_are_rewritten(tmp_path):
    toks, keys = trunks(1, 6000)
    with PromptStore(tmp_path / "s", block_tokens=256) as store:  # the prefix's 300 tokens keep a whole block
        # one long entry, then its shorter prefixes; deleting the long one leaves
        # its pack mostly dead (the prefixes keep its first blocks)
        store.put(MODEL, *entry(toks, keys, 0, 6000))
        store.put(MODEL, *entry(toks, keys, 0, 300))
        store.delete(MODEL, toks[0][:6000])
        with store.env.read() as txn:
            dead = _packing.dead(txn, store._db)
        assert dead > _packing.DEAD_MIN  # ~5.8 MB dead, 150 kB live
        before = store.file_size()
        store.gc()  # or the next put: the pack is rewritten with its live blocks only
        with store.env.read() as txn:
            assert _packing.dead(txn, store._db) < 1024  # only the new pack's footer
        assert store.file_size() < before - dead * 0.9
        tokens, cache = entry(toks, keys, 0, 300)
        got = store.get(MODEL, tokens)
        assert bits_equal(got[0].keys[..., :300, :], cache[0].keys[..., :300, :])
        audit_blocks(store), audit_packs(store)
        assert store.verify().ok


KILLER = """
import os, signal, sys
sys.path.insert(0, {here!r})
from test_disk_budget import MODEL, entry, trunks
from promptstore import PromptStore
from promptstore.format import _packs

toks, keys = trunks(1, 6000)
real = _packs.Packs.write
def write(self, pack, views, blocks):
    real(self, pack, views, blocks)
    if {kill!r} == "repack" and sum(len(v) for v in views) < 1 << 20:  # the rewrite of the sparse pack
        os.kill(os.getpid(), signal.SIGKILL)
_packs.Packs.write = write
with PromptStore({path!r}) as store:
    store.gc()
"""


def test_a_kill_while_a_pack_is_rewritten_loses_nothing(tmp_path):
    path = tmp_path / "s"
    toks, keys = trunks(1, 6000)
    with PromptStore(path, block_tokens=256) as store:  # as above: a pack left sparse, not dead
        store.put(MODEL, *entry(toks, keys, 0, 6000))
        store.put(MODEL, *entry(toks, keys, 0, 300))
        store.delete(MODEL, toks[0][:6000])
    proc = subprocess.run([sys.executable, "-c", KILLER.format(here=str(HERE), path=str(path), kill="repack")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    with PromptStore(path) as store:
        rep = store.verify()
        assert rep.ok and rep.orphan_packs == 1 and rep.orphan_blobs == 0  # the new pack, written, never recorded
        audit_blocks(store), audit_packs(store)
        tokens, cache = entry(toks, keys, 0, 300)
        assert bits_equal(store.get(MODEL, tokens)[0].keys[..., :300, :], cache[0].keys[..., :300, :])
        store.gc()  # sweeps the stray file and rewrites the pack again, this time to the end
        assert store.verify().ok and store.verify().orphan_blobs == 0
        with store.env.read() as txn:
            assert _packing.dead(txn, store._db) < 1024  # only the new pack's footer
        audit_blocks(store), audit_packs(store)
