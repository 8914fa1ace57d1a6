"""The shared tier: prompt caches on a Redis server or Redis Cluster, shared by a fleet.

``PromptStore(path, remote="redis://host:port")`` (or ``$PROMPTSTORE_REMOTE``)
keeps its local LMDB store as the first tier; what it puts is published in
the background, and a local miss (or a longer remote match) is fetched,
checked, written locally and restored. Layout of the keys: ``_layout``; the
values: ``_wire``; faults: every one is a miss, counted (``_tier``).
"""

from promptstore.errors import (
    RemoteCorrupt, RemoteError, RemoteFull, RemoteMissing, RemoteRefused, RemoteUnavailable, RemoteURLError,
)
from promptstore.remote._layout import Layout
from promptstore.remote._open import ENV, RemoteTier, open_remote
from promptstore.remote._tier import Found, Key, Remote
from promptstore.remote._url import RemoteURL, parse_url

__all__ = [
    "ENV",
    "Found",
    "Key",
    "Layout",
    "Remote",
    "RemoteCorrupt",
    "RemoteError",
    "RemoteMissing",
    "RemoteFull",
    "RemoteRefused",
    "RemoteTier",
    "RemoteURL",
    "RemoteURLError",
    "RemoteUnavailable",
    "open_remote",
    "parse_url",
]
