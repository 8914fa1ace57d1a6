"""Issue 22, as a newcomer meets the CLI: every bad input one clean line (JSON
under --json), read-only use that never creates a store, and the smaller
items (python -m promptstore, XDG_CACHE_HOME, binary sizes, local times,
an honest partial hit). Through the real command line (CliRunner on
promptstore.cli.main, or a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime

import pytest
from click.testing import CliRunner
from conftest import MODELS, ROOT

from promptstore import PromptStore
from promptstore.cli import main

LLAMA = str(MODELS / "llama")
PROMPT = "You are a terse assistant. Explain prompt caches."


def invoke(store, *args, input=None, code=0, env=None):
    res = CliRunner().invoke(main, (["--store", str(store)] if store is not None else []) + list(args), input=input, env=env)
    assert res.exit_code == code, (res.exit_code, res.stdout, res.stderr, res.exception)
    assert "Traceback" not in res.stdout + res.stderr and "a bug" not in res.stdout + res.stderr
    return res


def error(store, *args, code=1, input=None):
    """Run with --json; the error document (stdout holds only it)."""
    res = invoke(store, *args, "--json", input=input, code=code)
    doc = json.loads(res.stdout)
    assert doc["exit_code"] == code and "\n" not in doc["message"]
    plain = invoke(store, *args, input=input, code=code)
    assert plain.stdout == "" and plain.stderr.startswith(("error: ", "Usage:"))
    if code == 1:
        assert len(plain.stderr.strip().splitlines()) == 1
    return doc


def put(store, prompt=PROMPT, *extra):
    return json.loads(invoke(store, "put", "--model", LLAMA, "--prompt", prompt, "--json", *extra).stdout)


# -- every error path one clean line --------------------------------------------------


def test_missing_output_folder_is_refused_before_any_work(tmp_path):
    store = tmp_path / "s"
    entry = put(store)
    out = tmp_path / "nowhere" / "x.safetensors"
    doc = error(store, "get", "--model", LLAMA, "--prompt", PROMPT, "-o", str(out))
    assert doc["error"] == "InvalidInput" and "no such folder" in doc["message"] and str(out.parent) in doc["message"]
    doc = error(store, "export", entry["id"], "--model", LLAMA, "-o", str(out))
    assert doc["error"] == "InvalidInput" and "no such folder" in doc["message"]
    assert not out.parent.exists()


def test_a_message_without_content_is_named(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user"}]))
    for cmd in ("put", "get"):
        doc = error(tmp_path / "s", cmd, "--model", LLAMA, "--messages", str(f))
        assert doc["error"] == "InvalidInput" and "message 1 has no 'content'" in doc["message"] and str(f) in doc["message"]
    f.write_text(json.dumps([]))
    assert "non-empty list" in error(tmp_path / "s", "put", "--model", LLAMA, "--messages", str(f))["message"]
    assert not (tmp_path / "s").exists()


def test_non_utf8_stdin_and_prompt_file(tmp_path):
    doc = error(tmp_path / "s", "put", "--model", LLAMA, "--prompt", "-", input=b"caf\xe9 latin-1")
    assert doc["error"] == "InvalidInput" and "standard input is not UTF-8" in doc["message"] and "0xe9" in doc["message"]
    f = tmp_path / "p.txt"
    f.write_bytes(b"\xff\xfe\x00h\x00i")
    doc = error(tmp_path / "s", "get", "--model", LLAMA, "--prompt-file", str(f))
    assert doc["error"] == "InvalidInput" and str(f) in doc["message"] and "not UTF-8" in doc["message"]
    # valid UTF-8 on stdin still works, byte for byte the same prompt as --prompt
    via_stdin = json.loads(invoke(tmp_path / "s", "put", "--model", LLAMA, "--prompt", "-", "--json", input="héllo".encode()).stdout)
    assert via_stdin["id"] == put(tmp_path / "s", "héllo")["id"]


def test_usage_errors_of_warmup_and_serve_are_json(tmp_path):
    doc = error(tmp_path / "s", "warmup", code=2)
    assert doc["error"] == "UsageError" and "PROMPTS.jsonl" in doc["message"]
    doc = error(tmp_path / "s", "warmup", "--model", LLAMA, str(tmp_path / "missing.jsonl"), code=2)
    assert doc["error"] == "UsageError" and "missing.jsonl" in doc["message"]
    doc = error(tmp_path / "s", "warmup", "--model", LLAMA, "--batch-size", "0", __file__, code=2)
    assert "batch-size" in doc["message"]
    assert error(tmp_path / "s", "serve", code=2)["error"] == "UsageError"
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("prompt", ["", "   \n\t"])
def test_an_empty_prompt_is_refused(tmp_path, prompt):
    doc = error(tmp_path / "s", "put", "--model", LLAMA, "--prompt", prompt)
    assert doc["error"] == "InvalidInput" and "empty" in doc["message"]
    f = tmp_path / "empty.txt"
    f.write_text(prompt)
    assert "empty" in error(tmp_path / "s", "put", "--model", LLAMA, "--prompt-file", str(f))["message"]
    assert "empty" in error(tmp_path / "s", "put", "--model", LLAMA, "--prompt", "-", input=prompt)["message"]
    assert not (tmp_path / "s").exists()  # refused before the store was opened


def test_a_prompt_longer_than_the_context_is_refused_up_front(tmp_path, monkeypatch):
    limit = json.loads((MODELS / "llama" / "config.json").read_text())["max_position_embeddings"]
    f = tmp_path / "long.txt"
    f.write_text("word " * 1400)  # a little over the fixture's 4,096 positions
    calls = []
    monkeypatch.setattr("promptstore.cli.put.prefill_with_checkpoints", lambda *a, **k: calls.append(1))
    doc = error(tmp_path / "s", "put", "--model", LLAMA, "--prompt-file", str(f))
    assert doc["error"] == "InvalidInput" and f"context of {limit:,}" in doc["message"] and "--allow-long-prompt" in doc["message"]
    assert calls == []  # refused before prefill
    out = tmp_path / "o.safetensors"
    assert "--allow-long-prompt" in error(tmp_path / "s", "get", "--model", LLAMA, "--prompt-file", str(f), "-o", str(out))["message"]
    assert not out.exists()
    monkeypatch.undo()
    entry = json.loads(invoke(tmp_path / "s", "put", "--model", LLAMA, "--prompt-file", str(f), "--allow-long-prompt", "--json").stdout)
    assert entry["tokens"] > limit
    # a plain lookup never prefills: it reports, whatever the length
    got = json.loads(invoke(tmp_path / "s", "get", "--model", LLAMA, "--prompt-file", str(f), "--json").stdout)
    assert got["matched"] == entry["tokens"]


# -- read-only use ------------------------------------------------------------------------


def test_read_commands_never_create_a_store(tmp_path):
    folder = tmp_path / "not-a-store"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    for args in (("ls",), ("stats",), ("verify",), ("verify", "--fix"), ("rm", "--older-than", "1d", "--yes"),
                 ("gc", "--dry-run"), ("export", "abc", "--model", LLAMA, "-o", str(tmp_path / "x.safetensors")),
                 ("get", "--model", LLAMA, "--prompt", "hi")):
        doc = error(folder, *args)
        assert doc["error"] == "StoreUnavailable" and "not a promptstore store" in doc["message"], args
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    # no folder at all: ls lists nothing and a lookup is a miss; neither creates it
    missing = tmp_path / "later"
    assert json.loads(invoke(missing, "ls", "--json").stdout) == []
    assert invoke(missing, "ls").stdout.startswith("0 entries")
    got = json.loads(invoke(missing, "get", "--model", LLAMA, "--prompt", "hi", "--json").stdout)
    assert got["matched"] == 0 and got["entry"] is None
    assert error(missing, "stats")["error"] == "StoreUnavailable"
    assert not missing.exists()


STORE_COMMANDS = ("compact", "export", "gc", "get", "import", "ls", "put", "rm", "serve", "stats", "verify", "warmup")


def test_store_option_goes_after_the_command_too(tmp_path):
    """``promptstore ls --store DIR`` as well as ``promptstore --store DIR ls``;
    given after the command it wins over the global option and PROMPTSTORE_DIR."""
    store, other, env_dir = tmp_path / "s", tmp_path / "other", tmp_path / "env"
    env = {"PROMPTSTORE_DIR": str(env_dir)}
    entry = json.loads(invoke(None, "put", "--model", LLAMA, "--prompt", PROMPT, "--store", str(store), "--json", env=env).stdout)
    assert (store / "data.mdb").is_file() and not env_dir.exists()
    for global_store in (None, other):
        rows = json.loads(invoke(global_store, "ls", "--store", str(store), "--json", env=env).stdout)
        assert [r["id"] for r in rows] == [entry["id"]]
        got = json.loads(invoke(global_store, "get", "--model", LLAMA, "--prompt", PROMPT, "--store", str(store), "--json", env=env).stdout)
        assert got["matched"] == entry["tokens"] and got["entry"]["id"] == entry["id"]
    assert json.loads(invoke(other, "stats", "--store", str(store), "--json").stdout)["path"] == str(store)
    assert not other.exists() and not env_dir.exists()  # nothing created where the option was overridden
    # a read command pointed after the command at a missing store creates none
    assert json.loads(invoke(None, "ls", "--store", str(tmp_path / "later"), "--json").stdout) == []
    assert not (tmp_path / "later").exists()
    # a file is no store folder: a usage error, JSON under --json, nothing touched
    doc = error(None, "ls", "--store", str(store / "data.mdb"), code=2)
    assert doc["error"] == "UsageError" and "--store" in doc["message"]
    for name in STORE_COMMANDS:
        assert "--store DIRECTORY" in invoke(None, name, "--help").stdout, name
    for name in ("salvage", "bench"):  # they name their stores otherwise (SRC DST; their own scratch folder)
        assert "--store DIRECTORY" not in invoke(None, name, "--help").stdout, name
    assert json.loads(invoke(store, "verify", "--json").stdout)["ok"]
    assert invoke(store, "verify").stdout == "ok: 1 entry checked\n"  # counts in words: 1 entry, 2 entries


@pytest.fixture
def read_only_store(tmp_path):
    """A store on a read-only bind mount (EROFS even for root)."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    entry = put(src)
    ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode == 0
    if mounted and subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode != 0:
        subprocess.run(["umount", str(ro)])
        mounted = False
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("cannot make a read-only mount here (and root ignores file permissions)")
        for p in (src / "data.mdb", src / "lock.mdb", src):
            p.chmod(0o555 if p.is_dir() else 0o444)
        ro = src
    try:
        yield ro, entry
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)])
        else:
            src.chmod(0o755)


def test_a_store_the_user_may_only_read(read_only_store, monkeypatch):
    ro, entry = read_only_store
    assert not os.access(ro, os.W_OK)
    rows = json.loads(invoke(ro, "ls", "--json").stdout)
    assert [r["id"] for r in rows] == [entry["id"]]
    assert json.loads(invoke(ro, "stats", "--json").stdout)["entries"] == 1
    assert json.loads(invoke(ro, "verify", "--json").stdout)["ok"]
    got = json.loads(invoke(ro, "get", "--model", LLAMA, "--prompt", PROMPT, "--json").stdout)
    assert got["matched"] == entry["tokens"] and got["entry"]["id"] == entry["id"]
    loads = []
    monkeypatch.setattr("promptstore.cli._model.load_model", lambda *a, **k: loads.append(a) or (_ for _ in ()).throw(AssertionError))
    for args in (("put", "--model", LLAMA, "--prompt", "Another prompt."),
                 ("import", "--model", LLAMA, "--prompt", "x", __file__)):
        doc = error(ro, *args)
        assert doc["error"] == "StoreUnavailable" and "read-only" in doc["message"]
    assert loads == []  # failed before the model was loaded, let alone prefilled


# -- smaller items ---------------------------------------------------------------------------


def test_python_dash_m_promptstore_runs(tmp_path):
    env = dict(os.environ, PROMPTSTORE_DIR=str(tmp_path / "s"))
    proc = subprocess.run([sys.executable, "-m", "promptstore", "ls", "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and json.loads(proc.stdout) == [], proc.stderr
    proc = subprocess.run([sys.executable, "-m", "promptstore", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "Usage: promptstore" in proc.stdout


def test_default_store_follows_xdg_cache_home(tmp_path):
    env = {"PROMPTSTORE_DIR": None, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    res = invoke(None, "put", "--model", LLAMA, "--prompt", "Hi.", "--json", env=env)
    assert (tmp_path / "xdg" / "promptstore" / "data.mdb").is_file()
    assert not (tmp_path / "home" / ".cache" / "promptstore").exists()
    stats = json.loads(invoke(None, "stats", "--json", env=env).stdout)
    assert stats["path"] == str(tmp_path / "xdg" / "promptstore") and stats["entries"] == 1
    assert json.loads(res.stdout)["tokens"] > 0


def test_budget_takes_binary_units(tmp_path):
    put(tmp_path / "s")
    assert json.loads(invoke(tmp_path / "s", "gc", "--budget", "100KiB", "--dry-run", "--json").stdout)["budget"] == 100 * 1024
    assert json.loads(invoke(tmp_path / "s", "gc", "--budget", "1.5MiB", "--dry-run", "--json").stdout)["budget"] == 3 * 512 * 1024
    assert json.loads(invoke(tmp_path / "s", "gc", "--budget", "2MB", "--dry-run", "--json").stdout)["budget"] == 2 * 10**6
    assert "not a size" in error(tmp_path / "s", "gc", "--budget", "5iB", code=2)["message"]


@pytest.fixture
def far_timezone(monkeypatch):
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+05:30: local and UTC never show the same minute
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_ls_table_shows_local_times_and_json_utc(tmp_path, far_timezone):
    entry = put(tmp_path / "s")
    row = json.loads(invoke(tmp_path / "s", "ls", "--json").stdout)[0]
    assert row["last_used"].endswith("Z")
    used = datetime.fromisoformat(row["last_used"].replace("Z", "+00:00"))
    table = invoke(tmp_path / "s", "ls").stdout.splitlines()
    assert table[1].startswith(entry["id"][:12])
    assert table[1].endswith(used.astimezone().strftime("%Y-%m-%d %H:%M"))
    assert not table[1].endswith(used.strftime("%Y-%m-%d %H:%M"))


def test_get_reports_a_tiny_match_as_partial(tmp_path):
    store = tmp_path / "s"
    entry = put(store, PROMPT + " " + "More context. " * 20)
    other = invoke(store, "get", "--model", LLAMA, "--prompt", "Completely different.").stdout
    doc = json.loads(invoke(store, "get", "--model", LLAMA, "--prompt", "Completely different.", "--json").stdout)
    assert 0 < doc["matched"] < doc["tokens"] / 2  # the chat template's opening only
    pct = f"{100 * doc['matched'] / doc['tokens']:.1f}%"
    assert other.startswith(f"partial hit {entry['id']}: {doc['matched']} of {doc['tokens']} tokens ({pct})")
    full = invoke(store, "get", "--model", LLAMA, "--prompt", PROMPT + " " + "More context. " * 20).stdout
    assert full.startswith(f"hit {entry['id']}: {entry['tokens']} of {entry['tokens']} tokens;")


def test_library_default_path_is_unchanged_by_the_cli(tmp_path, monkeypatch):
    monkeypatch.delenv("PROMPTSTORE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    with PromptStore() as s:
        assert s.path == tmp_path / "x" / "promptstore"


def test_a_reader_that_leaves_early_gets_no_error_line(tmp_path):
    # `promptstore stats | head -3`: the write into the closed pipe printed
    # "error: [Errno 32] Broken pipe". The reader left; there is nothing to say.
    store = tmp_path / "s"
    PromptStore(store).close()
    proc = subprocess.Popen([sys.executable, "-m", "promptstore", "--store", str(store), "stats"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert err == ""
