"""Faults of the shared tier, on real servers: each gives a local-only answer
or a miss (never wrong data, never a crash, never a hang past the timeout),
counted in the tier's stats."""

from __future__ import annotations

import itertools
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from _redis import (  # noqa: F401
    free_port, fresh_cluster, fresh_single, redis_binary, redis_cluster, redis_root, redis_single, start_server,
)
from promptstore import PromptStore
from promptstore.store._fetched import remote_key
from test_remote import MODEL, kv_cache, same, toks, url_of

_ns = itertools.count()


def published(tmp_path, url, n=600, seed=0, name="a"):
    """A store that put one entry of ``n`` tokens and published it; (tokens, cache)."""
    t, cache = toks(n, seed=seed), kv_cache(n, seed=seed)
    with PromptStore(tmp_path / name, remote=url) as a:
        a.put(MODEL, t, cache)
        assert a.remote.flush(10)
        assert a.remote.stats().get("errors", 0) == 0
    return t, cache


def noise_cache(n: int, seed: int):
    """KV layers of random values: no block equals another entry's (``det`` repeats)."""
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(mx.array(rng.standard_normal((1, 2, n, 32), dtype=np.float32)).astype(mx.float16),
                           mx.array(rng.standard_normal((1, 2, n, 32), dtype=np.float32)).astype(mx.float16))
        out.append(c)
    return out


def block_keys(client, ns):
    return sorted(client.scan_iter(match=f"{ns}:b:*".encode()))


def test_remote_down(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0?timeout=0.5"  # nothing listens there
    with PromptStore(tmp_path / "b", remote=url) as b:
        t = toks(300)
        cache = kv_cache(300)
        b.put(MODEL, t[:200], kv_cache(200))  # the put itself never waits on the remote
        start = time.monotonic()
        hit = b.lookup(MODEL, t)  # the local answer stands
        assert hit is not None and hit.matched == 200
        assert b.lookup(MODEL, toks(10, seed=5)) is None
        assert b.get(MODEL, t) is None
        assert time.monotonic() - start < 3
        b.remote.flush(5)
        st = b.remote.stats()
        assert st["errors.unavailable"] >= 1 and st["misses"] >= 1
        assert st.get("skipped", 0) >= 1  # after the first failure it is left alone for a while
        assert cache  # unused: the remote never answered


def test_remote_slow_is_bounded(tmp_path, fresh_single):
    ns = f"f{next(_ns)}"
    url = url_of(fresh_single, ns, timeout=0.5)
    t, cache = published(tmp_path, url)
    with PromptStore(tmp_path / "b", remote=url) as b:
        fresh_single.pause()  # SIGSTOP: connections are accepted, nothing is answered
        try:
            start = time.monotonic()
            assert b.lookup(MODEL, t) is None
            took = time.monotonic() - start
            assert took < 3, took
            assert b.remote.stats()["errors.unavailable"] == 1
        finally:
            fresh_single.resume()
        b.remote.remote.cooldown = 0
        b.remote.remote._down_until = 0.0
        hit = b.lookup(MODEL, t)  # it answers again: the tier reconnects
        assert hit is not None and hit.matched == len(t)
        same(hit.cache, cache)


def test_pending_counts_entries_not_the_stop_marker(tmp_path, fresh_single):
    # After close() with the publisher busy, stats() said pending 1 with nothing left
    # to publish: the queue's size counted the marker close() puts in to stop the thread.
    ns = f"f{next(_ns)}"
    url = url_of(fresh_single, ns, timeout=2)
    with PromptStore(tmp_path / "a", remote=url) as a:
        fresh_single.pause()  # the next publish waits on the network: the thread is busy
        try:
            a.put(MODEL, toks(100, seed=1), kv_cache(100, seed=1))
            deadline = time.monotonic() + 5
            while a.remote.stats()["pending"] and time.monotonic() < deadline:  # taken up by the thread
                time.sleep(0.01)
            a.remote.publisher.close(0)  # no wait: the stop marker is queued behind the busy job
            assert a.remote.stats()["pending"] == 0
        finally:
            fresh_single.resume()


def test_master_killed_mid_fetch(tmp_path, fresh_cluster):
    ns = f"f{next(_ns)}"
    url = url_of(fresh_cluster, ns, timeout=0.5)
    t, cache = published(tmp_path, url, n=1500)
    with PromptStore(tmp_path / "b", remote=url) as b:
        key = remote_key(MODEL, np.asarray(t, dtype=np.uint32))
        found = b.remote.remote.find(key)
        assert found is not None and found.matched == len(t)
        holders = {fresh_cluster.node_of(b.remote.remote.layout.block(a)).port for a, _ in found.manifest.parts()}
        assert len(holders) == 3  # the entry's blocks are on every master
        fresh_cluster.nodes[1].kill()  # between finding the entry and fetching its blocks
        start = time.monotonic()
        assert b.remote.remote.fetch(found) is None
        b.remote.remote._down_until = 0.0  # skip the cool-down: try the whole path again
        assert b.lookup(MODEL, t) is None  # a whole lookup now: a miss
        assert time.monotonic() - start < 6
        assert b.remote.stats()["errors.unavailable"] >= 1
        assert not b.exists(MODEL, t)  # nothing half-fetched was stored
        # a put with a master down: stored locally, the publish fails, counted
        with PromptStore(tmp_path / "c", remote=url) as c:
            c.put(MODEL, toks(600, seed=77), kv_cache(600, seed=3))
            assert c.remote.flush(10)
            assert c.remote.stats()["errors"] >= 1 and c.exists(MODEL, toks(600, seed=77))


def test_a_short_block_leaves_the_connection_usable(tmp_path, redis_single):
    """A block value shorter than its manifest says is refused while it is
    read into place (the rest of its reply unread); the next fetch, over the
    same tier, of another entry is exact: no reply is read out of step."""
    ns = f"f{next(_ns)}"
    url = url_of(redis_single, ns)
    first, second = toks(900, seed=1), toks(900, seed=2)
    caches = {0: noise_cache(900, 11), 1: noise_cache(900, 12)}
    with PromptStore(tmp_path / "a", remote=url) as a:
        a.put(MODEL, first, caches[0])
        assert a.remote.flush(10)
        r = redis_single.client()
        only_first = block_keys(r, ns)
        a.put(MODEL, second, caches[1])
        assert a.remote.flush(10)
    k = only_first[len(only_first) // 2]
    r.set(k, r.get(k)[:-3])
    with PromptStore(tmp_path / "b", remote=url) as b:
        assert b.lookup(MODEL, first) is None
        assert b.remote.stats()["errors.corrupt"] == 1
        hit = b.lookup(MODEL, second)
        assert hit is not None and hit.matched == 900
        same(hit.cache, caches[1])
        st = b.remote.stats()
        assert st["hits"] == 1 and st.get("errors.unavailable", 0) == 0
        assert b.remote.remote.client.reads["through redis-py"] == 0


def test_evicted_blocks_are_a_miss(tmp_path, redis_single):
    ns = f"f{next(_ns)}"
    url = url_of(redis_single, ns)
    t, cache = published(tmp_path, url)
    r = redis_single.client()
    r.delete(block_keys(r, ns)[3])  # as maxmemory eviction would
    with PromptStore(tmp_path / "b", remote=url) as b:
        assert b.lookup(MODEL, t) is None
        assert b.get(MODEL, t) is None
        st = b.remote.stats()
        assert st["errors.missing"] == 2 and st.get("hits", 0) == 0
        assert not b.exists(MODEL, t)
    r.delete(*r.scan_iter(match=f"{ns}:m:*".encode()))  # manifest gone, index left: stale
    with PromptStore(tmp_path / "c", remote=url) as c:
        assert c.lookup(MODEL, t) is None
        assert c.remote.stats()["stale_index"] == 1


def test_maxmemory_eviction_never_gives_wrong_data(tmp_path, redis_binary):
    server = start_server(redis_binary, tmp_path / "redis", extra=["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"])
    try:
        url = url_of(server, "evict")
        entries = []
        with PromptStore(tmp_path / "a", remote=url) as a:
            for i in range(20):  # 20 x 0.3 MB through a 4 MB server
                t, c = toks(600, seed=100 + i), noise_cache(600, seed=100 + i)
                a.put(MODEL, t, c)
                assert a.remote.flush(10)
                entries.append((t, c))
        assert int(server.client().info("stats")["evicted_keys"]) > 0
        hits = 0
        with PromptStore(tmp_path / "b", remote=url) as b:
            for t, c in entries:
                hit = b.lookup(MODEL, t)
                if hit is not None:
                    same(hit.cache, c)
                    hits += 1
            st = b.remote.stats()
        assert hits < len(entries) and st["misses"] == len(entries) - hits
        # Redis's LRU is sampled: any key may go, even a fresh entry's. With room
        # made, one entry more is there, whole (so a hit after the evictions is
        # tested too, not only misses).
        server.client().config_set("maxmemory", "64mb")
        t, c = toks(600, seed=999), noise_cache(600, seed=999)
        with PromptStore(tmp_path / "a", remote=url) as a:
            a.put(MODEL, t, c)
            assert a.remote.flush(10)
        with PromptStore(tmp_path / "c", remote=url) as fresh:
            hit = fresh.lookup(MODEL, t)
            assert hit is not None and hit.matched == len(t)
            same(hit.cache, c)
    finally:
        server.kill()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_block(tmp_path, redis_cluster, damage):
    ns = f"f{next(_ns)}"
    url = url_of(redis_cluster, ns)
    t, cache = published(tmp_path, url)
    r = redis_cluster.client()
    k = block_keys(r, ns)[5]
    v = bytearray(r.get(k))
    v = {"flip": lambda: v[:100] + bytes([v[100] ^ 1]) + v[101:], "truncate": lambda: v[:-2], "empty": lambda: b""}[damage]()
    r.set(k, bytes(v))
    with PromptStore(tmp_path / "b", remote=url) as b:
        assert b.lookup(MODEL, t) is None
        assert b.remote.stats()["errors.corrupt"] == 1
        assert not b.exists(MODEL, t)


@pytest.mark.parametrize("damage", ["flip", "truncate", "pickle", "newer"])
def test_damaged_manifest(tmp_path, redis_cluster, damage):
    ns = f"f{next(_ns)}"
    url = url_of(redis_cluster, ns)
    t, cache = published(tmp_path, url, n=100)
    r = redis_cluster.client()
    (k,) = list(r.scan_iter(match=f"{ns}:m:*".encode()))
    v = bytes(r.get(k))
    bad = {
        "flip": v[:-5] + bytes([v[-5] ^ 0x40]) + v[-4:],
        "truncate": v[: len(v) // 2],
        "pickle": b'\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x05model\x94\x8c\x01x\x94s.',  # a pickle stream ({"model": "x"}); never unpickled: not even recognised
        "newer": v[:3] + b"\x09" + v[4:],
    }[damage]
    r.set(k, bad)
    with PromptStore(tmp_path / "b", remote=url) as b:
        assert b.lookup(MODEL, t) is None
        assert b.get(MODEL, t) is None
        st = b.remote.stats()
        assert st[f"errors.{'newer' if damage == 'newer' else 'corrupt'}"] == 2
        assert st["misses"] == 2


@pytest.mark.parametrize("field, value", [("created", 1e20), ("created", float("nan")), ("meta", {b"k": 1}), ("meta", {"k": float("nan")})])
def test_a_manifest_field_out_of_range_is_a_corrupt_miss(tmp_path, redis_single, field, value):
    """A manifest with an intact checksum (another writer's) whose time is not
    a time or whose meta a put would refuse: a counted corrupt miss, as any
    unexpected field. It broke lookup with OverflowError/ValueError, and
    listings with a bug report; meta like this was served but never stored."""
    import msgpack
    import xxhash

    from promptstore.remote._wire import MAGIC, _SUM

    ns = f"f{next(_ns)}"
    url = url_of(redis_single, ns)
    t, cache = published(tmp_path, url, n=100)
    u, _ = published(tmp_path, url, n=300, seed=3, name="a2")
    r = redis_single.client()
    k = _manifest_key(ns, t)
    raw = bytes(r.get(k))
    doc = msgpack.unpackb(raw[len(MAGIC) + _SUM.size:], raw=False)
    doc[field] = value
    body = msgpack.packb(doc, use_bin_type=True)
    r.set(k, MAGIC + _SUM.pack(xxhash.xxh3_64_intdigest(body)) + body)
    with PromptStore(tmp_path / "b", remote=url) as b:
        assert b.lookup(MODEL, t) is None
        assert b.get(MODEL, t) is None
        st = b.remote.stats()
        assert st["errors.corrupt"] == 2 and st["misses"] == 2
        assert [len(man.tokens) for _, man in b.remote.remote.entries()] == [300]
        assert b.lookup(MODEL, u).matched == 300


def test_resharding_redirects_are_followed(tmp_path, fresh_cluster):
    """Slots move between masters after an entry was published: in half of
    them the move is finished (the client's slot map is stale: MOVED), in the
    other half the keys have moved and the slot is still migrating (ASK). A
    second store restores the entry bit-exact, with no error counted."""
    from redis.crc import key_slot

    ns = f"f{next(_ns)}"
    url = url_of(fresh_cluster, ns)
    t, cache = published(tmp_path, url, n=600)
    keys = list(fresh_cluster.client().scan_iter(match=f"{ns}:*".encode()))
    # The source: the master holding the entry's keys in the most slots (which one
    # does depends on the namespace's name, so on the tests that ran before).
    src = max(fresh_cluster.nodes, key=lambda node: len({key_slot(k) for k in keys if fresh_cluster.node_of(k) is node}))
    dst, third = (node for node in fresh_cluster.nodes if node is not src)
    sc, dc, tc = src.client(), dst.client(), third.client()
    src_id, dst_id = (c.execute_command("CLUSTER", "MYID") for c in (sc, dc))
    slots = sorted({key_slot(k) for k in keys if fresh_cluster.node_of(k) is src})
    assert len(slots) >= 4, slots  # the entry's blocks, manifest and index spread over the masters
    moved = asked = 0
    for i, slot in enumerate(slots):
        dc.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        sc.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        inslot = sc.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if inslot:
            sc.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *inslot)
        if i % 2 == 0:  # finished: every master is told the new owner
            for c in (sc, dc, tc):
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
            moved += len(inslot)
        else:  # left migrating: the source answers ASK for its moved keys
            asked += len(inslot)
    assert moved and asked
    with PromptStore(tmp_path / "b", remote=url) as b:
        hit = b.lookup(MODEL, t + [1])
        assert hit is not None and hit.matched == len(t)
        same(hit.cache, cache)  # asserts bit-exact
        stats = b.remote.stats()
        assert not any(k.startswith("errors") and v for k, v in stats.items()), stats
    print(f"\nresharding: {moved} keys moved (MOVED), {asked} keys in migrating slots (ASK): restored bit-exact")


def test_a_lookup_falls_back_to_the_next_entry_when_the_best_is_evicted(tmp_path, redis_single):
    """Redis evicts blocks and manifests one by one, and index records stay:
    a lookup whose best entry lost a block, or whose best four index records
    name evicted manifests, restores the longest entry still whole (a
    reviewer saw a permanent miss in both cases)."""
    ns = f"f{next(_ns)}"
    url = url_of(redis_single, ns)
    t = toks(700, seed=5)
    caches = {n: noise_cache(n, n) for n in range(200, 701, 100)}  # no block shared between entries
    with PromptStore(tmp_path / "a", remote=url) as a:
        for n, cache in caches.items():
            a.put(MODEL, t[:n], cache)
        assert a.remote.flush(10) and a.remote.stats().get("errors", 0) == 0
        layout = a.remote.remote.layout
        longest = a.remote.remote.get(remote_key(MODEL, np.asarray(t, dtype=np.uint32)))
    r = redis_single.client()
    r.delete(layout.block(longest.manifest.parts()[0][0]))  # the best entry loses a block
    with PromptStore(tmp_path / "b", remote=url) as b:
        hit = b.lookup(MODEL, t + [1])
        assert hit is not None and hit.matched == 600
        same(hit.cache, caches[600])
        assert b.remote.stats()["errors.missing"] == 1
    for n in (300, 400, 500, 600, 700):  # five stale index records ahead of the 200-token entry
        r.delete(layout.manifest(_ekey_of(t[:n])))
    with PromptStore(tmp_path / "c", remote=url) as c:
        hit = c.lookup(MODEL, t + [1])
        assert hit is not None and hit.matched == 200
        same(hit.cache, caches[200])
        assert c.remote.stats()["stale_index"] == 5


def _ekey_of(tokens):
    return remote_key(MODEL, np.asarray(tokens, dtype=np.uint32)).ekey


def test_a_key_of_another_type_is_a_corrupt_miss_and_the_tier_stays_up(tmp_path, redis_single):
    """A key the tier reads holding another Redis type (WRONGTYPE) is damage
    counted as corrupt, not an unreachable remote: no cool-down, and the
    entries whose keys are intact still restore (a reviewer saw the whole
    tier switched off by one such key)."""
    ns = f"f{next(_ns)}"
    url = url_of(redis_single, ns)
    t, cache = published(tmp_path, url, n=600, seed=1)
    u = toks(300, seed=2)
    published(tmp_path, url, n=300, seed=2, name="a2")
    r = redis_single.client()
    bad = _manifest_key(ns, t)
    assert r.delete(bad) == 1
    r.hset(bad, b"x", b"y")  # the 600-token entry's manifest is now a hash
    with PromptStore(tmp_path / "b", remote=url) as b:
        assert b.lookup(MODEL, t) is None
        st = b.remote.stats()
        assert st["errors.corrupt"] >= 1 and "errors.unavailable" not in st
        hit = b.lookup(MODEL, u)  # at once: no cool-down
        assert hit is not None and hit.matched == 300
        assert b.remote.stats().get("skipped", 0) == 0


def _manifest_key(ns, tokens):
    from promptstore.remote._layout import Layout

    return Layout(ns).manifest(_ekey_of(tokens))


def test_a_staged_fetch_from_a_paused_remote_waits_one_timeout(tmp_path, fresh_single, monkeypatch):
    """A restore staged through mlx's loader (the CUDA default) fills every
    array even after one failed; each used to wait out the timeout again (81 s
    for 96 arrays in a reviewer's run). After the first failure the fetch's
    other reads fail at once: a miss within a few timeouts."""
    monkeypatch.setenv("PROMPTSTORE_RESTORE", "staged")
    ns = f"f{next(_ns)}"
    url = url_of(fresh_single, ns, timeout=0.5)
    t = toks(1000, seed=3)
    with PromptStore(tmp_path / "a", remote=url) as a:
        a.put(MODEL, t, noise_cache(1000, 3) * 12)  # 24 layers: 48 arrays, each filled on its own
        assert a.remote.flush(10) and a.remote.stats().get("errors", 0) == 0
    with PromptStore(tmp_path / "b", remote=url) as b:
        found = b.remote.remote.find(remote_key(MODEL, np.asarray(t, dtype=np.uint32)))
        assert found is not None and found.matched == 1000
        client = b.remote.remote.client
        real = client.get_into

        def pause_first(keys, sinks):  # the server stops answering once the fills have begun
            fresh_single.pause()
            return real(keys, sinks)

        monkeypatch.setattr(client, "get_into", pause_first)
        try:
            start = time.monotonic()
            assert b.remote.remote.fetch(found) is None
            took = time.monotonic() - start
        finally:
            fresh_single.resume()
        assert took < 5, took
        assert b.remote.stats()["errors.unavailable"] == 1


def test_a_full_remote_under_noeviction_refuses_writes_and_reads_go_on(tmp_path, redis_binary):
    """Redis's OOM reply to a publish (maxmemory, noeviction) was taken for an
    unreachable remote: the tier cooled down for 5 s, dropping the next
    publish and missing every read meanwhile, and the warning held the
    block's raw bytes."""
    server = start_server(redis_binary, tmp_path / "redis", extra=["--maxmemory", "8mb", "--maxmemory-policy", "noeviction"])
    try:
        url = url_of(server, "oom")
        t, c = toks(300, seed=1), noise_cache(300, seed=1)
        with PromptStore(tmp_path / "c", remote=url) as first:
            first.put(MODEL, t, c)
            assert first.remote.flush(10)
        with PromptStore(tmp_path / "a", remote=url) as a:
            for i in range(12):  # 12 x 2.4 MB through an 8 MB server that evicts nothing
                a.put(MODEL, toks(4000, seed=10 + i), noise_cache(4000, seed=10 + i))
            assert a.remote.flush(30)
            st = a.remote.stats()
            assert st.get("errors.full", 0) >= 1 and "errors.unavailable" not in st and "dropped" not in st, st
            hit = a.lookup(MODEL, t)  # at once: no cool-down
            assert hit is not None and hit.matched == len(t)
            same(hit.cache, c)
            assert a.remote.stats().get("skipped", 0) == 0
    finally:
        server.kill()


def test_ls_remote_skips_a_key_of_another_type(tmp_path, redis_single):
    """One key of another type under the namespace's manifest prefix made
    `promptstore ls --remote` fail (WRONGTYPE for its whole batch)."""
    import subprocess
    import sys

    ns = f"f{next(_ns)}"
    url = url_of(redis_single, ns)
    published(tmp_path, url, n=300, seed=3)
    from promptstore.remote._layout import Layout

    bad = Layout(ns).manifest(b"\x01" * 36)
    redis_single.client().hset(bad, b"x", b"y")
    out = subprocess.run([sys.executable, "-m", "promptstore", "--store", str(tmp_path / "b"), "--remote", url, "ls", "--remote", "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "300" in out.stdout


def test_an_error_reply_keeps_the_connection_and_a_reset_spares_calls_in_flight(tmp_path, redis_binary):
    """A publish refused with an error reply (OOM, under noeviction) reset the
    tier's connection: a fetch in flight on another thread died with it
    (counted unavailable) and every read was then skipped for 5 s. An error
    reply leaves the connection in step, so it stays; a reset (after a
    connection failure) lets the calls in flight on the old one finish."""
    server = start_server(redis_binary, tmp_path / "redis", extra=["--maxmemory-policy", "noeviction"])
    try:
        url = url_of(server, "oomreset", timeout=3)
        t, cache = published(tmp_path, url, n=2000, seed=1)
        r = server.client()
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + 200_000)  # full: publishes are refused
        with PromptStore(tmp_path / "b", remote=url) as b:
            rem = b.remote.remote
            found = rem.get(remote_key(MODEL, np.asarray(t, dtype=np.uint32)))
            assert rem.fetch(found) is not None
            connections = r.info("stats")["total_connections_received"]
            b.put(MODEL, toks(700, seed=2), noise_cache(700, seed=2))
            assert b.remote.flush(10) and b.remote.stats()["errors.full"] == 1
            assert rem.fetch(found) is not None
            assert r.info("stats")["total_connections_received"] == connections  # the same connection
            stop, failed = time.monotonic() + 1.5, []

            def fetch():
                while time.monotonic() < stop:
                    failed.extend([1] if rem.fetch(found) is None else [])

            fetcher = threading.Thread(target=fetch)
            fetcher.start()
            for i in itertools.count(3):  # publishes refused while the fetches go on
                if time.monotonic() > stop:
                    break
                b.put(MODEL, toks(700, seed=i), noise_cache(700, seed=i))
                assert b.remote.flush(10)
            fetcher.join()
            st = b.remote.stats()
            assert not failed and "errors.unavailable" not in st and "skipped" not in st, st
            server.pause()  # a fetch waits for its reply while the connection is reset
            got = {}
            fetcher = threading.Thread(target=lambda: got.update(c=rem.fetch(found)))
            fetcher.start()
            time.sleep(0.3)
            rem.client.reset()
            server.resume()
            fetcher.join(10)
            same(got["c"], cache)
    finally:
        server.kill()


@pytest.mark.parametrize("refusal", ["replica", "noperm"])
def test_a_refused_write_is_counted_and_reads_go_on(tmp_path, redis_binary, refusal):
    """A publish refused with an error reply other than OOM (a URL naming a
    read-only replica: READONLY; a user allowed to read only: NOPERM) was
    taken for an unreachable remote, and reads that work were skipped for
    5 s. It is a refused write, counted as errors.refused, with no cool-down."""
    primary = start_server(redis_binary, tmp_path / "redis")
    servers = [primary]
    try:
        t, cache = published(tmp_path, url_of(primary, "refused"), n=300, seed=1)
        if refusal == "replica":
            servers.append(start_server(redis_binary, tmp_path / "redis", extra=["--replicaof", "127.0.0.1", str(primary.port)]))
            deadline = time.monotonic() + 20
            while servers[1].client().dbsize() < primary.client().dbsize():  # the replica has synced
                assert time.monotonic() < deadline
                time.sleep(0.05)
            url = url_of(servers[1], "refused")
        else:
            primary.client().execute_command("ACL", "SETUSER", "reader", "on", ">pw", "~refused:*", "+get", "+exists", "+hgetall",
                                             "+info", "+command")
            url = f"redis://reader:pw@127.0.0.1:{primary.port}/0?ns=refused"
        with PromptStore(tmp_path / "b", remote=url) as b:
            b.put(MODEL, toks(50, seed=9), kv_cache(50, seed=9))
            assert b.remote.flush(10)
            hit = b.lookup(MODEL, t)  # at once: no cool-down
            assert hit is not None and hit.matched == 300
            same(hit.cache, cache)
            st = b.remote.stats()
            assert st.get("errors.refused") == 1 and "errors.unavailable" not in st and "skipped" not in st, st
    finally:
        for server in servers:
            server.kill()
