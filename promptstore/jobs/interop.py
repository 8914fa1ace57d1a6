"""mlx-lm prompt-cache files (``mlx_lm.cache_prompt``) <-> the store.

mlx-lm writes a prompt cache as one ``.safetensors`` file
(``mlx_lm.models.cache.save_prompt_cache``): every layer's ``state``, the
layer class names, and string metadata of which ``mlx_lm.generate`` reads
``model`` (it refuses a ``--model`` other than this string) and
``tokenizer_config`` (JSON: how mlx-lm loads the tokenizer, e.g. an
``eos_token`` that ``mlx_lm.cache_prompt --eos-token`` set). The file carries
no token ids, so importing one checks the layers' coverage against the
tokens of the prompt the caller names, then what the layers hold against
those tokens (:func:`check_cache_tokens`), and refuses a mismatch; a file
whose end cannot be checked is refused unless the caller trusts it.

The file's own metadata (``tokenizer_config`` and any other keys) is kept
in the entry's user metadata under ``mlx_lm_metadata`` and written back by
an export, so a file survives import and export with its metadata.

Files written here are plain mlx-lm files plus two extra metadata keys that
mlx-lm ignores: ``promptstore_tokens`` (JSON list of the covered token ids)
and ``promptstore_model`` (the model fingerprint). An import of such a file
checks the tokens exactly.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from promptstore.codecs import codec_for_layer, layer_coverage
from promptstore.errors import (
    CorruptEntry,
    CoverageMismatch,
    InvalidInput,
    ModelMismatch,
)
from promptstore.jobs._tokencheck import KV_SUBSTITUTES, TokenCheck, check_cache_tokens, kv_shape, token_ids
from promptstore.jobs.prefill import make_cache
from promptstore.ssm import gated_delta_layers, to_ssm

__all__ = [
    "MlxCacheFile",
    "read_mlx_cache_file",
    "write_mlx_cache_file",
    "cache_coverage",
    "check_cache_fits_model",
    "check_cache_tokens",
    "TokenCheck",
    "export_entry",
    "file_metadata_of",
    "import_mlx_cache_file",
]

TOKENS_KEY = "promptstore_tokens"
MODEL_KEY = "promptstore_model"
#: The entry metadata key that keeps an imported file's own metadata.
FILE_META_KEY = "mlx_lm_metadata"
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


def check_cache_file_name(path: Union[str, Path]) -> None:
    """Refuse a name mlx-lm's save would change: it must end in
    ``.safetensors`` after a name of its own (``mx.save_safetensors``
    appends the suffix to any other, a bare ``.safetensors`` included).

    Raises:
        InvalidInput: it does not.
    """
    if Path(path).suffix != ".safetensors":
        raise InvalidInput(
            f"{path}: an mlx-lm prompt-cache file must be named NAME.safetensors (mx.save_safetensors appends the suffix otherwise)"
        )


def write_mlx_cache_file(
    path: PathLike,
    cache: Sequence[Any],
    model: str,
    tokens: Optional[Sequence[int]] = None,
    fingerprint: Optional[str] = None,
    file_metadata: Optional[Mapping[str, Any]] = None,
) -> None:
    """Write ``cache`` as an mlx-lm prompt-cache file.

    Args:
        path: the ``.safetensors`` file to write (replaced atomically).
        cache: the per-layer caches (restored from the store or prefilled).
        model: what ``mlx_lm.generate`` records as the model (its ``--model``
            must then be exactly this string, or omitted).
        tokens: the token ids the cache covers; recorded for later imports.
        fingerprint: the model fingerprint; recorded for later imports.
        file_metadata: more metadata for the file, as an imported file
            carried it (:func:`file_metadata_of`): ``tokenizer_config``, the
            tokenizer config mlx-lm reloads (default ``"{}"``), and any user
            keys. ``model`` and promptstore's own keys are this call's.

    Raises:
        UnknownStorageKind: a layer has no mlx-lm class.
        CoverageMismatch: ``tokens`` is given and the cache covers another count.
        InvalidInput: the path does not end in ``.safetensors``, or
            ``file_metadata`` is not strings.
        OSError: the file could not be written (nothing is left behind).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import save_prompt_cache

    path = Path(path)
    check_cache_file_name(path)
    layers = [_to_mlx_lm_layer(layer) for layer in cache]
    if file_metadata is not None and not _strings(dict(file_metadata)):
        raise InvalidInput(f"{path}: file metadata must map names to strings (safetensors metadata holds only strings)")
    metadata: Dict[str, Any] = {"tokenizer_config": "{}", **(file_metadata or {}), "model": str(model)}
    metadata.pop(TOKENS_KEY, None)
    metadata.pop(MODEL_KEY, None)
    if tokens is not None:
        n = cache_coverage(layers, str(path))
        if n != len(tokens):
            raise CoverageMismatch(f"{path}: the cache covers {n} tokens but {len(tokens)} token ids were given")
        metadata[TOKENS_KEY] = json.dumps([int(t) for t in tokens])
    if fingerprint is not None:
        metadata[MODEL_KEY] = fingerprint
    # A short hidden name beside it (not one built from a name that may be
    # at the file system's limit already), unique to this process.
    tmp = path.with_name(f".promptstore-{os.getpid()}-{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        mx.eval([layer.state for layer in layers])
        try:
            save_prompt_cache(str(tmp), layers, metadata)
        except RuntimeError as err:  # mlx's writer: "[write] Unable to write ..."
            raise OSError(f"{path}: writing the file failed: {err} (a full disk or a file size limit?)") from err
        tmp.replace(path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _strings(x: Any) -> bool:
    """Whether ``x`` is what mlx-lm makes of a file's string metadata: strings,
    nested in dicts (keys with dots) or lists (numeric keys) by its tree_unflatten."""
    if isinstance(x, str):
        return True
    if isinstance(x, dict):
        return all(isinstance(k, str) and _strings(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_strings(v) for v in x)
    return False


def file_metadata_of(meta: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """The mlx-lm file metadata an entry's user metadata keeps (an imported
    file's), or None: none kept, or a value under the key that is not the
    file's (a user's own ``--meta mlx_lm_metadata=...``)."""
    kept = (meta or {}).get(FILE_META_KEY)
    return dict(kept) if isinstance(kept, dict) and _strings(kept) else None


def read_mlx_cache_file(path: PathLike) -> MlxCacheFile:
    """Read an mlx-lm prompt-cache file (written by ``mlx_lm.cache_prompt``,
    ``save_prompt_cache`` or :func:`write_mlx_cache_file`).

    Raises:
        InvalidInput: no such file.
        CorruptEntry: not a readable mlx-lm prompt-cache file, or its
            recorded token ids are not a list of ints in ``[0, 2**32)``.
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
            recorded = json.loads(metadata[TOKENS_KEY])
        except (ValueError, TypeError) as err:
            raise CorruptEntry(f"{path}: metadata {TOKENS_KEY!r} is damaged ({err})") from err
        except RecursionError as err:  # nested deeper than the parser recurses
            raise CorruptEntry(f"{path}: metadata {TOKENS_KEY!r} is damaged (JSON nested too deeply)") from err
        tokens = token_ids(recorded, None, f"{path}: metadata {TOKENS_KEY!r}", CorruptEntry)
        if len(tokens) != coverage:
            raise CorruptEntry(f"{path}: records {len(tokens)} token ids but its layers cover {coverage}")
    return MlxCacheFile(cache, dict(metadata), coverage, tokens, metadata.get(MODEL_KEY))


def check_cache_fits_model(cache: Sequence[Any], model: Any, where: str = "cache") -> None:
    """Refuse a cache whose layer classes, windows, array shapes or dtypes are not the model's.

    The check compares with what one token of prefill makes on ``model``:
    the same class per layer (or the class mlx-lm's ``--kv-bits`` or
    ``--max-kv-size`` makes of a KVCache), the model's own window size and
    kept tokens for its sliding-window layers, and, per array, the same shape
    apart from the sequence axis (a quantized layer's once dequantized) and,
    in a layer of the model's own class, the same dtype.

    Raises:
        ModelMismatch: another layer count, class, window, shape or dtype.
        CorruptEntry: a quantized layer whose bits or group size do not fit its arrays.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    probe = make_cache(model)
    if len(probe) != len(cache):
        raise ModelMismatch(f"{where}: {len(cache)} layers, but the model makes {len(probe)}; it was made by another model")
    for i, (mine, theirs) in enumerate(zip(probe, cache)):
        # the file's are mlx-lm's classes; ours as the mlx-lm class a file holds them as
        want = codec_for_layer(mine).mlx_lm_class or type(mine)
        if want is not type(theirs) and type(theirs) not in KV_SUBSTITUTES.get(want, ()):
            raise ModelMismatch(
                f"{where}: layer {i} is {type(theirs).__name__}, the model makes {want.__name__}; it was made by another model"
            )
        if type(mine) is type(theirs) and hasattr(mine, "max_size"):  # the model's own window, not --max-kv-size's
            if (mine.max_size, getattr(mine, "keep", 0)) != (theirs.max_size, getattr(theirs, "keep", 0)):
                raise ModelMismatch(
                    f"{where}: layer {i} is a window of {theirs.max_size} tokens (keeping {getattr(theirs, 'keep', 0)}), "
                    f"the model's is {mine.max_size} (keeping {getattr(mine, 'keep', 0)}); it was made by another model"
                )
    model(mx.array([[0]]), cache=probe)
    probe = [_to_mlx_lm_layer(layer) for layer in probe]

    def dtypes(layer):
        return [v.dtype for _, v in tree_flatten(layer.state) if isinstance(v, mx.array) and v.ndim >= 3]

    def shapes(layer):
        return [v.shape for _, v in tree_flatten(layer.state) if isinstance(v, mx.array) and v.ndim >= 3]

    for i, (mine, theirs) in enumerate(zip(probe, cache)):
        a, b = shapes(mine), shapes(theirs)
        if type(mine) is not type(theirs):  # a substitute: its keys, dequantized
            try:
                a, b = [kv_shape(mine)], [kv_shape(theirs)]
            except CorruptEntry as err:
                raise CorruptEntry(f"{where}: layer {i}: {err}") from err
            if b == [None]:  # it holds no position: no shape to compare (its coverage is checked apart)
                continue
        if len(a) != len(b) or not all(_same_but_length(x, y, mine) for x, y in zip(a, b)):
            raise ModelMismatch(f"{where}: layer {i} holds arrays of shapes {b}, the model's are {a}; it was made by another model")
        if type(mine) is type(theirs) and dtypes(mine) != dtypes(theirs):
            raise ModelMismatch(f"{where}: layer {i} holds arrays of dtypes {dtypes(theirs)}, the model makes {dtypes(mine)}; "
                                "it was made by another model (or another conversion of it)")


def _same_but_length(x: Tuple[int, ...], y: Tuple[int, ...], layer: Any) -> bool:
    """KV arrays are ``[B, heads, seq, dim]``: all but the sequence axis (the
    codec's ``seq_axis``) must agree. Recurrent slots have none: all of it."""
    if x == y:
        return True
    axis = codec_for_layer(layer).seq_axis
    if axis is None or len(x) != 4 or len(y) != 4:
        return False
    return x[:axis] == y[:axis] and x[axis + 1 :] == y[axis + 1 :]


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

    The file carries the metadata an imported file brought with it
    (``tokenizer_config``, user keys), so an import and an export give back
    what ``mlx_lm.cache_prompt`` wrote.

    Returns:
        ``(info, tokens)`` of the exported entry.

    Raises:
        EntryNotFound, ModelMismatch, CorruptEntry, UnknownStorageKind.
    """
    cache, info, tokens = store.load(key, model=model)
    write_mlx_cache_file(
        path, cache, model_path or info.model_name, tokens=tokens, fingerprint=info.model, file_metadata=file_metadata_of(info.meta)
    )
    return info, tokens


def import_mlx_cache_file(
    store: Any,
    fingerprint: str,
    path: PathLike,
    tokens: Optional[Sequence[int]] = None,
    model: Any = None,
    meta: Optional[Dict[str, Any]] = None,
    trust_unverified: bool = False,
    also: Sequence[str] = (),
):
    """Store the cache of an mlx-lm prompt-cache file under ``fingerprint``.

    The file has no token ids of its own (unless a promptstore export wrote
    it), so ``tokens`` names what it covers: the tokens of the prompt it was
    made from, templated as ``mlx_lm.cache_prompt`` does
    (:func:`promptstore.jobs.prefill.encode_prompt`). Its coverage must be exactly
    ``len(tokens)``; a file with recorded tokens must match them exactly;
    what the layers hold is checked against the tokens wherever it can be
    (:func:`check_cache_tokens`), and a file without recorded tokens whose
    end cannot be checked (a hybrid model's, past its first tokens) is
    refused unless ``trust_unverified``.

    The entry's metadata keeps the file's name (``imported_from``), what was
    checked (``import_check``) and the file's own metadata
    (``mlx_lm_metadata``: ``tokenizer_config`` and other keys), which an
    export writes back.

    Args:
        store: a PromptStore.
        fingerprint: the model identity to store under.
        path: the file.
        tokens: the token ids the file covers (optional only when the file
            records them).
        model: the loaded model; when given, the layers are checked against
            it (without it, a file that records no tokens is unverified).
        meta: user metadata for the entry.
        trust_unverified: store a file whose end cannot be checked.
        also: other identities of the same model a file may record (the
            folder-named one of older releases, which its entries were
            stored and exported under); the entry goes under ``fingerprint``.

    Returns:
        The stored EntryInfo.

    Raises:
        CoverageMismatch: the file covers another number of tokens, or other
            tokens, than given.
        ModelMismatch: the file records another fingerprint, or its layers do
            not fit ``model``.
        InvalidInput: the file cannot be verified (and ``trust_unverified``
            is False), ``meta`` uses a key import writes, or ``tokens``
            holds an id ``model`` cannot look up.
        CorruptEntry: the file is damaged, or records token ids that are not
            ints within ``model``'s vocabulary.
    """
    f = read_mlx_cache_file(path)
    if f.fingerprint is not None and f.fingerprint != fingerprint and f.fingerprint not in also:
        raise ModelMismatch(f"{path}: made by model {f.fingerprint!r}, not {fingerprint!r}; import it with the model it was made by")
    if tokens is None:
        if f.tokens is None:
            raise InvalidInput(f"{path}: an mlx-lm file carries no token ids; give the prompt it was made from")
        # checked before any reaches mlx: an id past the model's embedding reads out of bounds
        tokens = token_ids(f.tokens, model, f"{path}: metadata {TOKENS_KEY!r}", CorruptEntry)
    else:
        tokens = token_ids(tokens, model, f"{path}: the prompt's tokens")
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
    taken = sorted(set(meta or {}) & {"imported_from", "import_check", FILE_META_KEY})
    if taken:
        raise InvalidInput(f"metadata key {taken[0]!r} is written by import itself; choose another name")
    check: Optional[TokenCheck] = None
    if model is not None:
        check_cache_fits_model(f.cache, model, str(path))
        check = check_cache_tokens(f.cache, model, tokens, str(path))
    if f.tokens is None and (check is None or not check.verified) and not trust_unverified:
        why = check.unverified if check is not None else "no model to check it against was given"
        raise InvalidInput(
            f"{path}: {why}, so a file made from another prompt of the same length could not be told apart; nothing was stored. "
            "Pass --trust-unverified if you know the exact prompt the file was made from, or store the prompt with `promptstore put`"
        )
    if f.tokens is not None:
        done = "recorded tokens" + (f"; {check.describe()}" if check is not None else "")
    elif check is None:
        done = "none (stored with --trust-unverified)"
    else:
        done = check.describe() if check.verified else f"{check.describe()} (stored with --trust-unverified)"
    file_meta: Dict[str, Any] = {"imported_from": str(Path(path).name), "import_check": done}
    file_meta.update(meta or {})
    kept = {k: v for k, v in f.metadata.items() if k not in (TOKENS_KEY, MODEL_KEY)}
    if kept and _strings(kept):
        file_meta[FILE_META_KEY] = kept
    cache = f.cache
    if model is not None:  # gated-DeltaNet layers are stored as ssm.gated_delta on every path (README)
        cache = to_ssm(cache, len(tokens), gated_delta_layers(model))
    return store.put(fingerprint, tokens, cache, meta=file_meta)
