"""Model identity: a fingerprint of config, weights and tokenizer.

A fingerprint reads ``<name>@<32 hex digits>``. The name is for people
(``ls`` shows it); the digest covers the model's config, every weight's
name, dtype, shape and bytes (so another quantization is another model) and
the tokenizer. Entries of one fingerprint are never returned for another.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, cast

import xxhash

from promptstore.errors import InvalidInput

__all__ = ["fingerprint", "model_name_of"]

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
_CACHE: Dict[Tuple[str, tuple], str] = {}
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


def _dir_fingerprint(path: Path, name: Optional[str]) -> str:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise InvalidInput(f"{path}: no config.json; pass an mlx-lm model directory")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise InvalidInput(f"{path}: no *.safetensors weights; pass an mlx-lm model directory")
    tokenizer_files = [path / f for f in _TOKENIZER_FILES if (path / f).is_file()]
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in [config_path, *weights, *tokenizer_files]]
    key = (str(path.resolve()), tuple(stamp))
    if key in _CACHE and name is None:
        return _CACHE[key]
    h = xxhash.xxh3_128()
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise InvalidInput(f"{config_path}: unreadable config ({err})") from err
    h.update(b"config\0" + json.dumps(config, sort_keys=True).encode())
    for p in weights:
        h.update(b"weights\0" + p.name.encode() + b"\0")
        _hash_file(h, p)
    for p in tokenizer_files:
        h.update(b"tokenizer\0" + p.name.encode() + b"\0")
        _hash_file(h, p)
    result = f"{_clean_name(name or path.resolve().name)}@{h.hexdigest()}"
    if name is None:
        _CACHE[key] = result
    return result


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
        model: an mlx-lm model directory (``str`` or ``Path``), or a loaded
            ``nn.Module``. A directory fingerprint hashes config.json, every
            ``*.safetensors`` file and the tokenizer files; it is cached per
            process by file sizes and modification times.
        tokenizer: with a loaded module, its tokenizer (recommended).
        name: the readable part; default the directory name or model type.

    Returns:
        ``"<name>@<32 hex digits>"``. A directory and the module loaded from
        it give different fingerprints: use one form consistently (the CLI
        and ``promptstore serve`` use the directory).

    Raises:
        InvalidInput: not a model directory or module.
    """
    if isinstance(model, (str, os.PathLike)):
        path = Path(model).expanduser()
        if not path.is_dir():
            raise InvalidInput(f"{path}: not a directory; pass an mlx-lm model directory")
        return _dir_fingerprint(path, name)
    if hasattr(model, "parameters"):
        return _module_fingerprint(model, tokenizer, name)
    raise InvalidInput(f"cannot fingerprint a {type(model).__name__}: pass a model directory or module")
