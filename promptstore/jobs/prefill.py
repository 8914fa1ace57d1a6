"""Loading a model directory, templating a prompt and prefilling a cache.

Shared by the CLI, warm-up jobs and tests; mlx-lm is imported lazily.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from promptstore.errors import InvalidInput
from promptstore.identity import resolve_model

__all__ = [
    "CacheOptions", "load_model", "encode_prompt", "prefill", "make_cache", "eval_cache", "quantizer",
    "vocab_size", "check_ids", "id_error", "MAX_TOKEN_ID",
]

PREFILL_STEP = 2048
QUANTIZED_KV_START = 5000  # mlx_lm.generate's default
Progress = Callable[[int, int, float], None]  # (done, total, seconds so far)
#: The store keeps token ids as uint32.
MAX_TOKEN_ID = 2**32 - 1
# What mlx-lm's models call their token embedding (a model may hold others:
# gpt2's position embedding ``wpe`` has fewer rows than the vocabulary).
_TOKEN_EMBEDDINGS = frozenset({"embed_tokens", "wte", "embed_in", "word_embeddings", "tok_embeddings"})


@dataclass(frozen=True)
class CacheOptions:
    """mlx-lm's cache options, with the meaning ``mlx_lm.generate`` gives them.

    ``max_kv_size``: a rotating (sliding-window) KV cache of that many tokens
    (``make_prompt_cache(model, max_kv_size)``). ``kv_bits``: quantize the KV
    layers once they hold ``quantized_kv_start`` tokens, in groups of
    ``kv_group_size`` (``maybe_quantize_kv_cache``). ``step``: prompt tokens
    per forward pass (``--prefill-step-size``).
    """

    max_kv_size: Optional[int] = None
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    quantized_kv_start: int = QUANTIZED_KV_START
    step: int = PREFILL_STEP


def load_model(path: str, adapter_path: Optional[str] = None) -> Tuple[Any, Any]:
    """``mlx_lm.load`` of a model directory or a Hugging Face id in the local
    cache (never the network), with a typed error.

    Raises:
        InvalidInput: the directory is missing or not an mlx-lm model, or the
            adapter cannot be applied.
    """
    from mlx_lm import load

    p = resolve_model(path)
    if not (p / "config.json").is_file():
        raise InvalidInput(f"{p}: not an mlx-lm model directory (no config.json)")
    try:
        # (model, tokenizer) without return_config
        return cast(Tuple[Any, Any], load(str(p), adapter_path=adapter_path))
    except Exception as err:  # mlx-lm raises ValueError, KeyError, OSError... on bad dirs
        what = f"adapter {adapter_path}" if adapter_path is not None else "model"
        raise InvalidInput(f"{p}: cannot load {what}: {type(err).__name__}: {err}") from err


def check_tokenizer(path: str, config: Optional[Dict[str, Any]] = None) -> None:
    """Load the tokenizer of the model at ``path`` (a folder or a Hugging
    Face id in the local cache) and drop it: for a command that hands the
    model to code that loads it later, where a failure would surface only
    then (mlx-lm's server loads it in its generation thread, per request).
    ``config``: the tokenizer config it will be loaded with (``trust_remote_code``...).

    Raises:
        InvalidInput: the tokenizer cannot be loaded, naming why.
    """
    from mlx_lm.utils import load_tokenizer

    p = resolve_model(path)
    try:
        load_tokenizer(p, dict(config or {}))
    except Exception as err:  # transformers raises ValueError, OSError, ... on missing or bad files
        raise InvalidInput(f"{p}: cannot load the model's tokenizer: {type(err).__name__}: {err}") from err


def check_text(text: Any, what: str) -> None:
    """Refuse a str that cannot be UTF-8 (a lone surrogate: bytes that were
    not UTF-8, decoded as the command line decodes them).

    Raises:
        InvalidInput: naming ``what`` and where in it.
    """
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InvalidInput(f"{what} is not UTF-8 text (character {err.start} is {text[err.start]!r}: "
                               "a byte that is not UTF-8); convert it first, e.g. with iconv") from err


def check_messages(messages: Any) -> None:
    """Refuse anything but a non-empty list of ``{"role": str, "content": str | list}``,
    and a list whose every content is empty (or white space).

    Raises:
        InvalidInput: naming the first bad message by its index.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidInput('messages must be a non-empty list of {"role": ..., "content": ...} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidInput(f"message {i} is a {type(m).__name__}, not a {{\"role\": ..., \"content\": ...}} object")
        for key in ("role", "content"):
            if key not in m:
                raise InvalidInput(f"message {i} has no {key!r}; each message needs a \"role\" and a \"content\"")
        if not isinstance(m["role"], str):
            raise InvalidInput(f"message {i}: \"role\" must be a string")
        if not isinstance(m["content"], (str, list)):
            raise InvalidInput(f"message {i}: \"content\" must be a string (or a list of content parts)")
        check_text(m["role"], f"message {i}'s role")
        check_text(m["content"], f"message {i}'s content")
    if all(not m["content"] or (isinstance(m["content"], str) and not m["content"].strip()) for m in messages):
        # as an empty prompt is refused: the cache would hold the chat template alone
        raise InvalidInput("every message's content is empty: there is nothing to cache but the chat template")


def _template(tokenizer: Any, messages: List[Dict[str, Any]], **kwargs: Any) -> List[int]:
    try:
        return list(tokenizer.apply_chat_template(messages, **kwargs))
    except Exception as err:  # jinja2 raises TemplateError, UndefinedError, TypeError...
        raise InvalidInput(f"the model's chat template refused these messages ({type(err).__name__}: {err})") from err


def encode_prompt(
    tokenizer: Any,
    prompt: Optional[str] = None,
    messages: Optional[List[Dict[str, Any]]] = None,
    chat_template: bool = True,
    system_prompt: Optional[str] = None,
) -> List[int]:
    """Token ids of a prompt, templated as ``mlx_lm.cache_prompt`` does.

    A plain prompt becomes one open user turn (``continue_final_message``),
    after a system message when ``system_prompt`` is given (as
    ``mlx_lm.generate --system-prompt`` places it), so every later request
    that starts with it shares its tokens. Messages are templated as they
    are, without a generation prompt.

    Raises:
        InvalidInput: malformed messages, messages or a system prompt without
            a chat template, or a template that refuses them.
    """
    if (prompt is None) == (messages is None):
        raise InvalidInput("give exactly one of a prompt or messages")
    check_text(prompt, "the prompt")
    check_text(system_prompt, "the system prompt")
    has_template = getattr(tokenizer, "has_chat_template", False)
    use_template = chat_template and has_template
    if system_prompt is not None and not use_template:
        raise InvalidInput("a system prompt needs the model's chat template (drop --ignore-chat-template, or put it in the prompt)")
    if messages is not None:
        check_messages(messages)
        if system_prompt is not None:
            raise InvalidInput("give the system prompt as the first of the messages, not as well")
        if not use_template:
            raise InvalidInput("messages need the model's chat template")
        return _template(tokenizer, messages, add_generation_prompt=False)
    if use_template:
        turns: List[Dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        turns.append({"role": "user", "content": prompt})
        return _template(tokenizer, turns, add_generation_prompt=False, continue_final_message=True)
    return list(tokenizer.encode(prompt))


def make_cache(model: Any, options: Optional[CacheOptions] = None) -> List[Any]:
    """The model's prompt cache, as mlx-lm makes it (rotating layers with
    ``options.max_kv_size``), with SSMCache in its gated-DeltaNet layers, so
    every path stores them as ``ssm.gated_delta`` with coverage."""
    from promptstore.ssm import make_prompt_cache  # imports mlx-lm

    return make_prompt_cache(model, options.max_kv_size if options is not None else None)


def eval_cache(cache: List[Any], each: Optional[Callable[[int], None]] = None) -> None:
    """Evaluate every array a cache holds.

    With ``each``, layer by layer in order, calling ``each(layers_done)``
    after each: the forward pass runs lazily, so evaluating layer i runs the
    model up to layer i, and a caller can report progress within one
    forward pass. The graph, and so every bit computed, is the same.
    """
    from mlx.utils import tree_flatten

    def arrays(layers: List[Any]) -> List[mx.array]:
        # Without a destination, tree_flatten returns the list of pairs.
        pairs = cast(List[Tuple[str, Any]], tree_flatten([c.state for c in layers]))
        return [v for _, v in pairs if isinstance(v, mx.array)]

    if each is None:
        mx.eval(arrays(cache))
        return
    for i, layer in enumerate(cache):
        mx.eval(arrays([layer]))
        each(i + 1)


def quantizer(options: Optional[CacheOptions]) -> Optional[Callable[[List[Any]], None]]:
    """What ``mlx_lm.generate`` does to the cache after each prefill chunk
    with ``--kv-bits`` (``maybe_quantize_kv_cache``: KV layers holding
    ``quantized_kv_start`` tokens become quantized, replaced in the list);
    None without ``kv_bits``."""
    if options is None or options.kv_bits is None:
        return None
    from mlx_lm.generate import maybe_quantize_kv_cache

    start, group, bits = options.quantized_kv_start, options.kv_group_size, options.kv_bits

    def quantize(cache: List[Any]) -> None:
        try:
            maybe_quantize_kv_cache(cache, start, group, bits)
        except NotImplementedError as err:  # e.g. RotatingKVCache: "Quantization NYI"
            raise InvalidInput(
                f"kv_bits: mlx-lm cannot quantize this model's cache ({err}: a sliding-window layer); "
                "leave --kv-bits out for this model"
            ) from err
        except ValueError as err:  # mlx's quantize: "... divisible by the quantization group size 128 ..."
            raise InvalidInput(
                f"kv_group_size {group} with kv_bits {bits}: mlx cannot quantize this model's cache ({err}); "
                "choose a --kv-group-size that divides the model's head dimension (32 or 64 do for most)"
            ) from err

    return quantize


def vocab_size(model: Any) -> Optional[int]:
    """The rows of ``model``'s token embedding: the ids it can look up (None:
    the model holds no embedding layer). A model with embeddings of none of
    mlx-lm's token-embedding names counts its smallest, which fails closed."""
    rows = [
        (name.rsplit(".", 1)[-1], int(m.weight.shape[0]))
        for name, m in model.named_modules()
        if type(m) in (nn.Embedding, nn.QuantizedEmbedding)
    ]
    found = [n for name, n in rows if name in _TOKEN_EMBEDDINGS] or [n for _, n in rows]
    return min(found) if found else None


def id_error(tokens: Sequence[int], vocab: Optional[int]) -> Optional[str]:
    """Why ``tokens`` cannot go through an embedding of ``vocab`` rows, or
    None when they can (or ``vocab`` is None: unknown)."""
    if vocab is None or len(tokens) == 0:
        return None
    ids = np.asarray(tokens)
    if ids.dtype.kind not in "iu":
        return f"token ids must be ints, not {ids.dtype}"
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if not bad.size:
        return None
    i = int(bad[0])
    return (
        f"token id {int(ids[i])} at position {i} is outside the model's vocabulary of {vocab} ids "
        f"(0 to {vocab - 1}): the tokenizer and the model's embedding disagree"
    )


def check_ids(model: Any, tokens: Sequence[int]) -> None:
    """Refuse token ids ``model``'s embedding cannot look up, before any reaches mlx.

    mlx does not bounds-check an embedding lookup: an id past the rows reads
    other memory (a cache computed from garbage, or a segfault). A tokenizer
    can hand out such ids when its added tokens go past the model's
    ``vocab_size`` (``jobs._tokencheck.token_ids`` checks ids a caller or a
    file gives, one by one, with their types).

    Raises:
        InvalidInput: an id outside ``[0, vocabulary)``.
    """
    wrong = id_error(tokens, vocab_size(model))
    if wrong is not None:
        raise InvalidInput(wrong)


def prefill(
    model: Any,
    tokens: Sequence[int],
    cache: Optional[List[Any]] = None,
    step: Optional[int] = None,
    progress: Optional[Progress] = None,
    options: Optional[CacheOptions] = None,
) -> List[Any]:
    """Run ``tokens`` through ``model`` into ``cache`` (made when None), in chunks.

    With ``options.kv_bits``, KV layers are quantized after each chunk as
    ``mlx_lm.generate`` does (``maybe_quantize_kv_cache``, which replaces
    list items: the list passed in is updated in place).

    ``progress(done, total, seconds)`` is called as each chunk's layers are
    evaluated (:func:`eval_cache`), so it moves within a chunk; ``done``
    reaches ``len(tokens)`` at the end.

    Returns the cache, which then covers exactly ``len(tokens)`` more tokens.

    Raises:
        InvalidInput: an id the model's embedding cannot look up (:func:`check_ids`).
    """
    check_ids(model, tokens)
    if cache is None:
        cache = make_cache(model, options)
    if step is None:
        step = options.step if options is not None else PREFILL_STEP
    quantize = quantizer(options)
    total = len(tokens)
    start = time.perf_counter()
    done = 0
    while done < total:
        n = min(step, total - done)
        # mx.array takes any sequence of ints; its stub names only list and tuple.
        model(mx.array(cast(List[int], tokens[done : done + n]))[None], cache=cache)
        if quantize is not None:
            quantize(cache)
        if progress is None:
            eval_cache(cache)
        else:
            layers = len(cache)

            def each(i: int, base: int = done, n: int = n) -> None:
                # the last layer ends the chunk: ``done`` then counts it whole
                progress(base + n * i // layers, total, time.perf_counter() - start)

            eval_cache(cache, each)
        done += n
    return cache
