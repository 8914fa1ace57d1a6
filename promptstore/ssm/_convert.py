"""mlx-lm's ArraysCache layers of gated-DeltaNet models as SSMCache.

mlx-lm makes ``ArraysCache(2)`` for the gated-DeltaNet layers of Qwen3-Next
and Qwen3.5, and that class knows nothing of how many tokens it has absorbed.
Caches that come from mlx-lm (its server, an mlx-lm prompt-cache file, a
library caller) are turned into SSMCache here, with the coverage the caller
knows (it prefilled them, or was given the tokens), so that every path
stores them as ``ssm.gated_delta`` with coverage.

Which layers: with the model at hand, exactly its gated-DeltaNet layers
(:func:`gated_delta_layers`). Without it, from the model directory's
``config.json``: in the model types of :data:`GATED_DELTA_MODEL_TYPES` every
ArraysCache layer is a gated-DeltaNet layer (their ``make_cache`` gives the
other layers KVCache).
"""

from __future__ import annotations

import json
import os
from typing import Any, List, Optional, Sequence

from mlx_lm.models.cache import ArraysCache

from promptstore.ssm._cache import SSMCache, make_prompt_cache
from promptstore.errors import InvalidInput

__all__ = ["GATED_DELTA_MODEL_TYPES", "gated_delta_layers", "is_gated_delta_model_dir", "to_ssm"]

#: mlx-lm model types (config.json ``model_type``) whose recurrent layers are
#: the gated-DeltaNet blocks that SSMCache runs in (``_adapter``), and whose
#: other layers are attention (KVCache).
GATED_DELTA_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})


def gated_delta_layers(model: Any) -> List[bool]:
    """Per layer of ``model``'s prompt cache: True for a gated-DeltaNet layer
    (where :func:`promptstore.ssm.make_prompt_cache` puts an SSMCache)."""
    return [type(c) is SSMCache for c in make_prompt_cache(model)]


def is_gated_delta_model_dir(path: Any) -> bool:
    """Whether the mlx-lm model directory ``path`` is of a gated-DeltaNet
    hybrid type (False for anything unreadable)."""
    try:
        with open(os.path.join(os.fspath(path), "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, TypeError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in GATED_DELTA_MODEL_TYPES


def to_ssm(cache: Sequence[Any], coverage: int, gated: Optional[Sequence[bool]] = None) -> List[Any]:
    """``cache`` with its gated-DeltaNet ArraysCache layers as SSMCache.

    Args:
        cache: per-layer caches (mlx-lm's classes, or already SSMCache).
        coverage: the tokens every converted layer has absorbed.
        gated: per layer, whether it is a gated-DeltaNet layer
            (:func:`gated_delta_layers`); None: every ArraysCache layer is
            (a model of a type in :data:`GATED_DELTA_MODEL_TYPES`).

    Returns:
        A new list; converted layers share their arrays with the originals,
        every other layer is the same object.

    Raises:
        InvalidInput: ``gated`` has another length than ``cache``, or a
            layer cannot be converted (see ``SSMCache.from_arrays_cache``).
    """
    layers = list(cache)
    if gated is not None and len(gated) != len(layers):
        raise InvalidInput(f"to_ssm: {len(gated)} layer flags for a cache of {len(layers)} layers")
    flags = list(gated) if gated is not None else [True] * len(layers)
    return [
        SSMCache.from_arrays_cache(layer, coverage) if type(layer) is ArraysCache and g else layer
        for layer, g in zip(layers, flags)
    ]
