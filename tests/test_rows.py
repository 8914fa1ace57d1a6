"""Batch rows: save one row of a running batch, restore rows into a batch.

Every fixture model runs a batch of 4 prompts of different lengths through
mlx-lm's BatchGenerator; every row is saved mid-generation with put_row while
the batch keeps running, restored in a fresh process and continued there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from conftest import MODEL_NAMES, MODELS, load_fixture, sample_tokens
from promptstore import PromptStore
from promptstore.rows import extract_row, merge_rows, row_count, row_coverage, row_nbytes
from _bits import bits_equal

LENGTHS = (5, 12, 20, 9)  # gemma3's sliding window is 16: the 20-token row rotates
MAX_TOKENS = 12
SAVE_AT = 4  # save after this many generated tokens


def _lp(x: mx.array) -> np.ndarray:
    """Logprobs as float32 numpy (an exact upcast), for bit comparisons across processes."""
    return np.array(x.astype(mx.float32))


def run_batch(model, prompts, max_tokens, on_step=None):
    """Greedy BatchGenerator run: ``{row: tokens}``, ``{row: [logprobs]}``.

    ``on_step(k, gen)`` runs after the k-th generated token of every row.
    """
    gen = BatchGenerator(model, max_tokens=max_tokens)
    uids = gen.insert(prompts)
    row_of = {u: i for i, u in enumerate(uids)}
    toks, lps = {}, {}
    k = 0
    while True:
        rs = gen.next_generated()
        if not rs:
            break
        k += 1
        for r in rs:  # rows inserted later keep their uid as row number
            toks.setdefault(row_of.get(r.uid, r.uid), []).append(r.token)
            lps.setdefault(row_of.get(r.uid, r.uid), []).append(r.logprobs)
        if on_step is not None:
            on_step(k, gen)
    return toks, lps


def _batch_state(cache):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Run every fixture model's batch of 4, saving every row at SAVE_AT."""
    path = tmp_path_factory.mktemp("rows") / "store"
    out = {"store": path, "models": {}}
    with PromptStore(path) as store:
        for name in MODEL_NAMES:
            model, _, fp, _ = load_fixture(name)
            prompts = [sample_tokens(n, seed=i) for i, n in enumerate(LENGTHS)]
            rows = {}

            def save(k, gen):
                if k != SAVE_AT:
                    return
                batch = gen._generation_batch
                before = [mx.array(a) for a in _batch_state(batch.prompt_cache)]
                for i in range(len(batch)):
                    tokens = list(batch.tokens[i])
                    info = store.put_row(fp, tokens, batch.prompt_cache, i, meta={"row": i})
                    rows[batch.uids[i]] = (tokens, info)
                after = _batch_state(batch.prompt_cache)
                assert len(before) == len(after) and all(bits_equal(a, b) for a, b in zip(before, after))

            toks, lps = run_batch(model, prompts, MAX_TOKENS, save)
            ref_toks, ref_lps = run_batch(model, prompts, MAX_TOKENS)
            out["models"][name] = {"fp": fp, "prompts": prompts, "rows": rows, "toks": toks, "lps": lps,
                                   "ref_toks": ref_toks, "ref_lps": ref_lps}
    return out


def test_saving_leaves_the_batch_running_untouched(saved):
    for name, m in saved["models"].items():
        assert len(m["rows"]) == 4, name
        assert m["toks"] == m["ref_toks"], name
        for i in range(4):
            assert len(m["toks"][i]) == MAX_TOKENS
            assert all(bits_equal(a, b) for a, b in zip(m["lps"][i], m["ref_lps"][i])), (name, i)


def test_saved_rows_are_normal_serial_entries(saved):
    with PromptStore(saved["store"]) as store:
        for name, m in saved["models"].items():
            for uid, (tokens, info) in m["rows"].items():
                assert info.n_tokens == len(tokens) == LENGTHS[uid] + SAVE_AT
                cache = store.get(m["fp"], tokens)
                assert cache is not None
                assert row_count(cache) == 1
                assert {c for c in row_coverage(cache, 0) if c is not None} == {len(tokens)}
                kinds = set(info.kinds)
                assert kinds <= {"kv", "kv.rotating", "arrays"}, kinds
                if name == "gemma3_text":
                    rot = [c for c in cache if type(c) is RotatingKVCache]
                    assert rot and all(c.max_size == 16 and c.offset == len(tokens) for c in rot)
                    assert all(c.keys.shape[2] == min(16, len(tokens)) for c in rot)


_CHILD = r"""
import json, sys
import numpy as np
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from promptstore import PromptStore, fingerprint

spec = json.load(open(sys.argv[1]))
out = {}
with PromptStore(spec["store"]) as store:
    for name, m in spec["models"].items():
        model, _ = load(m["path"])
        fp = fingerprint(m["path"])
        assert fp == m["fp"], (fp, m["fp"])
        for row in m["rows"]:
            cache = store.get(fp, row["tokens"])
            gen = BatchGenerator(model, max_tokens=row["n"])
            gen.insert([[row["next"]]], caches=[cache], all_tokens=[row["tokens"]])
            toks, lps = [], []
            while True:
                rs = gen.next_generated()
                if not rs:
                    break
                toks += [r.token for r in rs]
                lps += [np.array(r.logprobs.astype(mx.float32)) for r in rs]
            key = f"{name}.{row['row']}"
            np.save(spec["dir"] + "/" + key + ".npy", np.stack(lps), allow_pickle=False)
            out[key] = toks
print(json.dumps(out))
"""


@pytest.mark.shape_dependent
def test_each_row_continues_in_a_fresh_process(saved, tmp_path):
    """Restore every row in a new process, continue greedily through BatchGenerator:
    the tokens (and logprobs, bit for bit) are what the uninterrupted batch produced."""
    spec = {"store": str(saved["store"]), "dir": str(tmp_path), "models": {}}
    for name, m in saved["models"].items():
        rows = []
        for uid, (tokens, _) in m["rows"].items():
            # The cache holds the row's tokens; the batch had already sampled the next one.
            rows.append({"row": uid, "tokens": tokens, "next": m["toks"][uid][SAVE_AT], "n": MAX_TOKENS - SAVE_AT - 1})
        spec["models"][name] = {"path": str(MODELS / name), "fp": m["fp"], "rows": rows}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "child.py").write_text(_CHILD)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "spec.json")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got) == 4 * len(MODEL_NAMES)
    for name, m in saved["models"].items():
        for uid in m["rows"]:
            want = m["toks"][uid][SAVE_AT + 1 :]
            assert got[f"{name}.{uid}"] == want, (name, uid)
            lps = np.load(tmp_path / f"{name}.{uid}.npy", allow_pickle=False)
            ref = np.stack([_lp(x) for x in m["lps"][uid][SAVE_AT + 1 :]])
            assert lps.shape == ref.shape and np.array_equal(lps, ref), (name, uid)


def _own_row_bytes(batch_cache, row: int) -> int:
    """A row's own bytes, computed from the batch's shapes (independent of rows.py)."""
    total = 0
    for layer in batch_cache:
        if type(layer) is BatchKVCache:
            off = int(layer.offset[row].item())
            for x in (layer.keys, layer.values):
                total += x.shape[1] * off * x.shape[3] * x.itemsize
        elif type(layer) is BatchRotatingKVCache:  # decode state: the row's last max_size tokens
            off = min(int(layer.offset[row].item()), layer.max_size)
            for x in (layer.keys, layer.values):
                total += x.shape[1] * off * x.shape[3] * x.itemsize
        elif type(layer) is ArraysCache:
            total += sum(s.nbytes // s.shape[0] for s in layer.cache if s is not None)
        else:
            raise AssertionError(type(layer))
    return total


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_row_of_batch_of_8_writes_only_its_own_bytes(name, store):
    model, _, fp, _ = load_fixture(name)
    prompts = [sample_tokens(n, seed=20 + i) for i, n in enumerate((6, 30, 11, 17, 40, 8, 23, 14))]
    infos = {}

    def save(k, gen):
        if k == 2:
            batch = gen._generation_batch
            assert len(batch) == 8
            i = 4
            info = store.put_row(fp, list(batch.tokens[i]), batch.prompt_cache, i)
            whole = sum(c.nbytes for c in batch.prompt_cache)
            infos["row"] = (info, _own_row_bytes(batch.prompt_cache, i), whole)

    run_batch(model, prompts, 3, save)
    info, own, whole = infos["row"]
    assert own > 0
    assert info.nbytes <= 1.05 * own, (info.nbytes, own)
    assert info.nbytes * 4 < whole  # nowhere near the batch (its padded buffers included)
    cache = store.get(fp, store.tokens(info.id))
    assert row_nbytes(cache) == info.nbytes


def test_extracted_row_does_not_keep_the_batch_alive():
    B, H, L, D = 8, 4, 2048, 64
    mx.synchronize()
    base = mx.get_active_memory()
    serial = []
    for i in range(B):
        c = KVCache()
        n = L - 37 * i
        c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
        serial.append([c])
    batch = merge_rows(None, serial)
    mx.eval(_batch_state(batch))
    del serial
    batch_bytes = sum(c.nbytes for c in batch)
    row = extract_row(batch, 3)
    want = [mx.array(a) for a in _batch_state(row)]
    del batch
    import gc

    gc.collect()
    held = mx.get_active_memory() - base
    row_bytes = sum(c.nbytes for c in row)
    assert row_bytes == 2 * H * (L - 37 * 3) * D * 4
    assert held < 2 * row_bytes + (1 << 20) + row_bytes, (held, row_bytes, batch_bytes)
    assert held < batch_bytes / 3
    assert all(bits_equal(a, b) for a, b in zip(want, _batch_state(row)))


@pytest.mark.shape_dependent
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_restored_row_joins_a_running_batch_of_3_bit_identically(name, saved):
    """A row restored from the store joins a running batch of 3 (BatchGenerator.insert):
    its logprobs equal, bit for bit, those of the same row in its own uninterrupted
    batch of 4; the 3 running rows are bit-identical to a run without the join, and
    joining the in-memory row (no store detour) gives the same bits."""
    model, _, fp, _ = load_fixture(name)
    m = saved["models"][name]
    uid = 2
    tokens, _ = m["rows"][uid]
    nxt, n = m["toks"][uid][SAVE_AT], MAX_TOKENS - SAVE_AT - 1
    others = [sample_tokens(k, seed=30 + i) for i, k in enumerate((7, 15, 11))]
    with PromptStore(saved["store"]) as store:
        restored = store.get(fp, tokens)

    def joined(cache):
        def on_step(k, gen):
            if k == 3:
                gen.insert([[nxt]], max_tokens=[n], caches=[cache], all_tokens=[tokens])
        return run_batch(model, others, 10, on_step)

    toks, lps = joined(restored)
    alone_toks, alone_lps = run_batch(model, others, 10)
    # Row 3 is the one that joined (uids are numbered in insertion order).
    assert sorted(toks) == [0, 1, 2, 3]
    assert toks[3] == m["toks"][uid][SAVE_AT + 1 :]
    assert all(bits_equal(a, b) for a, b in zip(lps[3], m["lps"][uid][SAVE_AT + 1 :]))
    for i in range(3):
        assert toks[i] == alone_toks[i]
        assert all(bits_equal(a, b) for a, b in zip(lps[i], alone_lps[i])), i
    # The same row never saved: extracted live from a fresh run of its batch of 4.
    live = {}

    def grab(k, gen):
        if k == SAVE_AT:
            live["row"] = extract_row(gen._generation_batch.prompt_cache, uid)

    run_batch(model, m["prompts"], SAVE_AT + 1, grab)
    ref_toks, ref_lps = joined(live["row"])
    for i in range(4):
        assert ref_toks[i] == toks[i]
        assert all(bits_equal(a, b) for a, b in zip(ref_lps[i], lps[i])), i

