"""Subprocess workers for the reliability tests: ``python tests/_workers.py MODE ARGS...``.

The process started by a test is a *zygote*: it imports mlx and promptstore,
never touches mlx or a store itself, and forks the workers (a fork costs
~15 ms; a fresh interpreter with mlx costs ~1.4 s, which would make 50+ kills
far too slow). Workers open their own PromptStore after the fork, as the
store requires. The zygote prints one JSON document on stdout.

Where mlx runs on its CUDA backend, a child forked after the zygote's imports
cannot use it (``cudaMallocManaged ... failed: initialization error``: the
parent's imports initialised CUDA). There the zygote imports nothing, each
worker imports after the fork, and the zygote starts a worker's clock (the
kill timer, a peer's "ready") only once the worker says it is warm (see
:data:`WARM`; ``PROMPTSTORE_TEST_FORK=cold`` forces this elsewhere). The
crash driver starts such workers ahead of their turn (:data:`AHEAD`), so
their warm-up overlaps the runs of the ones before.

What the workers put is deterministic (``_content``), so the test process can
check any entry bit-exactly. A worker reports the entries it put as ``a b``
pairs (``content``: ``entries`` or ``chats``, see ``_content.entry_of``); the
layout a worker writes follows ``$PROMPTSTORE_SHARED_BLOCKS``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _content, _bits, also where the interpreter adds no script folder (PYTHONSAFEPATH)

from _content import MODEL, TURNS, chat_entry, entry_of, nth, same_cache  # noqa: E402


def _say(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def _cuda_build() -> bool:
    """Whether the installed mlx is its CUDA backend's build (found without importing mlx)."""
    from importlib import metadata

    return any((d.metadata["Name"] or "").lower().startswith("mlx-cuda") for d in metadata.distributions())


def _warm_fork() -> bool:
    mode = os.environ.get("PROMPTSTORE_TEST_FORK", "").strip().lower()
    return mode == "warm" if mode in ("warm", "cold") else not _cuda_build()


WARM = _warm_fork()  # the zygote imports mlx and promptstore before forking


def _imports() -> None:
    """What every worker needs, imported: by the zygote (``WARM``) or by each
    worker after its fork."""
    import mlx.core  # noqa: F401
    import mlx_lm.models.cache  # noqa: F401
    import promptstore  # noqa: F401
    import promptstore.store._salvage  # noqa: F401

    if os.environ.get("PROMPTSTORE_TEST_BLOB_MIN"):  # payloads from this size on go to blob files
        import promptstore.format._blobs

        promptstore.format._blobs.MIN_PAYLOAD = int(os.environ["PROMPTSTORE_TEST_BLOB_MIN"])


def _warm_up(fd: int) -> None:
    """In a worker just forked: import what the zygote did not, then say so
    (a line ``W`` on ``fd``) where the zygote waits for it (:func:`_await_warm`)."""
    if not WARM:
        _imports()
        _say(fd, "W")


def _read_line(fd: int) -> bytes:
    """One line of ``fd``, read byte by byte so the lines after it stay in
    the pipe; shorter, without its newline, when the pipe ends first."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break  # the worker died first: its pipe says why
        line += byte
    return line


def _await_warm(fd: int) -> str:
    """Wait for a cold worker's ``W`` line on ``fd``; nothing to wait for
    when warm. Returns what was read instead of ``W`` (the worker failed
    first: its error line), for the caller to put before the rest of the pipe."""
    if WARM:
        return ""
    line = _read_line(fd)
    return "" if line == b"W\n" else line.decode()


def _await_line(fd: int, starts: tuple) -> str:
    """Read ``fd`` up to and including the first line starting with one of
    ``starts``, or to the end of the pipe; returns what was read."""
    got = b""
    while True:
        line = _read_line(fd)
        got += line
        if not line.endswith(b"\n") or line.decode().startswith(starts):
            return got.decode()


# -- crash: puts killed by SIGKILL --------------------------------------------------


def _crash_child(path: str, seed: int, fd: int, content: str, k: int) -> None:
    """Puts until killed. With ``chats``, child ``k`` starts at chat ``k``
    and goes on where the next child will start: children replace entries
    of the one before, and extend its chats, sharing its blocks."""
    from promptstore import PromptStore

    maint = os.environ.get("PROMPTSTORE_TEST_MAINT") == "1"
    try:
        if maint:  # rewrite packs at any dead byte: kills land inside rewrites too
            from promptstore.store import _packing

            _packing.DEAD_MIN = 0
        store = PromptStore(path, map_size=1 << 22)  # small map: growth happens under the kills too
        for i in range(10_000):
            a, b = nth(content, seed, i, k)
            tokens, cache = entry_of(content, a, b)
            _say(fd, f"S {a} {b}")
            store.put(MODEL, tokens, cache, meta={"seed": a, "i": b})
            _say(fd, f"D {a} {b}")
            if i % 3 == 2:  # reads between writes: touches flushed by the next put
                store.get(MODEL, entry_of(content, *nth(content, seed, i - 1, k))[0])
            if maint and i % 4 == 1:  # delete an earlier entry (its blocks' packs go partly dead)...
                a2, b2 = nth(content, seed, i - 1, k)
                _say(fd, f"X {a2} {b2}")  # said first: killed after, it may or may not be gone
                store.delete(MODEL, entry_of(content, a2, b2)[0])
            if maint and i % 4 == 2:
                store.gc()  # ...rewrite sparse packs, sweep strays
            if maint and i % 8 == 7:
                store.compact(upgrade=False)
    except BaseException:
        _say(fd, "E " + traceback.format_exc().replace("\n", " | "))
        os._exit(1)


def _scratch_put(content: str, a: int, b: int) -> None:
    """A put and a get of entry ``a b`` in a store of its own, thrown away:
    a cold worker's first put and get pay what a warm zygote did once (on
    CUDA, compiling mlx's kernels: seconds), before its turn comes."""
    import shutil
    import tempfile

    from promptstore import PromptStore

    scratch = tempfile.mkdtemp(prefix="promptstore-warm-")
    try:
        tokens, cache = entry_of(content, a, b)
        with PromptStore(os.path.join(scratch, "store")) as store:
            store.put(MODEL, tokens, cache)
            store.get(MODEL, tokens)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


#: Cold workers started ahead of their turn, so that their warm-up (imports
#: and a scratch put, seconds each on CUDA) overlaps the run of the ones
#: before: one worker runs at a time, each starts only when told to.
AHEAD = 1 if WARM else max(1, (os.cpu_count() or 2) // 2)


def _crash_worker(path: str, seed: int, content: str, k: int, others: list) -> tuple:
    """Fork worker ``k``: it warms up, says ``W``, waits for a byte on its go
    pipe (the end of that pipe: the zygote is done, it exits), then puts.
    ``others``: the workers started before it and not yet ended (their pipes
    are closed in it). Returns ``(pid, its output pipe, its go pipe)``."""
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in [r, go_w] + [fd for _, out, go in others for fd in (out, go)]:
            os.close(fd)
        child_seed = seed if content == "chats" else seed * 1000 + k
        try:
            _warm_up(w)
            if not WARM:
                _scratch_put(content, *nth(content, child_seed, 0, k))
            if os.read(go_r, 1) != b"g":
                os._exit(0)
        except BaseException:
            _say(w, "E " + traceback.format_exc().replace("\n", " | "))
            os._exit(1)
        _crash_child(path, child_seed, w, content, k)
        os._exit(0)
    os.close(w)
    os.close(go_r)
    return pid, r, go_w


def crash(path: str, kills: int, seed: int, content: str) -> dict:
    rng = random.Random(seed)
    done, inflight, errors = [], 0, []
    started: list = []
    for k in range(min(kills, 1 + AHEAD)):
        started.append(_crash_worker(path, seed, content, k, started))
    for k in range(kills):
        if k + AHEAD < kills and len(started) <= k + AHEAD:
            started.append(_crash_worker(path, seed, content, k + AHEAD, started[k:]))
        pid, r, go = started[k]
        first = _await_warm(r)
        try:
            os.write(go, b"g")
        except BrokenPipeError:  # it failed warming up: its pipe says why
            pass
        os.close(go)
        if not WARM:
            # A cold worker's first put in the store may still pay something its
            # scratch put did not: kill it in the puts after that one.
            first += _await_line(r, ("D", "E"))
        if k % 2:
            # Every other kill lands inside a put: at a random point of its
            # first 4 ms, once the next put has started. Left to the window
            # below alone, about a third of the kills did, so a test of 20
            # kills asking for 4 inside a put failed about one run in 30.
            first += _await_line(r, ("S", "E"))
            time.sleep(rng.uniform(0.0, 0.004))
        else:
            # The others after a committed put (so that every kill of these
            # leaves work to check, however slow a loaded machine makes puts),
            # anywhere in the puts of the next 200 ms.
            first += _await_line(r, ("D", "E"))
            time.sleep(rng.uniform(0.0, 0.2))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        lines = (first + _drain(r)).splitlines()
        if lines and lines[-1].startswith("S"):
            inflight += 1
        for line in lines:
            if line.startswith("D"):
                done.append([int(x) for x in line.split()[1:]])
            elif line.startswith("X"):  # deleted (or about to be): no longer promised
                gone = [int(x) for x in line.split()[1:]]
                done = [d for d in done if d != gone]
            elif line.startswith("E"):
                errors.append(line)
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            errors.append(f"child {k} ended with status {status}, not by SIGKILL")
    return {"kills": kills, "done": done, "inflight_at_kill": inflight, "errors": errors}


def _drain(fd: int) -> str:
    out = b""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    os.close(fd)
    return out.decode()


# -- concurrency: 2 writers + 2 readers -------------------------------------------


def _opened(barrier) -> None:
    """Tell the zygote this worker's store is open, then wait for every worker's."""
    ready, go = barrier
    os.write(ready, b".")
    os.read(go, 1)


def _writer(path: str, wid: int, seconds: float, report: str, barrier, fd: int) -> None:
    from promptstore import PromptStore

    store = PromptStore(path, map_size=1 << 21)
    _opened(barrier)
    end, i, reads = time.monotonic() + seconds, 0, 0
    with open(report, "a") as rep:
        while time.monotonic() < end:
            # chats of its own (even or odd), all sharing the system prompt's blocks
            conv, turn = 2 * (i // TURNS) + wid, i % TURNS
            tokens, cache = chat_entry(conv, turn)
            store.put(MODEL, tokens, cache)
            rep.write(f"{conv} {turn}\n")
            rep.flush()
            if i % 4 == 3:  # read one of the other writer's entries
                reads += _check_reported(store, report.replace(f"w{wid}", f"w{1 - wid}"), 1)
            i += 1
    store.close()
    _say(fd, json.dumps({"role": "writer", "puts": i, "reads": reads}))


def _check_reported(store, report: str, n: int) -> int:
    try:
        with open(report) as f:
            lines = [tuple(map(int, ln.split())) for ln in f.read().splitlines() if ln.strip()]
    except FileNotFoundError:
        return 0
    count = 0
    for conv, turn in random.sample(lines, min(n, len(lines))):
        tokens, cache = chat_entry(conv, turn)
        got = store.get(MODEL, tokens)
        if got is None:
            raise AssertionError(f"chat {conv} turn {turn} was reported stored but is missing")
        if not same_cache(got, cache):
            raise AssertionError(f"chat {conv} turn {turn} is not bit-exact")
        count += 1
    return count


def _reader(path: str, rid: int, seconds: float, reports, barrier, fd: int) -> None:
    from promptstore import PromptStore

    store = PromptStore(path, map_size=1 << 21)
    _opened(barrier)
    end, reads, listed = time.monotonic() + seconds, 0, 0
    while time.monotonic() < end:
        for rep in reports:
            reads += _check_reported(store, rep, 2)
        for info in list(store.entries())[-3:]:  # whatever is listed must load whole
            cache, got_info, tokens = store.load(info.id)
            if len(tokens) != info.n_tokens or cache[0].offset != info.n_tokens:
                raise AssertionError(f"entry {info.id} loaded partially")
            listed += 1
    store.close()
    _say(fd, json.dumps({"role": "reader", "reads": reads, "listed_loads": listed}))


def concurrency(path: str, seconds: float) -> dict:
    """Two writers and two readers, started together once all four have
    opened the store: an open while another process commits can fail
    (test_multiprocess.py::test_opening_a_store_while_another_process_commits)."""
    d = os.path.dirname(path.rstrip("/")) or "."
    reports = [os.path.join(d, f"w{w}.txt") for w in (0, 1)]
    (ready_r, ready_w), (go_r, go_w) = os.pipe(), os.pipe()
    kids = {}
    for role, n in (("writer", 0), ("writer", 1), ("reader", 0), ("reader", 1)):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                if not WARM:
                    _imports()
                if role == "writer":
                    _writer(path, n, seconds, reports[n], (ready_w, go_r), w)
                else:
                    _reader(path, n, seconds, reports, (ready_w, go_r), w)
            except BaseException:
                _say(w, json.dumps({"role": role, "error": traceback.format_exc()}))
                os.write(ready_w, b"!")  # never keep the others waiting
                os._exit(1)
            os._exit(0)
        os.close(w)
        kids[pid] = r
    ready = b""
    while len(ready) < len(kids):
        ready += os.read(ready_r, len(kids) - len(ready))
    os.write(go_w, b"." * len(kids))
    results = []
    for pid, r in kids.items():
        _, status = os.waitpid(pid, 0)
        out = _drain(r).strip()
        doc = json.loads(out.splitlines()[-1]) if out else {"error": "no output"}
        doc["status"] = status
        results.append(doc)
    return {"processes": 4, "seconds": seconds, "results": results}


# -- damage: open and read a damaged store in a child ---------------------------------


def _damage_child(path: str, expect: list, content: str, fd: int) -> None:
    from promptstore import PromptStore, PromptStoreError

    out = {"outcome": "ok", "correct": 0, "missing": 0, "typed_errors": 0}
    try:
        with PromptStore(path) as store:
            for seed, i in expect:
                tokens, cache = entry_of(content, seed, i)
                try:
                    got = store.get(MODEL, tokens)
                except PromptStoreError as err:
                    out["typed_errors"] += 1
                    out.setdefault("entry_errors", []).append(f"{type(err).__name__}: {err}")
                    continue
                if got is None:
                    out["missing"] += 1
                elif same_cache(got, cache):
                    out["correct"] += 1
                else:
                    out["outcome"] = "WRONG"
            rep = store.verify()
            out["verify_problems"] = len(rep.problems)
    except PromptStoreError as err:
        out = {"outcome": "error", "type": type(err).__name__, "message": str(err)}
    except BaseException as err:
        out = {"outcome": "untyped", "type": type(err).__name__, "message": traceback.format_exc()}
    _say(fd, json.dumps(out))


def _salvage_child(src: str, dst: str, fd: int) -> None:
    from promptstore import PromptStoreError
    from promptstore.store._salvage import salvage

    try:
        rep = salvage(src, dst)
        out = {"outcome": "ok", "copied": len(rep.copied), "skipped": len(rep.skipped), "broken": list(rep.unreadable_tables)}
    except PromptStoreError as err:
        out = {"outcome": "error", "type": type(err).__name__, "message": str(err)}
    except BaseException:
        out = {"outcome": "untyped", "message": traceback.format_exc()}
    _say(fd, json.dumps(out))


def _in_child(fn, *args) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            if not WARM:
                _imports()
            fn(*args, w)
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    out = _drain(r).strip()
    doc = json.loads(out.splitlines()[-1]) if out else {"outcome": "no output"}
    if os.WIFSIGNALED(status):
        doc = {"outcome": "signal", "signal": signal.Signals(os.WTERMSIG(status)).name}
    return doc


def damage(cases_json: str) -> dict:
    """For each case (store path, salvage dst, expected entries): read, then salvage."""
    out = []
    for case in json.loads(cases_json):
        read = _in_child(_damage_child, case["path"], case["expect"], case.get("content", "entries"))
        salv = _in_child(_salvage_child, case["path"], case["dst"])
        out.append({"name": case["name"], "read": read, "salvage": salv})
    return {"cases": out}


# -- disk full: a file-size limit in the child -----------------------------------------


def _fsize_child(path: str, limit: int, content: str, fd: int) -> None:
    import resource

    from promptstore import PromptStore, PromptStoreError

    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    done = []
    out = {}
    store = None
    try:
        store = PromptStore(path)
        for i in range(1000):
            a, b = nth(content, 77, i, chats=1000)
            tokens, cache = entry_of(content, a, b, big_every=3)
            store.put(MODEL, tokens, cache)
            done.append([a, b])
        out = {"outcome": "never full"}
    except PromptStoreError as err:
        out = {"outcome": "error", "type": type(err).__name__, "message": str(err)}
        try:  # the store keeps serving reads after a failed write
            out["read_after"] = store.get(MODEL, entry_of(content, *done[0], big_every=3)[0]) is not None
        except BaseException as e:
            out["read_after"] = repr(e)
    except BaseException:
        out = {"outcome": "untyped", "message": traceback.format_exc()}
    out["done"] = done
    _say(fd, json.dumps(out))


def fsize(path: str, limit: int, content: str = "entries") -> dict:
    return _in_child(_fsize_child, path, limit, content)


def _compact_child(path: str, seconds: float, report: str, fd: int) -> None:
    from promptstore import PromptStore

    store = PromptStore(path)
    end, i, gens = time.monotonic() + seconds, 0, set()
    with open(report, "a") as rep:
        while time.monotonic() < end:
            conv, turn = nth("chats", 55, i, chats=1000)
            tokens, cache = chat_entry(conv, turn)
            store.put(MODEL, tokens, cache)
            rep.write(f"{conv} {turn}\n")
            rep.flush()
            then = nth("chats", 55, i // 2, chats=1000)
            got = store.get(MODEL, chat_entry(*then)[0])
            if got is None or not same_cache(got, chat_entry(*then)[1]):
                raise AssertionError(f"chat {then} lost or damaged across compaction")
            gens.add(store.env.generation)
            i += 1
            time.sleep(0.005)
    store.close()
    _say(fd, json.dumps({"puts": i, "generations": sorted(gens)}))


def compact_peer(path: str, seconds: float, report: str) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _warm_up(w)
            _compact_child(path, seconds, report, w)
        except BaseException:
            _say(w, json.dumps({"error": traceback.format_exc()}))
            os._exit(1)
        os._exit(0)
    os.close(w)
    first = _await_warm(r)
    print(json.dumps({"ready": True}), flush=True)
    _, status = os.waitpid(pid, 0)
    out = (first + _drain(r)).strip()
    doc = json.loads(out.splitlines()[-1]) if out else {"error": "no output"}
    doc["status"] = status
    return doc


if __name__ == "__main__":
    if WARM:  # import (but never run) mlx and promptstore before forking: children start warm
        _imports()
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "crash":
        res = crash(args[0], int(args[1]), int(args[2]), args[3])
    elif mode == "concurrency":
        res = concurrency(args[0], float(args[1]))
    elif mode == "damage":
        res = damage(args[0])
    elif mode == "fsize":
        res = fsize(args[0], int(args[1]), *args[2:])
    elif mode == "compact_peer":
        res = compact_peer(args[0], float(args[1]), args[2])
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(res), flush=True)
