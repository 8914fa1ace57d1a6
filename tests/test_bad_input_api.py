"""Bad input to the API: a typed InvalidInput, and nothing stored is lost or changed."""

from __future__ import annotations

import json
import math

import pytest
from conftest import load_fixture

from _content import same_cache

from promptstore import InvalidInput, PromptStore
from promptstore.format import _entry
from promptstore.jobs.prefill import encode_prompt, prefill
from promptstore.jobs.warmup import read_prompts

PROMPT = "A system prompt worth keeping."


def _nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


BAD_META = [
    pytest.param({1: "x"}, "key 1", id="int-key"),
    pytest.param({(1, 2): "x"}, "key (1, 2)", id="tuple-key"),
    pytest.param({1.5: "x"}, "key 1.5", id="float-key"),
    pytest.param({None: "x"}, "key None", id="none-key"),
    pytest.param({"a": {"b": [{2: "x"}]}}, "meta['a']['b'][0]: key 2", id="nested-int-key"),
    pytest.param({"a": b"raw"}, "meta['a']: bytes", id="bytes"),
    pytest.param({"a": [1, float("nan")]}, "meta['a'][1]: nan", id="nan"),
    pytest.param({"a": {"b": float("inf")}}, "meta['a']['b']: inf", id="infinity"),
    pytest.param({"a": -float("inf")}, "meta['a']: -inf", id="minus-infinity"),
    pytest.param({"a": 2**64}, "meta['a']: the int", id="int-too-large"),
    pytest.param({"a": -(2**63) - 1}, "meta['a']: the int", id="int-too-small"),
    pytest.param({"a": object()}, "meta['a']: object", id="object"),
    pytest.param({"a": "\ud800"}, "meta['a']: not encodable", id="surrogate-value"),
    pytest.param({"\ud800": 1}, "meta key '\\ud800'", id="surrogate-key"),
    pytest.param({"a": _nested(200)}, "nested more than", id="too-deep"),
    pytest.param({"a": _nested(100_000)}, "nested more than", id="far-too-deep"),
    pytest.param([("a", 1)], "meta must be a dict", id="not-a-dict"),
]


@pytest.fixture
def pinned(tmp_path):
    """A store holding one pinned entry: ``(path, fingerprint, tokens, cache, entry id)``."""
    model, tok, fp, _ = load_fixture("llama")
    toks = encode_prompt(tok, PROMPT)
    cache = prefill(model, toks)
    path = tmp_path / "store"
    with PromptStore(path) as st:
        eid = st.put(fp, toks, cache, meta={"owner": "alice"}).id
        st.pin(eid)
    return path, fp, toks, cache, eid


def _state(st: PromptStore) -> tuple:
    return ([(i.id, i.meta, i.created) for i in st.entries()], st.pinned(), st.usage())


@pytest.mark.parametrize("meta, where", BAD_META)
def test_bad_meta_is_refused_and_the_pinned_entry_stays_bit_exact(pinned, meta, where):
    path, fp, toks, cache, eid = pinned
    with PromptStore(path) as st:
        before = _state(st)
        with pytest.raises(InvalidInput) as err:
            st.put(fp, toks, prefill(load_fixture("llama")[0], toks), meta=meta)
        assert where in str(err.value)
        assert _state(st) == before
        assert st.pinned() == [eid] and st.info(eid).meta == {"owner": "alice"}
        got = st.get(fp, toks)
        assert got is not None and same_cache(got, cache)
        assert st.verify().ok
        assert st.remove(eid).id == eid  # rm still deletes it
        assert list(st.entries()) == []


def test_good_meta_reads_back_as_written_and_prints_as_json(tmp_path):
    model, tok, fp, _ = load_fixture("llama")
    toks = encode_prompt(tok, PROMPT)
    meta = {"s": "é", "i": -(2**63), "u": 2**64 - 1, "f": 1.5, "b": True, "n": None,
            "l": [1, "two", [3.0]], "d": {"k": {"deep": _nested(20)}}}
    with PromptStore(tmp_path / "store") as st:
        eid = st.put(fp, toks, prefill(model, toks), meta=meta).id
        assert st.info(eid).meta == meta
        assert json.loads(json.dumps(st.info(eid).meta, allow_nan=False)) == meta


def test_check_meta_is_the_one_check_of_every_write():
    _entry.check_meta({"a": [1, {"b": None}], "d": _nested(_entry.MAX_META_DEPTH - 1)})
    with pytest.raises(InvalidInput, match=r"meta\['a'\]\[1\]\['b'\]: nan"):
        _entry.check_meta({"a": [1, {"b": math.nan}]})
    with pytest.raises(InvalidInput, match="nested more than"):
        _entry.check_meta({"d": _nested(_entry.MAX_META_DEPTH)})


def test_warmup_line_with_nan_or_bad_meta_is_a_line_error(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"id": 1, "prompt": "fine"}\n'
        '{"id": 2, "prompt": "x", "meta": {"a": NaN}}\n'
        '{"id": 3, "prompt": "y", "meta": {"a": [Infinity]}}\n'
        '{"id": 4, "prompt": "z", "meta": {"a": 100000000000000000000000}}\n'
        + '{"id": 5, "prompt": "w", "meta": {"a": ' + "[" * 600 + "]" * 600 + "}}\n"
        + '{"id": 6, "prompt": "v", "meta": {"a": 1}}\n'
    )
    records, errors = read_prompts(f)
    assert [r.id for r in records] == [1, 6]
    assert [(e.line, e.id) for e in errors] == [(2, 2), (3, 3), (4, 4), (5, 5)]
    assert "nan" in errors[0].reason and "inf" in errors[1].reason
    assert "out of range" in errors[2].reason and "nested" in errors[3].reason


def test_a_warmup_prompt_of_white_space_is_a_line_error_as_put_refuses_it(tmp_path):
    # Stored as the chat template's tokens alone, where `put --prompt "   "` says "empty".
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1, "prompt": "fine"}\n{"id": 2, "prompt": "   "}\n{"id": 3, "prompt": "\\n\\t"}\n')
    records, errors = read_prompts(f)
    assert [r.id for r in records] == [1]
    assert [(e.line, e.id) for e in errors] == [(2, 2), (3, 3)] and "white space" in errors[0].reason


def test_warmup_line_nested_too_deeply_is_a_line_error(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1, "prompt": "fine"}\n' + '{"id": 2, "prompt": "x", "meta": ' + "[" * 100_000 + "\n")
    records, errors = read_prompts(f)
    assert [r.id for r in records] == [1]
    assert [e.line for e in errors] == [2] and "nested too deeply" in errors[0].reason


# -- budget ----------------------------------------------------------------------


@pytest.mark.parametrize("budget", [2**64, pytest.param(2**200, id="2**200"), pytest.param(10**5000, id="10**5000"), -1, 1.5, "10", True])
def test_bad_budget_is_refused_before_the_store_is_created(tmp_path, budget):
    path = tmp_path / "store"
    with pytest.raises(InvalidInput, match="budget must be a byte count"):
        PromptStore(path, budget=budget)
    assert not path.exists()


@pytest.mark.parametrize("budget", [2**64, -1])
def test_set_budget_and_gc_refuse_a_budget_out_of_range(pinned, budget):
    path, fp, toks, _, eid = pinned
    with PromptStore(path) as st:
        before = _state(st)
        for call in (lambda: st.set_budget(budget), lambda: st.gc(budget=budget, dry_run=True), lambda: st.gc(budget=budget)):
            with pytest.raises(InvalidInput, match="budget must be a byte count"):
                call()
        assert st.budget is None and _state(st) == before


def test_the_largest_budget_the_store_holds_is_accepted(tmp_path):
    with PromptStore(tmp_path / "store", budget=2**64 - 1) as st:
        assert st.budget == 2**64 - 1
    with PromptStore(tmp_path / "store") as st:
        assert st.budget == 2**64 - 1


# -- untyped errors -----------------------------------------------------------------


def test_model_id_not_encodable_is_invalid_input(pinned):
    path, fp, toks, cache, eid = pinned
    with PromptStore(path) as st:
        before = _state(st)
        for call in (
            lambda: st.put("\ud800", toks, cache),
            lambda: st.lookup("\ud800", toks),
            lambda: st.get("\ud800", toks),
            lambda: st.exists("\ud800", toks),
            lambda: st.peek("\ud800", toks),
            lambda: st.delete("\ud800", toks),
        ):
            with pytest.raises(InvalidInput, match="not encodable as UTF-8"):
                call()
        assert _state(st) == before


@pytest.mark.parametrize("cache", [None, 5, "layers", {"a": 1}])
def test_cache_that_is_not_a_list_of_layers_is_invalid_input(pinned, cache):
    path, fp, toks, _, eid = pinned
    with PromptStore(path) as st:
        before = _state(st)
        with pytest.raises(InvalidInput, match="cache must be a list of cache layers"):
            st.put(fp, toks, cache)
        assert _state(st) == before


@pytest.mark.parametrize("plan", ["x", 5, {"evicted": []}])
def test_gc_plan_that_is_not_a_report_is_invalid_input(pinned, plan):
    path, fp, toks, _, eid = pinned
    with PromptStore(path) as st:
        before = _state(st)
        with pytest.raises(InvalidInput, match="plan must be the GcReport"):
            st.gc(plan=plan)
        with pytest.raises(InvalidInput, match="plan must be the GcReport"):
            st.set_budget(10, plan=plan)
        assert st.budget is None and _state(st) == before


def test_a_put_of_more_tokens_than_a_manifest_holds_is_refused(tmp_path):
    """A manifest reads back at most ``MAX_TOKENS`` token ids: a longer put is
    refused before anything is written, never stored unreadable."""
    import numpy as np

    from promptstore.bench import _data as data
    from promptstore.format._entry import MAX_TOKENS

    with PromptStore(tmp_path / "s") as st:
        with pytest.raises(InvalidInput, match=f"at most {MAX_TOKENS} tokens"):
            st.put("m", np.ones(MAX_TOKENS + 1, dtype=np.uint32), data.tiny_kv(3))
        assert list(st.entries()) == []


@pytest.mark.parametrize("path", [123, b"/tmp/store", "store\x00x", "store-\udcff"])
def test_a_store_path_that_cannot_name_a_folder_is_invalid_input(tmp_path, path):
    """Refused before anything is created (a reviewer saw TypeError,
    ValueError, and a UnicodeEncodeError after the folder was made)."""
    if isinstance(path, str):
        path = str(tmp_path / path)
    with pytest.raises(InvalidInput):
        PromptStore(path)
    assert list(tmp_path.iterdir()) == []


def test_a_remote_that_is_not_a_url_and_a_salvage_into_a_file_are_invalid_input(tmp_path):
    with pytest.raises(InvalidInput, match="remote must be a URL"):
        PromptStore(tmp_path / "s", remote=5)
    (tmp_path / "file").write_text("x")
    with PromptStore(tmp_path / "t") as st:
        with pytest.raises(InvalidInput, match="is a file"):
            st.salvage(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"


def test_a_salvage_into_a_folder_inside_the_source_is_invalid_input(tmp_path):
    # The source is only read: salvage wrote a new store inside it.
    from promptstore.store._salvage import salvage

    with PromptStore(tmp_path / "s") as st:
        st.put("m@x", list(range(20)), [_kv(20, 20)])
    before = sorted(p.name for p in (tmp_path / "s").iterdir())
    with pytest.raises(InvalidInput, match="inside the store"):
        salvage(tmp_path / "s", tmp_path / "s" / "inner")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == before


@pytest.mark.parametrize("src, dst, what", [
    (None, "out", "the store to salvage must be a str"),
    ("s", None, "the salvage destination must be a str"),
    ("s", 5, "the salvage destination must be a str"),
    ("s", b"out", "the salvage destination must be a str"),
    ("s", "out\0x", "the salvage destination contains a NUL byte"),
    ("s\0x", "out", "the store to salvage contains a NUL byte"),
    ("s", "", "the salvage destination is empty"),
])
def test_salvage_of_something_that_is_not_a_path_is_invalid_input(tmp_path, monkeypatch, src, dst, what):
    """salvage(None, dst) and PromptStore.salvage(None) raised TypeError, a
    NUL byte ValueError (a reviewer's finding): InvalidInput, nothing written."""
    from promptstore import salvage

    monkeypatch.chdir(tmp_path)
    with PromptStore(tmp_path / "s") as st:
        st.put("m@x", list(range(20)), [_kv(20, 20)])
        if src == "s":
            with pytest.raises(InvalidInput, match=what):
                st.salvage(dst)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(InvalidInput, match=what):
        salvage(src, dst)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("fix", ["yes", "no", 1, 0, None])
def test_verify_with_a_fix_that_is_not_a_bool_is_invalid_input(tmp_path, fix):
    """verify(fix="no") was taken as fix=True, and the report said fixed='no'
    (a reviewer's finding)."""
    with PromptStore(tmp_path / "s") as st:
        st.put("m@x", list(range(20)), [_kv(20, 20)])
        with pytest.raises(InvalidInput, match="fix must be True or False"):
            st.verify(fix=fix)
        assert st.verify(fix=False).fixed is False and st.verify(fix=True).fixed is True


@pytest.mark.parametrize("keys", [None, 5, "abc", [1, 2]])
def test_own_bytes_of_something_that_is_not_a_list_of_ids_is_invalid_input(tmp_path, keys):
    with PromptStore(tmp_path / "s") as st:
        with pytest.raises(InvalidInput, match="list of entry ids"):
            st.own_bytes(keys)
        assert st.own_bytes([]) == {}


def test_warmup_line_whose_id_is_not_utf8_is_a_line_error(tmp_path):
    """The id goes into the entry's meta as text: a lone surrogate used to pass
    the line check and fail the put of the whole batch it was prefilled in."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1, "prompt": "fine"}\n{"id": "\\ud800", "prompt": "x"}\n{"id": 3, "prompt": "y"}\n')
    records, errors = read_prompts(f)
    assert [r.id for r in records] == [1, 3]
    assert [e.line for e in errors] == [2] and "UTF-8" in errors[0].reason


def test_an_empty_store_path_is_invalid_input(tmp_path, monkeypatch):
    """``PromptStore("")`` opened the current directory as a store."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInput, match="store path is empty"):
        PromptStore("")
    assert list(tmp_path.iterdir()) == []


def test_meta_with_a_tuple_is_returned_as_it_reads_back(pinned):
    """README: put's meta is what reads back as written. A tuple is stored as
    a list; the EntryInfo put returned held the tuple (a docs reviewer's finding)."""
    path, fp, toks, cache, eid = pinned
    with PromptStore(path) as st:
        info = st.put(fp, toks, cache, meta={"a": (1, (2, 3)), "b": {"c": ()}})
        assert info.meta == st.info(info.id).meta == {"a": [1, [2, 3]], "b": {"c": []}}


def test_a_model_identity_longer_than_a_manifest_string_is_refused(tmp_path):
    """A manifest string reads back at most 1 MiB (the reader's max_str_len):
    a longer model identity was stored and every read said CorruptEntry."""
    import mlx.core as mx

    from promptstore.bench import _data as data

    with PromptStore(tmp_path / "s") as st:
        st.put("m@short", [1, 2, 3], data.tiny_kv(3))
        before = _state(st)
        with pytest.raises(InvalidInput, match="manifest could not be read back.*max_str_len"):
            st.put("m@" + "x" * (1 << 20), [1, 2, 3], data.tiny_kv(3))
        assert _state(st) == before and st.verify().problems == ()
        # a payload large enough for a blob file: refused as its manifest is
        # made final, inside the transaction, and its file removed
        big = [_kv(3, 3), _arrays_of(2)]
        blobs = tmp_path / "s" / "blobs"
        big[1][0] = mx.ones((1, 1 << 18), dtype=mx.float32)
        with pytest.raises(InvalidInput, match="manifest could not be read back.*max_str_len"):
            st.put("m@" + "x" * (1 << 20), [1, 2, 3], big)
        assert _state(st) == before and st.verify().problems == ()
        assert not (blobs.is_dir() and any(blobs.iterdir())) and st.verify().orphan_blobs == 0
        st.put("m@short", [1, 2, 3], big)  # the same as a blob entry under a short model id
        assert blobs.is_dir() and any(blobs.iterdir())
        long = "m@" + "x" * ((1 << 20) - 2)  # at the limit: stored and read back
        st.put(long, [1, 2, 3], data.tiny_kv(3))
        assert same_cache(st.get(long, [1, 2, 3]), data.tiny_kv(3))


def test_an_entry_of_more_blocks_than_a_manifest_lists_is_cut_in_longer_blocks(tmp_path):
    """With block_tokens=1, 66,000 tokens made 66,000 block bounds (and parts
    lists as long), over the reader's max_array_len (MAX_ARRAYS): the put
    succeeded and every read then said CorruptEntry. The blocks after the
    shared prefix are cut longer instead, so the entry reads back."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from _raw import raw_manifest

    n = 66_000
    toks = list(range(1, n + 1))
    kv = KVCache()
    kv.update_and_fetch(*(mx.arange(n * 2, dtype=mx.float32).reshape(1, 1, n, 2).astype(mx.float16) + i for i in (0, 1)))
    with PromptStore(tmp_path / "s", block_tokens=1) as st:
        eid = st.put("m@x", toks, [kv]).id
        bounds = raw_manifest(st, eid)["bounds"]
        assert len(bounds) <= _entry.MAX_ARRAYS and bounds[-1] == n
        assert same_cache(st.get("m@x", toks), [kv])
        hit = st.lookup("m@x", toks[:1000] + [0])
        assert hit.matched == 1000 and hit.cache[0].offset == 1000
        assert st.verify().problems == ()



def test_block_bounds_never_outgrow_a_manifest_list():
    from promptstore.format._blocks import plan_bounds

    def ok(bounds, n):
        return len(bounds) <= _entry.MAX_ARRAYS and bounds[-1] == n and all(b > a for a, b in zip((0,) + bounds, bounds))

    assert plan_bounds((), 0, 1 << 20, 16) == tuple(range(16, (1 << 20) + 1, 16))  # 1 Mi tokens by 16: just fits
    longer = plan_bounds((), 0, 1_100_000, 16)  # 68,750 blocks of 16: cut in blocks of 17 instead
    assert ok(longer, 1_100_000) and longer[:2] == (17, 34)
    base = tuple(range(1, 30_001))  # a stored entry cut by 1, sharing 30,000 tokens: its ends kept, the rest longer
    cut = plan_bounds(base, 30_000, 200_000, 1)
    assert ok(cut, 200_000) and cut[:30_000] == base
    full = tuple(range(1, _entry.MAX_ARRAYS + 1))  # a base whose ends alone fill a list: not followed
    assert ok(plan_bounds(full, _entry.MAX_ARRAYS, 70_000, 1), 70_000)
    assert ok(plan_bounds(full + (70_000,), 70_000, 70_000, 1), 70_000)


# -- caches built by hand (also tests/test_bad_input_layers.py) ----------------


def _kv(n_pos, offset, keys=True):
    from mlx_lm.models.cache import KVCache
    import mlx.core as mx

    c = KVCache()
    c.keys = mx.ones((1, 2, n_pos, 4)) if keys else None
    c.values = mx.ones((1, 2, n_pos, 4))
    c.offset = offset
    return c


def _arrays_of(ndim):
    from mlx_lm.models.cache import ArraysCache
    import mlx.core as mx

    a = ArraysCache(1)
    a[0] = mx.ones((1,) * ndim)
    return a


# -- plans, store options, closed stores, serving-cache arguments ---------------


@pytest.mark.parametrize("evicted", ["0123456789abcdef", None, ("0123",), (1,)], ids=["a-string", "none", "a-prefix", "an-int"])
def test_a_gc_plan_whose_ids_are_not_whole_ids_is_refused_and_evicts_nothing(tmp_path, evicted):
    from promptstore import GcReport

    with PromptStore(tmp_path / "s") as st:
        for i in range(12):
            st.put("m@x", list(range(i, i + 20)), [_kv(20, 20)])
        plan = st.gc(budget=0, dry_run=True)
        # A string walked character by character evicted entries never planned.
        bad = GcReport(evicted, plan.freed, plan.usage, plan.budget, True)
        with pytest.raises(InvalidInput, match="plan.evicted"):
            st.gc(plan=bad)
        assert len(list(st.entries())) == 12


def test_a_gc_plan_with_bad_created_times_is_refused(tmp_path):
    from promptstore import GcReport

    with PromptStore(tmp_path / "s") as st:
        st.put("m@x", list(range(20)), [_kv(20, 20)])
        plan = st.gc(budget=0, dry_run=True)
        with pytest.raises(InvalidInput, match="plan.created"):
            st.gc(plan=GcReport(plan.evicted, plan.freed, plan.usage, plan.budget, True, created=None))  # type: ignore[arg-type]
        assert len(list(st.entries())) == 1


@pytest.mark.parametrize("plan", [[None], None, "abc", [1]], ids=["none-item", "none", "a-string", "an-int"])
def test_remove_planned_takes_entry_infos_only(tmp_path, plan):
    with PromptStore(tmp_path / "s") as st:
        st.put("m@x", list(range(20)), [_kv(20, 20)])
        with pytest.raises(InvalidInput, match="EntryInfo"):
            st.remove_planned(plan)
        assert len(list(st.entries())) == 1


@pytest.mark.parametrize("size", [-1, 0, "x", True, 1 << 60], ids=["negative", "zero", "a-string", "a-bool", "too-large"])
def test_a_bad_map_size_is_refused_before_the_folder_is_made(tmp_path, size):
    with pytest.raises(InvalidInput, match="map_size"):
        PromptStore(tmp_path / "s", map_size=size)
    assert not (tmp_path / "s").exists()


def test_touch_on_a_closed_store_raises_store_closed(tmp_path):
    from promptstore import StoreClosed

    st = PromptStore(tmp_path / "s")
    st.close()
    with pytest.raises(StoreClosed):
        st.touch("m@x", list(range(20)))


def test_row_nbytes_takes_a_list_of_layers():
    from promptstore.rows import row_nbytes

    with pytest.raises(InvalidInput, match="list of cache layers"):
        row_nbytes(None)
    assert row_nbytes([_kv(20, 20)]) == 2 * 1 * 2 * 20 * 4 * 4


def test_serving_cache_refuses_bad_arguments_and_misses_float_tokens(tmp_path):
    from promptstore import PersistentPromptCache

    toks = list(range(1, 21))
    with PromptStore(tmp_path / "s") as st:
        pc = PersistentPromptCache(st)
        try:
            pc.insert_cache("m@x", toks, [_kv(20, 20)])
            pc.flush()
            assert pc.fetch_nearest_cache("m@x", toks + [5])[0] is not None
            # Floats were truncated to int64: 1.9 read as token 1, a hit on another prompt.
            assert pc.fetch_nearest_cache("m@x", [t + 0.9 for t in toks] + [5.0])[0] is None
            with pytest.raises(InvalidInput, match="list of token ids"):
                pc.fetch_nearest_cache("m@x", None)
            with pytest.raises(InvalidInput, match="n_sequences"):
                pc.trim_to(n_sequences="a")
            with pytest.raises(InvalidInput, match="n_bytes"):
                pc.trim_to(n_bytes=1.5)
        finally:
            pc.close()


def test_a_store_path_that_is_a_dangling_link_says_so(tmp_path):
    from promptstore import StoreUnavailable

    (tmp_path / "s").symlink_to(tmp_path / "nowhere")
    with pytest.raises(StoreUnavailable, match="a symbolic link to .*nowhere, which does not exist"):
        PromptStore(tmp_path / "s")


def test_a_warmup_id_that_is_not_a_finite_number_is_a_line_error(tmp_path):
    # `warmup --json` printed the id back as a bare NaN, which is not JSON.
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1, "prompt": "fine"}\n{"id": NaN, "prompt": "x"}\n{"id": -Infinity, "prompt": "y"}\n')
    records, errors = read_prompts(f)
    assert [r.id for r in records] == [1]
    assert [(e.line, e.id) for e in errors] == [(2, "nan"), (3, "-inf")] and "finite" in errors[0].reason


def test_a_manifest_too_large_says_what_made_it_large():
    import numpy as np

    common = dict(model="m", model_name="m", layers=[], payload=0, created=0.0, trimmable=True, entry_id="0" * 16)
    with pytest.raises(InvalidInput, match="store less meta"):
        _entry.pack_manifest(tokens=np.arange(4), meta={f"k{i}": "x" * (1 << 20) for i in range(65)}, **common)
    with pytest.raises(InvalidInput, match=r"17000000 tokens in 1 blocks over 0 layers: a larger block_tokens"):
        _entry.pack_manifest(tokens=np.zeros(17_000_000, dtype=np.uint32), meta={}, **common)
