"""Races between processes that once lost data (found in review), kept fixed."""

from __future__ import annotations

import multiprocessing as mp
import os

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from promptstore import PromptStore


def _kv(n: int, seed: int):
    c = KVCache()
    k = mx.full((1, 2, n, 16), seed, mx.bfloat16)
    c.update_and_fetch(k, k + 1)
    return [c]


def _compactor(path: str, rounds: int, queue) -> None:
    try:
        with PromptStore(path) as s:
            for _ in range(rounds):
                s.compact()
        queue.put("ok")
    except Exception as err:  # reported to the parent, which asserts on it
        queue.put(f"{type(err).__name__}: {err}")


def test_two_concurrent_compactions_keep_the_live_generation(tmp_path):
    path = str(tmp_path / "s")
    with PromptStore(path) as s:
        for i in range(5):
            s.put("m", list(range(1, 50 + i)), _kv(49 + i, i))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_compactor, args=(path, 5, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert results == ["ok", "ok"]
    live = open(os.path.join(path, "CURRENT")).read().strip()
    assert sorted(d for d in os.listdir(path) if d.startswith("gen-")) == [live]
    with PromptStore(path) as s:
        assert len(list(s.entries())) == 5
        assert s.verify().ok


def _writer(path: str, n: int, queue) -> None:
    done = []
    with PromptStore(path) as s:
        for i in range(n):
            toks = [1000 + i, 5, 6]
            s.put("m", toks, _kv(3, i))
            done.append(toks)
    queue.put(done)


def test_verify_fix_never_removes_entries_committed_meanwhile(tmp_path):
    path = str(tmp_path / "s")
    with PromptStore(path) as s:
        for i in range(20):
            s.put("m", [i + 1, 2, 3], _kv(3, i))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_writer, args=(path, 120, queue))
    p.start()
    passes = 0
    with PromptStore(path) as s:
        while p.is_alive() or passes == 0:
            report = s.verify(fix=True)
            assert report.problems == () and report.orphan_chunks == 0
            passes += 1
        done = queue.get(timeout=120)
        p.join(timeout=60)
        assert len(done) == 120 and passes > 1
        for toks in done:
            (layer,) = s.get("m", toks)
            assert layer.offset == 3
        assert s.verify().ok
