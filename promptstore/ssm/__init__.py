"""Recurrent caches of gated-DeltaNet layers (Qwen3-Next, Qwen3.5) and speculative decoding.

* ``_cache``: :class:`SSMCache`, per-row coverage, row moves, verify rounds;
* ``_round``: the bookkeeping of one speculative round (snapshot, pending rows);
* ``_recur``: the recurrence kernels by phase (decode, window, fold);
* ``_adapter``: routes mlx-lm's gated-DeltaNet layers through the cache;
* ``speculative``: speculative decoding on caches that cannot trim.
"""

from promptstore.ssm._cache import RoundError, SSMCache, adapt, make_prompt_cache, unadapt

__all__ = ["SSMCache", "RoundError", "make_prompt_cache", "adapt", "unadapt"]
