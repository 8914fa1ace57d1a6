"""Loading a model directory, templating a prompt and prefilling a cache.

Shared by the CLI, warm-up jobs and tests; mlx-lm is imported lazily.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import mlx.core as mx

from promptstore.errors import InvalidInput

__all__ = ["load_model", "encode_prompt", "prefill", "make_cache", "eval_cache"]

PREFILL_STEP = 2048
Progress = Callable[[int, int, float], None]  # (done, total, seconds so far)


def load_model(path: str) -> Tuple[Any, Any]:
    """``mlx_lm.load`` of a local model directory, with a typed error.

    Raises:
        InvalidInput: the directory is missing or not an mlx-lm model.
    """
    from mlx_lm import load

    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise InvalidInput(f"{p}: not an mlx-lm model directory (no config.json)")
    try:
        return cast(Tuple[Any, Any], load(str(p)))  # (model, tokenizer) without return_config
    except Exception as err:  # mlx-lm raises ValueError, KeyError, OSError... on bad dirs
        raise InvalidInput(f"{p}: cannot load model: {type(err).__name__}: {err}") from err


def encode_prompt(
    tokenizer: Any,
    prompt: Optional[str] = None,
    messages: Optional[List[Dict[str, Any]]] = None,
    chat_template: bool = True,
) -> List[int]:
    """Token ids of a prompt, templated as ``mlx_lm.cache_prompt`` does.

    A plain prompt becomes one open user turn (``continue_final_message``),
    so every later request that starts with it shares its tokens. Messages
    are templated as they are, without a generation prompt.
    """
    if (prompt is None) == (messages is None):
        raise InvalidInput("give exactly one of a prompt or messages")
    has_template = getattr(tokenizer, "has_chat_template", False)
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidInput("messages must be a list of {\"role\": ..., \"content\": ...} objects")
        if not chat_template or not has_template:
            raise InvalidInput("messages need the model's chat template")
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
    if chat_template and has_template:
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=False, continue_final_message=True
            )
        )
    return list(tokenizer.encode(prompt))


def make_cache(model: Any) -> List[Any]:
    """The model's prompt cache, as mlx-lm makes it."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def eval_cache(cache: List[Any]) -> None:
    """Evaluate every array a cache holds."""
    from mlx.utils import tree_flatten

    # Without a destination, tree_flatten returns the list of pairs.
    pairs = cast(List[Tuple[str, Any]], tree_flatten([c.state for c in cache]))
    mx.eval([v for _, v in pairs if isinstance(v, mx.array)])


def prefill(
    model: Any,
    tokens: Sequence[int],
    cache: Optional[List[Any]] = None,
    step: int = PREFILL_STEP,
    progress: Optional[Progress] = None,
) -> List[Any]:
    """Run ``tokens`` through ``model`` into ``cache`` (made when None), in chunks.

    Returns the cache, which then covers exactly ``len(tokens)`` more tokens.
    """
    if cache is None:
        cache = make_cache(model)
    total = len(tokens)
    start = time.perf_counter()
    done = 0
    while done < total:
        n = min(step, total - done)
        # mx.array takes any sequence of ints; its stub names only list and tuple.
        model(mx.array(cast(List[int], tokens[done : done + n]))[None], cache=cache)
        eval_cache(cache)
        done += n
        if progress is not None:
            progress(done, total, time.perf_counter() - start)
    return cache
