"""Model identity: a fingerprint of config, weights and tokenizer.

A fingerprint reads ``<name>@<32 hex digits>``. The digest covers the
model's config, every weight's name, dtype, shape and bytes (so another
quantization is another model) and the tokenizer. The name is for people
(``ls`` shows it) and, since the store keys entries by the whole string,
it is taken from the content too: the last part of ``_name_or_path`` in
config.json, else its ``model_type``. So a byte-identical copy of a model
folder, or a new Hugging Face snapshot folder of the same files, is the
same model. Entries of one fingerprint are never returned for another.

Releases before this one named a directory fingerprint after the folder
(``legacy_fingerprint``); the CLI also looks entries up under that name, so
they stay reachable from the folder they were made from.

Hashing a 40 GB model takes seconds warm and minutes cold, so a directory's
digest is remembered on disk (``promptstore-identity.json`` in the user's
cache folder, or ``$PROMPTSTORE_IDENTITY_CACHE``), keyed by every hashed
file's name, size, mtime, inode and device: an unchanged model is never
re-read, and any change to any file is a new key.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union, cast

import xxhash

from promptstore._paths import cache_root, user_path
from promptstore.errors import InvalidInput

__all__ = ["fingerprint", "legacy_fingerprint", "adapter_fingerprint", "model_name_of", "resolve_model", "model_dir", "context_length"]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
_ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")
_CACHE: Dict[str, str] = {}  # stamp key -> digest, this process
_READ = 16 * 1024 * 1024


def model_name_of(model: str) -> str:
    """The readable part of a model identity string (before ``@``)."""
    return model.split("@", 1)[0] if "@" in model else model


def _clean_name(name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")
    return name or "model"


def _hash_file(h: "xxhash.xxh3_128", path: Path) -> None:
    with open(path, "rb") as f:
        while True:
            block = f.read(_READ)
            if not block:
                break
            h.update(block)


def _digest_cache_file() -> Path:
    env = os.environ.get("PROMPTSTORE_IDENTITY_CACHE")
    return Path(env).expanduser() if env else cache_root() / "promptstore-identity.json"


def _load_digests() -> Dict[str, str]:
    try:
        data = json.loads(_digest_cache_file().read_text())
    except (OSError, ValueError, RecursionError):  # a damaged cache file is recomputed
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}


def _save_digest(key: str, digest: str) -> None:
    """Remember a digest (best effort: an unwritable cache folder only costs a re-hash)."""
    path = _digest_cache_file()
    try:
        known = _load_digests()
        known[key] = digest
        if len(known) > 256:  # old keys of models since changed or deleted
            known = dict(list(known.items())[-256:])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(path)
    except OSError:
        pass


def _model_files(path: Path) -> Tuple[Path, List[Path], List[Path]]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise InvalidInput(f"{path}: no config.json; pass an mlx-lm model directory")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise InvalidInput(f"{path}: no *.safetensors weights; pass an mlx-lm model directory")
    tokenizer_files = [path / f for f in _TOKENIZER_FILES if (path / f).is_file()]
    return config_path, weights, tokenizer_files


def model_dir(model: Union[str, os.PathLike]) -> Path:
    """The folder of a model (as ``resolve_model``), checked for a config
    and weights without reading them: the quick check a command makes before
    it opens a store.

    Raises:
        InvalidInput: not an mlx-lm model directory or cached Hugging Face id.
    """
    path = resolve_model(model)
    _model_files(path)
    return path


def _stamp_key(files: List[Path]) -> str:
    """Every file's name, size, mtime, inode and device: a new value for any
    change to any of them (a copy has other inodes, so it is hashed once)."""
    stamp = []
    for p in files:
        st = p.stat()
        stamp.append([p.name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev])
    return xxhash.xxh3_128(json.dumps(stamp).encode()).hexdigest()


def _dir_digest(path: Path) -> Tuple[str, Dict[str, Any]]:
    """``(digest, config)`` of a model directory; the digest from the caches when no file changed."""
    config_path, weights, tokenizer_files = _model_files(path)
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise InvalidInput(f"{config_path}: unreadable config ({err})") from err
    except RecursionError as err:  # nested deeper than the parser recurses
        raise InvalidInput(f"{config_path}: unreadable config (JSON nested too deeply)") from err
    if not isinstance(config, dict):
        raise InvalidInput(f"{config_path}: not a JSON object; pass an mlx-lm model directory")
    key = _stamp_key([config_path, *weights, *tokenizer_files])
    digest = _CACHE.get(key) or _load_digests().get(key)
    if digest is None:
        h = xxhash.xxh3_128()
        h.update(b"config\0" + json.dumps(config, sort_keys=True).encode())
        for p in weights:
            h.update(b"weights\0" + p.name.encode() + b"\0")
            _hash_file(h, p)
        for p in tokenizer_files:
            h.update(b"tokenizer\0" + p.name.encode() + b"\0")
            _hash_file(h, p)
        digest = h.hexdigest()
        _save_digest(key, digest)
    _CACHE[key] = digest
    return digest, config


def _content_name(config: Dict[str, Any]) -> str:
    """A readable name from config.json alone (so the same files give the same name)."""
    source = config.get("_name_or_path")
    if isinstance(source, str) and source.strip("/ "):
        return source.rstrip("/").rsplit("/", 1)[-1]
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) and model_type else "model"


def _dir_fingerprint(path: Path, name: Optional[str]) -> str:
    digest, config = _dir_digest(path)
    return f"{_clean_name(name or _content_name(config))}@{digest}"


def legacy_fingerprint(model: Union[str, os.PathLike]) -> str:
    """The identity releases before this one gave a model directory: named
    after the folder (for a Hugging Face id, its snapshot folder). Entries
    stored under it stay reachable through this string.

    Raises:
        InvalidInput: not a model directory or cached Hugging Face id.
    """
    path = resolve_model(model)
    digest, _ = _dir_digest(path)
    return f"{_clean_name(path.resolve().name)}@{digest}"


def adapter_fingerprint(identity: str, adapter_path: Union[str, os.PathLike]) -> str:
    """The identity of a model with an mlx-lm (LoRA) adapter applied: the
    base identity's name plus ``+adapter``, and a digest over the base
    digest and the adapter's config and weights.

    Raises:
        InvalidInput: the adapter folder lacks adapter_config.json or
            adapters.safetensors.
    """
    path = user_path(adapter_path, "the adapter folder")
    files = [path / f for f in _ADAPTER_FILES]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise InvalidInput(f"{path}: no {' or '.join(missing)}; pass an mlx-lm adapter folder (mlx_lm.lora --adapter-path)")
    h = xxhash.xxh3_128()
    h.update(b"base\0" + identity.encode())
    for p in files:
        h.update(b"adapter\0" + p.name.encode() + b"\0")
        _hash_file(h, p)
    return f"{model_name_of(identity)}+adapter@{h.hexdigest()}"


def resolve_model(model: Union[str, os.PathLike]) -> Path:
    """The local folder of a model: a directory as given, or a Hugging Face
    id (``org/name``) resolved from the local Hugging Face cache without the
    network, as ``mlx_lm.load`` resolves it (``mlx_lm.utils.hf_repo_to_path``).

    Raises:
        InvalidInput: neither a directory nor a model in the local cache
            (an empty name too: it is no name for the current folder).
    """
    if os.fspath(model) == "":
        raise InvalidInput("the model is empty; pass an mlx-lm model directory (\".\" for the current one) or a Hugging Face id")
    path = user_path(model, "the model")
    if path.is_dir():
        return path
    text = str(model)
    if path.exists():
        raise InvalidInput(f"{path}: not a directory; pass an mlx-lm model directory or a Hugging Face id")
    if text.count("/") != 1 or text.startswith((".", "/", "~")) or not all(text.split("/")):
        raise InvalidInput(f"{path}: no such directory; pass an mlx-lm model directory (with config.json) or a Hugging Face id (org/name)")
    try:
        from mlx_lm.utils import hf_repo_to_path

        return Path(hf_repo_to_path(text))
    except Exception as err:  # huggingface_hub: LocalEntryNotFoundError, HFValidationError, ...
        raise InvalidInput(
            f"{text}: no such directory, and not in the local Hugging Face cache ({type(err).__name__}); "
            f"download it first (`hf download {text}`, or any mlx_lm command online) or pass its folder"
        ) from err


def context_length(config: Dict[str, Any]) -> Optional[int]:
    """The longest sequence a model was made for (``max_position_embeddings``
    of config.json or of its ``text_config``), or None when it does not say."""
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict):
            n = cfg.get("max_position_embeddings")
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return n
    return None


def _module_fingerprint(model: Any, tokenizer: Any, name: Optional[str]) -> str:
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    h = xxhash.xxh3_128()
    args = getattr(model, "args", None)
    if args is not None:
        try:
            from dataclasses import asdict

            desc = asdict(args)
        except TypeError:
            desc = dict(vars(args))
        h.update(b"config\0" + json.dumps(desc, sort_keys=True, default=str).encode())
    # Without a destination, tree_flatten returns the list of pairs.
    params = cast(List[Tuple[str, mx.array]], tree_flatten(model.parameters()))
    mx.eval([v for _, v in params])
    for k, v in sorted(params, key=lambda kv: kv[0]):
        h.update(f"weights\0{k}\0{v.dtype}\0{v.shape}\0".encode())
        if v.dtype == mx.bfloat16:
            v = v.view(mx.uint16)
        h.update(np.asarray(v).data.cast("B"))
    if tokenizer is not None:
        inner = getattr(tokenizer, "_tokenizer", tokenizer)
        backend = getattr(inner, "backend_tokenizer", None)
        if backend is not None:
            h.update(b"tokenizer\0" + backend.to_str().encode())
        else:
            h.update(b"tokenizer\0" + json.dumps(sorted(inner.get_vocab().items())).encode())
        template = getattr(inner, "chat_template", None)
        if template:
            h.update(b"template\0" + str(template).encode())
    model_type = getattr(args, "model_type", None) if args is not None else None
    return f"{_clean_name(name or model_type or type(model).__name__)}@{h.hexdigest()}"


def fingerprint(model: Any, tokenizer: Any = None, *, name: Optional[str] = None) -> str:
    """The identity string of a model.

    Args:
        model: an mlx-lm model directory (``str`` or ``Path``), a Hugging
            Face id in the local cache (:func:`resolve_model`), or a loaded
            ``nn.Module``. A directory fingerprint hashes config.json, every
            ``*.safetensors`` file and the tokenizer files; the digest is
            remembered by each file's size, mtime and inode (module docstring).
        tokenizer: with a loaded module, its tokenizer (recommended).
        name: the readable part; default from config.json (``_name_or_path``,
            else ``model_type``), or the module's model type.

    Returns:
        ``"<name>@<32 hex digits>"``. A directory and the module loaded from
        it give different fingerprints: use one form consistently (the CLI
        and ``promptstore serve`` use the directory).

    Raises:
        InvalidInput: not a model directory or module.
    """
    if isinstance(model, (str, os.PathLike)):
        return _dir_fingerprint(resolve_model(model), name)
    if hasattr(model, "parameters"):
        return _module_fingerprint(model, tokenizer, name)
    raise InvalidInput(f"cannot fingerprint a {type(model).__name__}: pass a model directory or module")
