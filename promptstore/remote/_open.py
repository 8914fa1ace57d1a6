"""What a PromptStore holds when it has a remote: the tier and its publisher."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence, Union

from promptstore.codecs import Encoded
from promptstore.remote._publisher import QUEUE, Publisher
from promptstore.remote._tier import Key, Remote
from promptstore.errors import RemoteURLError
from promptstore.remote._url import RemoteURL

ENV = "PROMPTSTORE_REMOTE"
CLOSE_FLUSH = 30.0  # seconds close() waits for pending publishes


class RemoteTier:
    """A :class:`Remote` plus write-behind publishing through a bounded queue.

    Args:
        url: ``redis://[user:password@]host:port[/db][?ns=NAME&timeout=S]`` or ``rediss://``.
        queue: entries waiting to be published, at most; more are dropped.
    """

    def __init__(self, url: Union[str, RemoteURL], queue: int = QUEUE):
        self.remote = Remote(url)
        self.publisher = Publisher(self.remote, queue)

    @property
    def url(self) -> RemoteURL:
        return self.remote.url

    def publish_later(self, key: Key, name: str, layers: Sequence[Encoded], trimmable: bool,
                      meta: Dict[str, Any], created: float) -> bool:
        """Queue one entry for publishing; never waits. False: dropped (queue full)."""
        return self.publisher.submit(lambda: self.remote.publish(key, name, layers, trimmable, meta, created))

    def flush(self, timeout: float = CLOSE_FLUSH) -> bool:
        """Wait (at most ``timeout`` s) until every queued entry is published or failed."""
        return self.publisher.flush(timeout)

    def stats(self) -> Dict[str, int]:
        s = self.remote.stats()
        s["pending"] = self.publisher.pending()
        return s

    def close(self, timeout: float = CLOSE_FLUSH) -> None:
        self.publisher.close(timeout)
        self.remote.close()


def open_remote(remote: Union[str, bool, RemoteURL, None]) -> Optional[RemoteTier]:
    """The tier a store's ``remote=`` names: None reads ``$PROMPTSTORE_REMOTE``;
    False or ``""`` means none.

    Raises:
        RemoteURLError: a URL the tier cannot use.
    """
    if remote is None:
        remote = os.environ.get(ENV, "")
    if remote is False or remote == "":
        return None
    if remote is True:  # it read as "no remote", whatever $PROMPTSTORE_REMOTE said
        raise RemoteURLError("remote=True names no URL: pass the URL, or None to use $PROMPTSTORE_REMOTE")
    if not isinstance(remote, (str, RemoteURL)):
        raise RemoteURLError(f"remote must be a URL (str), False or None, not {type(remote).__name__}")
    return RemoteTier(remote)
