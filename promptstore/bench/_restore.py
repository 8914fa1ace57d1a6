"""The restore targets alone: get and put against their references, and the peak memory of a get.

Run as ``python -m promptstore.bench._restore [TOKENS,...] [THREADS,...] [MODES,...]``
(default ``4096,32768``, ``auto`` and ``default``): for each cache size, each
number of fill threads (``auto``: the default, else ``PROMPTSTORE_FILL_THREADS``)
and each restore mode (``default``: the backend's, else ``PROMPTSTORE_RESTORE``:
``direct``, ``staged`` or ``ahead``, see ``format._blank``), the bench's
throughput case in a fresh process, then the peak memory of a get of the
entry it left, both on the Qwen3-Next-80B-shaped cache; one JSON line each,
with the ratios the bench judges. The full ``promptstore bench``
measures the same and much more; this is the part a lent GPU machine can run
inside one command's time limit (``docs/gpu.md``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx

from promptstore._backend import backend
from promptstore.bench import _cases as cases
from promptstore.bench import _data as data
from promptstore.format import _blank

_THREADS = "PROMPTSTORE_FILL_THREADS"
_MODE = "PROMPTSTORE_RESTORE"


def measure(n_tokens: int, threads: str, repeats: int = 5, mode: str = "default") -> Dict[str, Any]:
    """One size, thread count and restore mode: the bench's ratios, in fresh processes."""
    env = {} if threads == "auto" else {_THREADS: threads}
    if mode != "default":
        env[_MODE] = mode
    saved = {name: os.environ.pop(name, None) for name in (_THREADS, _MODE)}
    os.environ.update(env)  # the peak-memory child inherits it
    work = Path(tempfile.mkdtemp(prefix="promptstore-restore-"))
    try:
        t = cases.throughput_child(work, data.QWEN3_NEXT_80B, n_tokens, repeats, env)
        m = cases.peak_memory(work, n_tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    return {
        "tokens": n_tokens, "threads": threads, "mode": mode, "bytes": t["bytes"], "bit_exact": t["bit_exact"],
        "get_vs_load": t["mlx_load_fresh"] / t["get_fresh"],
        "get_vs_memcpy": t["memcpy_fresh"] / t["get_fresh"],
        "put_vs_write": t["file_write"] / t["put"],
        "put_grow_vs_write_grow": t["file_write_grow"] / t["put_grow"],
        "get_gbps": t["bytes"] / t["get_fresh"] / 1e9, "load_gbps": t["bytes"] / t["mlx_load_fresh"] / 1e9,
        "peak_rss_per_byte": m["rss_delta"] / t["bytes"], "memory": m,
    }


def main(argv: List[str]) -> None:
    sizes = [int(s) for s in (argv[0] if argv else "4096,32768").split(",")]
    threads = (argv[1] if len(argv) > 1 else "auto").split(",")
    modes = (argv[2] if len(argv) > 2 else "default").split(",")
    print(json.dumps({"backend": backend(), "device": str(mx.default_device()), "mlx": mx.__version__,  # type: ignore[attr-defined]
                      "cpus": os.cpu_count(), "loaders": _blank.loaders()}), flush=True)
    for n in sizes:
        for th in threads:
            for mode in modes:
                print(json.dumps(measure(n, th, mode=mode)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
