"""`promptstore serve --draft-model`: speculative decoding on the fixture hybrids,
through real HTTP requests to a real server subprocess on 127.0.0.1.

Greedy answers equal those of the same server without a draft; after a restart
the cached tokens come from the store; the counters report draft tokens and
acceptance; entries are ``ssm.gated_delta``."""

from __future__ import annotations

import http.client
import urllib.error
from typing import List

import pytest

from conftest import MODELS
from promptstore import fingerprint
from test_serving_server import Server, cached, cli_json, text

SYSTEM = "You are a terse assistant that answers in one line."
PROMPTS = ["Name three colours of the rainbow, please.", "What is a prompt cache?", "Count to five."]


def _chat(user: str) -> list:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _answers(srv: Server) -> List[dict]:
    return [srv.chat(_chat(p), max_tokens=12) for p in PROMPTS]


@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_5"])
def test_draft_server_is_greedy_identical_and_restarts_from_the_store(tmp_path, model):
    log = tmp_path / "server.log"
    draft = ("--draft-model", str(MODELS / model), "--num-draft-tokens", "3")  # a self-draft

    plain = Server(tmp_path / "plain", model, log)
    try:
        want = _answers(plain)
    except BaseException:
        plain.kill()
        raise
    plain.stop()

    store = tmp_path / "store"
    srv = Server(store, model, log, *draft)
    try:
        got = _answers(srv)
        assert [text(r) for r in got] == [text(r) for r in want]
        assert [r["usage"]["completion_tokens"] for r in got] == [r["usage"]["completion_tokens"] for r in want]
        assert all(cached(r) == 0 for r in got)
    except BaseException:
        srv.kill()
        raise
    first = srv.stop()
    counters = first["cache"]
    assert first["draft_model"] == str(MODELS / model)
    assert counters["speculative_requests"] == len(PROMPTS)
    assert counters["draft_tokens"] > 0 and 0 < counters["accepted_draft_tokens"] <= counters["draft_tokens"]
    assert counters["acceptance"] == counters["accepted_draft_tokens"] / counters["draft_tokens"]
    assert counters["pending"] == 0 and counters["errors"] == 0 and counters["write_failed"] == 0

    # per request: the prompt checkpoint and prompt + answer, target and draft layers, as ssm.gated_delta
    docs = cli_json(store, "ls")
    fp = fingerprint(MODELS / model)
    assert len(docs) == 2 * len(PROMPTS) and {d["model"] for d in docs} == {f"{fp}+draft:{fp}"}
    for d in docs:
        assert "arrays" not in d["kinds"] and d["kinds"].count("ssm.gated_delta") == len(d["kinds"]) // 2
    lengths = sorted(d["tokens"] for d in docs)
    for r in got:
        n = r["usage"]["prompt_tokens"]
        assert n - 1 in lengths and n + r["usage"]["completion_tokens"] in lengths

    srv = Server(store, model, log, *draft)
    try:
        again = _answers(srv)  # memory is empty: whatever is cached came from the store
        assert [text(r) for r in again] == [text(r) for r in want]
        assert [cached(r) for r in again] == [r["usage"]["prompt_tokens"] - 1 for r in got]
    except BaseException:
        srv.kill()
        raise
    second = srv.stop()["cache"]
    assert second["store_hits"] == len(PROMPTS) and second["errors"] == 0
    assert cli_json(store, "verify")["ok"]


def test_draft_server_refuses_what_it_cannot_run_and_keeps_serving(tmp_path):
    model = "qwen3_next"
    srv = Server(tmp_path / "store", model, tmp_path / "server.log",
                 "--draft-model", str(MODELS / model), "--num-draft-tokens", "2")
    try:
        # mlx-lm's server answers a request whose generation raised with an
        # error status, or (non-streaming) by closing the connection
        with pytest.raises((urllib.error.HTTPError, http.client.RemoteDisconnected)):
            srv.chat(_chat(PROMPTS[0]), max_tokens=12, repetition_penalty=1.3)
        ok = srv.chat(_chat(PROMPTS[0]), max_tokens=12)
        assert text(ok) and ok["usage"]["completion_tokens"] > 0
    except BaseException:
        srv.kill()
        raise
    counters = srv.stop()["cache"]
    assert counters["speculative_requests"] == 1 and counters["draft_tokens"] > 0
    assert "takes no logits processors" in (tmp_path / "server.log").read_text()
