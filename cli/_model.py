"""Model options shared by put / get / import / warmup: the model (a folder
or a Hugging Face id in the local cache), its adapter, and mlx-lm's cache
flags, with the names and meanings ``mlx_lm.generate`` gives them."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import click

from promptstore import InvalidInput
from promptstore.cli._common import warn
from promptstore.identity import adapter_fingerprint, context_length, fingerprint, legacy_fingerprint, resolve_model
from promptstore.jobs.prefill import PREFILL_STEP, QUANTIZED_KV_START, CacheOptions, load_model

MODEL_HELP = "mlx-lm model: a local folder, or a Hugging Face id (org/name) already in the local Hugging Face cache."
_CACHE_FLAGS = ("max_kv_size", "kv_bits", "kv_group_size", "quantized_kv_start", "prefill_step_size")


@dataclass(frozen=True)
class ModelArgs:
    """What the model options asked for."""

    model: str
    adapter_path: Optional[str]
    cache: CacheOptions
    allow_long_prompt: bool = False


@dataclass
class Loaded:
    """A loaded model and the identities its entries are stored under."""

    model: Any
    tokenizer: Any
    spec: str  # as the user gave it: what mlx_lm.generate --model is given
    path: Path
    identity: str
    legacy: Optional[str]  # the folder-named identity of older releases, when it differs
    config: Dict[str, Any]


def model_options(cache: bool = True) -> Callable:
    """--model and --adapter-path; with ``cache``, mlx-lm's cache flags and
    --allow-long-prompt. The command receives them as one ``margs`` (ModelArgs)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            flags = {k: kwargs.pop(k, None) if cache else None for k in _CACHE_FLAGS}
            opts = CacheOptions(
                max_kv_size=flags["max_kv_size"],
                kv_bits=flags["kv_bits"],
                kv_group_size=flags["kv_group_size"] or 64,
                quantized_kv_start=QUANTIZED_KV_START if flags["quantized_kv_start"] is None else flags["quantized_kv_start"],
                step=flags["prefill_step_size"] or PREFILL_STEP,
            )
            kwargs["margs"] = ModelArgs(
                kwargs.pop("model_dir"), kwargs.pop("adapter_path"), opts, bool(kwargs.pop("allow_long_prompt", False))
            )
            return fn(*args, **kwargs)

        opts: List[Callable] = [
            click.option("--model", "model_dir", required=True, metavar="DIR|ORG/NAME", help=MODEL_HELP),
            click.option(
                "--adapter-path",
                default=None,
                type=click.Path(file_okay=False, exists=True),
                help="mlx-lm adapter folder (LoRA) applied to the model; its caches are stored under the adapted model's identity.",
            ),
        ]
        if cache:
            opts += [
                click.option("--max-kv-size", type=click.IntRange(min=1), default=None, help="A rotating KV cache of at most this many tokens (as mlx_lm.generate)."),
                click.option("--kv-bits", type=click.Choice(["2", "3", "4", "5", "6", "8"]), callback=_as_int, default=None, help="Quantize the KV cache to this many bits (as mlx_lm.generate)."),
                click.option("--kv-group-size", type=click.Choice(["32", "64", "128"]), callback=_as_int, default="64", show_default=True, help="Group size of KV quantization."),
                click.option("--quantized-kv-start", type=click.IntRange(min=0), default=QUANTIZED_KV_START, show_default=True, help="With --kv-bits, quantize once the cache holds this many tokens."),
                click.option("--prefill-step-size", type=click.IntRange(min=1), default=PREFILL_STEP, show_default=True, help="Prompt tokens per forward pass; smaller lowers peak memory."),
                click.option("--allow-long-prompt", is_flag=True, help="Prefill a prompt longer than the model's context (max_position_embeddings) instead of refusing it."),
            ]
        for opt in reversed(opts):
            wrapper = opt(wrapper)
        return wrapper

    return decorate


def _as_int(_ctx, _param, value):
    return None if value is None else int(value)


def identities(spec: str, adapter_path: Optional[str] = None) -> List[str]:
    """The identities a model's entries may be stored under: the current one
    first, then the folder-named one of older releases (when it differs and
    no adapter is applied). Reads no weights when the digest is remembered.

    Raises:
        InvalidInput: not a model folder or cached Hugging Face id.
    """
    path = resolve_model(spec)
    ident = fingerprint(path)
    if adapter_path is not None:
        return [adapter_fingerprint(ident, adapter_path)]
    legacy = legacy_fingerprint(path)
    return [ident] if legacy == ident else [ident, legacy]


def model_folder(spec: str) -> Path:
    """The folder of a model given as put/get take it (a folder, or a Hugging
    Face id resolved offline from the local cache), checked as an mlx-lm model.

    Raises:
        InvalidInput: not a model folder (config.json, weights) or cached Hugging Face id.
    """
    identities(spec)  # the checks and messages of put/get (the digest is remembered)
    return resolve_model(spec)


def load(margs: ModelArgs) -> Loaded:
    """Load the model (offline) and compute its identities.

    Raises:
        InvalidInput: not a model, or an adapter that cannot be applied.
    """
    path = resolve_model(margs.model)
    ids = identities(margs.model, margs.adapter_path)  # before loading: a bad adapter folder fails fast
    model, tokenizer = load_model(str(path), margs.adapter_path)
    if margs.cache.max_kv_size is not None and hasattr(model, "make_cache"):
        warn(f"--max-kv-size is ignored: this model ({type(model).__module__}) makes its own cache, and mlx-lm's "
             "make_prompt_cache (as mlx_lm.generate) then ignores it")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return Loaded(model, tokenizer, margs.model, path, ids[0], ids[1] if len(ids) > 1 else None, config)


def check_length(loaded: Loaded, n_tokens: int, margs: ModelArgs) -> None:
    """Refuse, before any prefill, a prompt longer than the model's context.

    Raises:
        InvalidInput: unless --allow-long-prompt.
    """
    limit = context_length(loaded.config)
    if limit is not None and n_tokens > limit and not margs.allow_long_prompt:
        raise InvalidInput(
            f"the prompt is {n_tokens:,} tokens, longer than the model's context of {limit:,} "
            f"(max_position_embeddings in {loaded.path / 'config.json'}); shorten it, or pass --allow-long-prompt to prefill it anyway"
        )


def best_lookup(store: Any, loaded: Loaded, tokens: List[int]):
    """The longest usable stored prefix under the current identity or the
    older, folder-named one (compared on manifests; only the better is restored)."""
    if loaded.legacy is None:
        return store.lookup(loaded.identity, tokens)
    best = max((loaded.identity, loaded.legacy), key=lambda ident: store.peek(ident, tokens))
    return store.lookup(best, tokens)


