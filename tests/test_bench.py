"""promptstore bench: the quick run end to end, target judging, synthetic data.

No test asserts on a time: the bench reports, it never gates.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import lmdb
import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import ArraysCache, KVCache

from promptstore import PromptStore, fingerprint
from promptstore.format import _entry, _pages, _payload
from promptstore.format._blocks import BLOCK_TOKENS
from promptstore.bench import _data as data
from promptstore.bench import _sharing as sharing
from promptstore.bench._chat import Chat
from promptstore.bench._fixture import FIXTURES_ENV, HYBRID, fixture_model
from promptstore.bench._mem import _status
from promptstore.bench import targets
from promptstore.cli import main
from promptstore.cli.bench import render
from _bits import bits_equal


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``promptstore bench --quick --json --out`` run, shared by the checks below.

    The repository's fixture models are hidden from it (``$PROMPTSTORE_FIXTURES``
    names an empty folder), as they are from an installed package: the bench
    builds the fixture hybrid it needs into its scratch folder.
    """
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "bench.md"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FIXTURES_ENV, str(tmp_path_factory.mktemp("no-fixtures")))
        result = CliRunner().invoke(main, ["bench", "--quick", "--json", "--out", str(out), "--dir", str(tmp)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out.read_text(), tmp


def test_quick_run_builds_its_fixture_and_reports_its_backend(quick):
    res, md, tmp = quick
    assert Path(res["fixture_hybrid"]).parent.parent.parent == tmp  # built in the scratch folder, removed after
    m = res["machine"]
    assert m["mlx"] == mx.__version__ and m["device"] == str(mx.default_device())
    assert m["backend"] == ("cpu" if mx.default_device() == mx.cpu else "metal" if mx.metal.is_available() else "cuda")
    chosen = os.environ.get("PROMPTSTORE_RESTORE")  # a run of the suite with every restore staged sets it
    assert m["restore"] == (chosen or ("staged" if m["backend"] == "cuda" else "direct"))
    assert m["loaders"] == int(os.environ.get("PROMPTSTORE_LOADERS", "4"))
    assert f"mlx {mx.__version__} on {mx.default_device()}, restores {m['restore']}" in md


def test_fixture_model_is_built_byte_identical_when_the_repository_has_none(tmp_path, monkeypatch):
    repo = Path(__file__).resolve().parents[1] / "fixtures" / "models" / HYBRID
    monkeypatch.delenv(FIXTURES_ENV, raising=False)
    assert fixture_model(HYBRID, tmp_path / "unused") == repo  # in a checkout: the committed copy
    assert not (tmp_path / "unused").exists()
    monkeypatch.setenv(FIXTURES_ENV, str(tmp_path / "empty"))
    built = fixture_model(HYBRID, tmp_path / "scratch")
    assert built == tmp_path / "scratch" / "fixtures" / HYBRID
    names = sorted(p.name for p in repo.iterdir())
    assert sorted(p.name for p in built.iterdir()) == names
    assert all((built / n).read_bytes() == (repo / n).read_bytes() for n in names)
    assert fingerprint(built) == fingerprint(repo)


def test_quick_run_measures_every_case(quick):
    res, md, tmp = quick
    assert res["quick"] is True
    assert res["command"] == f"promptstore bench --quick --json --out {tmp / 'bench.md'} --dir {tmp}"
    assert f"`{res['command']}`" in md
    assert [t["tokens"] for t in res["throughput"]] == [256, 1024]
    for t in res["throughput"]:
        assert t["bit_exact"] is True
        assert t["bytes"] == data.QUICK.nbytes(t["tokens"])
        for key in ("put", "put_grow", "get_fresh", "get_reuse", "mlx_save", "mlx_load_fresh", "file_write", "file_write_grow",
                    "file_read", "memcpy_fresh", "memcpy_reuse"):
            assert t[key] > 0, key
        # a durable put writes at least the payload to storage
        assert t["put_written_per_put"] >= t["bytes"]
    for m in res["memory"]:
        assert m["restored"] is True and m["bytes"] == data.QUICK.nbytes(m["tokens"])
        assert m["mlx_peak"] >= m["bytes"]  # the restored arrays themselves live in mlx memory
    assert [r["entries"] for r in res["lookup"]] == [10, 50]
    assert all(r["q1024"] > 0 and r["q32768"] > 0 for r in res["lookup"])
    rs = res["row_save"]
    assert rs["rows"] == 8 and rs["entry_bytes"] == rs["row_bytes"] < rs["batch_bytes"]
    assert rs["written"] >= rs["row_bytes"]
    assert all(p["same_first_token"] and p["matched"] == p["tokens"] - 1 for p in res["prefill"])


def test_quick_run_measures_the_shared_block_cases(quick):
    res, md, _ = quick
    chat = res["chat"]
    assert set(chat) == {"dense", "hybrid"}
    for name, c in chat.items():
        turns = c["turns"]
        spec = c["chat"]
        assert len(turns) == spec["turns"] and c["bit_exact"] is True
        # every later turn continues the previous turn's cache (memory hit at its full length)
        assert [t["hit"] for t in turns[1:]] == [t["tokens"] for t in turns[:-1]]
        assert [t["inserts"] for t in turns] == [3] + [2] * (spec["turns"] - 1)
        per_turn = spec["user"] + spec["tail"] + spec["answer"]
        assert [t["added"] for t in turns] == [spec["system"] + per_turn] + [per_turn] * (spec["turns"] - 1)
        # a turn writes at least what it adds: its new KV and its recurrent states
        assert all(t["written"] >= t["new"] > 0 for t in turns), name
        # ... and writes those bytes to files once: no block (the partial last one included) and no
        # state is written twice; beyond them only the packs' footers (24 bytes a block, 16 a pack)
        assert all(t["new"] <= t["files"] <= t["new"] + 1024 for t in turns), (name, [t["files"] - t["new"] for t in turns])
        assert c["lmdb_median"] == statistics.median((t["written"] - t["files"]) / t["new"] for t in turns) > 0
        # each token's KV stored once: bytes are deterministic, so the ratio is too
        assert c["unique"] <= c["stored"] <= 1.10 * c["unique"], name
        assert c["logical"] > c["stored"]  # without sharing, more
    shape = data.Shape(**res["shape"])
    hybrid = chat["hybrid"]
    # the checkpoint history: the system prompt's plus the latest few of the chain
    assert hybrid["entries"] == hybrid["checkpoints"] + 1 and hybrid["pruned"] > 0
    assert hybrid["unique"] == shape.kv_per_token * hybrid["final_tokens"] + shape.state_bytes * hybrid["entries"]
    dense = chat["dense"]
    assert dense["entries"] == 1 + 2 * dense["chat"]["turns"]  # trimmable entries are all kept
    assert dense["unique"] == data.DENSE.kv_per_token * dense["final_tokens"]
    first, whole = res["shared_prompt"]
    assert first["system_entry"] is True and whole["system_entry"] is False
    assert first["unique"] == whole["unique"] == data.DENSE.kv_per_token * (first["system"] + first["own_tokens"])
    assert first["unique"] <= first["stored"] <= 1.10 * first["unique"]
    # without the system prompt's own entry, each conversation stores the block that ends it again
    assert whole["stored"] > first["stored"]
    p = res["prefix_read"]
    assert p["bit_exact"] is True and p["prefix_bytes"] == data.DENSE.kv_per_token * p["prefix"]
    # the blocks that cover the prefix, no more
    assert p["bytes_read"] == data.DENSE.kv_per_token * (-(-p["prefix"] // BLOCK_TOKENS) * BLOCK_TOKENS) <= 1.10 * p["prefix_bytes"]
    assert "block_sizes" not in res  # full run only
    for title in ("turn chat through PersistentPromptCache", "Conversations sharing one system prompt",
                  "A prefix hit on a long trimmable entry"):
        assert title in md


def test_block_sizes_compare_sharing_and_reads(tmp_path):
    rows = sharing.block_sizes(tmp_path, data.DENSE, (16, 256), Chat(turns=2, system=40, user=20, tail=4, answer=30),
                               shared=(3, 100), entry=(1024, 100), repeats=1)
    assert [r["block_tokens"] for r in rows] == [16, 256] and not list(tmp_path.iterdir())
    small, large = rows
    assert small["block_bytes"] == 16 * 2 * 64 * 2  # one block of one array: tokens x heads x dims x bf16
    for r in rows:
        e = r["entry"]
        assert e["bit_exact"] is True and e["put_s"] > 0 and e["get_s"] > 0 and e["manifest"] > 0
        assert 1.0 <= r["chat_ratio"] and 1.0 <= r["shared_ratio"]
    # a prefix hit reads whole blocks: 112 tokens of 16-token blocks, the first 256-token block
    assert small["entry"]["bytes_read"] == 112 * data.DENSE.kv_per_token
    assert large["entry"]["bytes_read"] == 256 * data.DENSE.kv_per_token
    # whole conversations re-store the block that ends the system prompt: 4 tokens of 16, all 100 of 256
    assert small["shared_whole_ratio"] < large["shared_whole_ratio"]


def test_quick_run_cleans_its_scratch_and_reports_every_target(quick):
    res, md, tmp = quick
    assert [p.name for p in tmp.iterdir()] == ["bench.md"]  # scratch stores removed
    names = [t["name"] for t in res["targets"]]
    assert len(names) == 4 * 2 + 2 + 1 + 1 + 1 + 2 * 3 + 2 + 1 + 1  # ... lookup, eviction, row save, ..., remote
    assert len(set(names)) == len(names)
    assert md == render(res)
    for t in res["targets"]:
        assert f"| {t['name']} | {t['value']:.2f} |" in md
        assert ("PASS" if t["ok"] else "MISS") in md


def test_only_runs_the_cases_named_and_judges_only_their_targets(tmp_path):
    out = tmp_path / "bench.md"
    result = CliRunner().invoke(main, ["bench", "--quick", "--json", "--only", "row_save,lookup", "--out", str(out),
                                       "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    res = json.loads(result.stdout)
    assert res["only"] == ["lookup", "row_save"]  # in the order they run
    measured = set(res) & {"throughput", "memory", "lookup", "eviction", "row_save", "prefill", "chat", "shared_prompt",
                           "prefix_read", "draft", "remote", "remote_ttft", "fixture_hybrid"}
    assert measured == {"lookup", "row_save"}  # no fixture model built either
    assert [t["name"].split(",")[0] for t in res["targets"]] == ["lookup", "row save bytes written / row bytes"]
    md = out.read_text()
    assert md.startswith("# promptstore bench (quick, only lookup, row_save run)")
    assert "## Lookup latency" in md and "## Saving row" in md and "## Throughput" not in md
    assert res["command"].endswith("--only row_save,lookup")
    assert [p.name for p in tmp_path.iterdir()] == ["bench.md"]


@pytest.mark.parametrize("only", ["lookup,speed", ","])
def test_only_refuses_an_unknown_case(tmp_path, only):
    result = CliRunner().invoke(main, ["bench", "--quick", "--json", "--only", only, "--dir", str(tmp_path)])
    assert result.exit_code == 2
    err = json.loads(result.stdout)
    assert err["error"] == "UsageError" and "throughput, lookup, eviction" in err["message"]
    assert ("speed" in err["message"]) == (only != ",")
    assert not list(tmp_path.iterdir())


def _fake(get_s=1.0, load_s=1.5, memcpy_s=0.6, put_s=1.0, file_s=0.9, rss=1.2e9, n=1e9, lookup_s=0.004, written=1.04e9,
          chat_stored=1.1e9, chat_median=1.05, chat_max=1.1, shared_stored=1.1e9, prefix_read=1.1e6, prefix_exact=True):
    chat = {"stored": int(chat_stored), "unique": int(1e9), "written_median": chat_median, "written_max": chat_max,
            "chat": {"turns": 20}}
    return {
        "throughput": [{"tokens": 32768, "bytes": int(n), "get_fresh": get_s, "mlx_load_fresh": load_s,
                        "memcpy_fresh": memcpy_s, "put": put_s, "file_write": file_s}],
        "memory": [{"tokens": 32768, "bytes": int(n), "rss_delta": int(rss)}],
        "lookup": [{"entries": 10000, "q1024": 0.001, "q32768": lookup_s}],
        "row_save": {"written": int(written), "row_bytes": int(1e9)},
        "chat": {"dense": {**chat, "shape": "dense fixture shape"}, "hybrid": {**chat, "shape": "Qwen3-Next-80B shape"}},
        "shared_prompt": [{"stored": int(shared_stored), "unique": int(1e9), "conversations": 100, "system": 8100,
                           "system_entry": True}],
        "prefix_read": {"bytes_read": int(prefix_read), "prefix_bytes": int(1e6), "prefix": 4000, "tokens": 32768,
                        "bit_exact": prefix_exact},
    }


def test_interleaved_rounds_alternate_order_and_run_befores_first():
    from promptstore.bench._cases import interleaved

    calls = []
    ops = {name: (lambda n=name: calls.append("before-" + n), lambda n=name: calls.append(n)) for name in "abc"}
    out = interleaved(ops, repeats=3, warmup=1)
    assert set(out) == set("abc") and all(t >= 0 for t in out.values())
    ran = [c for c in calls if not c.startswith("before-")]
    assert ran == list("abc" "cba" "abc" "cba")
    assert all(calls[i] == "before-" + calls[i + 1] for i in range(0, len(calls), 2))


def test_targets_pass_at_their_bounds():
    judged = {t["name"]: t for t in targets(_fake())}
    assert all(t["ok"] for t in judged.values()), judged
    assert not any("growing" in name for name in judged)  # judged only when measured
    assert judged["get vs mlx-lm load_prompt_cache (32K)"]["value"] == 1.5
    assert judged["durable put vs file write+fsync (32K)"]["value"] == pytest.approx(0.9)


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"load_s": 0.9}, "get vs mlx-lm load_prompt_cache (32K)"),
        ({"memcpy_s": 0.5, "get_s": 0.9}, "get vs memcpy (32K)"),
        ({"file_s": 0.8}, "durable put vs file write+fsync (32K)"),
        ({"rss": 1.3e9}, "peak memory of a get / N (32K)"),
        ({"lookup_s": 0.0051}, "lookup, 32K-token query, 10000 entries (ms)"),
        ({"written": 1.06e9}, "row save bytes written / row bytes"),
        ({"shared_stored": 1.11e9}, "stored / unique bytes (100 conversations sharing a 8100-token system prompt, system prompt put first)"),
        ({"prefix_read": 1.11e6}, "prefix hit: bytes read / prefix bytes (4000 of a 32768-token entry), bit-exact"),
        ({"prefix_exact": False}, "prefix hit: bytes read / prefix bytes (4000 of a 32768-token entry), bit-exact"),
    ],
)
def test_targets_miss_just_past_their_bounds(kw, name):
    judged = {t["name"]: t for t in targets(_fake(**kw))}
    assert judged[name]["ok"] is False
    assert all(t["ok"] for n, t in judged.items() if n != name)


@pytest.mark.parametrize("shape", ["dense fixture shape", "Qwen3-Next-80B shape"])
@pytest.mark.parametrize("kw, what", [({"chat_stored": 1.11e9}, "stored / unique bytes"),
                                      ({"chat_median": 1.11}, "bytes written / new bytes, median turn"),
                                      ({"chat_max": 1.11}, "bytes written / new bytes, worst turn")])
def test_chat_targets_miss_just_past_their_bounds(kw, what, shape):
    judged = {t["name"]: t for t in targets(_fake(**kw))}
    missed = [n for n, t in judged.items() if not t["ok"]]
    assert f"{what} (20-turn chat, {shape})" in missed and len(missed) == 2  # both chats share the fake's figures


def test_steady_put_replaces_its_entry_and_growing_put_keeps_them(tmp_path):
    from promptstore.bench import _cases as cases

    res = cases.throughput(tmp_path, data.QUICK, 64, repeats=3)
    with PromptStore(tmp_path / "store") as store:
        sizes = sorted(e.n_tokens for e in store.entries())
    # the 1-token warm-up entry, the entry every get reads, the last two steady puts (the first was deleted)
    assert sizes == [1] + [64] * 3
    # the growing puts' store and the growing reference's files are removed afterwards
    assert not list(tmp_path.glob("grow*")) and res["put_grow"] > 0 and res["file_write_grow"] > 0


def test_growing_put_is_judged_on_its_own_figures():
    fake = _fake()
    fake["throughput"][0].update(put_grow=2.0, file_write_grow=1.9)  # 0.95: passes
    judged = {t["name"]: t for t in targets(fake)}
    assert judged["durable put vs file write+fsync, both growing (32K)"]["value"] == pytest.approx(0.95)
    fake["throughput"][0].update(put_grow=2.0, file_write_grow=1.7)  # 0.85: misses, the steady put still passes
    judged = {t["name"]: t for t in targets(fake)}
    assert judged["durable put vs file write+fsync, both growing (32K)"]["ok"] is False
    assert judged["durable put vs file write+fsync (32K)"]["ok"] is True


def test_full_shape_is_qwen3_next_80b():
    s = data.QWEN3_NEXT_80B
    attn = [i for i in range(s.layers) if s.is_attention(i)]
    assert s.layers == 48 and len(attn) == 12 and attn[:3] == [3, 7, 11]
    # 36 x (conv 3*8192 bf16 + state 32*128*128 f32) + 12 x 2 x 2 heads x 256 dims bf16 per token
    assert s.nbytes(4096) == 36 * (3 * 8192 * 2 + 32 * 128 * 128 * 4) + 12 * 2 * 2 * 4096 * 256 * 2
    assert s.kv_per_token == 24 * 1024 and round(s.state_bytes / 2**20, 1) == 73.7


def test_dense_shape_is_the_llama_fixture():
    config = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "models" / "llama" / "config.json").read_text())
    d = data.DENSE
    assert (d.ssm_layers, d.attn_layers) == (0, config["num_hidden_layers"])
    assert (d.kv_heads, d.head_dim) == (config["num_key_value_heads"], config["head_dim"])
    assert all(d.is_attention(i) for i in range(d.layers)) and d.state_bytes == 0
    assert d.kv_per_token == 2 * 2 * 2 * 64 * 2  # layers x (keys, values) x heads x dims x bf16


def test_grower_extends_in_place_and_renews_recurrent_state():
    g = data.Grower(data.QUICK, seed=1)
    cache = g.cache(10)
    before = [data.covered(layer)[1] for layer in cache]
    g.extend(cache, 5)
    kv, ssm = cache[3], cache[0]
    assert kv.offset == 15
    kind, arrays = data.covered(kv)
    assert kind == "kv" and [a.shape[-2] for a in arrays] == [15, 15]
    assert all(bits_equal(a[..., :10, :], b).item() for a, b in zip(arrays, before[3], strict=True))  # earlier rows kept
    assert not any(bits_equal(a, b).item() for a, b in zip(data.covered(ssm)[1], before[0], strict=True))  # a new state
    fork = data.fork([kv])
    g.extend(fork, 3)
    assert kv.offset == 15 and fork[0].offset == 18 and data.same_rows(fork, [kv], 15)  # the fork shares, the original stays


def test_hybrid_cache_has_real_shapes_and_dtypes():
    cache = data.hybrid_cache(data.QUICK, 256)
    assert [type(c) for c in cache] == [ArraysCache, ArraysCache, ArraysCache, KVCache]
    conv, state = cache[0][0], cache[0][1]
    assert conv.shape == (1, 3, 8192) and conv.dtype == mx.bfloat16
    assert state.shape == (1, 32, 128, 128) and state.dtype == mx.float32
    kv = cache[3]
    assert kv.keys.shape == (1, 2, 256, 256) and kv.keys.dtype == mx.bfloat16 and kv.offset == 256
    assert data.cache_nbytes(cache) == data.QUICK.nbytes(256)
    assert not bits_equal(kv.keys, kv.values).item()  # random, not zeros


def test_lookup_corpus_queries_extend_their_targets():
    corpus = data.LookupCorpus(seed=3)
    for q, query in corpus.queries.items():
        target = corpus.targets[q]
        assert len(query) == q and len(target) < q
        assert np.array_equal(query[: len(target)], target)
    lengths = [len(t) for t in corpus.entries(200)]
    assert min(lengths) >= 255 and max(lengths) <= 32768
    assert len(set(lengths)) > 100


def test_unsynced_lmdb_is_setup_only(tmp_path):
    original = lmdb.open
    with data.unsynced_lmdb(), PromptStore(tmp_path / "s") as store:
        assert lmdb.open is not original
        store.put("m@1", [1, 2, 3], data.tiny_kv(3))
    assert lmdb.open is original
    with PromptStore(tmp_path / "s") as store:  # what was put without fsync is a normal entry
        hit = store.lookup("m@1", [1, 2, 3, 4])
        assert hit is not None and hit.matched == 3 and hit.trimmed == 0


# -- the restore hot path the bench drove (read_arrays, page release) -----------------


@pytest.fixture
def big_entry(tmp_path, monkeypatch):
    """A 4-layer hybrid entry above the page-release threshold, with arrays that
    lie inside one chunk and arrays that span chunks, kept in LMDB as before
    blob files (tests/test_blobs.py has the blob-file side)."""
    from promptstore.format import _blobs
    from promptstore.store import _keys

    monkeypatch.setattr(_blobs, "MIN_PAYLOAD", 1 << 62)

    cache = data.hybrid_cache(data.QUICK, 1024, seed=5)
    tokens = list(range(1, 1025))
    store = PromptStore(tmp_path / "s")
    info = store.put("m@1", tokens, cache)
    assert info.nbytes >= _pages.MIN_PAYLOAD
    yield store, cache, tokens, _keys.entry_key(_keys.model_id("m@1"), _keys.as_tokens(tokens))
    store.close()


def test_restore_is_bit_exact_across_chunk_boundaries(big_entry):
    store, cache, tokens, _ = big_entry
    man = _manifest(store, tokens)
    recs = [r for layer in man.layers for r in layer.arrays]
    assert any(_payload._spans(r) for r in recs) and any(not _payload._spans(r) for r in recs)
    for _ in range(2):  # the second restore reads pages the first one released
        restored = store.get("m@1", tokens)
        for x, y in zip(cache, restored):
            for a, b in zip(data._layer_arrays(x), data._layer_arrays(y), strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and bits_equal(a, b).item()


def _manifest(store, tokens):
    from promptstore.store import _keys

    with store.env.read() as txn:
        return store._manifest(txn, _keys.entry_key(_keys.model_id("m@1"), _keys.as_tokens(tokens)))


@pytest.mark.parametrize("spanning", [True, False])
def test_a_flipped_byte_is_caught_in_either_copy_path(big_entry, spanning):
    from promptstore import CorruptEntry
    from promptstore.store import _keys

    store, _, tokens, ekey = big_entry
    man = _manifest(store, tokens)
    rec = next(r for layer in man.layers for r in layer.arrays if _payload._spans(r) == spanning and r.nbytes > 4096)
    at = rec.offset + rec.nbytes - 7  # in the last chunk a spanning array reaches
    ci, pos = divmod(at, _entry.CHUNK)
    key = ekey + _keys.u32(ci)

    def flip(txn):
        raw = bytearray(txn.get(key, db=store._db[b"chunks"]))
        raw[pos] ^= 0x10
        txn.put(key, bytes(raw), db=store._db[b"chunks"])

    store.env.write(flip)
    with pytest.raises(CorruptEntry, match=rf"checksum mismatch in layer \d+ array {rec.name!r}"):
        store.get("m@1", tokens)


def test_restore_leaves_no_lmdb_pages_mapped(big_entry):
    store, _, tokens, _ = big_entry
    n = _manifest(store, tokens).payload
    before = _status("RssFile")
    restored = store.get("m@1", tokens)
    assert restored is not None
    # Without the release the whole payload (n bytes) would stay mapped.
    assert _status("RssFile") - before < n // 4


def test_release_ignores_memory_outside_the_map(big_entry, tmp_path):
    store = big_entry[0]
    data_file = _pages.DataFile(str(store.path / "data.mdb"))
    data_file.refresh()
    assert data_file.spans
    release = data_file.release
    private = bytearray(b"\x5a" * (1 << 20))
    release(memoryview(private))  # DONTNEED here would zero private memory
    assert private == bytearray(b"\x5a" * (1 << 20))
    elsewhere = _pages.DataFile(str(tmp_path / "not-mapped.mdb"))
    elsewhere.refresh()
    assert elsewhere.spans == [] and elsewhere.offset(memoryview(private)) is None and elsewhere.fd is None


def test_peak_rss_of_a_restore_stays_under_one_and_a_quarter_n(tmp_path):
    cache = data.hybrid_cache(data.QUICK, 16384, seed=2)
    tokens = list(range(1, 16385))
    with PromptStore(tmp_path / "s") as store:
        n = store.put("m@1", tokens, cache).nbytes
        store.put("m@1", tokens[:1024], data.hybrid_cache(data.QUICK, 1024, seed=3))
        del cache
        store.get("m@1", tokens[:1024])  # warm code paths on another entry: none of n's pages are mapped yet
        import gc

        gc.collect()
        mx.clear_cache()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _status("VmRSS")
        restored = store.get("m@1", tokens)
        peak = _status("VmHWM") - before
    assert restored is not None
    # Without releasing the LMDB pages the peak was ~2 N (copy + mapped payload).
    assert peak <= 1.25 * n, (peak, n)


@pytest.mark.parametrize("sizes", [[3], [_entry.CHUNK], [_entry.CHUNK + 1, 5], [1000, _entry.CHUNK - 1000, 7], [2 * _entry.CHUNK + 3, _entry.CHUNK // 3, _entry.CHUNK]])
def test_iter_chunks_cuts_the_payload_exactly(sizes):
    rng = np.random.default_rng(len(sizes))
    arrays = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]
    views = [memoryview(a) for a in arrays]
    total = sum(sizes)
    chunks = [bytes(c) for c in _payload.iter_chunks(views, total)]  # copied at once, as txn.put does
    assert len(chunks) == _entry.n_chunks(total)
    assert all(len(c) == _entry.CHUNK for c in chunks[:-1]) and 0 < len(chunks[-1]) <= _entry.CHUNK
    assert b"".join(chunks) == b"".join(a.tobytes() for a in arrays)


def test_restore_targets_alone_measure_a_bit_exact_get(tmp_path):
    """``python -m promptstore.bench._restore``: the bench's restore case and
    peak memory in fresh processes, with the fill threads it is given."""
    from promptstore.bench import _restore

    row = _restore.measure(64, "1", repeats=1)
    assert row["bit_exact"] is True and row["memory"]["restored"] is True
    assert row["threads"] == "1" and row["tokens"] == 64 and row["mode"] == "default"
    assert row["bytes"] == row["memory"]["bytes"] > 0
    for key in ("get_vs_load", "get_vs_memcpy", "put_vs_write", "peak_rss_per_byte"):
        assert row[key] > 0


def test_restore_targets_alone_take_a_restore_mode(monkeypatch):
    """A mode reaches the throughput child (its environment) and the
    peak-memory child (this process's, restored afterwards)."""
    from promptstore.bench import _restore

    seen = []
    monkeypatch.setenv("PROMPTSTORE_RESTORE", "direct")
    monkeypatch.setattr(_restore.cases, "throughput_child",
                        lambda work, shape, n, repeats, env: seen.append(dict(env)) or {
                            "bytes": 8, "bit_exact": True, "mlx_load_fresh": 1.0, "get_fresh": 1.0, "memcpy_fresh": 1.0,
                            "file_write": 1.0, "put": 1.0, "file_write_grow": 1.0, "put_grow": 1.0})
    monkeypatch.setattr(_restore.cases, "peak_memory",
                        lambda work, n: seen.append(os.environ.get("PROMPTSTORE_RESTORE")) or {"rss_delta": 8})
    row = _restore.measure(64, "auto", mode="ahead")
    assert row["mode"] == "ahead" and seen == [{"PROMPTSTORE_RESTORE": "ahead"}, "ahead"]
    assert os.environ["PROMPTSTORE_RESTORE"] == "direct"


def test_chat_on_other_widths_reports_one_line_per_shape(capsys):
    """``python -m promptstore.bench._chatshapes``: the full chat on named
    shapes; what LMDB writes per put is about fixed, so the ratio falls as
    the KV per token grows."""
    from promptstore.bench import _chatshapes

    _chatshapes.main(["dense", "qwen2.5-0.5b"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["shape"] for r in rows] == ["dense", "qwen2.5-0.5b"]
    assert [r["kv_per_token"] for r in rows] == [1024, 12 * 1024]
    assert all(r["bit_exact"] and r["stored_vs_unique"] <= 1.10 for r in rows)
    assert rows[1]["lmdb_median"] < rows[0]["lmdb_median"] / 2
    with pytest.raises(SystemExit, match="unknown shape"):
        _chatshapes.main(["nope"])
