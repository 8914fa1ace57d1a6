"""The full bench's 20-turn chat on caches of several widths.

Run as ``python -m promptstore.bench._chatshapes [SHAPE ...]`` (default
``dense``; names in :data:`SHAPES`): one JSON line per shape with stored /
unique bytes, bytes written per turn / new bytes (median and worst turn),
LMDB's share of those, and whether the conversation restored bit-exactly.
What a put writes besides the new KV is LMDB's pages, about the same count
whatever the cache's width, so the ratio is a question of KV bytes per token
(docs/performance.md, "The dense fixture's chat").
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import List

from promptstore.bench import _data as data
from promptstore.bench._chat import FULL_CHAT, serve_chat

#: The shapes it takes by name.
SHAPES = {
    "dense": data.DENSE,
    "qwen2.5-0.5b": data.QWEN25_05B,
    "llama3-8b": data.LLAMA3_8B,
    "qwen3-next-80b": data.QWEN3_NEXT_80B,
}


def main(argv: List[str]) -> None:
    for name in argv or ["dense"]:
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}; one of {', '.join(SHAPES)}")
        shape = SHAPES[name]
        work = Path(tempfile.mkdtemp(prefix="promptstore-chat-"))
        try:
            r = serve_chat(work / "store", shape, FULL_CHAT)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({
            "shape": name, "kv_per_token": shape.kv_per_token, "stored_vs_unique": r["stored"] / r["unique"],
            "written_median": r["written_median"], "written_max": r["written_max"],
            "lmdb_median": r["lmdb_median"], "lmdb_max": r["lmdb_max"], "bit_exact": r["bit_exact"],
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
