"""promptstore: persistent, versioned, bit-exact prompt caches for MLX models.

Public API::

    from promptstore import PromptStore, fingerprint

    with PromptStore() as store:                  # $PROMPTSTORE_DIR or ~/.cache/promptstore
        store.put(fingerprint(model_dir), tokens, cache)
        hit = store.lookup(fingerprint(model_dir), longer_tokens)
"""

from promptstore.errors import (
    CodecError,
    CorruptEntry,
    CoverageMismatch,
    EntryNotFound,
    InvalidInput,
    ModelMismatch,
    PromptStoreError,
    StoreError,
    StoreFull,
    StoreUnavailable,
    UnknownStorageKind,
    UnsupportedVersion,
)
from promptstore.identity import fingerprint
from promptstore.store import EntryInfo, Hit, PromptStore, VerifyReport, default_path
from promptstore.warmup import LineError, WarmupSummary, warmup

__version__ = "0.1.0"

__all__ = [
    "PromptStore",
    "EntryInfo",
    "Hit",
    "VerifyReport",
    "default_path",
    "fingerprint",
    "warmup",
    "WarmupSummary",
    "LineError",
    "PromptStoreError",
    "InvalidInput",
    "CoverageMismatch",
    "ModelMismatch",
    "EntryNotFound",
    "CodecError",
    "UnknownStorageKind",
    "UnsupportedVersion",
    "CorruptEntry",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
]
