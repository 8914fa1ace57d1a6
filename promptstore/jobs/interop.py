"""mlx-lm prompt-cache files (``mlx_lm.cache_prompt``) <-> the store.

mlx-lm writes a prompt cache as one ``.safetensors`` file
(``mlx_lm.models.cache.save_prompt_cache``): every layer's ``state``, the
layer class names, and string metadata of which ``mlx_lm.generate`` reads
``model`` (it refuses a ``--model`` other than this string) and
``tokenizer_config`` (JSON). The file carries no token ids, so importing one
checks the layers' coverage against the tokens of the prompt the caller
names and refuses a mismatch.

Files written here are plain mlx-lm files plus two extra metadata keys that
mlx-lm ignores: ``promptstore_tokens`` (JSON list of the covered token ids)
and ``promptstore_model`` (the model fingerprint). An import of such a file
checks the tokens exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

from promptstore.codecs import codec_for_layer, layer_coverage
from promptstore.errors import (
    CorruptEntry,
    CoverageMismatch,
    InvalidInput,
    ModelMismatch,
)
from promptstore.jobs.prefill import make_cache

__all__ = [
    "MlxCacheFile",
    "read_mlx_cache_file",
    "write_mlx_cache_file",
    "cache_coverage",
    "check_cache_fits_model",
    "check_tail_tokens",
    "export_entry",
    "import_mlx_cache_file",
]

TOKENS_KEY = "promptstore_tokens"
MODEL_KEY = "promptstore_model"
PathLike = Union[str, Path]


@dataclass(frozen=True)
class MlxCacheFile:
    """A prompt-cache file as read: the layers, mlx-lm's metadata and, when a
    promptstore export wrote it, the covered token ids and model fingerprint."""

    cache: List[Any]
    metadata: Dict[str, str]
    coverage: int
    tokens: Optional[List[int]]
    fingerprint: Optional[str]


def _to_mlx_lm_layer(layer: Any) -> Any:
    """mlx-lm resolves a file's layer classes by name in its own cache module:
    each layer is written as its codec's mlx-lm class (promptstore's own
    classes as the mlx-lm class they mirror).

    Raises:
        UnknownStorageKind: no codec for the exact class, or its kind has no
            mlx-lm class (MissingCapability).
        InvalidInput: a batch of several rows (SSMCache).
    """
    return codec_for_layer(layer).to_mlx_lm(layer)


def cache_coverage(cache: Sequence[Any], where: str = "cache") -> int:
    """The number of tokens every layer of ``cache`` has absorbed.

    Raises:
        CoverageMismatch: the layers disagree, or none can tell its coverage
            (a purely recurrent model: nothing to check a prompt against).
    """
    known: Dict[int, int] = {}
    for i, layer in enumerate(cache):
        n = layer_coverage(layer)
        if n is not None:
            known.setdefault(int(n), i)
    if not known:
        raise CoverageMismatch(f"{where}: no layer records how many tokens it covers, so it cannot be checked against a prompt")
    if len(known) > 1:
        detail = ", ".join(f"layer {i}: {n}" for n, i in sorted(known.items()))
        raise CoverageMismatch(f"{where}: layers cover different numbers of tokens ({detail}); the file is inconsistent")
    return next(iter(known))


def write_mlx_cache_file(
    path: PathLike,
    cache: Sequence[Any],
    model: str,
    tokens: Optional[Sequence[int]] = None,
    fingerprint: Optional[str] = None,
    tokenizer_config: Optional[Dict[str, Any]] = None,
) -> None:
    """Write ``cache`` as an mlx-lm prompt-cache file.

    Args:
        path: the ``.safetensors`` file to write (replaced atomically).
        cache: the per-layer caches (restored from the store or prefilled).
        model: what ``mlx_lm.generate`` records as the model (its ``--model``
            must then be exactly this string, or omitted).
        tokens: the token ids the cache covers; recorded for later imports.
        fingerprint: the model fingerprint; recorded for later imports.
        tokenizer_config: the tokenizer config mlx-lm reloads (default ``{}``).

    Raises:
        UnknownStorageKind: a layer has no mlx-lm class.
        CoverageMismatch: ``tokens`` is given and the cache covers another count.
        InvalidInput: the path does not end in ``.safetensors``.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import save_prompt_cache

    path = Path(path)
    if path.suffix != ".safetensors":
        raise InvalidInput(f"{path}: an mlx-lm prompt-cache file must end in .safetensors (mx.save_safetensors appends it otherwise)")
    layers = [_to_mlx_lm_layer(layer) for layer in cache]
    metadata = {"model": str(model), "tokenizer_config": json.dumps(tokenizer_config or {})}
    if tokens is not None:
        n = cache_coverage(layers, str(path))
        if n != len(tokens):
            raise CoverageMismatch(f"{path}: the cache covers {n} tokens but {len(tokens)} token ids were given")
        metadata[TOKENS_KEY] = json.dumps([int(t) for t in tokens])
    if fingerprint is not None:
        metadata[MODEL_KEY] = fingerprint
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        mx.eval([layer.state for layer in layers])
        save_prompt_cache(str(tmp), layers, metadata)
        tmp.replace(path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_mlx_cache_file(path: PathLike) -> MlxCacheFile:
    """Read an mlx-lm prompt-cache file (written by ``mlx_lm.cache_prompt``,
    ``save_prompt_cache`` or :func:`write_mlx_cache_file`).

    Raises:
        InvalidInput: no such file.
        CorruptEntry: not a readable mlx-lm prompt-cache file.
        CoverageMismatch: its layers disagree on how many tokens they cover.
    """
    from mlx_lm.models.cache import load_prompt_cache

    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"{path}: no such file")
    try:
        cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    except Exception as err:  # mlx raises RuntimeError/ValueError/KeyError... on foreign files
        raise CorruptEntry(f"{path}: not an mlx-lm prompt-cache file ({type(err).__name__}: {err})") from err
    if not isinstance(metadata, dict) or not cache:
        raise CorruptEntry(f"{path}: not an mlx-lm prompt-cache file (no layers or metadata)")
    coverage = cache_coverage(cache, str(path))
    tokens = None
    if TOKENS_KEY in metadata:
        try:
            tokens = [int(t) for t in json.loads(metadata[TOKENS_KEY])]
        except (ValueError, TypeError) as err:
            raise CorruptEntry(f"{path}: metadata {TOKENS_KEY!r} is damaged ({err})") from err
        if len(tokens) != coverage:
            raise CorruptEntry(f"{path}: records {len(tokens)} token ids but its layers cover {coverage}")
    return MlxCacheFile(cache, dict(metadata), coverage, tokens, metadata.get(MODEL_KEY))


def check_cache_fits_model(cache: Sequence[Any], model: Any, where: str = "cache") -> None:
    """Refuse a cache whose layer classes or array shapes are not the model's.

    The check compares with what one token of prefill makes on ``model``:
    the same class per layer and, per array, the same shape apart from the
    sequence axis.

    Raises:
        ModelMismatch: another layer count, class or shape.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    probe = make_cache(model)
    if len(probe) != len(cache):
        raise ModelMismatch(f"{where}: {len(cache)} layers, but the model makes {len(probe)}; it was made by another model")
    for i, (mine, theirs) in enumerate(zip(probe, cache)):
        if type(mine) is not type(theirs):  # both are mlx-lm's classes here
            raise ModelMismatch(
                f"{where}: layer {i} is {type(theirs).__name__}, the model makes {type(mine).__name__}; it was made by another model"
            )
    model(mx.array([[0]]), cache=probe)

    def shapes(layer):
        return [v.shape for _, v in tree_flatten(layer.state) if isinstance(v, mx.array) and v.ndim >= 3]

    for i, (mine, theirs) in enumerate(zip(probe, cache)):
        a, b = shapes(mine), shapes(theirs)
        if len(a) != len(b) or not all(_same_but_length(x, y, mine) for x, y in zip(a, b)):
            raise ModelMismatch(f"{where}: layer {i} holds arrays of shapes {b}, the model's are {a}; it was made by another model")


def _same_but_length(x: Tuple[int, ...], y: Tuple[int, ...], layer: Any) -> bool:
    """KV arrays are ``[B, heads, seq, dim]``: all but the sequence axis (the
    codec's ``seq_axis``) must agree. Recurrent slots have none: all of it."""
    if x == y:
        return True
    axis = codec_for_layer(layer).seq_axis
    if axis is None or len(x) != 4 or len(y) != 4:
        return False
    return x[:axis] == y[:axis] and x[axis + 1 :] == y[axis + 1 :]


TAIL_TOKENS = 4
TAIL_TOLERANCE = 0.05


def check_tail_tokens(cache: Sequence[Any], model: Any, tokens: Sequence[int], where: str = "cache") -> bool:
    """Check that a KV cache's last positions were made from ``tokens``' last tokens.

    For a cache of plain KV layers only: a copy trimmed by a few tokens is
    run on the prompt's last tokens, and the keys and values it makes must
    agree with the stored ones (relative to their magnitude; a different
    chunking of prefill changes the low bits, a different token changes
    everything). Recurrent layers cannot be trimmed, so hybrid caches are
    not checked (returns False).

    Returns:
        True when the check ran and passed; False when it does not apply.

    Raises:
        CoverageMismatch: the cache ends with other tokens than ``tokens``.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    n = len(tokens)
    k = min(TAIL_TOKENS, n - 1)
    if k < 1 or not all(type(layer) is KVCache and layer.offset == n for layer in cache):
        return False
    copies = []
    for layer in cache:  # fresh array objects: update_and_fetch writes into its buffers in place
        c = KVCache()
        c.keys, c.values, c.offset = layer.keys[..., : n - k, :], layer.values[..., : n - k, :], n - k
        copies.append(c)
    model(mx.array([list(tokens[n - k :])]), cache=copies)
    for i, (mine, theirs) in enumerate(zip(copies, cache)):
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            a = a[..., n - k : n, :].astype(mx.float32)
            b = b[..., n - k : n, :].astype(mx.float32)
            err = cast(float, (mx.abs(a - b).max() / (mx.abs(b).max() + 1e-6)).item())  # float32 scalar: a float
            if err > TAIL_TOLERANCE:
                raise CoverageMismatch(
                    f"{where}: the cache's last {k} positions (layer {i}) were not made from the last {k} tokens of the prompt; "
                    "give the exact prompt the file was made from"
                )
    return True


def export_entry(store: Any, key: str, path: PathLike, model_path: Optional[str] = None, model: Optional[str] = None) -> Tuple[Any, List[int]]:
    """Write the store entry ``key`` as an mlx-lm prompt-cache file.

    Args:
        store: a PromptStore.
        key: entry id or unique id prefix.
        path: the ``.safetensors`` file to write.
        model_path: what the file records as the model (a path that
            ``mlx_lm.generate --model`` will be given); default the entry's
            readable model name.
        model: the model fingerprint the entry must belong to, when known.

    Returns:
        ``(info, tokens)`` of the exported entry.

    Raises:
        EntryNotFound, ModelMismatch, CorruptEntry, UnknownStorageKind.
    """
    cache, info, tokens = store.load(key, model=model)
    write_mlx_cache_file(path, cache, model_path or info.model_name, tokens=tokens, fingerprint=info.model)
    return info, tokens


def import_mlx_cache_file(
    store: Any,
    fingerprint: str,
    path: PathLike,
    tokens: Optional[Sequence[int]] = None,
    model: Any = None,
    meta: Optional[Dict[str, Any]] = None,
):
    """Store the cache of an mlx-lm prompt-cache file under ``fingerprint``.

    The file has no token ids of its own (unless a promptstore export wrote
    it), so ``tokens`` names what it covers: the tokens of the prompt it was
    made from, templated as ``mlx_lm.cache_prompt`` does
    (:func:`promptstore.jobs.prefill.encode_prompt`). Its coverage must be exactly
    ``len(tokens)``; a file with recorded tokens must match them exactly; a
    plain-KV file's last positions are checked against the prompt's last
    tokens (:func:`check_tail_tokens`; hybrid files only by count).

    Args:
        store: a PromptStore.
        fingerprint: the model identity to store under.
        path: the file.
        tokens: the token ids the file covers (optional only when the file
            records them).
        model: the loaded model; when given, the layers are checked against it.
        meta: user metadata for the entry.

    Returns:
        The stored EntryInfo.

    Raises:
        CoverageMismatch: the file covers another number of tokens, or other
            tokens, than given.
        ModelMismatch: the file records another fingerprint, or its layers do
            not fit ``model``.
        CorruptEntry, InvalidInput.
    """
    f = read_mlx_cache_file(path)
    if f.fingerprint is not None and f.fingerprint != fingerprint:
        raise ModelMismatch(f"{path}: made by model {f.fingerprint!r}, not {fingerprint!r}; import it with the model it was made by")
    if tokens is None:
        if f.tokens is None:
            raise InvalidInput(f"{path}: an mlx-lm file carries no token ids; give the prompt it was made from")
        tokens = f.tokens
    tokens = [int(t) for t in tokens]
    if f.coverage != len(tokens):
        hint = (
            " (the file holds one token fewer: was it made with another chat template setting?)"
            if f.coverage == len(tokens) - 1
            else ""
        )
        raise CoverageMismatch(
            f"{path}: the file's cache covers {f.coverage} tokens but the prompt encodes to {len(tokens)}{hint}; "
            "give the exact prompt (and --no-chat-template setting) the file was made from"
        )
    if f.tokens is not None and f.tokens != tokens:
        first = next(i for i, (a, b) in enumerate(zip(f.tokens, tokens)) if a != b)
        raise CoverageMismatch(f"{path}: the file covers other tokens than the prompt (first difference at token {first})")
    if model is not None:
        check_cache_fits_model(f.cache, model, str(path))
        if f.tokens is None:
            check_tail_tokens(f.cache, model, tokens, str(path))
    file_meta = {"imported_from": str(Path(path).name)}
    file_meta.update(meta or {})
    return store.put(fingerprint, tokens, f.cache, meta=file_meta)
