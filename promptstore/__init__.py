"""promptstore: persistent, versioned, bit-exact prompt caches for MLX models.

Public API::

    from promptstore import PromptStore, fingerprint

    with PromptStore() as store:                  # $PROMPTSTORE_DIR or ~/.cache/promptstore
        store.put(fingerprint(model_dir), tokens, cache)
        hit = store.lookup(fingerprint(model_dir), longer_tokens)
"""

from promptstore import errors
from promptstore.errors import (
    CodecError,
    CorruptEntry,
    CoverageMismatch,
    EntryNotFound,
    InvalidInput,
    MissingCapability,
    ModelMismatch,
    PromptStoreError,
    RemoteCorrupt,
    RemoteError,
    RemoteFull,
    RemoteMissing,
    RemoteRefused,
    RemoteUnavailable,
    RemoteURLError,
    RoundError,
    StoreClosed,
    StoreError,
    StoreFull,
    StoreUnavailable,
    UnknownStorageKind,
    UnsupportedVersion,
)
from promptstore.identity import fingerprint
from promptstore.ssm.speculative import SpeculativeResult, SpeculativeStats, speculative_generate, speculative_generate_step
from promptstore.ssm import SSMCache, adapt, unadapt
from promptstore.ssm import make_prompt_cache as make_ssm_prompt_cache
from promptstore.store import EntryInfo, Hit, PromptStore, VerifyReport, default_path
from promptstore.serving import PersistentPromptCache, model_identity
from promptstore.store._results import GcReport
from promptstore.store._salvage import SalvageReport, salvage
from promptstore.jobs.warmup import LineError, WarmupSummary, warmup

__version__ = "0.1.0"

__all__ = [
    "GcReport",
    "SalvageReport",
    "salvage",
    "PromptStore",
    "EntryInfo",
    "Hit",
    "VerifyReport",
    "default_path",
    "fingerprint",
    "SSMCache",
    "make_ssm_prompt_cache",
    "adapt",
    "unadapt",
    "speculative_generate",
    "speculative_generate_step",
    "SpeculativeResult",
    "SpeculativeStats",
    "PersistentPromptCache",
    "model_identity",
    "warmup",
    "WarmupSummary",
    "LineError",
    *errors.__all__,  # the whole error tree, as promptstore.errors lists it
]
