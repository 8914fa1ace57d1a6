"""The issue's demo: two `promptstore serve` processes, each with its own
local store, on one Redis Cluster (3 masters on 127.0.0.1). A prompt only
server A has seen is answered by server B from the remote tier: its response
reports cached tokens, and the same greedy answer."""

from __future__ import annotations

import time

from _redis import redis_binary, redis_cluster, redis_root  # noqa: F401
from promptstore.remote import Remote
from test_serving_server import FIRST, Server, cached, text

PUBLISH_WAIT = 30.0  # seconds A's background writes and publishes may take


def published(url: str) -> int:
    remote = Remote(url)
    try:
        return sum(1 for _ in remote.entries())
    finally:
        remote.close()


def test_server_b_restores_what_only_server_a_prefilled(tmp_path, redis_cluster, monkeypatch):
    url = f"{redis_cluster.url}?ns=serve-demo"
    monkeypatch.setenv("PROMPTSTORE_REMOTE", url)  # both servers inherit it
    log = tmp_path / "servers.log"
    a = Server(tmp_path / "a", "llama", log)
    try:
        first = a.chat(FIRST)
        assert cached(first) == 0
        deadline = time.monotonic() + PUBLISH_WAIT
        while published(url) == 0:  # A's cache: written to A's store, then published behind it
            assert time.monotonic() < deadline, f"nothing published in {PUBLISH_WAIT} s; see {log}"
            time.sleep(0.1)
    except BaseException:
        a.kill()
        raise
    a.stop()

    b = Server(tmp_path / "b", "llama", log)
    try:
        again = b.chat(FIRST)
    except BaseException:
        b.kill()
        raise
    counters = b.stop()["cache"]
    assert cached(again) > 0 and again["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert text(again) == text(first)
    assert counters["store_hits"] >= 1
