"""The global --remote / --no-remote options: a CLI put publishes before it
exits; a get from another store finds it through the remote."""

from __future__ import annotations

import json

from click.testing import CliRunner

from _redis import redis_binary, redis_root, redis_single  # noqa: F401
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
    PromptStore(tmp_path / "b", remote=False).close()  # get never creates a store (nor reads a remote without one)
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


def test_cli_bad_url_is_one_line(tmp_path):
    out = run("--store", str(tmp_path / "a"), "--remote", "http://nope:1", "put", "--model", str(MODELS / "llama"),
              "--prompt", PROMPT, "--json", code=1)
    assert out["error"] == "RemoteURLError" and "redis://" in out["message"]
