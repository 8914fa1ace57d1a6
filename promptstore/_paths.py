"""Platform folders: where promptstore keeps its default store and caches."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from promptstore.errors import InvalidInput

__all__ = ["cache_root", "default_path", "durable", "store_path", "user_path"]


def user_path(path: Any, what: str = "path") -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded.

    Raises:
        InvalidInput: ``~user`` names no user on this machine, or no home
            folder can be found for ``~``.
    """
    try:
        return Path(path).expanduser()
    except RuntimeError as err:  # pathlib: "Could not determine home directory."
        head = os.fspath(path).split(os.sep, 1)[0]
        raise InvalidInput(f"{what} {os.fspath(path)!r}: {head!r} names no home folder on this machine") from err


def cache_root() -> Path:
    """The user's cache folder: ``$XDG_CACHE_HOME``, else ``~/Library/Caches``
    on macOS, else ``~/.cache`` (the XDG default)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(os.path.expanduser(xdg)):  # the spec ignores relative paths
        return Path(xdg).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches"
    return Path.home() / ".cache"


def default_path() -> Path:
    """``$PROMPTSTORE_DIR``, else ``promptstore`` in the user's cache folder:
    ``$XDG_CACHE_HOME``, else ``~/Library/Caches`` on macOS (where an
    existing ``~/.cache/promptstore`` of an older release is kept), else
    ``~/.cache``."""
    env = os.environ.get("PROMPTSTORE_DIR")
    if env:
        return user_path(env, "$PROMPTSTORE_DIR")
    legacy = Path.home() / ".cache" / "promptstore"
    if not os.environ.get("XDG_CACHE_HOME") and legacy.is_dir():
        return legacy
    return cache_root() / "promptstore"


def store_path(path: Any, what: str = "the store path") -> Path:
    """``path`` as a store's folder, checked before anything is created
    (``what`` names it in the messages).

    Raises:
        InvalidInput: not a str or path, empty, or one the file system
            cannot name (a NUL byte, a name that is not UTF-8).
    """
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise InvalidInput(f"{what} must be a str or a pathlib.Path, not {type(path).__name__}")
    try:
        os.fspath(path).encode("utf-8")  # py-lmdb opens paths by their UTF-8 bytes
    except UnicodeEncodeError as err:
        raise InvalidInput(f"{what} {str(path)[:80]!r} is not valid UTF-8 ({err.reason})") from err
    if "\0" in os.fspath(path):
        raise InvalidInput(f"{what} contains a NUL byte")
    if os.fspath(path) == "":
        raise InvalidInput(f"{what} is empty; name a folder (\".\" for the current one)")
    return user_path(path, what)


def durable(path: Path) -> None:
    """``fsync`` the file or folder at ``path``: its bytes, or its entries
    (names created, renamed or removed in it), are on the device when this
    returns.

    Raises:
        OSError: it cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
