"""2 writer and 2 reader processes on one store for a bounded time.

No errors; every put a writer reported (after it returned) is readable,
bit-exact, by the other processes; nothing listed ever loads partially. The
writers put the turns of chats (``_content.chat_entry``): along a chat entries
share blocks, and every chat of both writers shares the system prompt's, so
the two processes count references to the same blocks. The map starts at
2 MiB so it grows (MapResizedError in the others) under load.
PROMPTSTORE_STRESS=1 runs 60 s instead of 5.
"""

from __future__ import annotations

import os

from _raw import audit_blocks, referrers
from _content import SYSTEM
from test_crash import run_worker

STRESS = os.environ.get("PROMPTSTORE_STRESS") == "1"


def test_two_writers_two_readers(tmp_path):
    seconds = 60 if STRESS else 5
    res = run_worker("concurrency", tmp_path / "store", seconds)
    errors = [r for r in res["results"] if "error" in r or r["status"] != 0]
    assert not errors, errors
    writers = [r for r in res["results"] if r["role"] == "writer"]
    readers = [r for r in res["results"] if r["role"] == "reader"]
    assert len(writers) == 2 and len(readers) == 2
    assert all(w["puts"] > 5 for w in writers), writers
    assert all(r["reads"] > 5 and r["listed_loads"] > 0 for r in readers), readers
    assert sum(w["reads"] for w in writers) > 0  # writers also read each other's entries
    from promptstore import PromptStore

    with PromptStore(tmp_path / "store") as store:
        assert store.verify().ok
        assert audit_blocks(store) > 0  # every count exact, every named block stored
        infos = list(store.entries())
        assert len(infos) == sum(w["puts"] for w in writers)
        # the system prompt's blocks: referenced by every entry of both writers
        assert max(len(who) for who in referrers(store).values()) == len(infos)
        assert all(info.n_tokens > SYSTEM for info in infos)
    print(f"\nconcurrency: 4 processes x {seconds} s: {sum(w['puts'] for w in writers)} puts, "
          f"{sum(r['reads'] for r in res['results'])} checked reads, {sum(r.get('listed_loads', 0) for r in readers)} listed loads")
