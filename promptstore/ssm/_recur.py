"""The gated-DeltaNet recurrence that ``SSMCache`` owns, and the fold of pending rows.

Every function here replays, op for op, what mlx-lm's ``qwen3_next`` and
``qwen3_5`` gated-DeltaNet blocks do between their input projections and their
output norm (mlx-lm 0.32). Bit-identity with unadapted mlx-lm rests on that: the
same ops, on the same operands, in the same dtypes. mlx-lm's public helpers
(``compute_g``, ``normalize_qk``, ``gated_delta_ops``, ``gated_delta_kernel``)
are called rather than copied, so their arithmetic cannot drift from ours.

A *chunk* is what one recorded call leaves behind: per position, the conv input
row and the post-conv ``q, k, v`` with the gates ``g, beta``. Folding the first
``keep`` positions of a round is the state-only recurrence over those rows plus
the conv tail, i.e. exactly the arithmetic the verify window performed over
those positions (and a fresh forward over them, on backends whose kernels do
not depend on the call's shape, such as the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, overload

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import (
    compute_g,
    gated_delta_kernel,
    gated_delta_ops,
    normalize_qk,
)

# q/k normalisation epsilon hard-coded by both mlx-lm blocks.
_QK_EPS = 1e-6


@dataclass(frozen=True)
class Chunk:
    """Position-local inputs recorded from one recurrence call (``s`` positions).

    Shapes: ``qkv`` [B, s, conv_dim] (masked conv-input rows), ``q, k``
    [B, s, Hk, Dk], ``v`` [B, s, Hv, Dv], ``g, beta`` [B, s, Hv], ``mask``
    [B, s] or None.
    """

    qkv: mx.array
    q: mx.array
    k: mx.array
    v: mx.array
    g: mx.array
    beta: mx.array
    mask: Optional[mx.array]

    @property
    def length(self) -> int:
        return self.qkv.shape[1]


def conv_step(
    layer: Any,
    conv_state: Optional[mx.array],
    qkv: mx.array,
    mask: Optional[mx.array],
    lengths: Optional[mx.array],
) -> Tuple[mx.array, mx.array, mx.array]:
    """Causal depthwise conv over ``[conv_state, qkv]``.

    Returns ``(masked qkv, new conv state, silu(conv) output)``. ``lengths``
    (prefill right padding) makes each row's conv tail end at its last real
    position, as mlx-lm does.
    """
    B, S, _ = qkv.shape
    n_keep = layer.conv_kernel_size - 1
    if conv_state is None:
        # mlx-lm uses the block input's dtype; qkv's dtype is its promotion with
        # the weights, and the concatenation below promotes to it either way.
        conv_state = mx.zeros((B, n_keep, layer.conv_dim), dtype=qkv.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    if lengths is not None:
        ends = mx.clip(lengths, 0, S)
        positions = (ends[:, None] + mx.arange(n_keep))[..., None]
        new_conv = mx.take_along_axis(conv_input, positions, axis=1)
    else:
        new_conv = mx.contiguous(conv_input[:, -n_keep:, :])
    conv_out = nn.silu(layer.conv1d(conv_input))
    return qkv, new_conv, conv_out


def heads(layer: Any, conv_out: mx.array, a: mx.array, b: mx.array):
    """Split the conv output into normalised ``q, k``, ``v``, and the gates ``g, beta``."""
    B, S, _ = conv_out.shape
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=_QK_EPS)
    beta = mx.sigmoid(b)
    g = compute_g(layer.A_log, a, layer.dt_bias)
    return q, k, v, g, beta


def recurrence(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array],
    mask: Optional[mx.array],
    use_kernel: bool,
) -> Tuple[mx.array, mx.array]:
    """The gated delta rule over ``q.shape[1]`` positions; mlx-lm's dispatch."""
    if state is None:
        B, _, _, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (
        not use_kernel
        or mx.default_device() != mx.gpu
        or not mx.metal.is_available()
        or k.shape[-1] < 32
        or k.shape[-1] % 32 != 0
    ):
        return gated_delta_ops(q, k, v, g, beta, state, mask)
    return gated_delta_kernel(q, k, v, g, beta, state, mask)


def _cat(xs: List[mx.array]) -> mx.array:
    return xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=1)


@overload
def _rows(x: mx.array, idx: Optional[mx.array]) -> mx.array: ...
@overload
def _rows(x: Optional[mx.array], idx: Optional[mx.array]) -> Optional[mx.array]: ...
def _rows(x: Optional[mx.array], idx: Optional[mx.array]) -> Optional[mx.array]:
    if x is None or idx is None:
        return x
    return mx.take(x, idx, axis=0)


def fold(
    conv_state: Optional[mx.array],
    state: Optional[mx.array],
    chunks: Sequence[Chunk],
    keeps: Sequence[int],
    n_keep: int,
    use_kernel: bool,
) -> Tuple[mx.array, mx.array]:
    """Apply the first ``keeps[i]`` recorded positions of row ``i`` to the snapshot.

    Rows are grouped by their keep, and each group runs the unmasked (or, when
    the round was recorded with a mask, the equally masked) recurrence over
    exactly its accepted positions, so every row gets the arithmetic of a fresh
    forward over its accepted tokens. Returns the new ``(conv, state)``.
    """
    qkv = _cat([c.qkv for c in chunks])
    q, k, v = (_cat([getattr(c, n) for c in chunks]) for n in ("q", "k", "v"))
    g, beta = _cat([c.g for c in chunks]), _cat([c.beta for c in chunks])
    masks = [c.mask for c in chunks]
    if all(m is None for m in masks):
        mask = None
    else:
        mask = _cat([mx.ones(c.qkv.shape[:2], mx.bool_) if c.mask is None else c.mask for c in chunks])
    B = qkv.shape[0]
    if conv_state is None:
        conv_state = mx.zeros((B, n_keep, qkv.shape[2]), dtype=qkv.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)

    groups: dict = {}
    for row, keep in enumerate(keeps):
        groups.setdefault(keep, []).append(row)
    convs, states, order = [], [], []
    for keep, rows in sorted(groups.items()):
        idx = None if len(groups) == 1 else mx.array(rows)
        s0 = _rows(state, idx)
        if keep == 0:
            if s0 is None:
                Hv, Dv, Dk = v.shape[2], v.shape[3], q.shape[3]
                s0 = mx.zeros((len(rows), Hv, Dv, Dk), dtype=mx.float32)
            s = s0
        else:
            sl = slice(0, keep)
            _, s = recurrence(
                _rows(q[:, sl], idx),
                _rows(k[:, sl], idx),
                _rows(v[:, sl], idx),
                _rows(g[:, sl], idx),
                _rows(beta[:, sl], idx),
                s0,
                None if mask is None else _rows(mask[:, sl], idx),
                use_kernel,
            )
        convs.append(mx.contiguous(_rows(conv_input[:, keep : keep + n_keep, :], idx)))
        states.append(s)
        order.extend(rows)
    if len(groups) == 1:
        return convs[0], states[0]
    positions = [0] * B
    for pos, row in enumerate(order):
        positions[row] = pos
    inverse = mx.array(positions)
    conv = mx.take(mx.concatenate(convs, axis=0), inverse, axis=0)
    new_state = mx.take(mx.concatenate(states, axis=0), inverse, axis=0)
    return conv, new_state


@dataclass(frozen=True)
class Trajectory:
    """The slots a recorded window passed through, one entry per position count.

    ``convs[p]`` and ``states[p]`` are the conv and recurrent state after the
    first ``p`` positions (``p`` in ``0..S``); ``ys[t]`` is the output of
    position ``t`` (``[B, 1, Hv, Dv]``).
    """

    convs: List[mx.array]
    states: List[mx.array]
    ys: List[mx.array]


def trajectory(
    conv_state: Optional[mx.array],
    state: Optional[mx.array],
    chunk: Chunk,
    n_keep: int,
    use_kernel: bool,
) -> Trajectory:
    """Replay a recorded chunk from the pre-round slots, one position per call.

    The reference of the rollback contract: the state a verify window reached
    after each of its positions. It runs the recorded operands through
    :func:`recurrence` one position at a time, which is the window's own
    per-position loop (mlx-lm's ops path steps through positions with
    operands of the same shapes whatever the window length; the kernel keeps
    a float32 state across positions, as the float32 state slot does between
    calls), so it does not depend on how the window was shaped. Nothing here
    is used on the serving path.

    Args:
        conv_state, state: the slots before the window (None: a fresh cache).
        chunk: the window's recorded inputs.
        n_keep: conv tail length (``conv_kernel_size - 1``).
        use_kernel: the dispatch the window used.

    Returns:
        The conv and recurrent states after ``0..S`` positions, and the
        per-position outputs.
    """
    B, S, conv_dim = chunk.qkv.shape
    if conv_state is None:
        conv_state = mx.zeros((B, n_keep, conv_dim), dtype=chunk.qkv.dtype)
    if state is None:
        state = mx.zeros((B, chunk.v.shape[2], chunk.v.shape[3], chunk.q.shape[3]), dtype=mx.float32)
    conv_input = mx.concatenate([conv_state, chunk.qkv], axis=1)
    convs = [mx.contiguous(conv_input[:, p : p + n_keep, :]) for p in range(S + 1)]
    states, ys = [state], []
    for t in range(S):
        step = slice(t, t + 1)
        y, state = recurrence(
            chunk.q[:, step],
            chunk.k[:, step],
            chunk.v[:, step],
            chunk.g[:, step],
            chunk.beta[:, step],
            state,
            None if chunk.mask is None else chunk.mask[:, step],
            use_kernel,
        )
        states.append(state)
        ys.append(y)
    return Trajectory(convs, states, ys)
