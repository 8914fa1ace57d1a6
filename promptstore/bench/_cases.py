"""The measurements of ``promptstore bench``, one function per case.

Every case returns plain dicts of raw figures (seconds, bytes); ratios and
targets are computed in ``promptstore.bench``. Times are medians over
``repeats`` runs of the same operation on the same data.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar, cast

import mlx.core as mx
import numpy as np

from promptstore.bench import _data as data
from promptstore.codecs import encode_layer
from promptstore.format import _payload
from promptstore.format._bits import bits_equal
from promptstore.identity import fingerprint
from promptstore.jobs.prefill import load_model, prefill
from promptstore.rows import extract_row, put_row
from promptstore.store import PromptStore

MODEL = "bench-qwen3-next-80b-shaped@0"


def median_time(fn: Callable[[], Any], repeats: int, before: Optional[Callable[[], Any]] = None) -> float:
    """Median wall time of ``fn()``; ``before()`` runs untimed ahead of each call."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def io_written() -> Tuple[int, int]:
    """``(write_bytes, wchar)`` of ``/proc/self/io``.

    ``wchar``: the bytes this process passed to write calls (to any file,
    pipes included): every byte the store writes (LMDB is opened without
    ``writemap``, so it writes pages with ``pwrite``; blob files with
    ``write``). The bench's "bytes written". ``write_bytes``: what the kernel
    accounts as sent to storage, counted as page-cache pages are dirtied: a
    large folio (ext4 on Linux >= 6.16) is counted whole, however few of its
    bytes a write changed, so small scattered writes count many times what
    reaches the device.
    """
    found = {}
    with open("/proc/self/io") as f:
        for line in f:
            name, _, value = line.partition(":")
            found[name] = int(value)
    return found.get("write_bytes", 0), found.get("wchar", 0)


def _payload_views(cache) -> List[memoryview]:
    """The byte views promptstore would write for ``cache`` (same bytes, same order)."""
    _, views, _ = _payload.prepare([encode_layer(layer) for layer in cache])
    return views


def throughput(workdir: Path, shape: data.Shape, n_tokens: int, repeats: int, seed: int = 0) -> Dict[str, Any]:
    """put/get against mlx-lm save/load, a plain file write+fsync/read and memcpy.

    The operations run interleaved, one of each per round, so that a noisy
    machine (shared cores, shared disk) slows every side alike. ``put`` is
    measured with the store at a steady size: the entry of two puts ago is
    deleted (untimed) first, as the reference file is replaced, so both sides
    write over space they freed. ``put_grow`` keeps every entry (in a store
    of its own) and ``file_write_grow`` every file: both sides take new space.
    Leaves the entry of ``tokens`` in ``workdir/store`` for the peak-memory
    case.
    """
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    cache = data.hybrid_cache(shape, n_tokens, seed)
    tokens = np.random.default_rng(seed).integers(3, 150_000, size=n_tokens, dtype=np.uint32)
    views = _payload_views(cache)
    nbytes = sum(v.nbytes for v in views)
    out: Dict[str, Any] = {"tokens": n_tokens, "bytes": nbytes, "repeats": repeats}
    st = workdir / "cache.safetensors"
    raw = workdir / "payload.bin"
    src = np.empty(nbytes, dtype=np.uint8)
    pos = 0
    for v in views:
        src[pos : pos + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
        pos += v.nbytes
    dst = np.empty_like(src)
    res: List[Any] = []
    store = PromptStore(workdir / "store")
    grow = PromptStore(workdir / "grow")
    try:
        store.put(MODEL, tokens[:1], data.tiny_kv(1))  # for the peak-memory child's warm-up
        store.put(MODEL, tokens, cache)  # the entry every get reads (untimed first put)
        first_exact = _bits_exact(cache, _found(store.get(MODEL, tokens)))  # the last get is checked too
        rounds = iter(range(1, 1 << 30))
        written: List[int] = []  # bytes each steady put passed to write calls
        dirtied: List[int] = []  # and what the kernel counted as page cache dirtied
        last: List[np.ndarray] = []  # the entries the last two steady puts wrote
        kept: List[Path] = []  # the files the growing reference wrote

        def variant() -> np.ndarray:
            toks = tokens.copy()
            toks[-1] = (int(toks[-1]) + next(rounds)) % 150_000 + 3
            return toks

        # Each put stores new bytes, as a put of a new prompt would: the
        # cache's KV layers get a value changed in every block (untimed), so
        # none of their shared blocks is in the store yet.
        varied: List[Any] = []
        made = iter(range(7, 1 << 30))

        def new_variant() -> None:
            varied[:] = []
            varied.append(data.vary(cache, next(made)))

        def drop_older() -> None:
            # Untimed: the store stays at one size, as the reference replaces
            # its file (a store at its byte budget evicts as it puts). The
            # entry of two puts ago goes (LMDB reuses pages freed by
            # transaction T from T + 2 on; a blob file is unlinked at once).
            if len(last) >= 2:
                store.delete(MODEL, last.pop(0))
            new_variant()

        def put() -> None:
            toks = variant()
            io0 = io_written()
            store.put(MODEL, toks, varied[0])
            io1 = io_written()
            written.append(io1[1] - io0[1])
            dirtied.append(io1[0] - io0[0])
            last.append(toks)

        def put_grow() -> None:  # its own store: it must not take the pages the steady puts free
            grow.put(MODEL, variant(), varied[0])

        def file_write_grow() -> None:
            path = workdir / f"grow-{len(kept)}.bin"
            kept.append(path)
            with open(path, "wb", buffering=0) as f:
                for v in views:
                    f.write(v)
                os.fsync(f.fileno())

        def get() -> None:
            res.append(store.get(MODEL, tokens))

        def mlx_save() -> None:
            save_prompt_cache(str(st), cache)
            fd = os.open(st, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        def mlx_load() -> None:
            loaded = load_prompt_cache(str(st))
            mx.eval([a for layer in loaded for a in data._layer_arrays(layer)])
            res.append(loaded)

        def file_write() -> None:
            with open(raw, "wb", buffering=0) as f:
                for v in views:
                    f.write(v)
                os.fsync(f.fileno())

        def file_read() -> None:
            buf = np.empty(nbytes, dtype=np.uint8)
            with open(raw, "rb", buffering=0) as f:
                f.readinto(buf.data)

        def release(clear: bool) -> Callable[[], None]:
            def fn() -> None:
                res.clear()
                gc.collect()
                if clear:
                    mx.clear_cache()

            return fn

        def unlink(path: Path) -> Callable[[], None]:
            return lambda: path.unlink(missing_ok=True)

        fresh = {
            "put": (drop_older, put),
            "file_write": (unlink(raw), file_write),
            "put_grow": (new_variant, put_grow),
            "file_write_grow": (None, file_write_grow),
            "mlx_save": (unlink(st), mlx_save),
            "get_fresh": (release(True), get),
            "mlx_load_fresh": (release(True), mlx_load),
            "file_read": (release(True), file_read),
            "memcpy_fresh": (release(True), lambda: np.copyto(np.empty_like(src), src)),
        }
        out.update(interleaved({name: (_then_level(before, nbytes), fn) for name, (before, fn) in fresh.items()}, repeats))
        out["put_written_per_put"] = int(statistics.median(written))
        out["put_dirtied_per_put"] = int(statistics.median(dirtied))
        release(True)()
        # With the mlx buffer cache: room for the buffers of the previous repeat.
        limit = mx.set_cache_limit(max(mx.get_cache_memory(), 3 * nbytes))
        try:
            reuse = {
                "get_reuse": (release(False), get),
                "mlx_load_reuse": (release(False), mlx_load),
                "memcpy_reuse": (release(False), lambda: np.copyto(dst, src)),
            }
            out.update(interleaved(reuse, repeats, warmup=1))
        finally:
            mx.set_cache_limit(limit)
        get()
        out["bit_exact"] = first_exact and _bits_exact(cache, res[-1])
    finally:
        store.close()
        grow.close()
        shutil.rmtree(workdir / "grow", ignore_errors=True)
        res.clear()
        st.unlink(missing_ok=True)
        raw.unlink(missing_ok=True)
        for path in kept:
            path.unlink(missing_ok=True)
    np.save(workdir / f"tokens-{n_tokens}.npy", tokens)
    del src, dst, views, cache
    gc.collect()
    mx.clear_cache()
    return out


def level_memory(nbytes: int) -> None:
    """Leave ``nbytes`` of warm free memory in the kernel before a *fresh*
    operation (touch them, then free them).

    On a VM whose virtio balloon reports free 2 MiB blocks to the host,
    memory the guest freed a few seconds earlier is returned to the host,
    and touching it again costs a host fault on top of the guest's. Without
    this, a fresh operation paid that or not by what ran before it, and the
    copy inside a fresh get was several times slower right after the puts
    than elsewhere (figures: docs/performance.md).
    """
    warm = np.ones(nbytes, dtype=np.uint8)
    del warm


_T = TypeVar("_T")


def _found(value: Optional[_T]) -> _T:
    """What the bench reads back it has just written: a miss is a bug."""
    if value is None:
        raise RuntimeError("bench: an entry just written was not found")
    return value


def _bits_exact(cache: Sequence[Any], restored: Sequence[Any]) -> bool:
    """Same dtypes, shapes and bits in every array."""
    return all(
        bits_equal(a, b).item()
        for x, y in zip(cache, restored, strict=True)
        for a, b in zip(data._layer_arrays(x), data._layer_arrays(y), strict=True)
    )


def _then_level(before: Optional[Callable[[], Any]], nbytes: int) -> Callable[[], None]:
    def fn() -> None:
        if before is not None:
            before()
        level_memory(nbytes)

    return fn


def interleaved(ops: Dict[str, Any], repeats: int, warmup: int = 0) -> Dict[str, float]:
    """Median time of each ``(before, fn)`` in ``ops``, run one of each per round."""
    times: Dict[str, List[float]] = {name: [] for name in ops}
    for r in range(warmup + repeats):
        # Every other round in reverse, so that no operation always runs
        # after the same one (whatever it leaves behind: freed heap memory
        # glibc hands back without a fault, pages in the CPU cache).
        order = list(ops.items()) if r % 2 == 0 else list(ops.items())[::-1]
        for name, (before, fn) in order:
            if before is not None:
                before()
            gc.collect()
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def throughput_child(workdir: Path, shape: data.Shape, n_tokens: int, repeats: int, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """:func:`throughput` in a fresh process (optionally with extra environment)."""
    cmd = [sys.executable, "-m", "promptstore.bench._child", str(workdir), json.dumps(asdict(shape)), str(n_tokens), str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"throughput child failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


def peak_memory(workdir: Path, n_tokens: int) -> Dict[str, Any]:
    """Peak memory a get adds, measured in a fresh subprocess (see :mod:`_mem`)."""
    cmd = [sys.executable, "-m", "promptstore.bench._mem", str(workdir / "store"), MODEL, str(workdir / f"tokens-{n_tokens}.npy")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"peak-memory child failed: {proc.stderr.strip()[-2000:]}")
    doc = json.loads(proc.stdout)
    doc["tokens"] = n_tokens
    return doc


def lookup(workdir: Path, sizes: Sequence[int], repeats: int, seed: int = 0) -> List[Dict[str, Any]]:
    """Lookup latency of 1K- and 32K-token queries as the store grows
    (``q*``: ``lookup``, restoring the hit; ``peek*``: the index alone)."""
    corpus = data.LookupCorpus(seed)
    path = workdir / "lookup-store"
    results = []
    have = 0
    for size in sizes:
        with data.unsynced_lmdb(), PromptStore(path) as store:
            if have == 0:
                for toks in corpus.targets.values():
                    store.put(MODEL, toks, data.tiny_kv(len(toks)))
                have = len(corpus.targets)
            for toks in corpus.entries(size - have):
                store.put(MODEL, toks, data.tiny_kv(len(toks)))
            have = size
            store.env.env.sync(True)
        with PromptStore(path) as store:
            row: Dict[str, Any] = {"entries": size, "file_bytes": store.file_size()}
            for q, query in corpus.queries.items():
                hit = store.lookup(MODEL, query)
                expect = len(corpus.targets[q])
                if hit is None or hit.matched != expect:
                    raise RuntimeError(f"lookup of the {q}-token query matched {getattr(hit, 'matched', None)}, expected {expect}")
                row[f"q{q}"] = median_time(lambda: store.lookup(MODEL, query), repeats)
                row[f"peek{q}"] = median_time(lambda: store.peek(MODEL, query), repeats)  # the index alone
            results.append(row)
    return results


def eviction(workdir: Path, sizes: Sequence[int], repeats: int) -> List[Dict[str, Any]]:
    """Time of a put that evicts the least recently used entry, in stores of
    ``sizes`` entries (8-token entries of a tiny cache; the budget set to the
    store's usage, so every put evicts exactly one). ``put_evict``: median of
    those puts; ``put``: median of the same puts into the store without a budget.

    Every store is built first; then the puts run interleaved, one into each
    store per round (:func:`interleaved`), so that a drift of the machine's
    fsync latency over the minutes a large store takes to build weighs on
    every size alike."""
    rng = np.random.default_rng(5)

    def tokens(i: int) -> List[int]:  # entries of one size: each evicting put evicts about one
        return [3 + i // 65536, 3 + i % 65536] + rng.integers(3, 150_000, 6).tolist()

    paths = [workdir / f"evict-{size}" for size in sizes]
    filler = data.tiny_kv(8)  # one cache for every entry built: on a GPU making one is a kernel launch and a sync
    mx.eval(filler[0].state)
    for size, path in zip(sizes, paths):
        with data.unsynced_lmdb(), PromptStore(path) as store:
            for i in range(size):
                store.put(MODEL, tokens(i), filler)
            store.env.env.sync(True)
    stores = [PromptStore(path) for path in paths]
    try:

        def put(store: PromptStore, fresh: Iterator[int]) -> Callable[[], Any]:
            return lambda: store.put(MODEL, tokens(next(fresh)), data.tiny_kv(8))

        ops = {str(size): (None, put(store, iter(range(size, 2 * size + 2 * repeats + 1)))) for size, store in zip(sizes, stores)}
        plain = interleaved(ops, repeats)
        for store in stores:
            store.set_budget(store.usage())
        evicting = interleaved(ops, repeats)
        for size, store in zip(sizes, stores):
            if len(list(store.entries())) > size + repeats + 2:  # the first entry's is larger: slack for a put or two
                raise RuntimeError("the puts did not evict")
    finally:
        for store in stores:
            store.close()
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
    return [{"entries": size, "put": plain[str(size)], "put_evict": evicting[str(size)]} for size in sizes]


def row_save(workdir: Path, shape: data.Shape, n_tokens: int, rows: int = 8, seed: int = 0) -> Dict[str, Any]:
    """Bytes written to storage when one row of a batch of ``rows`` is saved
    with ``put_row`` (its compact extract + put)."""
    cache, lengths = data.batch_cache(shape, rows, n_tokens, seed)
    i = rows - 1
    t0 = time.perf_counter()
    row = extract_row(cache, i)
    t_extract = time.perf_counter() - t0
    row_bytes = data.cache_nbytes(row)
    ssm_class = type(row[0]).__name__
    del row
    tokens = np.random.default_rng(seed).integers(3, 150_000, size=lengths[i], dtype=np.uint32)
    with PromptStore(workdir / "row-store") as store:
        store.put(MODEL, tokens[:1], data.tiny_kv(1))  # the store file exists before the measured put
        io0 = io_written()
        t0 = time.perf_counter()
        info = put_row(store, MODEL, tokens, cache, i)
        t_put = time.perf_counter() - t0
        io1 = io_written()
    return {
        "rows": rows,
        "row": i,
        "row_tokens": lengths[i],
        "row_bytes": row_bytes,
        "batch_bytes": data.cache_nbytes(cache),
        "entry_bytes": info.nbytes,
        "written": io1[1] - io0[1],  # passed to write calls
        "dirtied": io1[0] - io0[0],  # page cache the kernel counted as dirtied
        "extract_s": t_extract,
        "put_s": t_put,
        "ssm_class": ssm_class,
        "method": "promptstore.rows.put_row",
    }


def restore_vs_prefill(workdir: Path, model_dir: Path, lengths: Sequence[int], repeats: int, seed: int = 0) -> List[Dict[str, Any]]:
    """Time to first token on the fixture hybrid: cold prefill of the whole
    prompt vs ``lookup`` of the stored prompt-minus-one and one forward step."""
    model, _ = load_model(str(model_dir))
    fp = fingerprint(model_dir)
    rng = np.random.default_rng(seed)
    out = []
    with PromptStore(workdir / "prefill-store") as store:
        for n in lengths:
            tokens = rng.integers(3, 500, size=n).tolist()

            def first_token(cache, rest) -> int:
                logits = model(mx.array(rest)[None], cache=cache)
                y = mx.argmax(logits[:, -1, :], axis=-1)
                mx.eval(y)
                return cast(int, y.item())  # argmax: an int

            def cold() -> int:
                cache = prefill(model, tokens[:-1])
                return first_token(cache, tokens[-1:])

            store.put(fp, tokens[:-1], prefill(model, tokens[:-1]))

            def restored() -> int:
                hit = _found(store.lookup(fp, tokens))
                return first_token(hit.cache, tokens[hit.matched :])

            same = cold() == restored()
            t_cold = median_time(cold, repeats)
            t_restored = median_time(restored, repeats)
            hit = _found(store.lookup(fp, tokens))
            out.append(
                {
                    "tokens": n,
                    "cold_s": t_cold,
                    "restored_s": t_restored,
                    "entry_bytes": hit.info.nbytes,
                    "matched": hit.matched,
                    "same_first_token": same,
                }
            )
    del model
    gc.collect()
    mx.clear_cache()
    return out
