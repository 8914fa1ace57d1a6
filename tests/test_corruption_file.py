"""Damage to data.mdb itself: truncation and overwritten LMDB pages.

Each case is opened and read in its own forked process (a crash there must
not take the test run with it): it ends in a typed error naming the file and
the way to recover, or in correct reads (a damaged entry may raise a typed
error, never return wrong data). Then ``salvage`` copies the intact entries
into a fresh store, which must verify clean and hold only bit-exact entries.
"""

from __future__ import annotations

import json
import os
import random
import shutil

from _raw import audit_blocks, referrers
from _content import MODEL, TURNS, chat_entry, same_cache
from promptstore import PromptStore
from test_crash import run_worker

PAGE = 4096
N = 16


def _pages(path):
    return os.path.getsize(path) // PAGE


def _overwrite(path, pages, fill):
    with open(path, "r+b") as f:
        for p in pages:
            f.seek(p * PAGE)
            f.write(fill(PAGE))


def damage_cases(base, rng):
    rnd = lambda n: bytes(rng.randrange(256) for _ in range(n))  # noqa: E731
    zero = lambda n: bytes(n)  # noqa: E731
    data = lambda d: d / "data.mdb"  # noqa: E731
    return {
        "truncate_half": lambda d: os.truncate(data(d), _pages(data(d)) // 2 * PAGE),
        "truncate_to_meta": lambda d: os.truncate(data(d), 2 * PAGE),
        "truncate_to_zero": lambda d: os.truncate(data(d), 0),
        "zero_both_meta_pages": lambda d: _overwrite(data(d), [0, 1], zero),
        "random_meta_page_0": lambda d: _overwrite(data(d), [0], rnd),
        "random_inner_pages": lambda d: _overwrite(data(d), rng.sample(range(2, _pages(data(d))), 3), rnd),
        "zero_inner_pages": lambda d: _overwrite(data(d), rng.sample(range(2, _pages(data(d))), 3), zero),
        "lock_file_removed": lambda d: os.unlink(d / "lock.mdb"),
    }


def test_file_damage_then_salvage(tmp_path):
    """The store holds the turns of four chats: entries that share blocks, so
    a damaged page of a shared block damages every entry that references it."""
    base = tmp_path / "base"
    expect = [[61 + i // TURNS, i % TURNS] for i in range(N)]
    with PromptStore(base) as store:
        for conv, turn in expect:
            store.put(MODEL, *chat_entry(conv, turn))
        assert max(len(who) for who in referrers(store).values()) == N  # the system prompt's blocks
    rng = random.Random(8)
    cases = []
    for name, hurt in damage_cases(base, rng).items():
        d = tmp_path / name
        shutil.copytree(base, d)
        hurt(d)
        cases.append({"name": name, "path": str(d), "dst": str(tmp_path / f"{name}.salvaged"), "expect": expect, "content": "chats"})
    res = run_worker("damage", json.dumps(cases))
    lines, crashes = [], []
    for case, out in zip(cases, res["cases"]):
        read, salv = out["read"], out["salvage"]
        lines.append(f"{case['name']}: read {read.get('outcome')} {read.get('type', '')} "
                     f"correct={read.get('correct', '-')} typed={read.get('typed_errors', '-')}; "
                     f"salvage {salv.get('outcome')} copied={salv.get('copied', '-')}")
        if read["outcome"] == "signal" or salv["outcome"] == "signal":
            crashes.append(case["name"])
            continue
        assert read["outcome"] in ("ok", "error"), (case["name"], read)
        if read["outcome"] == "error":
            assert case["path"] in read["message"], read["message"]
            assert "salvage" in read["message"] or "backup" in read["message"], read["message"]
        else:
            assert read["correct"] + read["missing"] + read["typed_errors"] == N
        assert salv["outcome"] in ("ok", "error"), (case["name"], salv)
        if case["name"] in ("zero_both_meta_pages", "random_meta_page_0"):
            # the tree is lost but every entry's bytes are there: the scan finds them all
            assert salv["outcome"] == "ok" and salv["copied"] == N, (case["name"], salv)
        if case["name"] == "truncate_to_zero":  # an emptied data file is damage, not an empty store
            assert read["outcome"] == "error" and "STORE_ID" in read["message"], read
        if salv["outcome"] == "ok":
            with PromptStore(case["dst"]) as dst:
                assert dst.verify().ok
                audit_blocks(dst)  # the copies' blocks, each stored once and counted right
                infos = list(dst.entries())
                assert len(infos) == salv["copied"]
                for conv, turn in expect:
                    t, c = chat_entry(conv, turn)
                    got = dst.get(MODEL, t)
                    assert got is None or same_cache(got, c)
                if read["outcome"] == "ok":  # whatever read correctly was salvaged
                    assert salv["copied"] >= read["correct"]
        else:
            assert case["path"] in salv["message"] or "data.mdb" in salv["message"], salv["message"]
    print("\n" + "\n".join(lines))
    assert not crashes, f"LMDB crashed the process on: {crashes}"


def test_a_damaged_store_id_file_is_a_typed_error_that_says_what_to_do(tmp_path):
    """STORE_ID holding bytes that are not text (a reviewer appended three):
    StoreUnavailable naming the file, where it was a bare UnicodeDecodeError;
    removing the file as told records the identity again, and nothing is lost."""
    from click.testing import CliRunner

    from promptstore.cli import main
    from promptstore.errors import StoreUnavailable

    path = tmp_path / "db"
    t, c = chat_entry(0, 1)
    with PromptStore(path) as store:
        store.put(MODEL, t, c)
    marker = path / "STORE_ID"
    marker.write_bytes(marker.read_bytes() + b"\x9d\xcd\xff")
    try:
        PromptStore(path)
    except StoreUnavailable as err:
        assert str(marker) in str(err) and "remove" in str(err)
    else:
        raise AssertionError("a damaged STORE_ID opened")
    out = CliRunner().invoke(main, ["--store", str(path), "verify", "--json"])
    doc = json.loads(out.output)
    assert out.exit_code != 0 and doc["error"] == "StoreUnavailable" and "STORE_ID" in doc["message"], out.output
    marker.unlink()
    with PromptStore(path) as store:
        assert same_cache(store.get(MODEL, t), c) and store.verify().ok
    assert len(marker.read_text().strip()) == 32


_LMDB_WALK = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=32)
with env.begin() as txn:
    for name in (b"ids", b"used", b"lru", b"sizes", b"entries", b"nodes", b"trims"):
        try:
            db = env.open_db(name, txn=txn, create=False)
        except lmdb.NotFoundError:
            continue
        for _ in txn.cursor(db=db).iternext(values=False):
            pass
"""


def test_verify_reports_a_data_file_on_which_lmdb_would_abort(tmp_path):
    """A leaf page that claims to be a branch page: LMDB's cursor asserts on
    it and aborts the process (SIGABRT, no output), where a read by key does
    not go. verify, the command for a damaged store, died so when the page
    was in a table it walks (a jobs reviewer's finding), and said the store
    was ok when it was in one it does not (``lru``, say, which eviction
    walks). It now reports the file damaged either way, and what to do."""
    import struct
    import subprocess
    import sys

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    base = tmp_path / "base"
    with PromptStore(base) as store:
        for i in range(300):
            c = KVCache()
            c.update_and_fetch(mx.full((1, 1, 4, 8), i, mx.float16), mx.full((1, 1, 4, 8), -i, mx.float16))
            store.put(MODEL, [i + 3, 7, 9, i + 11], [c])
    data = (base / "data.mdb").read_bytes()
    leaves = [p for p in range(2, len(data) // 4096) if struct.unpack_from("<H", data, p * 4096 + 10)[0] == 0x02]

    def damaged(page: int):
        d = tmp_path / f"p{page}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base, d)
        with open(d / "data.mdb", "r+b") as f:
            f.seek(page * 4096 + 10)
            f.write(struct.pack("<H", 0x01))  # P_BRANCH
        return d

    aborting = []  # the pages LMDB aborts on (not free, not refused with an error)
    for page in leaves:
        d = damaged(page)
        if subprocess.run([sys.executable, "-c", _LMDB_WALK, str(d)], capture_output=True).returncode == -6:
            aborting.append(page)
        shutil.rmtree(d)
    assert len(aborting) >= 20, (len(aborting), len(leaves))
    for page in aborting[:: len(aborting) // 6][:6]:
        out = subprocess.run([sys.executable, "-m", "promptstore.cli", "--store", str(damaged(page)), "verify", "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, (page, out.returncode, out.stderr[-500:])
        doc = json.loads(out.stdout)
        assert doc["error"] == "StoreUnavailable" and "salvage" in doc["message"] and "damaged" in doc["message"], doc


def test_salvage_keeps_the_pin_and_last_use_of_an_entry_the_scan_found(tmp_path):
    """An entry whose manifest is damaged, found again by the byte scan (an
    earlier copy in a freed page), came out unpinned and last used in 1970,
    first in line for eviction, though the pin and last-use tables read fine."""
    from promptstore.store import _keys, salvage

    src = tmp_path / "s"
    tokens, cache = chat_entry(0, 1)
    with PromptStore(src) as s:
        info = s.put(MODEL, tokens, cache, meta={"v": 1})
        s.pin(info.id)
        used = next(iter(s.entries())).last_used
        ekey = _keys.entry_key(_keys.model_id(MODEL), _keys.as_tokens(tokens))

        def damage(txn):
            raw = bytearray(txn.get(ekey, db=s._db.entries))
            raw[-3] ^= 0xFF
            txn.put(ekey, bytes(raw), db=s._db.entries)

        s.env.write(damage)
    report = salvage(src, tmp_path / "d")
    assert report.copied == (info.id,) and report.scanned == (info.id,)
    with PromptStore(tmp_path / "d") as d:
        assert d.pinned() == [info.id]
        assert [e.last_used for e in d.entries()] == [used]
        same_cache(d.get(MODEL, tokens), cache)
