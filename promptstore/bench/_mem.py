"""Child process of ``promptstore bench``: peak memory added by one get.

Run as ``python -m promptstore.bench._mem STORE MODEL TOKENS.npy``; prints JSON.

Three figures, because they answer different questions:

* ``rss_delta``: peak resident set (``VmHWM`` of ``/proc/self/status``) after
  the get minus the resident set just before it. This is what ``top`` and an
  OOM killer see, and the figure the target is judged on. It counts the LMDB
  pages the read maps in (file-backed, shared page cache: ``file_delta``) as
  well as the private copy. (Not ``ru_maxrss``: after fork+exec it keeps the
  parent's high-water mark.)
* ``anon_delta``: peak private (anonymous) memory, sampled every millisecond
  from ``/proc/self/status`` RssAnon: the memory the get really allocates.
* ``mlx_peak``: ``mx.get_peak_memory()`` during the get: the mlx allocator's
  view only (misses numpy and LMDB).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import mlx.core as mx
import numpy as np

from promptstore.store import PromptStore


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_anon = _status("RssAnon")
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak_anon = max(self.peak_anon, _status("RssAnon"))
            time.sleep(0.001)


def main(argv) -> None:
    store_path, model, tok_path = argv
    tokens = np.load(tok_path)
    with PromptStore(store_path) as store:
        # Warm up every code path on the 1-token entry, so imports do not count.
        if store.get(model, tokens[:1]) is None:
            raise SystemExit("the warm-up entry (first token) is missing")
        rss0 = _status("VmRSS")
        anon0 = _status("RssAnon")
        file0 = _status("RssFile")
        mx.reset_peak_memory()
        mlx0 = mx.get_active_memory()
        sampler = _Sampler()
        sampler.start()
        t0 = time.perf_counter()
        cache = store.get(model, tokens)
        seconds = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
        hwm = _status("VmHWM")
        file1 = _status("RssFile")
        nbytes = 0
        for info in store.entries(model):
            if info.n_tokens == len(tokens):
                nbytes = info.nbytes
        doc = {
            "bytes": nbytes,
            "rss_delta": max(0, hwm - rss0),
            "anon_delta": max(0, max(sampler.peak_anon, _status("RssAnon")) - anon0),
            "file_delta": max(0, file1 - file0),
            "mlx_peak": mx.get_peak_memory() - mlx0,
            "get_s": seconds,
            "restored": cache is not None,
        }
    print(json.dumps(doc))


if __name__ == "__main__":
    main(sys.argv[1:])
