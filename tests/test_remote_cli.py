"""The global --remote / --no-remote options: a CLI put publishes before it
exits; a get from another store finds it through the remote."""

from __future__ import annotations

import json

from click.testing import CliRunner

from _redis import free_port, redis_binary, redis_root, redis_single  # noqa: F401
from conftest import MODELS
from promptstore import PromptStore
from promptstore.cli import main

PROMPT = "You are a terse assistant. Explain prompt caches."


def run(*args, code=0, env=None):
    res = CliRunner().invoke(main, list(args), env=env)
    assert res.exit_code == code, res.output
    return json.loads(res.stdout) if "--json" in args else res.output


def test_cli_put_publishes_and_get_fetches(tmp_path, redis_single):
    url = f"{redis_single.url}?ns=cli"
    model = str(MODELS / "llama")
    PromptStore(tmp_path / "b", remote=False).close()  # B has a store of its own, empty
    put = run("--store", str(tmp_path / "a"), "--remote", url, "put", "--model", model, "--prompt", PROMPT, "--json")
    miss = run("--store", str(tmp_path / "b"), "--no-remote", "get", "--model", model, "--prompt", PROMPT, "--json",
               env={"PROMPTSTORE_REMOTE": url})
    assert miss["matched"] == 0
    got = run("--store", str(tmp_path / "b"), "get", "--model", model, "--prompt", PROMPT, "--json",
              env={"PROMPTSTORE_REMOTE": url})
    assert got["matched"] == put["tokens"] > 0 and got["to_prefill"] == 0
    with PromptStore(tmp_path / "a", remote=False) as a, PromptStore(tmp_path / "b", remote=False) as b:
        (ea,) = list(a.entries())
        cache_a, _, toks = a.load(ea.id)
        cache_b = b.get(ea.model, toks)  # B's own tier holds it now
        assert cache_b is not None
        for x, y in zip(cache_a, cache_b):
            assert x.keys[..., : x.offset, :].tolist() == y.keys[..., : y.offset, :].tolist()


def test_cli_get_without_a_local_store_asks_the_remote(tmp_path, redis_single):
    """A host that never stored anything: get creates its store and fetches from the remote."""
    url = f"{redis_single.url}?ns=cli-fresh"
    model = str(MODELS / "llama")
    put = run("--store", str(tmp_path / "a"), "--remote", url, "put", "--model", model, "--prompt", PROMPT, "--json")
    off = run("--store", str(tmp_path / "b"), "--no-remote", "get", "--model", model, "--prompt", PROMPT, "--json",
              env={"PROMPTSTORE_REMOTE": url})
    assert off["matched"] == 0 and not (tmp_path / "b").exists()  # no remote: still a miss that creates nothing
    got = run("--store", str(tmp_path / "b"), "get", "--model", model, "--prompt", PROMPT, "--json",
              env={"PROMPTSTORE_REMOTE": url})
    assert got["matched"] == put["tokens"] > 0 and got["entry"]["id"] == put["id"]
    with PromptStore(tmp_path / "b", remote=False) as b:  # kept locally: the next get needs no remote
        assert [e.id for e in b.entries()] == [put["id"]]


def test_cli_bad_url_is_one_line(tmp_path):
    out = run("--store", str(tmp_path / "a"), "--remote", "http://nope:1", "put", "--model", str(MODELS / "llama"),
              "--prompt", PROMPT, "--json", code=1)
    assert out["error"] == "RemoteURLError" and "redis://" in out["message"]


def test_a_malformed_remote_stops_only_the_commands_that_use_it(tmp_path):
    """Local maintenance (ls, export, verify, gc, rm, compact) never opens the
    shared tier: a bad $PROMPTSTORE_REMOTE must not lock a user out of it."""
    store, bad = str(tmp_path / "a"), {"PROMPTSTORE_REMOTE": "http://nope:1"}
    put = run("--store", store, "--no-remote", "put", "--model", str(MODELS / "llama"), "--prompt", PROMPT, "--json")
    for args in (("put", "--model", str(MODELS / "llama"), "--prompt", PROMPT + " Again."),
                 ("get", "--model", str(MODELS / "llama"), "--prompt", PROMPT), ("stats",)):
        assert run("--store", store, *args, "--json", code=1, env=bad)["error"] == "RemoteURLError", args
    assert [d["id"] for d in run("--store", store, "ls", "--json", env=bad)] == [put["id"]]
    run("--store", store, "export", put["id"], "-o", str(tmp_path / "c.safetensors"), "--model", str(MODELS / "llama"),
        env=bad)
    assert run("--store", store, "verify", "--json", env=bad)["problems"] == []
    assert run("--store", store, "verify", "--fix", "--json", env=bad)["problems"] == []
    run("--store", store, "gc", "--dry-run", env=bad)
    run("--store", store, "gc", env=bad)
    run("--store", store, "compact", env=bad)
    run("--store", store, "rm", put["id"], "--yes", env=bad)
    assert run("--store", store, "ls", "--json", env=bad) == []


def test_ls_remote_lists_what_other_hosts_published(tmp_path, redis_single):
    url = f"{redis_single.url}?ns=cli-ls"
    model = str(MODELS / "llama")
    put = run("--store", str(tmp_path / "a"), "--remote", url, "put", "--model", model, "--prompt", PROMPT, "--json")
    other = run("--store", str(tmp_path / "a"), "--remote", url, "put", "--model", model, "--prompt", PROMPT + " Twice.",
                "--json")
    local_a = {d["id"]: d for d in run("--store", str(tmp_path / "a"), "--no-remote", "ls", "--json")}
    assert run("--store", str(tmp_path / "b"), "--remote", url, "ls", "--json") == []  # B's own store: nothing
    docs = run("--store", str(tmp_path / "b"), "--remote", url, "ls", "--remote", "--json")
    assert {d["id"] for d in docs} == {put["id"], other["id"]} == set(local_a)  # the ids the local store gives
    for d in docs:
        mine = local_a[d["id"]]
        for field in ("model", "model_name", "tokens", "kinds", "bytes", "trimmable", "meta", "created"):
            assert d[field] == mine[field], field
        assert d["own_bytes"] + d["shared_bytes"] == d["bytes"]
    assert run("--store", str(tmp_path / "b"), "--remote", f"{redis_single.url}?ns=cli-ls-other", "ls", "--remote",
               "--json") == []  # another namespace
    text = run("--store", str(tmp_path / "b"), "--remote", url, "ls", "--remote")
    assert text.splitlines()[0].split()[:5] == ["KEY", "MODEL", "KINDS", "TOKENS", "SIZE"]
    assert text.splitlines()[-1].startswith("2 entries, ")
    err = run("--store", str(tmp_path / "b"), "--no-remote", "ls", "--remote", "--json", code=2, env={"PROMPTSTORE_REMOTE": url})
    assert err["error"] == "UsageError" and "--remote" in err["message"]


def test_stats_shows_the_remote_tier(tmp_path, redis_single):
    url = f"{redis_single.url}?ns=cli-stats"
    model = str(MODELS / "llama")
    run("--store", str(tmp_path / "a"), "--remote", url, "put", "--model", model, "--prompt", PROMPT, "--json")
    assert run("--store", str(tmp_path / "a"), "--no-remote", "stats", "--json")["remote"] is None
    doc = run("--store", str(tmp_path / "a"), "--remote", url, "stats", "--json")
    r = doc["remote"]
    assert r["error"] is None and r["namespace"] == "cli-stats" and r["url"].startswith(redis_single.url)
    assert r["entries"] == doc["entries"] == 1 and r["live_bytes"] == doc["live_bytes"] > 0
    assert 0 < r["stored_bytes"] and r["nodes"] == 1 and r["used_memory"] > r["stored_bytes"]
    assert r["maxmemory_policy"] == [redis_single.client().config_get("maxmemory-policy")["maxmemory-policy"]]
    assert set(r["counters"]) >= {"hits", "misses", "published", "dropped", "bytes_fetched", "bytes_published", "errors"}
    assert r["counters"]["errors"] == 0
    text = run("--store", str(tmp_path / "a"), "--remote", url, "stats")
    assert f"remote  {r['url']}" in text and "this process: 0 hits" in text


def test_stats_with_the_remote_down_still_answers(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}?ns=down&timeout=0.5"  # nothing listens there
    model = str(MODELS / "llama")
    run("--store", str(tmp_path / "a"), "--no-remote", "put", "--model", model, "--prompt", PROMPT, "--json")
    doc = run("--store", str(tmp_path / "a"), "--remote", url, "stats", "--json")
    assert doc["entries"] == 1 and "entries" not in doc["remote"]
    assert "failed" in doc["remote"]["error"] and doc["remote"]["counters"]["errors.unavailable"] == 1
    text = run("--store", str(tmp_path / "a"), "--remote", url, "stats")
    assert "unreadable:" in text and "(unavailable 1)" in text
