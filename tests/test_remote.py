"""The shared tier against real Redis servers: one server and a 3-master cluster.

Two PromptStores with separate local folders share one remote: what only A
stored, B finds by token prefix and restores bit-exact (==).
"""

from __future__ import annotations

import itertools
import threading
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from _redis import fresh_cluster, fresh_single, redis_binary, redis_cluster, redis_root, redis_single  # noqa: F401
from _samples import assert_same, det, visible_state
from promptstore import PromptStore
from promptstore.format._blocks import BLOCK_TOKENS
from promptstore.remote import RemoteURLError, parse_url
from promptstore.ssm import SSMCache

MODEL = "tiny@" + "ab" * 16
_ns = itertools.count()


def kv_cache(n: int, layers: int = 2, seed: int = 0, dtype=mx.bfloat16):
    out = []
    for li in range(layers):
        c = KVCache()
        c.update_and_fetch(det((1, 2, n, 32), dtype, seed + 2 * li), det((1, 2, n, 32), dtype, seed + 2 * li + 1))
        out.append(c)
    return out


def toks(n: int, seed: int = 0) -> list:
    return [(i * 7919 + seed * 104729) % 30000 + 3 for i in range(n)]


def same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert_same(visible_state(x), visible_state(y))


def url_of(server, ns: str, **params) -> str:
    extra = "".join(f"&{k}={v}" for k, v in params.items())
    return f"{server.url}/0?ns={ns}{extra}"


@pytest.fixture(params=["single", "cluster"])
def remote_url(request):
    server = request.getfixturevalue("redis_single" if request.param == "single" else "redis_cluster")
    return url_of(server, f"t{next(_ns)}")


def pair(tmp_path, url):
    return PromptStore(tmp_path / "a", remote=url), PromptStore(tmp_path / "b", remote=url)


# -- URLs -------------------------------------------------------------------------


def test_urls():
    u = parse_url("rediss://alice:s%40cret@cache.example:7000/2?ns=fleet-1&timeout=0.5")
    assert (u.tls, u.username, u.password, u.host, u.port, u.db, u.namespace, u.timeout) == (
        True, "alice", "s@cret", "cache.example", 7000, 2, "fleet-1", 0.5)
    assert "s@cret" not in str(u) and "***" in str(u)
    assert parse_url("redis://h").port == 6379 and parse_url("redis://h").namespace == "promptstore"
    for bad in ("http://h:1", "redis://:1", "redis://h:1/x", "redis://h:1?ns=a b", "redis://h:1?tmo=1",
                "redis://h:1?timeout=0", "redis://h:99999", "", "redis://h:0", "redis://h:00",
                "redis://h:1/\u0663"):  # port 0 (was read as 6379), an Arabic-Indic digit as the db (was db 3)
        with pytest.raises(RemoteURLError):
            parse_url(bad)
    with pytest.raises(RemoteURLError):  # refused before any store is opened
        PromptStore("/nonexistent/never-created", remote="memcached://h:1")
    # An IPv6 host printed without its brackets, a URL parse_url then refused.
    v6 = parse_url("redis://[::1]:7000?ns=v6")
    assert str(v6) == "redis://[::1]:7000/0?ns=v6" and parse_url(str(v6)) == v6
    with pytest.raises(RemoteURLError, match="names no URL"):  # it read as "no remote", silently
        PromptStore("/nonexistent/never-created", remote=True)


def test_a_database_on_a_cluster_is_a_url_error(tmp_path, redis_cluster, redis_single, caplog):
    """A cluster has only database 0: /1 in its URL is a RemoteURLError (it
    was RemoteUnavailable, a cluster node refusing SELECT), raised by a
    direct call and, for a store's reads, logged while the local tier answers."""
    url = f"{redis_cluster.url}/1?ns=t{next(_ns)}"
    with PromptStore(tmp_path / "c", remote=url) as s:
        with pytest.raises(RemoteURLError, match="only database 0"):
            list(s.remote.remote.entries())
        with caplog.at_level("WARNING", logger="promptstore"):
            s.put(MODEL, toks(100), kv_cache(100))  # its publish fails in the background
            s.remote.flush(10)
            hit = s.lookup(MODEL, toks(100) + [9])
        assert hit is not None and hit.matched == 100
        assert s.remote.stats()["errors.url"] >= 1 and "only database 0" in caplog.text
    # a single server keeps its database: what /1 stores, /0 does not see
    ns = f"t{next(_ns)}"
    with PromptStore(tmp_path / "one", remote=f"{redis_single.url}/1?ns={ns}") as s1:
        s1.put(MODEL, toks(64), kv_cache(64))
        assert s1.remote.flush(10) and len(list(s1.remote.remote.entries())) == 1
    with PromptStore(tmp_path / "zero", remote=f"{redis_single.url}/0?ns={ns}") as s0:
        assert list(s0.remote.remote.entries()) == []


def test_env_and_off(tmp_path, monkeypatch, redis_single):
    monkeypatch.setenv("PROMPTSTORE_REMOTE", url_of(redis_single, "envns"))
    with PromptStore(tmp_path / "a") as s:
        assert s.remote is not None and s.remote.url.namespace == "envns"
    with PromptStore(tmp_path / "b", remote=False) as s:
        assert s.remote is None


# -- sharing ----------------------------------------------------------------------


def test_b_restores_what_only_a_stored(tmp_path, remote_url):
    a, b = pair(tmp_path, remote_url)
    with a, b:
        t = toks(600)
        cache = kv_cache(600)
        a.put(MODEL, t, cache, meta={"who": "a"})
        assert a.remote.flush(10)
        assert a.remote.stats()["published"] == 1
        assert b.lookup(MODEL, toks(50, seed=9)) is None  # another prompt: a miss
        hit = b.lookup(MODEL, t + [5, 6, 7])
        assert hit is not None and hit.matched == 600 and hit.trimmed == 0
        same(hit.cache, cache)
        st = b.remote.stats()
        assert st["hits"] == 1 and st["misses"] == 1 and st["bytes_fetched"] > 0
        assert b.exists(MODEL, t)  # written to B's own tier: the next lookup is local
        assert b.info(hit.info.id).meta == {"who": "a"}
        assert b.lookup(MODEL, t).matched == 600
        assert b.remote.stats()["hits"] == 1
        assert b.remote.stats().get("published", 0) == 0  # B does not publish it back


def _held_publisher(store, monkeypatch) -> threading.Event:
    """Hold ``store``'s publisher until the returned event is set (the real
    publish runs then): what the caller does meanwhile happens before it."""
    gate = threading.Event()
    real = store.remote.remote.publish

    def held(*args, **kwargs):
        assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(store.remote.remote, "publish", held)
    return gate


def test_a_publish_sends_what_was_put_not_what_the_cache_became(tmp_path, redis_single, monkeypatch):
    """The caller goes on with its cache as mlx-lm does (back one token, then a
    new one, written into the same arrays) before the publisher runs: the fleet
    gets what was put, as the local store did. At 512 tokens (a multiple of
    KVCache's step) the cache's arrays are exactly what the entry covers."""
    a, b = pair(tmp_path, url_of(redis_single, f"t{next(_ns)}"))
    with a, b:
        n = 512
        t, cache = toks(n), kv_cache(n)
        gate = _held_publisher(a, monkeypatch)
        a.put(MODEL, t, cache)
        for c in cache:
            c.trim(1)
            c.update_and_fetch(mx.full((1, 2, 1, 32), 7, mx.bfloat16), mx.full((1, 2, 1, 32), 7, mx.bfloat16))
        mx.eval([c.keys for c in cache] + [c.values for c in cache])
        gate.set()
        assert a.remote.flush(30)
        assert a.remote.stats()["published"] == 1
        hit = b.lookup(MODEL, t)
        assert hit is not None and hit.matched == n
        same(hit.cache, kv_cache(n))
        same(a.get(MODEL, t), kv_cache(n))


def test_a_lazy_cache_is_published(tmp_path, redis_single, monkeypatch):
    """A cache whose arrays were never evaluated by the caller: the publisher,
    on its own thread, still publishes it (mlx evaluates a graph only on the
    thread whose stream built it)."""
    a, b = pair(tmp_path, url_of(redis_single, f"t{next(_ns)}"))
    with a, b:
        n = 300
        cache = []
        for li in range(2):
            c = KVCache()
            c.update_and_fetch(det((1, 2, n, 32), mx.bfloat16, 2 * li) * 1, det((1, 2, n, 32), mx.bfloat16, 2 * li + 1) * 1)
            cache.append(c)
        gate = _held_publisher(a, monkeypatch)
        a.put(MODEL, toks(n), cache)
        gate.set()
        assert a.remote.flush(30)
        assert a.remote.stats()["published"] == 1, a.remote.stats()
        hit = b.lookup(MODEL, toks(n))
        assert hit is not None and hit.matched == n
        same(hit.cache, kv_cache(n))


def test_a_fetch_reads_its_blocks_into_place(tmp_path, remote_url, monkeypatch):
    """Blocks are read from the sockets straight into the restored arrays (on
    one server and on every master of a cluster), and the same fetch through
    redis-py, where the direct read declines (a connection without what it
    uses), restores the same bits."""
    from promptstore.remote import _direct

    a, b = pair(tmp_path, remote_url)
    with a, b:
        t = toks(1100, seed=6)
        cache = kv_cache(1100, seed=4)
        a.put(MODEL, t, cache)
        assert a.remote.flush(10)
        client = b.remote.remote.client
        hit = b.lookup(MODEL, t)
        assert hit is not None and hit.matched == 1100
        same(hit.cache, cache)
        assert client.reads["direct"] >= 1 and client.reads["through redis-py"] == 0
        b.delete(MODEL, t)
        # A redis-py whose connections lack what the direct read uses: it declines, redis-py reads.
        monkeypatch.setattr(_direct, "_NEEDS", _direct._NEEDS + ("no_such_method",))
        hit = b.lookup(MODEL, t)
        assert hit is not None and hit.matched == 1100
        same(hit.cache, cache)
        assert client.reads["through redis-py"] >= 1
        assert b.remote.stats().get("errors", 0) == 0


def test_get_exact(tmp_path, remote_url):
    a, b = pair(tmp_path, remote_url)
    with a, b:
        t = toks(70, seed=1)
        cache = kv_cache(70, seed=3, dtype=mx.float16)
        a.put(MODEL, t, cache)
        a.remote.flush(10)
        assert b.get(MODEL, t[:-1]) is None
        got = b.get(MODEL, t)
        assert got is not None
        same(got, cache)


def test_longer_remote_match_reuses_local_blocks(tmp_path, remote_url):
    a, b = pair(tmp_path, remote_url)
    with a, b:
        full = kv_cache(700, seed=5)
        t = toks(700, seed=2)
        prefix = kv_cache(700, seed=5)
        for layer in prefix:
            layer.trim(700 - 520)
        b.put(MODEL, t[:520], prefix)  # B holds the first 520 tokens
        a.put(MODEL, t, full)
        a.remote.flush(10)
        b.remote.flush(10)
        hit = b.lookup(MODEL, t + [1])
        assert hit is not None and hit.matched == 700
        same(hit.cache, full)
        st = b.remote.stats()
        # B's whole blocks (cut every BLOCK_TOKENS from 0, locally and remotely alike)
        # x 2 arrays x 2 layers came from B's own entry, not the network
        assert st["blocks_reused"] == 520 // BLOCK_TOKENS * 2 * 2 > 0
        assert st["bytes_fetched"] < sum(c.keys.nbytes + c.values.nbytes for c in full)


def test_trimmed_remote_match(tmp_path, remote_url):
    a, b = pair(tmp_path, remote_url)
    with a, b:
        t = toks(400, seed=4)
        cache = kv_cache(400, seed=7)
        a.put(MODEL, t, cache)
        a.remote.flush(10)
        query = t[:300] + [29999, 29998]
        assert b.peek(MODEL, query) == 300
        hit = b.lookup(MODEL, query)
        assert hit is not None and hit.matched == 300 and hit.trimmed == 100
        expect = kv_cache(400, seed=7)
        for layer in expect:
            layer.trim(100)
        same(hit.cache, expect)


def test_a_remote_prefix_hit_fetches_only_the_blocks_it_needs(tmp_path, remote_url):
    """A 600-token prefix hit on a remote entry of 3 blocks and a bit fetched
    all of it (and stored all of it here); it fetches the 2 blocks that hold
    those 600 tokens, stores them as an entry of their own, and a later
    longer match fetches only the rest."""
    n = 3 * BLOCK_TOKENS + 100
    a, b = pair(tmp_path, remote_url)
    with a, b:
        t = toks(n, seed=9)
        a.put(MODEL, t, kv_cache(n, seed=13))
        assert a.remote.flush(10)
        row = 2 * 32 * 2  # one token of one array: 2 heads x 32 dims, bfloat16
        hit = b.lookup(MODEL, t[:600] + [29999])
        assert hit is not None and hit.matched == 600
        expect = kv_cache(n, seed=13)
        for layer in expect:
            layer.trim(n - 600)
        same(hit.cache, expect)
        assert b.remote.stats()["bytes_fetched"] == 2 * BLOCK_TOKENS * row * 2 * 2  # 2 blocks x 2 arrays x 2 layers
        assert [e.n_tokens for e in b.entries()] == [2 * BLOCK_TOKENS]
        hit = b.lookup(MODEL, t + [1])
        assert hit is not None and hit.matched == n
        same(hit.cache, kv_cache(n, seed=13))
        st = b.remote.stats()
        assert st["bytes_fetched"] == n * row * 2 * 2  # the first 2 blocks came from this store's entry
        assert st["blocks_reused"] == 2 * 2 * 2


def test_recurrent_entries_match_only_whole(tmp_path, remote_url):
    a, b = pair(tmp_path, remote_url)
    with a, b:
        t = toks(300, seed=6)
        ssm = SSMCache.from_parts(det((1, 3, 64), mx.float32, 23), det((1, 4, 16, 16), mx.float32, 24), [300])
        cache = kv_cache(300, layers=1, seed=11) + [ssm]
        a.put(MODEL, t, cache)
        a.remote.flush(10)
        assert b.lookup(MODEL, t[:299] + [1]) is None  # a shorter query cannot use it
        hit = b.lookup(MODEL, t + [1, 2])
        assert hit is not None and hit.matched == 300
        same(hit.cache, cache)


def test_model_identity_and_namespace_keep_apart(tmp_path, redis_cluster):
    ns = f"t{next(_ns)}"
    with PromptStore(tmp_path / "a", remote=url_of(redis_cluster, ns)) as a, \
            PromptStore(tmp_path / "b", remote=url_of(redis_cluster, ns)) as b, \
            PromptStore(tmp_path / "c", remote=url_of(redis_cluster, ns + "x")) as c:
        t = toks(130, seed=8)
        a.put(MODEL, t, kv_cache(130))
        a.remote.flush(10)
        assert b.lookup("other@" + "cd" * 16, t) is None
        assert b.get("other@" + "cd" * 16, t) is None
        assert c.lookup(MODEL, t) is None
        assert b.lookup(MODEL, t).matched == 130


def test_blocks_are_stored_once(tmp_path, redis_single):
    ns = f"t{next(_ns)}"
    with PromptStore(tmp_path / "a", remote=url_of(redis_single, ns)) as a:
        t = toks(600, seed=3)
        whole = kv_cache(600, seed=2)
        part = kv_cache(600, seed=2)
        for layer in part:
            layer.trim(600 - 512)
        a.put(MODEL, t[:512], part)
        a.remote.flush(10)
        first = a.remote.stats()["bytes_published"]
        a.put(MODEL, t, whole)  # a conversation grown by 88 tokens
        a.remote.flush(10)
        st = a.remote.stats()
        held = 512 // BLOCK_TOKENS * 2 * 2  # the first 512 tokens' blocks, per array, were there already
        assert st["blocks_held"] == held
        assert st["bytes_published"] - first == 2 * 2 * (88 * 2 * 32 * 2)  # only the new tail travelled
        r = redis_single.client()
        assert len(list(r.scan_iter(match=f"{ns}:b:*".encode()))) == held + 4  # 2 entries: the tail adds 4 blocks


ACL = "+get +set +exists +hset +hgetall +scan +info +cluster|slots +command"


@pytest.mark.parametrize("kind", ["single", "cluster"])
def test_acl_user_limited_to_its_namespace(tmp_path, request, kind):
    server = request.getfixturevalue("redis_single" if kind == "single" else "redis_cluster")
    ns = f"acl{next(_ns)}"
    nodes = server.nodes if kind == "cluster" else [server]
    for node in nodes:
        node.client().execute_command("ACL", "SETUSER", f"u{ns}", "on", ">pw", f"~{ns}:*", "resetchannels", *ACL.split())
    url = f"redis://u{ns}:pw@127.0.0.1:{server.url.rsplit(':', 1)[1]}/0?ns={ns}"
    a, b = pair(tmp_path, url)
    with a, b:
        t, cache = toks(300, seed=12), kv_cache(300, seed=12)
        a.put(MODEL, t, cache)
        assert a.remote.flush(10)
        hit = b.lookup(MODEL, t)
        assert hit is not None and hit.matched == 300 and b.remote.stats().get("errors", 0) == 0
        same(hit.cache, cache)
    other = url.replace(f"ns={ns}", f"ns={ns}other")  # the same user, another namespace: refused
    with PromptStore(tmp_path / "c", remote=other) as c:
        c.put(MODEL, t, cache)
        c.remote.flush(10)
        assert c.remote.stats()["errors"] >= 1 and c.remote.stats().get("published", 0) == 0


def test_a_chunked_window_past_its_first_chunk_is_no_remote_prefix(tmp_path, remote_url):
    """The remote lookup trimmed such an entry below its start (a 136-token
    cache for 100 tokens); with the local fix it raised MissingCapability
    from lookup instead, every time, even with a local prefix to return."""
    from mlx_lm.models.cache import ChunkedKVCache

    c = ChunkedKVCache(64)
    c.update_and_fetch(det((1, 2, 200, 32), mx.bfloat16, 0), det((1, 2, 200, 32), mx.bfloat16, 1))
    c.maybe_trim_front()
    assert c.start_position == 136
    t = toks(200)
    a, b = pair(tmp_path, remote_url)
    with a, b:
        a.put(MODEL, t, [c])
        assert a.remote.flush(10)
        query = t[:100] + [7, 7]
        assert b.lookup(MODEL, query) is None
        b.put(MODEL, t[:64], kv_cache(64, layers=1))
        assert b.lookup(MODEL, query).matched == 64
        hit = b.lookup(MODEL, t[:150] + [7])  # inside the kept chunk: trimmed to 150
        assert hit.matched == 150 and (hit.cache[0].offset, hit.cache[0].start_position) == (150, 136)


@pytest.mark.parametrize("call", ["get", "lookup", "peek"])
def test_close_while_a_read_waits_on_the_remote_is_a_miss(tmp_path, fresh_single, call):
    """close() from another thread while a read waits on a stalled remote:
    the read ends as a miss within its timeout. get crashed with
    AttributeError ('NoneType' has no attribute 'remote'): close() had
    dropped the tier, which the read went on to use."""
    b = PromptStore(tmp_path / "b", remote=url_of(fresh_single, f"t{next(_ns)}", timeout=1))
    assert b.lookup(MODEL, toks(5, seed=1)) is None  # connected
    out = {}

    def read():
        try:
            out["r"] = getattr(b, call)(MODEL, toks(100))
        except BaseException as err:  # what the caller would get
            out["r"] = err

    fresh_single.pause()
    try:
        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.3)
        start = time.monotonic()
        b.close()
        assert time.monotonic() - start < 1  # close does not wait for the remote
        reader.join(10)
    finally:
        fresh_single.resume()
    assert out["r"] == {"get": None, "lookup": None, "peek": 0}[call]
