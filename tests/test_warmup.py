"""Warm-up jobs: hits after warm-up, boundary checkpoints, batched == serial
byte for byte, SIGKILL half way then resume, bad lines, the CLI."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from conftest import ROOT, backend, load_fixture
from promptstore import CorruptEntry, PromptStore
from promptstore import warmup
from promptstore.cli import main
from promptstore.codecs import encode_layer
from promptstore.jobs.prefill import encode_prompt, prefill
from promptstore.jobs.checkpoints import message_boundaries
from promptstore.jobs.warmup import read_prompts
from _bits import bits_equal

PROMPTS = ROOT / "fixtures" / "prompts" / "sample20.jsonl"
BAD = ROOT / "fixtures" / "prompts" / "bad_lines.jsonl"
EVERY = 32


def _records():
    return [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]


def _tokens(tok, rec):
    return encode_prompt(tok, rec.get("prompt"), rec.get("messages"))


def _warm(path, name, batch_size, every=EVERY, **kw):
    model, tok, _, mdir = load_fixture(name)
    with PromptStore(path) as st:
        return warmup(st, mdir, PROMPTS, batch_size=batch_size, checkpoint_every=every, loaded=(model, tok), **kw)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """Each fixture model warmed once, batched (4) and serial (1)."""
    out = {}
    for name in ("llama", "qwen3_next", "qwen3_5"):
        for bs in (4, 1):
            path = tmp_path_factory.mktemp(f"{name}-{bs}") / "store"
            out[name, bs] = (path, _warm(path, name, bs))
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_every_prompt_hits_at_full_coverage(warmed, name):
    path, summary = warmed[name, 4]
    model, tok, fp, _ = load_fixture(name)
    assert (summary.prompts, summary.stored, summary.skipped, summary.failed) == (20, 20, 0, 0)
    assert summary.ok
    # Batched where a batch prefills bit-identically to serial rows; the job's
    # probe falls back to serial where kernels depend on shape (README,
    # "Fidelity contract"), and every prompt must hit all the same.
    assert summary.batched or backend() != "cpu"
    with PromptStore(path) as st:
        for rec in _records():
            toks = _tokens(tok, rec)
            hit = st.lookup(fp, toks)
            assert hit is not None, rec["id"]
            assert (hit.matched, hit.trimmed) == (len(toks), 0), rec["id"]
            assert hit.info.meta["warmup"] == rec["id"]
        entries = list(st.entries())
        assert len(entries) == 20 + summary.checkpoints
        assert st.verify().ok
    if name == "llama":
        assert summary.checkpoints == 0  # trimmable: lookup trims instead
    else:
        assert summary.checkpoints > 0


def _branch(rec):
    """The warmed conversation up to its first user turn, then another reply and one more user turn."""
    return rec["messages"][:2] + [{"role": "assistant", "content": "Zebra."}, {"role": "user", "content": "Tell me more about zebras."}]


@pytest.mark.shape_dependent  # the reference: a fresh prefill of the whole query
@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_extended_conversation_hits(warmed, name):
    path, _ = warmed[name, 4]
    model, tok, fp, _ = load_fixture(name)
    rec = next(r for r in _records() if r["id"] == "chat-4")
    warm = _tokens(tok, rec)
    # 1. The whole warmed conversation plus a reply and one more user turn: hits all of it.
    longer = encode_prompt(tok, messages=rec["messages"] + [{"role": "assistant", "content": "Both."}, {"role": "user", "content": "Why?"}])
    assert longer[: len(warm)] == warm
    with PromptStore(path) as st:
        hit = st.lookup(fp, longer)
        assert (hit.matched, hit.trimmed) == (len(warm), 0)
        # 2. A branch after the first user turn.
        q = encode_prompt(tok, messages=_branch(rec))
        common = next(i for i, (a, b) in enumerate(zip(q, warm)) if a != b)
        boundary = message_boundaries(tok, rec["messages"], warm)[1]  # end of the first user turn
        assert boundary == len(encode_prompt(tok, messages=rec["messages"][:2])) and boundary <= common
        hit = st.lookup(fp, q)
        assert hit is not None
        if name == "llama":  # dense: a longer warmed entry trimmed down
            assert hit.trimmed > 0 and 0 < hit.matched <= common
        else:  # hybrid: the deepest checkpoint inside the common prefix, never trimmed
            assert hit.trimmed == 0
            assert hit.matched == max([boundary] + [k for k in range(EVERY, common + 1, EVERY)])
            assert hit.info.meta["checkpoint"] in ("boundary", f"every {EVERY}")
        # The restored cache continues exactly like a fresh prefill of the whole query.
        ref = prefill(model, q)
        cont = prefill(model, q[hit.matched :], cache=hit.cache)
        for a, b in zip(ref, cont):
            ea, eb = encode_layer(a), encode_layer(b)
            assert all(bits_equal(ea.arrays[k], eb.arrays[k]).item() for k in ea.arrays)


def test_dense_branch_trims_the_warmed_conversation(store):
    model, tok, fp, mdir = load_fixture("llama")
    rec = next(r for r in _records() if r["id"] == "chat-4")
    s = warmup(store, mdir, [rec], loaded=(model, tok))
    assert (s.stored, s.checkpoints) == (1, 0)
    warm, q = _tokens(tok, rec), encode_prompt(tok, messages=_branch(rec))
    common = next(i for i, (a, b) in enumerate(zip(q, warm)) if a != b)
    hit = store.lookup(fp, q)
    assert (hit.matched, hit.trimmed) == (common, len(warm) - common)


def test_readonly_open_of_an_existing_store(tmp_path):
    PromptStore(tmp_path / "s").close()
    with PromptStore(tmp_path / "s", readonly=True) as st:
        assert list(st.entries()) == []


def test_lookup_trims_the_longest_common_prefix(warmed):
    path, _ = warmed["llama", 4]
    model, tok, fp, _ = load_fixture("llama")
    q = encode_prompt(tok, messages=_branch(next(r for r in _records() if r["id"] == "chat-4")))
    with PromptStore(path) as st:
        best = 0
        for e in st.entries():
            t = st.tokens(e.id)
            best = max(best, next((i for i, (a, b) in enumerate(zip(q, t)) if a != b), min(len(q), len(t))))
        assert st.lookup(fp, q).matched == best


def test_hybrid_boundary_checkpoint_exactly(store):
    """With periodic checkpoints off, a branch hits exactly at the end-of-user-turn checkpoint."""
    model, tok, fp, mdir = load_fixture("qwen3_next")
    rec = next(r for r in _records() if r["id"] == "chat-4")
    s = warmup(store, mdir, [rec], checkpoint_every=0, loaded=(model, tok))
    assert (s.stored, s.checkpoints) == (1, 2)  # end of system, end of first user turn
    hit = store.lookup(fp, encode_prompt(tok, messages=_branch(rec)))
    assert hit.matched == len(encode_prompt(tok, messages=rec["messages"][:2])) and hit.trimmed == 0
    assert hit.info.meta == {"checkpoint": "boundary"}


def _dump(path):
    """Every entry: manifest fields but the creation time, and its chunk bytes."""
    from promptstore.format import _entry
    from promptstore.store import _keys

    out = {}
    with PromptStore(path) as st, st.env.read() as txn:
        for k, raw in txn.cursor(db=st._db[b"entries"]):
            k = bytes(k)
            man = _entry.unpack_manifest(bytes(raw), "test")
            chunks = [bytes(txn.get(k + _keys.u32(i), db=st._db[b"chunks"])) for i in range(man.chunks)]
            out[k] = (man.model, man.tokens.tolist(), man.layers, man.payload, man.trimmable, man.meta, chunks)
    return out


@pytest.mark.shape_dependent  # the reference: prefills one prompt at a time
@pytest.mark.parametrize("name", ["llama", "qwen3_next", "qwen3_5"])
def test_batched_entries_byte_identical_to_serial(warmed, name):
    batched, serial = _dump(warmed[name, 4][0]), _dump(warmed[name, 1][0])
    assert warmed[name, 4][1].batched and not warmed[name, 1][1].batched
    assert set(batched) == set(serial) and len(batched) == 20 + warmed[name, 4][1].checkpoints
    for k in batched:
        assert batched[k] == serial[k], k.hex()


@pytest.mark.shape_dependent  # the reference: one prefill per prompt
def test_batched_equals_plain_prefill_dense(warmed):
    """The dense batched entries equal what `promptstore put` (one prefill) stores."""
    model, tok, fp, _ = load_fixture("llama")
    with PromptStore(warmed["llama", 4][0]) as st:
        for rec in _records()[:6]:
            toks = _tokens(tok, rec)
            for a, b in zip(st.get(fp, toks), prefill(model, toks)):
                ea, eb = encode_layer(a), encode_layer(b)
                assert ea.meta == eb.meta
                assert all(bits_equal(ea.arrays[k], eb.arrays[k]).item() for k in ea.arrays)


def test_rerun_skips_everything(warmed, tmp_path):
    path, first = warmed["qwen3_next", 4]
    again = _warm(path, "qwen3_next", 4)
    assert (again.stored, again.skipped, again.checkpoints, again.tokens, again.bytes) == (0, 20, 0, 0, 0)


def test_probe_falls_back_when_batching_is_not_exact(warmed, monkeypatch, tmp_path):
    """If the first batch differs from a serial prefill by one bit, the job goes serial."""
    w = importlib.import_module("promptstore.jobs.warmup")  # the package's `warmup` attribute is the function

    calls = []
    monkeypatch.setattr(w, "_same_entry", lambda a, b: calls.append(1) and False)
    s = _warm(tmp_path / "s", "qwen3_next", 4)
    assert calls and not s.batched and "not bit-identical" in s.note
    assert (s.stored, s.failed) == (20, 0)
    assert _dump(tmp_path / "s") == _dump(warmed["qwen3_next", 1][0])  # the probe stored nothing of its batch


def test_bad_lines_reported_job_continues(store):
    model, tok, fp, mdir = load_fixture("llama")
    s = warmup(store, mdir, BAD, loaded=(model, tok))
    assert [(e.line, e.id) for e in s.errors] == [(2, None), (3, "both"), (5, "empty"), (6, "badmsg"), (7, None)]
    assert "not JSON" in s.errors[0].reason and "exactly one" in s.errors[1].reason
    assert (s.prompts, s.stored, s.failed) == (7, 2, 5) and not s.ok
    recs, errs = read_prompts(BAD)
    assert [r.id for r in recs] == ["ok-1", "ok-2"] and len(errs) == 5


def test_cli_json_and_exit_codes(tmp_path):
    runner = CliRunner(mix_stderr=False) if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else CliRunner()
    args = ["--store", str(tmp_path / "s"), "warmup", "--model", str(ROOT / "fixtures/models/llama"), "--json"]
    r = runner.invoke(main, args + [str(BAD)])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert (doc["stored"], doc["failed"], doc["prompts"]) == (2, 5, 7)
    assert [e["line"] for e in doc["errors"]] == [2, 3, 5, 6, 7]
    r = runner.invoke(main, args + ["--batch-size", "3", str(PROMPTS)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (doc["stored"], doc["skipped"], doc["failed"], doc["batch_size"]) == (20, 0, 0, 3)
    assert isinstance(doc["bytes"], int) and doc["bytes"] > 0
    r = runner.invoke(main, args[:-1] + [str(PROMPTS)])
    assert r.exit_code == 0 and "0 stored, 20 skipped, 0 failed" in r.stdout


def _count(path) -> int:
    # Not readonly=True: that open fails on any store (StoreError mdb_get EINVAL, reported).
    try:
        with PromptStore(path) as st:
            return len(list(st.entries()))
    except Exception:
        return 0  # not created yet


def test_sigkill_half_way_then_resume(warmed, tmp_path):
    """A real `python -m promptstore.cli warmup` killed with SIGKILL half way; the re-run completes
    with exactly the entries of an uninterrupted run, byte for byte, and nothing partial."""
    ref_path, ref = warmed["qwen3_next", 1]
    expected = 20 + ref.checkpoints
    path = tmp_path / "s"
    cmd = [sys.executable, "-m", "promptstore.cli", "--store", str(path), "warmup", "--model",
           str(ROOT / "fixtures/models/qwen3_next"), "--batch-size", "2", "--checkpoint-every", str(EVERY), "--json", str(PROMPTS)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    seen = 0
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        seen = _count(path)
        if seen >= expected // 2:
            break
        time.sleep(0.002)
    assert proc.poll() is None, "the job finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    after_kill = _count(path)
    assert expected // 2 <= after_kill < expected
    with PromptStore(path) as st:
        assert st.verify().ok  # nothing partial
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["skipped"] > 0 and doc["stored"] + doc["skipped"] == 20 and doc["failed"] == 0
    with PromptStore(path) as st:
        rep = st.verify()
        assert rep.ok and rep.checked == expected
        assert len(list(st.entries())) == expected
    resumed = _dump(path)
    assert resumed == _dump(ref_path)


@pytest.mark.parametrize("batch_size", [8, 1])
def test_a_budget_stops_the_job_before_it_evicts_what_it_warmed(tmp_path, batch_size):
    """With a byte budget the job stops before the entry that would take its
    bytes past it: it used to write the whole batch, evict its own first
    entries, and still count them as stored."""
    model, tok, _, mdir = load_fixture("qwen3_next")
    with PromptStore(tmp_path / "s") as st:
        st.set_budget(200_000)
        summary = warmup(st, mdir, PROMPTS, batch_size=batch_size, checkpoint_every=0, loaded=(model, tok))
        entries = list(st.entries())
        assert summary.stopped and "budget" in summary.stopped
        assert 0 < summary.stored < 20 and summary.bytes <= 200_000
        assert len(entries) == summary.stored + summary.checkpoints  # nothing it wrote was evicted
        assert summary.bytes == st.usage() <= 200_000  # arrays and manifests, as the budget counts them
        again = warmup(st, mdir, PROMPTS, batch_size=batch_size, checkpoint_every=0, loaded=(model, tok))
        assert again.skipped == summary.stored  # what it stored is still there for a resumed job


def test_a_budget_set_while_the_job_runs_stops_it_before_it_evicts_what_it_warmed(tmp_path):
    """Another process sets a budget (``promptstore gc --budget``) while the
    job runs: the job stops before it evicts what it warmed. It read the
    budget once, at its start: it went on, evicted its own entries, and
    reported them stored."""
    model, tok, _, mdir = load_fixture("qwen3_next")
    path = tmp_path / "s"
    with PromptStore(path) as st:

        def progress(done, total, tokens, seconds):
            if done == 2 and st.budget is None:  # room for a few more entries, not for all
                gc = subprocess.run([sys.executable, "-m", "promptstore.cli", "--store", str(path), "gc",
                                     "--budget", str(st.usage() + 60_000), "--yes"], capture_output=True, text=True)
                assert gc.returncode == 0 and st.budget is not None, gc.stderr

        summary = warmup(st, mdir, PROMPTS, batch_size=1, checkpoint_every=0, loaded=(model, tok), progress=progress)
        assert summary.stopped and "budget" in summary.stopped
        assert 2 < summary.stored < 20
        assert len(list(st.entries())) == summary.stored + summary.checkpoints  # nothing it wrote was evicted
        assert st.verify().ok


def test_a_budget_of_exactly_the_jobs_bytes_stores_every_prompt_and_evicts_none(tmp_path):
    """The job counted array bytes only, the budget manifests too: under a
    budget of exactly what the job writes, the last put evicted the first
    prompt, and the summary still said every prompt was stored."""
    model, tok, _, mdir = load_fixture("llama")
    lines = [{"id": f"p{i}", "prompt": f"{w} " + "word " * (5 + 7 * i)}
             for i, w in enumerate(["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"])]
    with PromptStore(tmp_path / "free") as st:
        free = warmup(st, mdir, lines, batch_size=1, checkpoint_every=0, loaded=(model, tok))
        assert free.stored == 6 and free.bytes == st.usage()
    with PromptStore(tmp_path / "s") as st:
        st.set_budget(free.bytes)
        summary = warmup(st, mdir, lines, batch_size=1, checkpoint_every=0, loaded=(model, tok))
        entries = list(st.entries())
        assert len(entries) == summary.stored + summary.checkpoints  # nothing it counted as stored was evicted
        assert summary.bytes == st.usage() <= free.bytes
        if summary.stopped is None:
            assert summary.stored == 6
        else:  # its estimate of the next manifest is an upper bound: it may stop one short, never evict
            assert "budget" in summary.stopped and summary.stored == 5


def test_a_budget_counts_what_the_store_took_so_shared_prefixes_count_once(tmp_path):
    """Four prompts sharing their first 1,536 tokens (three shared blocks):
    the job counted each entry's whole bytes, so it stopped after two under a
    4 MB budget ("the job wrote 3.5 MB"), where the store held 1.8 MB and all
    four fit. It counts what each put added now (``EntryInfo.added``)."""
    model, tok, _, mdir = load_fixture("llama")
    base = " ".join(f"rule {i}: keep caches warm." for i in range(120))
    lines = [{"id": f"p{i}", "prompt": base + f" Now answer question number {i} briefly."} for i in range(4)]
    with PromptStore(tmp_path / "s") as st:
        st.set_budget(4_000_000)
        summary = warmup(st, mdir, lines, batch_size=1, checkpoint_every=0, loaded=(model, tok))
        entries = list(st.entries())
        assert summary.stopped is None and summary.stored == 4 and len(entries) == 4
        assert summary.bytes <= st.usage() <= 4_000_000
        assert summary.bytes < sum(e.nbytes for e in entries) / 2  # the shared blocks once


class FailsOneRow:
    """The real store, whose put of exactly ``bad`` tokens fails."""

    def __init__(self, store, bad):
        self._store, self._bad = store, bad

    def __getattr__(self, name):
        return getattr(self._store, name)

    def put(self, model_id, tokens, cache, **kw):
        if list(tokens) == self._bad:
            raise CorruptEntry("injected: this row's put fails")
        return self._store.put(model_id, tokens, cache, **kw)


def test_one_bad_row_fails_only_its_own_line_in_a_batch(tmp_path):
    """An id over the meta limit (stored as meta["warmup"]) failed the whole
    batch it was prefilled in: "stored 4, failed 5", every line with its
    reason. It is a line error now; and a row whose put fails in a batch is
    found by putting the batch's rows one at a time."""
    model, tok, fp, mdir = load_fixture("llama")
    lines = [{"id": "a", "prompt": "First fine prompt about caches."},
             {"id": "b", "prompt": "Second fine prompt about caches, longer."},
             {"id": "x" * ((1 << 20) + 1), "prompt": "Third prompt, whose id is too long to store."},
             {"id": "d", "prompt": "Fourth fine prompt about caches, the longest of them all here."},
             {"id": "e", "prompt": "Fifth."}]
    with PromptStore(tmp_path / "s") as st:
        s = warmup(st, mdir, lines, batch_size=8, loaded=(model, tok))
        assert (s.stored, s.failed) == (4, 1) and [e.line for e in s.errors] == [3]
    bad = encode_prompt(tok, lines[3]["prompt"])

    good = [line for k, line in enumerate(lines) if k != 2]
    with PromptStore(tmp_path / "t") as st:
        s = warmup(FailsOneRow(st, bad), mdir, good, batch_size=8, loaded=(model, tok))
        assert (s.stored, s.failed) == (3, 1) and [(e.line, e.id) for e in s.errors] == [(3, "d")]
        assert "injected" in s.errors[0].reason
        assert len(list(st.entries())) == 3
        for line in good:
            tokens = encode_prompt(tok, line["prompt"])
            assert st.exists(fp, tokens) == (tokens != bad)


def _entries(path) -> dict:
    """Every entry of a store: id -> (kinds and metas, array bytes), read back."""
    from promptstore.format._payload import host_bytes

    out = {}
    with PromptStore(path) as st:
        for info in st.entries():
            enc = [encode_layer(layer) for layer in st.load(info.id)[0]]
            out[info.id] = ([(e.kind, e.meta) for e in enc], [bytes(host_bytes(a)) for e in enc for a in e.arrays.values()])
    return out


def test_a_resumed_job_stores_what_an_uninterrupted_one_does(tmp_path):
    """A sliding window's cache at a checkpoint depends on where prefill
    stopped before it. A resumed job skipped the checkpoints already stored,
    stopped prefill at fewer places, and stored other final entries (11 of 13
    differed on gemma3_text, one 6x larger) under the same ids."""
    import shutil

    model, tok, _, mdir = load_fixture("gemma3_text")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    with PromptStore(whole) as st:
        warmup(st, mdir, PROMPTS, batch_size=1, checkpoint_every=EVERY, loaded=(model, tok))
    shutil.copytree(whole, resumed)
    with PromptStore(resumed) as st:  # as if killed after each prompt's checkpoints, before its final entry
        finals = [i for i in st.entries() if "warmup" in i.meta and "checkpoint" not in i.meta]
        gone = [i for i in finals if i.n_tokens > EVERY]
        for info in gone:
            st.remove(info.id)
    assert len(gone) >= 5
    with PromptStore(resumed) as st:
        s = warmup(st, mdir, PROMPTS, batch_size=1, checkpoint_every=EVERY, loaded=(model, tok))
    assert s.stored == len(gone)
    assert _entries(resumed) == _entries(whole)


def test_rows_put_again_after_a_failed_batch_do_not_count_their_checkpoints_twice(tmp_path):
    """A batch whose put failed runs its rows again one at a time: their
    checkpoints, stored the first time, were put and counted again (in
    ``checkpoints`` and ``bytes``, which a budget stops on)."""
    model, tok, fp, mdir = load_fixture("qwen3_next")
    lines = [{"id": k, "prompt": f"Prompt number {k} about caches: " + "more words here " * (4 + 3 * k)} for k in range(3)]
    bad = encode_prompt(tok, lines[1]["prompt"])

    with PromptStore(tmp_path / "s") as st:
        s = warmup(FailsOneRow(st, bad), mdir, lines, batch_size=3, checkpoint_every=8, loaded=(model, tok))
        entries = list(st.entries())
        assert (s.stored, s.failed) == (2, 1) and s.checkpoints > 0
        assert len(entries) == s.stored + s.checkpoints and s.bytes == st.usage()


@pytest.mark.parametrize("block_tokens", [16, 64, 512])
def test_the_manifest_bound_holds_at_every_block_size(tmp_path, block_tokens):
    """It assumed blocks of 128 tokens: with 16-token blocks a manifest took
    1.4x the bound, and the job's check could pass where the put evicted
    (a reviewer's finding). It takes the shortest block now."""
    from promptstore.bench import _data as data
    from promptstore.format import _entry

    grower = data.Grower(data.DENSE, 1)
    cache = grower.empty()
    grower.extend(cache, 4096)
    with PromptStore(tmp_path / "s", block_tokens=block_tokens) as st:
        meta = {"warmup": "p1"}
        st.put("m@0123456789abcdef", list(range(4096)), cache, meta=meta)
        with st.env.read() as txn:
            (raw,) = [bytes(v) for _, v in txn.cursor(db=st._db.entries)]
        arrays = sum(len(encode_layer(layer).arrays) for layer in cache)
        assert len(raw) <= _entry.manifest_bound(4096, arrays, meta, block_tokens)
