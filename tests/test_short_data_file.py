"""A data file that ends before LMDB's last page number.

LMDB can hand out pages at the end of the file and free them again in the
same transaction without writing them (an eviction that deletes many
entries did it: a reviewer's random sequence of API calls left a healthy
store that every command refused as truncated). Such a file must open and
read whole; a file cut short into a page its trees use must still be
refused before LMDB touches it (SIGBUS). Each open runs in a child process,
so that a crash fails the test instead of ending the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import lmdb

from _content import MODEL, TURNS, chat_entry
from promptstore import PromptStore
from promptstore.store import _lmdbfile

PAGE = 4096

_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from _content import MODEL, TURNS, chat_entry, same_cache
    from promptstore import PromptStore
    from promptstore.errors import StoreUnavailable
    try:
        store = PromptStore({path!r}, readonly={readonly})
    except StoreUnavailable as err:
        print(json.dumps({{"refused": str(err)}}))
        sys.exit(0)
    out = {{"verify": store.verify().ok, "exact": []}}
    for conv in range(3):
        tokens, cache = chat_entry(conv, TURNS - 1)
        hit = store.get(MODEL, tokens)
        out["exact"].append(hit is not None and same_cache(cache, hit))
    if not {readonly}:
        tokens, cache = chat_entry(5, TURNS - 1)
        store.put(MODEL, tokens, cache)
        out["put_then_get"] = same_cache(cache, store.get(MODEL, tokens))
        out["verify_after_put"] = store.verify().ok
    store.close()
    print(json.dumps(out))
    """
)


def _open_in_child(path, readonly: bool) -> dict:
    code = _CHILD.format(tests=os.path.dirname(__file__), path=str(path), readonly=readonly)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _store_with_free_pages_at_its_end(path) -> int:
    """A store whose last pages are free, and how many pages its trees use.

    A 2 MiB value written and deleted leaves its overflow pages free at the
    end of the file; the small commits after it reuse the lowest free pages
    first and free the pages the delete wrote, so the file's last pages end
    up free, as LMDB leaves pages it handed out and freed in one transaction."""
    store = PromptStore(path)
    for conv in range(3):
        store.put(MODEL, *chat_entry(conv, TURNS - 1))
    store.close()
    env = lmdb.open(str(path), max_dbs=64, map_size=1 << 32)
    try:
        info = env.open_db(b"info")
        with env.begin(write=True) as txn:
            txn.put(b"test-scratch", b"x" * (2 << 20), db=info)
        with env.begin(write=True) as txn:
            txn.delete(b"test-scratch", db=info)
        for i in range(4):
            with env.begin(write=True) as txn:
                txn.put(b"test-scratch-%d" % i, b"y", db=info)
                txn.delete(b"test-scratch-%d" % i, db=info)
        with env.begin() as txn:
            used = _lmdbfile.pages_in_use(path / "data.mdb", PAGE, txn.id())
        assert used is not None
        assert env.info()["last_pgno"] + 1 == os.path.getsize(path / "data.mdb") // PAGE
    finally:
        env.close()
    assert used < os.path.getsize(path / "data.mdb") // PAGE - 100  # the scenario: many free pages at the end
    return used


def test_a_file_ending_before_free_pages_opens_and_reads_whole(tmp_path):
    used = _store_with_free_pages_at_its_end(tmp_path / "s")
    os.truncate(tmp_path / "s" / "data.mdb", used * PAGE)  # only free pages are cut
    shutil.copytree(tmp_path / "s", tmp_path / "copy")
    assert _open_in_child(tmp_path / "copy", readonly=True) == {"verify": True, "exact": [True, True, True]}
    assert _open_in_child(tmp_path / "s", readonly=False) == {
        "verify": True,
        "exact": [True, True, True],
        "put_then_get": True,
        "verify_after_put": True,
    }


def test_a_file_cut_into_a_used_page_is_still_refused(tmp_path):
    used = _store_with_free_pages_at_its_end(tmp_path / "s")
    os.truncate(tmp_path / "s" / "data.mdb", (used - 1) * PAGE)  # the highest page the trees use is cut
    for readonly in (True, False):
        out = _open_in_child(tmp_path / "s", readonly=readonly)
        assert "is truncated" in out["refused"] and f"{used - 1} " in out["refused"].replace("-", " "), out
        assert "promptstore salvage" in out["refused"]
