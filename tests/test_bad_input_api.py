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
