"""Remote URLs: ``redis://[user:password@]host:port[/db][?ns=NAME&timeout=SECONDS]``.

``rediss://`` is the same over TLS. ``ns`` is the namespace (the key
prefix, default ``promptstore``): deployments that share one cluster keep
apart by it. ``timeout`` bounds every network call (seconds, default 2).
A Redis Cluster is discovered from the one node named; ``db`` must then be 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional
from urllib.parse import parse_qs, unquote, urlsplit

from promptstore.errors import RemoteURLError

DEFAULT_NAMESPACE = "promptstore"
DEFAULT_TIMEOUT = 2.0
_NS = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class RemoteURL:
    """A parsed remote URL; ``str()`` of it hides the password."""

    host: str
    port: int
    tls: bool = False
    username: Optional[str] = None
    password: Optional[str] = None
    db: int = 0
    namespace: str = DEFAULT_NAMESPACE
    timeout: float = DEFAULT_TIMEOUT

    def __str__(self) -> str:
        auth = ""
        if self.username or self.password:
            auth = f"{self.username or ''}{':***' if self.password else ''}@"
        scheme = "rediss" if self.tls else "redis"
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6, as a URL writes it (and parse_url reads it)
        return f"{scheme}://{auth}{host}:{self.port}/{self.db}?ns={self.namespace}"


def parse_url(url: str) -> RemoteURL:
    """Parse a ``redis://`` or ``rediss://`` URL.

    Raises:
        RemoteURLError: another scheme, no host, a bad port, db or namespace.
    """
    if not isinstance(url, str) or not url.strip():
        raise RemoteURLError("the remote URL is empty; expected redis://[user:password@]host:port[/db]")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as err:
        raise RemoteURLError(f"{_hide(url)}: {err}; expected redis://[user:password@]host:port[/db]") from err
    if parts.scheme not in ("redis", "rediss"):
        raise RemoteURLError(f"{_hide(url)}: the scheme must be redis:// or rediss:// (TLS), not {parts.scheme!r}")
    if not parts.hostname:
        raise RemoteURLError(f"{_hide(url)}: no host; expected redis://[user:password@]host:port[/db]")
    if port == 0:  # urlsplit reads ":0" and ":00" as 0, which "or 6379" would have turned into the default
        raise RemoteURLError(f"{_hide(url)}: port 0 is not a port; expected redis://[user:password@]host:port[/db]")
    path = parts.path.strip("/")
    if path and not (path.isascii() and path.isdigit()):  # str.isdigit alone takes other scripts' digits
        raise RemoteURLError(f"{_hide(url)}: the path must be a database number (/0), not {path!r}")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = set(query) - {"ns", "timeout"}
    if unknown:
        raise RemoteURLError(f"{_hide(url)}: unknown parameter(s) {', '.join(sorted(unknown))}; known: ns, timeout")
    ns = query.get("ns", [DEFAULT_NAMESPACE])[-1]
    if not _NS.match(ns):
        raise RemoteURLError(f"{_hide(url)}: namespace {ns!r} must be 1-64 of A-Z a-z 0-9 _ . -")
    try:
        timeout = float(query.get("timeout", [DEFAULT_TIMEOUT])[-1])
    except ValueError as err:
        raise RemoteURLError(f"{_hide(url)}: timeout must be seconds: {err}") from err
    if not 0 < timeout <= 600:
        raise RemoteURLError(f"{_hide(url)}: timeout must lie in (0, 600] seconds")
    return RemoteURL(
        host=parts.hostname,
        port=6379 if port is None else port,
        tls=parts.scheme == "rediss",
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
        db=int(path) if path else 0,
        namespace=ns,
        timeout=timeout,
    )


def _hide(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)
