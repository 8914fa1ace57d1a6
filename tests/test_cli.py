"""The command line in-process (click's CliRunner): every command and option, parsing --json."""

from __future__ import annotations

import json
import time as _time
from datetime import timedelta

import click
import mlx.core as mx
import pytest
from click.testing import CliRunner
from conftest import MODELS, load_fixture

from _raw import blocks_of, flip_block, get_chunk, set_chunk, shared_block
from promptstore import PromptStore
from promptstore.cli import main
from promptstore.cli._select import key_length, parse_duration
from promptstore.jobs.prefill import encode_prompt
from _bits import bits_equal

LLAMA = str(MODELS / "llama")
QNEXT = str(MODELS / "qwen3_next")
PROMPT = "You are a terse assistant. Explain prompt caches."


@pytest.fixture
def cli(tmp_path):
    runner = CliRunner()
    store_dir = str(tmp_path / "store")

    def run(*args, input=None, code=0):
        result = runner.invoke(main, ["--store", store_dir, *args], input=input)
        assert result.exit_code == code, (result.exit_code, result.output, result.stderr, result.exception)
        assert "Traceback" not in result.output + result.stderr
        return result

    run.store_dir = store_dir
    return run


def js(result):
    return json.loads(result.stdout)


def put(cli, prompt, model=LLAMA, *extra):
    return js(cli("put", "--model", model, "--prompt", prompt, "--json", *extra))


# -- put / get ------------------------------------------------------------------


def test_put_then_get_hits_and_reports_what_is_left(cli):
    model, tok, _, _ = load_fixture("llama")
    entry = put(cli, PROMPT, LLAMA, "--meta", "team=infra")
    assert entry["tokens"] == len(encode_prompt(tok, PROMPT))
    assert entry["meta"] == {"team": "infra"} and entry["checkpoints"] == []
    assert len(entry["id"]) == 16 and entry["bytes"] > 0 and entry["kinds"] == ["kv", "kv"]
    exact = js(cli("get", "--model", LLAMA, "--prompt", PROMPT, "--json"))
    assert (exact["matched"], exact["to_prefill"], exact["entry"]["id"]) == (entry["tokens"], 0, entry["id"])
    longer = js(cli("get", "--model", LLAMA, "--prompt", PROMPT + " And more words here.", "--json"))
    assert longer["matched"] == entry["tokens"] and longer["to_prefill"] == longer["tokens"] - entry["tokens"] > 0
    other = js(cli("get", "--model", LLAMA, "--prompt", "Completely different.", "--json"))
    # the chat template's opening tokens are shared: the entry is trimmed down to them
    assert 0 < other["matched"] < entry["tokens"] and other["trimmed"] == entry["tokens"] - other["matched"]
    miss = js(cli("get", "--model", LLAMA, "--prompt", "Completely different.", "--no-chat-template", "--json"))
    assert miss["matched"] == 0 and miss["entry"] is None and miss["to_prefill"] == miss["tokens"]
    human = cli("get", "--model", LLAMA, "--prompt", PROMPT).stdout
    assert human.startswith(f"hit {entry['id']}: {entry['tokens']} of {entry['tokens']} tokens")


def test_put_prompt_sources_agree_and_no_chat_template_differs(cli, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text(PROMPT)
    a = put(cli, PROMPT)
    b = js(cli("put", "--model", LLAMA, "--prompt-file", str(f), "--json"))
    c = js(cli("put", "--model", LLAMA, "--prompt", "-", "--json", input=PROMPT))
    assert a["id"] == b["id"] == c["id"]
    raw = js(cli("put", "--model", LLAMA, "--prompt", PROMPT, "--no-chat-template", "--json"))
    _, tok, _, _ = load_fixture("llama")
    assert raw["tokens"] == len(tok.encode(PROMPT)) and raw["id"] != a["id"]


def test_put_messages_file(cli, tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"messages": msgs}))
    entry = js(cli("put", "--model", LLAMA, "--messages", str(f), "--json"))
    _, tok, _, _ = load_fixture("llama")
    assert entry["tokens"] == len(tok.apply_chat_template(msgs, add_generation_prompt=False))
    # a dense model's cache is trimmable: no checkpoints are needed
    assert entry["checkpoints"] == []
    # a request body with tools (which the server renders into the prompt) was taken, the tools dropped
    f.write_text(json.dumps({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}))
    err = js(cli("put", "--model", LLAMA, "--messages", str(f), "--json", code=1))
    assert err["error"] == "InvalidInput" and "(tools)" in err["message"]


# -- ls -------------------------------------------------------------------------


def test_ls_keys_sort_limit_and_model_filter(cli):
    short = put(cli, "Hi.")
    long_ = put(cli, "A much longer prompt with many more words in it than the other one.")
    other = put(cli, "Hi.", QNEXT)
    rows = js(cli("ls", "--json", "--sort", "tokens"))
    assert [r["id"] for r in rows][0] == long_["id"]
    assert {r["id"] for r in rows} == {short["id"], long_["id"], other["id"]}
    for r in rows:
        assert r["id"].startswith(r["key"]) and len(r["key"]) >= 12
    by_size = js(cli("ls", "--json", "--sort", "size"))
    assert [r["bytes"] for r in by_size] == sorted((r["bytes"] for r in by_size), reverse=True)
    assert len(js(cli("ls", "--json", "--limit", "1"))) == 1
    assert {r["id"] for r in js(cli("ls", "--json", "--model", QNEXT))} == {other["id"]}
    assert {r["id"] for r in js(cli("ls", "--json", "--model", "llama"))} == {short["id"], long_["id"]}
    # A mistyped model folder matched nothing and said "0 entries" (rm: "nothing to remove").
    for cmd in (("ls",), ("rm", "--dry-run")):
        err = js(cli(*cmd, "--json", "--model", "./no-such-dir/llama", code=1))
        assert err["error"] == "InvalidInput" and "no such folder" in err["message"]
    # A mistyped model name listed nothing and said nothing of why: stderr names the models held.
    typo = cli("ls", "--model", "lama")
    assert typo.stdout.strip() == "0 entries, 0 B"
    assert "no entry is of model 'lama'" in typo.stderr and "llama, qwen3_next" in typo.stderr
    removal = cli("rm", "--model", "lama", "--yes", "--json")
    assert js(removal)["removed"] == [] and "no entry is of model 'lama'" in removal.stderr
    assert cli("ls", "--model", "llama").stderr == ""
    table = cli("ls", "--limit", "2").stdout.splitlines()
    assert table[0].split() == ["KEY", "MODEL", "KINDS", "TOKENS", "SIZE", "OWN", "SHARED", "LAST", "USED"]
    for r in rows:
        assert 0 < r["own_bytes"] <= r["bytes"] and r["own_bytes"] + r["shared_bytes"] == r["bytes"]
    assert len(table) == 4 and table[-1].startswith("3 entries, ") and table[-1].endswith("(showing 2)")
    key = table[1].split()[0]
    keyed = next(r for r in rows if r["id"].startswith(key))
    model = LLAMA if keyed["model_name"] == "llama" else QNEXT
    assert js(cli("export", key, "-o", str(_tmp(cli) / "x.safetensors"), "--model", model, "--json"))["entry"]["id"].startswith(key)


def _tmp(cli):
    from pathlib import Path

    return Path(cli.store_dir).parent


def test_key_length_grows_until_unique():
    assert key_length(["0123456789abcdef", "fedcba9876543210"]) == 12
    assert key_length(["0123456789abcd00", "0123456789abcd11"]) == 15
    assert key_length([]) == 12


# -- rm -------------------------------------------------------------------------


def test_rm_plans_refuses_without_tty_and_deletes_with_yes(cli):
    a = put(cli, "First prompt.")
    b = put(cli, "Second prompt.")
    plan = js(cli("rm", a["id"][:12], "--dry-run", "--json"))
    assert plan["dry_run"] and [p["id"] for p in plan["planned"]] == [a["id"]] and plan["removed"] == []
    assert len(js(cli("ls", "--json"))) == 2
    human = cli("rm", a["id"][:12], "--dry-run").stdout
    assert "plan: remove 1 entry" in human and "nothing removed" in human
    refused = cli("rm", a["id"][:12], "--json", code=1)  # CliRunner's stdin is no terminal
    assert js(refused)["error"] == "NeedsConfirmation" and "--yes" in js(refused)["message"]
    done = js(cli("rm", a["id"][:12], "--yes", "--json"))
    assert done["removed"] == [a["id"]] and done["bytes"] == a["bytes"]
    assert [r["id"] for r in js(cli("ls", "--json"))] == [b["id"]]
    missing = cli("rm", a["id"], "--yes", code=1)
    assert missing.stderr.startswith("error: ") and a["id"] in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


def test_rm_asks_on_a_terminal(cli, monkeypatch):
    import promptstore.cli.rm as rm_mod

    a = put(cli, "First prompt.")
    monkeypatch.setattr(rm_mod, "interactive", lambda: True)
    no = cli("rm", a["id"], input="n\n", code=1)
    assert "Remove 1 entry" in no.stderr and "nothing removed" in no.stderr
    assert len(js(cli("ls", "--json"))) == 1
    yes = cli("rm", a["id"], input="y\n")
    assert "removed 1 entry, " in yes.stdout and yes.stdout.strip().endswith(" freed")
    assert js(cli("ls", "--json")) == []


def test_rm_reports_what_it_frees_not_the_shared_bytes(cli):
    """An entry whose KV blocks a longer entry shares: rm's plan says how
    much of it is its own, and the report what the store's usage fell by
    (it reported the whole cache's bytes as removed)."""
    import numpy as np
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 500, 2048).tolist()
    keys, values = (rng.standard_normal((1, 2, 2048, 64)).astype(np.float16) for _ in "kv")

    def cache(n):
        kv = KVCache()
        kv.update_and_fetch(mx.array(keys[..., :n, :]), mx.array(values[..., :n, :]))
        return [kv]

    with PromptStore(cli.store_dir) as s:
        short = s.put("m@0123456789abcdef", tokens[:1024], cache(1024))
        s.put("m@0123456789abcdef", tokens, cache(2048))
        usage = s.usage()
    plan = js(cli("rm", short.id, "--dry-run", "--json"))
    assert plan["bytes"] == short.nbytes and plan["own_bytes"] < short.nbytes // 20
    human = cli("rm", short.id, "--dry-run").stdout
    assert "frees" in human
    done = js(cli("rm", short.id, "--yes", "--json"))
    with PromptStore(cli.store_dir) as s:
        assert done["freed"] == usage - s.usage() < short.nbytes // 20
        assert done["own_bytes"] == done["freed"]
        again = s.put("m@0123456789abcdef", tokens[:1024], cache(1024))
        longer = next(e for e in s.entries() if e.n_tokens == 2048)
        usage = s.usage()
    # Both: nothing outside the plan shares their blocks, so it frees them all
    # (it summed each entry's unshared bytes: the 1024 tokens both hold were left out).
    plan = js(cli("rm", again.id, longer.id, "--dry-run", "--json"))
    assert plan["own_bytes"] == usage
    done = js(cli("rm", again.id, longer.id, "--yes", "--json"))
    assert done["freed"] == done["own_bytes"] == usage


def test_rm_by_model_and_older_than(cli, monkeypatch):
    old = put(cli, "Old prompt.")
    young = put(cli, "Young prompt.")
    hybrid = put(cli, "Old prompt.", QNEXT)
    # age one entry: rewrite its last-use time as if it was used ten days ago
    import promptstore.store._write as store_mod

    ten_days_ago = _time.time() - 10 * 86400
    monkeypatch.setattr(store_mod.time, "time", lambda: ten_days_ago)
    with PromptStore(cli.store_dir) as s:
        s.load(old["id"])
    monkeypatch.undo()
    plan = js(cli("rm", "--older-than", "7d", "--dry-run", "--json"))
    assert [p["id"] for p in plan["planned"]] == [old["id"]]
    assert js(cli("rm", "--older-than", "1d", "--model", QNEXT, "--yes", "--json"))["removed"] == []
    assert js(cli("rm", "--model", QNEXT, "--yes", "--json"))["removed"] == [hybrid["id"]]
    assert js(cli("rm", "--older-than", "1w", "--yes", "--json"))["removed"] == [old["id"]]
    assert [r["id"] for r in js(cli("ls", "--json"))] == [young["id"]]
    assert "nothing to remove" in cli("rm", "--older-than", "30m", "--yes").stdout


def test_rm_usage_errors_exit_2(cli):
    cli("rm", code=2)
    err = cli("rm", "abc", "--model", LLAMA, "--json", code=2)
    assert js(err) == {"error": "UsageError", "message": "give KEYs, or --model/--older-than, not both", "exit_code": 2}
    assert "not a duration" in js(cli("rm", "--older-than", "soon", "--json", code=2))["message"]
    assert "longer than any age" in js(cli("rm", "--older-than", "99999999999d", "--yes", "--json", code=2))["message"]


def test_rm_dry_run_only_reads_a_store_of_an_older_layout(cli):
    """rm --dry-run opened the store for writing: a store of an older format
    was upgraded by a dry run (its own release then refused it), and a
    store this user may only read was refused, where gc --dry-run plans
    (a reviewer's finding). It opens read-only, as gc --dry-run does."""
    import shutil
    from pathlib import Path

    from promptstore.store._schema import FORMAT_KEY, U64

    golden = Path(__file__).resolve().parent.parent / "fixtures" / "golden" / "store-format-1"
    shutil.copytree(golden, cli.store_dir)
    data = Path(cli.store_dir) / "data.mdb"
    raw = data.read_bytes()
    with PromptStore(cli.store_dir, readonly=True) as ro:
        ids = sorted(i.id for i in ro.entries())
    plan = js(cli("rm", ids[0], "--dry-run", "--json"))
    assert plan["dry_run"] and [p["id"] for p in plan["planned"]] == [ids[0]] and plan["own_bytes"] > 0
    assert "nothing removed" in cli("rm", "--older-than", "1s", "--dry-run").stdout
    assert data.read_bytes() == raw  # not upgraded, nothing written
    with PromptStore(cli.store_dir, readonly=True) as ro:
        with ro.env.read() as txn:
            assert U64.unpack(bytes(txn.get(FORMAT_KEY, db=ro._db.info)))[0] == 1
        assert sorted(i.id for i in ro.entries()) == ids


def test_parse_duration():
    assert parse_duration("7d") == timedelta(days=7)
    assert parse_duration("1d12h") == timedelta(hours=36)
    assert parse_duration("30m") == timedelta(minutes=30)
    assert parse_duration(" 2w ") == timedelta(weeks=2)
    for bad in ("", "7", "d", "7y", "7d x"):
        with pytest.raises(click.BadParameter):
            parse_duration(bad)


# -- stats / verify ---------------------------------------------------------------


def test_stats_counts_entries_bytes_models_kinds_hits_and_misses(cli):
    a = put(cli, "One.")
    b = put(cli, "One.", QNEXT)
    cli("get", "--model", LLAMA, "--prompt", "One.")
    cli("get", "--model", LLAMA, "--prompt", "Something else entirely.", "--no-chat-template")
    cli("get", "--model", QNEXT, "--prompt", "One.")
    doc = js(cli("stats", "--json"))
    assert doc["entries"] == 2 and doc["live_bytes"] == a["bytes"] + b["bytes"]
    assert doc["file_bytes"] >= doc["live_bytes"]
    assert (doc["hits"], doc["misses"]) == (2, 1) and abs(doc["hit_rate"] - 2 / 3) < 1e-12
    assert {m["name"]: m["entries"] for m in doc["models"].values()} == {"llama": 1, "qwen3_next": 1}
    assert doc["models"][a["model"]]["bytes"] == a["bytes"]
    # put stores qwen3_next's gated-DeltaNet layers as ssm.gated_delta, never mlx-lm's arrays
    assert doc["kinds"]["kv"]["entries"] == 2 and doc["kinds"]["ssm.gated_delta"]["entries"] == 1
    assert "arrays" not in doc["kinds"]
    assert doc["kinds"]["ssm.gated_delta"]["layers"] == b["kinds"].count("ssm.gated_delta") > 0
    assert doc["kinds"]["kv"]["layers"] == 2 + b["kinds"].count("kv")
    human = cli("stats").stdout
    assert "2 hits, 1 misses" in human and "llama" in human and human.strip().endswith(f"2 entries, {human.split()[-2]} {human.split()[-1]}")


def test_stats_and_ls_show_a_shared_prefix_stored_once(cli):
    first = put(cli, "One two three.", LLAMA, "--no-chat-template")
    assert js(cli("stats", "--json"))["dedup_ratio"] < 1  # one entry: its manifest, nothing shared
    assert "shared prefixes" not in cli("stats").stdout
    longer = put(cli, "One two three. And then a few more words.", LLAMA, "--no-chat-template")
    doc = js(cli("stats", "--json"))
    assert doc["live_bytes"] == first["bytes"] + longer["bytes"]
    # The longer entry references the first one's blocks: they are stored once.
    assert doc["stored_bytes"] < first["bytes"] + longer["bytes"] * 1.05
    assert doc["dedup_ratio"] == doc["live_bytes"] / doc["stored_bytes"] > 1.2  # stored includes the manifests
    rows = {r["id"]: r for r in js(cli("ls", "--json"))}
    assert rows[first["id"]]["own_bytes"] == 0 and rows[first["id"]]["shared_bytes"] == first["bytes"]
    assert rows[longer["id"]]["own_bytes"] == longer["bytes"] - first["bytes"]
    assert f"{doc['dedup_ratio']:.2f}x smaller for shared prefixes stored once" in cli("stats").stdout


def test_verify_detects_and_fixes_damage(cli):
    good = put(cli, "Good entry.", LLAMA, "--no-chat-template")
    bad = put(cli, "Entry to damage.", LLAMA, "--no-chat-template")
    worse = put(cli, "Entry to damage. And the turn after it.", LLAMA, "--no-chat-template")  # continues bad's cache
    ok = js(cli("verify", "--json"))
    assert ok["ok"] and ok["checked"] == 3 and ok["problems"] == []
    damaged = sorted([bad["id"], worse["id"]])
    with PromptStore(cli.store_dir) as s:
        flip_block(s, shared_block(s, damaged), bit=0x40)  # a block of bad's tokens, which worse shares
        assert not set(blocks_of(s, good["id"])) & set(blocks_of(s, bad["id"]))
    found = js(cli("verify", "--json", code=1))
    assert not found["ok"] and sorted(p["id"] for p in found["problems"]) == damaged and not found["fixed"]
    assert "verify --fix" in cli("verify", code=1).stderr
    fixed = js(cli("verify", "--fix", "--json", code=1))  # problems were found: still exit 1
    assert fixed["fixed"] and sorted(p["id"] for p in fixed["problems"]) == damaged
    assert js(cli("verify", "--json"))["ok"]
    assert [r["id"] for r in js(cli("ls", "--json"))] == [good["id"]]
    got = js(cli("get", "--model", LLAMA, "--prompt", "Good entry.", "--no-chat-template", "--json"))
    assert got["entry"]["id"] == good["id"] and got["to_prefill"] == 0


def test_verify_detects_and_fixes_damage_to_a_payload(cli, monkeypatch):
    monkeypatch.setenv("PROMPTSTORE_SHARED_BLOCKS", "0")  # format 1: the KV in the entry's payload chunks
    good = put(cli, "Good entry.")
    bad = put(cli, "Entry to damage.")
    with PromptStore(cli.store_dir) as s:
        chunk = bytearray(get_chunk(s, bad["id"], 0))
        chunk[len(chunk) // 2] ^= 0x40
        set_chunk(s, bad["id"], 0, chunk)
    found = js(cli("verify", "--json", code=1))
    assert not found["ok"] and [p["id"] for p in found["problems"]] == [bad["id"]] and not found["fixed"]
    fixed = js(cli("verify", "--fix", "--json", code=1))
    assert fixed["fixed"] and [p["id"] for p in fixed["problems"]] == [bad["id"]]
    assert js(cli("verify", "--json"))["ok"]
    assert [r["id"] for r in js(cli("ls", "--json"))] == [good["id"]]


# -- export / import ---------------------------------------------------------------


def test_export_writes_an_mlx_lm_file_that_imports_back(cli, tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import load_prompt_cache

    entry = put(cli, PROMPT, QNEXT)
    out = tmp_path / "e.safetensors"
    doc = js(cli("export", entry["id"][:10], "-o", str(out), "--model", QNEXT, "--json"))
    assert doc["tokens"] == entry["tokens"] and doc["model"] == QNEXT
    cache, meta = load_prompt_cache(str(out), return_metadata=True)
    assert meta["model"] == QNEXT
    with PromptStore(cli.store_dir) as s:
        stored, _, tokens = s.load(entry["id"])
    assert json.loads(meta["promptstore_tokens"]) == tokens
    assert [type(c).__name__ for c in cache] == [type(c).__name__ for c in stored]
    for mine, theirs in zip(stored, cache):
        a = [v for _, v in tree_flatten(mine.state) if isinstance(v, mx.array)]
        b = [v for _, v in tree_flatten(theirs.state) if isinstance(v, mx.array)]
        assert len(a) == len(b) and all(x.dtype == y.dtype and bits_equal(x, y).item() for x, y in zip(a, b))
    # Imported over the entry it came from: the same representation (ssm.gated_delta, as put
    # stores it), so the import replaces it instead of being refused as a change of kinds.
    again = js(cli("import", "--model", QNEXT, str(out), "--json"))
    assert again["id"] == entry["id"] and again["kinds"] == entry["kinds"] and "ssm.gated_delta" in again["kinds"]
    cli("rm", entry["id"], "--yes")
    back = js(cli("import", "--model", QNEXT, str(out), "--json"))  # tokens recorded: no prompt needed
    assert back["id"] == entry["id"] and back["tokens"] == entry["tokens"] and back["kinds"] == entry["kinds"]
    assert js(cli("get", "--model", QNEXT, "--prompt", PROMPT, "--json"))["matched"] == entry["tokens"]
    with PromptStore(cli.store_dir) as s:
        restored, _, _ = s.load(entry["id"])
    for mine, theirs in zip(stored, restored):
        a = [v for _, v in tree_flatten(mine.state) if isinstance(v, mx.array)]
        b = [v for _, v in tree_flatten(theirs.state) if isinstance(v, mx.array)]
        assert len(a) == len(b) and all(x.dtype == y.dtype and bits_equal(x, y).item() for x, y in zip(a, b))


def test_output_files_named_with_a_tilde_are_written_in_the_home_folder(cli, tmp_path, monkeypatch):
    # `-o '~/x'` (quoted, or --out=~/x, which the shell leaves alone): the check
    # before the work expanded it, the write did not, and failed after the work.
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    entry = put(cli, PROMPT, LLAMA)
    doc = js(cli("export", entry["id"], "-o", "~/e.safetensors", "--model", LLAMA, "--json"))
    assert doc["output"] == str(home / "e.safetensors") and (home / "e.safetensors").is_file()
    got = js(cli("get", "--model", LLAMA, "--prompt", PROMPT, "-o", "~/g.safetensors", "--json"))
    assert got["output"] == str(home / "g.safetensors") and (home / "g.safetensors").is_file()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cli("bench", "--quick", "--only", "lookup", "--dir", str(scratch), "--out", "~/b.md")
    assert (home / "b.md").read_text().startswith("# promptstore bench")


def test_export_requires_model_and_checks_it(cli, tmp_path):
    # Deliberately changed (issue 22): without --model the file named a model that
    # mlx_lm.generate then refused; now --model is required.
    entry = put(cli, PROMPT)
    res = js(cli("export", entry["id"], "-o", str(tmp_path / "a.safetensors"), "--json", code=2))
    assert res["error"] == "UsageError" and "--model" in res["message"] and not (tmp_path / "a.safetensors").exists()
    err = js(cli("export", entry["id"], "-o", str(tmp_path / "b.safetensors"), "--model", QNEXT, "--json", code=1))
    assert err["error"] == "ModelMismatch"
    assert js(cli("export", entry["id"], "-o", str(tmp_path / "c.bin"), "--model", LLAMA, "--json", code=2))["error"] == "UsageError"
    # A bare ".safetensors" passed the CLI's check, then failed after the work on the writer's
    dot = js(cli("export", entry["id"], "-o", str(tmp_path / ".safetensors"), "--model", LLAMA, "--json", code=2))
    assert dot["error"] == "UsageError" and "NAME.safetensors" in dot["message"]
    dot = js(cli("get", "--model", LLAMA, "--prompt", PROMPT, "-o", str(tmp_path / ".safetensors"), "--json", code=2))
    assert dot["error"] == "UsageError" and not (tmp_path / ".safetensors").exists()
    missing = js(cli("export", "ffff", "-o", str(tmp_path / "d.safetensors"), "--model", LLAMA, "--json", code=1))
    assert missing["error"] == "EntryNotFound"


def test_import_refuses_coverage_and_model_mismatches(cli, tmp_path):
    entry = put(cli, PROMPT)
    out = tmp_path / "f.safetensors"
    cli("export", entry["id"], "-o", str(out), "--model", LLAMA)
    err = js(cli("import", "--model", LLAMA, "--prompt", "Short.", str(out), "--json", code=1))
    assert err["error"] == "CoverageMismatch" and f"covers {entry['tokens']} tokens" in err["message"]
    err = js(cli("import", "--model", QNEXT, "--prompt", PROMPT, str(out), "--json", code=1))
    assert err["error"] == "ModelMismatch"
    # a plain mlx-lm file (no promptstore metadata) from another model: the layers do not fit
    from mlx_lm.models.cache import save_prompt_cache

    from promptstore.jobs.prefill import prefill

    qmodel, qtok, _, _ = load_fixture("qwen3_next")
    toks = encode_prompt(qtok, PROMPT)
    plain = tmp_path / "plain.safetensors"
    save_prompt_cache(str(plain), prefill(qmodel, toks), {"model": "x", "tokenizer_config": "{}"})
    err = js(cli("import", "--model", LLAMA, "--prompt", PROMPT, str(plain), "--json", code=1))
    assert err["error"] == "ModelMismatch"
    err = js(cli("import", "--model", QNEXT, str(plain), "--json", code=1))
    assert err["error"] == "InvalidInput" and "no token ids" in err["message"]
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    assert js(cli("import", "--model", QNEXT, "--prompt", PROMPT, str(junk), "--json", code=1))["error"] == "CorruptEntry"
    assert js(cli("ls", "--json")) == [js(cli("ls", "--json"))[0]]  # only the llama entry


# -- errors -------------------------------------------------------------------------


def test_expected_errors_are_one_line_and_usage_errors_exit_2(cli, tmp_path):
    res = cli("get", "--model", str(tmp_path / "nope"), "--prompt", "x", code=1)
    assert res.stderr.startswith("error: ") and "config.json" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    err = js(cli("get", "--model", str(tmp_path / "nope"), "--prompt", "x", "--json", code=1))
    assert err["error"] == "InvalidInput" and err["exit_code"] == 1
    cli("get", "--model", LLAMA, "--prompt", "x", "--prompt-file", __file__, code=2)
    both = js(cli("get", "--model", LLAMA, "--json", code=2))
    assert both["error"] == "UsageError" and "exactly one of" in both["message"]
    parse = js(cli("ls", "--sort", "bogus", "--json", code=2))
    assert parse["error"] == "UsageError" and "bogus" in parse["message"]
    assert "Usage:" in cli("ls", "--sort", "bogus", code=2).stderr
    assert js(cli("put", "--model", LLAMA, "--prompt", "x", "--meta", "novalue", "--json", code=2))["error"] == "UsageError"
    assert "error" in js(cli("get", "--json", "--prompt", "x", code=2))  # missing --model


def test_group_usage_errors_are_json_with_json(tmp_path):
    """cli/_common.Group, for ``@click.group(cls=Group)`` on the main group."""
    from promptstore.cli._common import Group

    group = Group(name="promptstore", params=main.params, callback=main.callback, commands=main.commands)
    runner = CliRunner()
    afile = tmp_path / "afile"
    afile.write_text("")
    res = runner.invoke(group, ["--store", str(afile), "ls", "--json"])
    assert res.exit_code == 2 and json.loads(res.stdout)["error"] == "UsageError" and "afile" in json.loads(res.stdout)["message"]
    res = runner.invoke(group, ["--store", str(tmp_path / "s"), "bogus", "--json"])
    assert res.exit_code == 2 and "bogus" in json.loads(res.stdout)["message"]
    res = runner.invoke(group, ["--store", str(tmp_path / "s"), "bogus"])
    assert res.exit_code == 2 and "No such command" in res.stderr and res.stdout == ""
    res = runner.invoke(group, ["--store", str(tmp_path / "s"), "ls", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout) == []


def test_gc_dry_run_says_when_pins_keep_the_budget_out_of_reach(cli):
    """A dry run on a store of pinned entries said only "nothing evicted",
    where the real run is refused (StoreFull)."""
    entry = put(cli, PROMPT)
    with PromptStore(cli.store_dir) as s:
        s.pin(entry["id"])
    plan = js(cli("gc", "--budget", "0", "--dry-run", "--json"))
    assert plan["evict"] == [] and plan["reachable"] is False and plan["usage"] > 0
    human = cli("gc", "--budget", "0", "--dry-run")
    assert "cannot be reached" in human.stderr and "dry run: nothing evicted" in human.stdout
    assert js(cli("gc", "--budget", "1MB", "--dry-run", "--json"))["reachable"] is True
    err = js(cli("gc", "--budget", "0", "--yes", "--json", code=1))
    assert err["error"] == "StoreFull" and [r["id"] for r in js(cli("ls", "--json"))] == [entry["id"]]


def _limited(limit: int):
    """preexec_fn: files this process writes end at ``limit`` bytes (EFBIG past it), as a full disk would."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_get_whose_last_use_cannot_be_recorded_still_exits_0_and_export_says_why(tmp_path):
    import subprocess
    import sys

    store = tmp_path / "s"
    cmd = [sys.executable, "-m", "promptstore", "--store", str(store)]
    prompt = ["--model", LLAMA, "--prompt", "hello there"]
    subprocess.run(cmd + ["put", *prompt], check=True, capture_output=True)
    # The store's data file is past the limit: the get reads, then its close
    # cannot record the last use. That was a traceback and exit 1 after the hit.
    out = subprocess.run(cmd + ["get", *prompt], capture_output=True, text=True, preexec_fn=_limited(16 << 10))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("hit ") and "Traceback" not in out.stderr
    assert "recording last uses at close failed" in out.stderr
    # An export that cannot write its file: an OSError naming it, not "unexpected RuntimeError (a bug)".
    key = json.loads(subprocess.run(cmd + ["ls", "--json"], capture_output=True, text=True, check=True).stdout)[0]["id"]
    target = tmp_path / "x.safetensors"
    out = subprocess.run(cmd + ["export", key, "--model", LLAMA, "-o", str(target), "--json"],
                         capture_output=True, text=True, preexec_fn=_limited(4 << 10))  # the file has 9 KiB
    doc = json.loads(out.stdout)
    assert out.returncode == 1 and doc["error"] == "OSError", doc
    assert str(target) in doc["message"] and "writing the file failed" in doc["message"]
    assert not target.exists() and not list(tmp_path.glob(".x.tmp*"))
    assert subprocess.run(cmd + ["get", *prompt], capture_output=True, text=True).stdout.startswith("hit ")


def test_a_kv_group_size_that_does_not_divide_the_head_dimension_names_the_fix(cli):
    # The llama fixture's heads have 64 dimensions: mlx's quantize raised a bare ValueError.
    err = js(cli("put", "--model", LLAMA, "--prompt", PROMPT, "--kv-bits", "4", "--kv-group-size", "128",
                 "--quantized-kv-start", "0", "--json", code=1))
    assert err["error"] == "InvalidInput" and "--kv-group-size that divides" in err["message"]
    assert js(cli("ls", "--json")) == []


def test_an_output_name_at_the_file_system_limit_is_written(cli, tmp_path):
    # The temporary file's name was built from the output's, longer than it: a
    # valid 250-byte name failed ("File name too long") after the work.
    entry = put(cli, PROMPT, LLAMA)
    out = tmp_path / ("x" * 240 + ".safetensors")
    doc = js(cli("export", entry["id"], "-o", str(out), "--model", LLAMA, "--json"))
    assert doc["output"] == str(out) and out.is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
