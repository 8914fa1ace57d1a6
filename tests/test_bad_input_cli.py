"""Bad input at the command line: a usage error (exit 2) or an expected error (exit 1),
JSON under --json, never a traceback or an "unexpected" bug line, and the store untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import MODELS

from promptstore import PromptStore
from promptstore.cli import main

LLAMA = str(MODELS / "llama")
HUGE = str(2**64)  # one more than a store's budget can be


@pytest.fixture
def cli(tmp_path):
    runner = CliRunner()
    store_dir = str(tmp_path / "store")

    def run(*args, code=0):
        result = runner.invoke(main, ["--store", store_dir, *args])
        assert result.exit_code == code, (result.exit_code, result.output, result.exception)
        out = result.output + (result.stderr if result.stderr_bytes is not None else "")
        assert "Traceback" not in out and "unexpected" not in out and "a bug" not in out, out
        return result

    run.store_dir = store_dir
    return run


def js(result):
    return json.loads(result.stdout)


@pytest.fixture
def stored(cli):
    """One pinned entry in the store; its id."""
    eid = js(cli("put", "--model", LLAMA, "--prompt", "keep me", "--meta", "owner=alice", "--json"))["id"]
    with PromptStore(cli.store_dir) as st:
        st.pin(eid)
    return eid


def _listing(cli):
    return sorted((e["id"], json.dumps(e["meta"], sort_keys=True), e["created"]) for e in js(cli("ls", "--json")))


# -- meta ---------------------------------------------------------------------------


def test_put_meta_that_is_not_utf8_is_a_usage_error_before_prefill(cli, stored):
    before = _listing(cli)
    doc = js(cli("put", "--model", LLAMA, "--prompt", "keep me", "--meta", "owner=\udcff", "--json", code=2))
    assert doc["error"] == "UsageError" and "--meta" in doc["message"] and "meta['owner']" in doc["message"]
    assert _listing(cli) == before
    with PromptStore(cli.store_dir) as st:
        assert st.pinned() == [stored] and st.info(stored).meta == {"owner": "alice"}


def test_warmup_nan_and_deep_lines_are_line_errors_and_the_job_goes_on(cli, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"id": "a", "prompt": "first good prompt"}\n'
        '{"id": "nan", "prompt": "x", "meta": {"a": NaN}}\n'
        '{"id": "deep", "prompt": "y", "meta": {"a": ' + "[" * 100_000 + "\n"
        '{"id": "b", "prompt": "second good prompt", "meta": {"n": 1.5}}\n'
    )
    doc = js(cli("warmup", "--model", LLAMA, "--batch-size", "8", str(f), "--json", code=1))
    assert (doc["stored"], doc["failed"], doc["prompts"]) == (2, 2, 4)
    assert [(e["line"], e["id"]) for e in doc["errors"]] == [(2, "nan"), (3, None)]
    assert "nan" in doc["errors"][0]["reason"] and "nested too deeply" in doc["errors"][1]["reason"]
    listing = js(cli("ls", "--json"))  # every stored meta prints as JSON (no NaN)
    assert sorted(e["meta"]["warmup"] for e in listing) == ["a", "b"]
    human = cli("warmup", "--model", LLAMA, str(f), code=1)
    assert f"{f}:2 (nan): " in human.output and f"{f}:3: " in human.output


# -- budget -------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [["--yes"], ["--dry-run"], ["--yes", "--json"], ["--dry-run", "--json"]])
@pytest.mark.parametrize("budget", [HUGE, "18446744073709551616B", "20000000TB", pytest.param("9" * 5000, id="5000-digits")])
def test_gc_budget_out_of_range_is_a_usage_error(cli, stored, budget, extra):
    before = _listing(cli)
    r = cli("gc", "--budget", budget, *extra, code=2)
    if "--json" in extra:
        doc = js(r)
        assert doc["error"] == "UsageError" and "--budget" in doc["message"] and "larger than a store's budget" in doc["message"]
    else:
        assert "--budget" in r.output and "larger than a store's budget" in r.output
    assert _listing(cli) == before
    with PromptStore(cli.store_dir) as st:
        assert st.budget is None


def test_gc_largest_budget_is_exact_and_accepted(cli, stored):
    top = str(2**64 - 1)
    dry = js(cli("gc", "--budget", top, "--dry-run", "--json"))
    assert dry["budget"] == 2**64 - 1 and dry["evict"] == []
    done = js(cli("gc", "--budget", top, "--yes", "--json"))
    assert done["budget"] == 2**64 - 1 and done["evicted"] == []


# -- rm --older-than ----------------------------------------------------------------


@pytest.mark.parametrize("age", ["9999999d", "800000d", "1000000000d", "99999999w"])
@pytest.mark.parametrize("extra", [["--dry-run", "--json"], ["--yes", "--json"], ["--dry-run"]])
def test_rm_older_than_beyond_any_date_is_a_usage_error(cli, stored, age, extra):
    before = _listing(cli)
    r = cli("rm", "--older-than", age, *extra, code=2)
    text = js(r)["message"] if "--json" in extra else r.output
    assert "--older-than" in text and "longer than any age an entry can have" in text
    assert _listing(cli) == before


# -- put --messages ---------------------------------------------------------------------


@pytest.mark.parametrize("as_json", [True, False])
def test_put_messages_nested_too_deeply_is_invalid_input(cli, tmp_path, as_json):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    r = cli("put", "--model", LLAMA, "--messages", str(deep), *(["--json"] if as_json else []), code=1)
    if as_json:
        doc = js(r)
        assert doc["error"] == "InvalidInput" and str(deep) in doc["message"] and "nested too deeply" in doc["message"]
    else:
        assert "nested too deeply" in r.output
    assert not (tmp_path / "store").exists()  # refused before the store was opened


def test_put_messages_whose_every_content_is_empty_is_invalid_input(cli, tmp_path):
    """As an empty prompt is: the entry would hold the chat template alone."""
    empty = tmp_path / "empty.json"
    empty.write_text('[{"role": "system", "content": ""}, {"role": "user", "content": "  "}]')
    doc = js(cli("put", "--model", LLAMA, "--messages", str(empty), "--json", code=1))
    assert doc["error"] == "InvalidInput" and "every message's content is empty" in doc["message"]
    assert not (tmp_path / "store").exists()
    one = tmp_path / "one.json"  # one empty message among others is a conversation like any
    one.write_text('[{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]')
    assert js(cli("put", "--model", LLAMA, "--messages", str(one), "--json"))["tokens"] > 0


def test_kv_bits_on_a_sliding_window_model_is_invalid_input(cli, stored):
    """mlx-lm cannot quantize a RotatingKVCache ("Quantization NYI"): a typed
    error naming the option, not 'a bug', and the store keeps what it had."""
    before = _listing(cli)
    out = js(cli("put", "--model", str(MODELS / "gemma3_text"), "--prompt", "hello there friend", "--kv-bits", "4",
                 "--quantized-kv-start", "0", "--json", code=1))
    assert out["error"] == "InvalidInput" and "--kv-bits" in out["message"], out
    assert _listing(cli) == before


@pytest.mark.parametrize("where", ["group", "command"])
def test_an_empty_store_is_a_usage_error_for_every_command(tmp_path, monkeypatch, where):
    """``--store ""`` (an unset shell variable) made ``put`` write a store into
    the current directory while ``ls``/``get``/``stats`` read the default one."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PROMPTSTORE_DIR", str(tmp_path / "default"))
    runner = CliRunner()
    for args in (["put", "--model", LLAMA, "--prompt", "hi"], ["ls"], ["stats"], ["get", "--model", LLAMA, "--prompt", "hi"]):
        argv = ["--store", "", *args, "--json"] if where == "group" else [*args, "--store", "", "--json"]
        result = runner.invoke(main, argv)
        assert result.exit_code == 2, (args, result.output)
        err = json.loads(result.stdout)
        assert err["error"] == "UsageError" and "store directory is empty" in err["message"]
    assert list(tmp_path.iterdir()) == []  # nothing written here, nor a default store made


# -- the second CLI review: bad input that surfaced as "a bug" or lost work -------------------


def test_bench_out_into_a_missing_folder_is_refused_before_the_run(cli, tmp_path):
    """The check came after the run: a full bench's minutes of results were lost."""
    doc = js(cli("bench", "--quick", "--out", str(tmp_path / "nofolder" / "b.md"), "--json", code=1))
    assert doc["error"] == "InvalidInput" and "nofolder" in doc["message"] and "--out" in doc["message"]


@pytest.mark.parametrize("flag", ["--prompt", "--system-prompt"])
def test_a_prompt_that_is_not_utf8_is_invalid_input_and_creates_no_store(cli, tmp_path, flag):
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates: the
    tokenizer raised a TypeError, reported as the chat template refusing the messages."""
    args = ["--prompt", "caf\udce9"] if flag == "--prompt" else ["--prompt", "hi", "--system-prompt", "caf\udce9"]
    doc = js(cli("put", "--model", LLAMA, *args, "--json", code=1))
    assert doc["error"] == "InvalidInput" and f"{flag} is not UTF-8" in doc["message"]
    assert not (tmp_path / "store").exists()


def test_encode_prompt_refuses_text_that_is_not_utf8():
    from promptstore import InvalidInput
    from promptstore.jobs.prefill import encode_prompt

    class Tok:
        has_chat_template = False

        def encode(self, text):  # pragma: no cover - never reached
            raise AssertionError("encoded")

    for kwargs, what in (({"prompt": "a\udcff"}, "the prompt"),
                         ({"messages": [{"role": "user", "content": "a\udcff"}]}, "message 0's content")):
        with pytest.raises(InvalidInput, match=f"{what} is not UTF-8"):
            encode_prompt(Tok(), **kwargs)


@pytest.mark.parametrize("argv", [
    ["--store", "~nosuchuser_ps/s", "ls"],
    ["put", "--model", "~nosuchuser_ps/m", "--prompt", "hi"],
    ["ls", "--model", "~nosuchuser_ps/m"],
    ["get", "--model", LLAMA, "--prompt", "keep me", "-o", "~nosuchuser_ps/x.safetensors"],
])
def test_a_tilde_user_that_does_not_exist_is_invalid_input(cli, stored, argv):
    """pathlib raises RuntimeError for ~user of no user: it was 'a bug'."""
    before = _listing(cli)
    doc = js(cli(*argv, "--json", code=1))
    assert doc["error"] == "InvalidInput" and "'~nosuchuser_ps' names no home folder" in doc["message"], doc
    assert _listing(cli) == before


def test_a_stale_promptstore_dir_does_not_break_a_command_given_its_own_store(tmp_path, monkeypatch, stored, cli):
    """$PROMPTSTORE_DIR naming a file made every command a usage error, even with
    ``--store`` after the command; it is an error only where it is used."""
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("PROMPTSTORE_DIR", str(afile))
    runner = CliRunner()
    ok = runner.invoke(main, ["ls", "--store", cli.store_dir, "--json"])
    assert ok.exit_code == 0 and [e["id"] for e in json.loads(ok.stdout)] == [stored]
    bad = runner.invoke(main, ["ls", "--json"])
    assert bad.exit_code == 1 and json.loads(bad.stdout)["error"] == "InvalidInput" and "is a file" in bad.stdout
    assert afile.read_text() == ""


def test_a_model_config_nested_too_deeply_is_invalid_input(cli, tmp_path):
    model = tmp_path / "deepmodel"
    model.mkdir()
    (model / "config.json").write_text("[" * 100_000)
    (model / "model.safetensors").write_bytes(b"")
    doc = js(cli("put", "--model", str(model), "--prompt", "hi", "--json", code=1))
    assert doc["error"] == "InvalidInput" and "nested too deeply" in doc["message"]


def test_an_import_whose_token_metadata_is_nested_too_deeply_is_a_corrupt_file(cli, stored, tmp_path):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    from promptstore.jobs.interop import TOKENS_KEY

    layer = KVCache()
    layer.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    path = tmp_path / "deep.safetensors"
    save_prompt_cache(str(path), [layer, layer], {TOKENS_KEY: "[" * 100_000})
    before = _listing(cli)
    doc = js(cli("import", str(path), "--model", LLAMA, "--json", code=1))
    assert doc["error"] == "CorruptEntry" and "nested too deeply" in doc["message"]
    assert _listing(cli) == before


def test_prompt_from_a_closed_standard_input_is_invalid_input(tmp_path):
    """With file descriptor 0 closed, ``sys.stdin`` is None: an AttributeError before."""
    res = subprocess.run(
        [sys.executable, "-m", "promptstore", "--store", str(tmp_path / "s"), "put", "--model", LLAMA, "--prompt", "-", "--json"],
        preexec_fn=lambda: os.close(0), capture_output=True, text=True, timeout=120,
    )
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and doc["error"] == "InvalidInput" and "standard input, which is closed" in doc["message"]
    assert not (tmp_path / "s").exists()


def test_no_answer_to_a_confirmation_is_json_under_json(cli, stored, monkeypatch):
    """End of input at rm's question printed click's 'Aborted!' where --json promises JSON."""
    monkeypatch.setattr("promptstore.cli.rm.interactive", lambda: True)
    result = CliRunner().invoke(main, ["--store", cli.store_dir, "rm", stored, "--json"], input="")
    assert result.exit_code == 1 and json.loads(result.stdout.splitlines()[-1])["error"] == "Aborted"
    assert [e[0] for e in _listing(cli)] == [stored]


def test_an_output_name_that_is_not_utf8_is_invalid_input(cli, stored, tmp_path):
    """mlx writes by UTF-8 names only: it raised std::bad_cast, reported as a full disk."""
    doc = js(cli("export", stored, "--model", LLAMA, "-o", str(tmp_path / "caf\udce9.safetensors"), "--json", code=1))
    assert doc["error"] == "InvalidInput" and "not UTF-8" in doc["message"]


@pytest.mark.parametrize("budget", ["0.5", ".3", "1.5B", "0.0001KB"])
def test_a_budget_of_a_fraction_of_a_byte_is_a_usage_error(cli, stored, budget):
    """``--budget 0.5`` set a budget of 0 bytes."""
    doc = js(cli("gc", "--budget", budget, "--yes", "--json", code=2))
    assert doc["error"] == "UsageError" and "whole number of bytes" in doc["message"]
    with PromptStore(cli.store_dir) as st:
        assert st.budget is None and [i.id for i in st.entries()] == [stored]


@pytest.mark.parametrize("budget, size", [("1.3GiB", 1395864371), ("2.2MiB", 2306867), ("1.0001KB", 1000), ("1.5GB", 1500000000)])
def test_a_fractional_size_with_a_unit_is_rounded_down_to_whole_bytes(cli, stored, budget, size):
    assert js(cli("gc", "--budget", budget, "--dry-run", "--json"))["budget"] == size


def test_a_put_of_a_missing_model_creates_no_store(cli, tmp_path):
    for cmd in (["put", "--prompt", "hi"], ["warmup", str(tmp_path / "p.jsonl")]):
        (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
        doc = js(cli(*cmd, "--model", str(tmp_path / "nomodel"), "--json", code=1))
        assert doc["error"] == "InvalidInput" and "nomodel" in doc["message"]
        assert not (tmp_path / "store").exists()


def test_put_progress_without_a_terminal_is_one_line(cli):
    result = cli("put", "--model", LLAMA, "--prompt", "a longer prompt " * 40)
    assert result.stderr.count("prefill") == 1, result.stderr


def test_a_byte_order_mark_is_no_part_of_a_prompt(cli, tmp_path):
    """Editors that write a UTF-8 byte-order mark: it was tokenized into the prompt (another
    key than the same prompt typed), and a messages or warm-up file starting with one was 'not JSON'."""
    plain = js(cli("put", "--model", LLAMA, "--prompt", "a prompt with a mark", "--json"))
    (tmp_path / "p.txt").write_bytes("\ufeffa prompt with a mark".encode("utf-8"))
    marked = js(cli("put", "--model", LLAMA, "--prompt-file", str(tmp_path / "p.txt"), "--json"))
    assert marked["id"] == plain["id"]
    (tmp_path / "m.json").write_bytes('\ufeff[{"role": "user", "content": "hi there"}]'.encode("utf-8"))
    cli("put", "--model", LLAMA, "--messages", str(tmp_path / "m.json"), "--json")
    (tmp_path / "w.jsonl").write_bytes('\ufeff{"id": "a", "prompt": "warm me"}\n'.encode("utf-8"))
    assert js(cli("warmup", "--model", LLAMA, str(tmp_path / "w.jsonl"), "--json"))["stored"] == 1
    (tmp_path / "w2.jsonl").write_bytes('\ufeff\n{"id": "b", "prompt": "warm me too"}\n'.encode("utf-8"))
    doc = js(cli("warmup", "--model", LLAMA, str(tmp_path / "w2.jsonl"), "--json"))
    assert (doc["stored"], doc["failed"]) == (1, 0)  # a line of only the mark is a blank line


def test_a_store_path_under_a_file_is_invalid_input_for_ls(tmp_path):
    """``ls --store afile/sub`` listed "0 entries" (a store not made yet) where none can ever be."""
    (tmp_path / "afile").write_text("x")
    result = CliRunner().invoke(main, ["ls", "--store", str(tmp_path / "afile" / "sub"), "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["error"] == "InvalidInput" and "is a file" in doc["message"]
    assert (tmp_path / "afile").read_text() == "x"


def test_a_value_given_to_json_is_a_usage_error_in_json(tmp_path):
    result = CliRunner().invoke(main, ["ls", "--store", str(tmp_path / "s"), "--json=1"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 2 and doc["error"] == "UsageError" and "--json" in doc["message"]


def test_an_empty_model_is_invalid_input_not_the_current_folder(cli, tmp_path, monkeypatch):
    """``--model ''`` (an unset shell variable) named the current folder."""
    monkeypatch.chdir(MODELS / "llama")
    doc = js(cli("put", "--model", "", "--prompt", "hi", "--json", code=1))
    assert doc["error"] == "InvalidInput" and "model is empty" in doc["message"]
    assert not (tmp_path / "store").exists()
