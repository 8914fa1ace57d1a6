"""Route mlx-lm's gated-DeltaNet blocks through the cache's own recurrence.

``adapt(model)`` swaps the class of every ``qwen3_next`` / ``qwen3_5``
gated-DeltaNet block for a subclass whose ``__call__`` computes the block's
projections and hands them to ``cache.recur_decode`` / ``cache.recur_window``.
The parameter tree is untouched (same module, same weights, same names), and a
block whose cache offers no such methods (None, ArraysCache) runs mlx-lm's own
code. The projections, norm and output projection are mlx-lm's ops in mlx-lm's
order, so outputs are bit-identical to the unadapted model.
"""

from __future__ import annotations

from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients
from mlx_lm.models import qwen3_5, qwen3_next


def _route(cache: Any, layer: nn.Module, qkv: mx.array, a: mx.array, b: mx.array, mask) -> mx.array:
    if qkv.shape[1] == 1:
        return cache.recur_decode(layer, qkv, a, b, mask)
    return cache.recur_window(layer, qkv, a, b, mask)


class _Qwen3NextGatedDeltaNet(qwen3_next.Qwen3NextGatedDeltaNet):
    """qwen3_next's block with the recurrence owned by the cache."""

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        if not hasattr(cache, "recur_window"):
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(inputs), self.in_proj_ba(inputs)
        )
        qkv = mx.concatenate(
            [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1
        )
        out = _route(cache, self, qkv, a, b, mask)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))


class _Qwen3_5GatedDeltaNet(qwen3_5.GatedDeltaNet):
    """qwen3_5's block with the recurrence owned by the cache."""

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        if not hasattr(cache, "recur_window"):
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        if self.sharding_group is not None:
            inputs = sum_gradients(self.sharding_group)(inputs)
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(inputs)
        a = self.in_proj_a(inputs)
        out = _route(cache, self, qkv, a, b, mask)
        out = self.norm(out, z)
        out = self.out_proj(out.reshape(B, S, -1))
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out


_ADAPTED: Dict[type, type] = {
    qwen3_next.Qwen3NextGatedDeltaNet: _Qwen3NextGatedDeltaNet,
    qwen3_5.GatedDeltaNet: _Qwen3_5GatedDeltaNet,
}
_ORIGINAL: Dict[type, type] = {v: k for k, v in _ADAPTED.items()}


def adapt(model: nn.Module) -> int:
    """Route every gated-DeltaNet block of ``model`` through its cache; idempotent.

    Returns:
        The number of adapted blocks (0 for a model without such blocks).
    """
    n = 0
    for m in model.modules():
        if type(m) in _ADAPTED:
            m.__class__ = _ADAPTED[type(m)]
        n += type(m) in _ORIGINAL
    return n


def unadapt(model: nn.Module) -> int:
    """Undo :func:`adapt`. Returns the number of blocks restored."""
    n = 0
    for m in model.modules():
        if type(m) in _ORIGINAL:
            m.__class__ = _ORIGINAL[type(m)]
            n += 1
    return n


def is_gated_delta_layer(layer: Any) -> bool:
    """True when decoder layer ``layer`` holds a gated-DeltaNet block mlx-lm ships."""
    block = getattr(layer, "linear_attn", None)
    return type(block) in _ADAPTED or type(block) in _ORIGINAL
