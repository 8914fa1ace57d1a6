"""Platform folders: where promptstore keeps its default store and caches."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["cache_root", "default_path"]


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
        return Path(env).expanduser()
    legacy = Path.home() / ".cache" / "promptstore"
    if not os.environ.get("XDG_CACHE_HOME") and legacy.is_dir():
        return legacy
    return cache_root() / "promptstore"
