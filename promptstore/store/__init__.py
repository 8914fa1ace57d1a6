"""The store engine: PromptStore over LMDB, keyed by model identity and exact tokens.

``PromptStore`` (``_store``) is the facade. Its collaborators, each with its own state:

* ``_schema``: every LMDB table, key layout and struct, defined once;
* ``_env`` and ``_gate``: the environment, transactions, map growth, generations, close;
* ``_keys`` and ``_index``: entry keys, prefix hashes and the prefix index;
* ``_write``: the one write path that adds or removes an entry;
* ``_read``: manifests, and the one place that picks how a payload is read;
* ``_catalog``: entries by id, EntryInfo, the listing;
* ``_usage``: last use and hit counters, kept off the read path;
* ``_budget`` and ``_capacity``: the byte budget, pins, LRU eviction, gc;
* ``_verify``: verify, the index rebuild, stray blob files;
* ``_salvage``: copying the intact entries of a damaged store into a new one;
* ``_results``: the frozen dataclasses the API returns.
"""

from promptstore.store._results import GcReport
from promptstore.store._results import VerifyReport
from promptstore.store._salvage import SalvageReport, salvage
from promptstore.store._store import EntryInfo, Hit, PromptStore, default_path

__all__ = ["PromptStore", "EntryInfo", "Hit", "VerifyReport", "GcReport", "SalvageReport", "salvage", "default_path"]
