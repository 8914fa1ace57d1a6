"""Recurrent caches of gated-DeltaNet layers (Qwen3-Next, Qwen3.5) and speculative decoding.

* ``_cache``: :class:`SSMCache`, per-row coverage, row moves, verify rounds;
* ``_round``: the bookkeeping of one speculative round (snapshot, pending rows);
* ``_recur``: the recurrence kernels by phase (decode, window, fold);
* ``_adapter``: routes mlx-lm's gated-DeltaNet layers through the cache;
* ``_convert``: mlx-lm's ArraysCache layers of such models as SSMCache;
* ``speculative``: speculative decoding on caches that cannot trim.
"""

from promptstore.ssm._cache import RoundError, SSMCache, SSMState, adapt, make_prompt_cache, unadapt
from promptstore.ssm._convert import (
    GATED_DELTA_MODEL_TYPES,
    gated_delta_layers,
    is_gated_delta_model_dir,
    to_ssm,
)

__all__ = [
    "SSMCache",
    "SSMState",
    "RoundError",
    "make_prompt_cache",
    "adapt",
    "unadapt",
    "to_ssm",
    "gated_delta_layers",
    "is_gated_delta_model_dir",
    "GATED_DELTA_MODEL_TYPES",
]
