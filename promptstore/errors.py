"""The one error tree of promptstore.

Every error promptstore raises on purpose is a :class:`PromptStoreError`.
Messages say what failed, where (path or key) and what to do about it.

::

    PromptStoreError
    ├── InvalidInput            (also ValueError) a bad argument from the caller
    ├── CoverageMismatch        a layer covers a different number of tokens than given
    ├── ModelMismatch           an entry belongs to another model identity
    ├── EntryNotFound           (also KeyError) no entry under that key
    ├── CodecError              a layer cannot be encoded or decoded
    │   ├── UnknownStorageKind  unregistered class or kind string
    │   │   └── MissingCapability   (also InvalidInput) the exact class's codec cannot do this
    │   └── UnsupportedVersion  a codec or format version newer than this reader
    ├── CorruptEntry            checksum, size or manifest damage in one entry
    ├── RoundError              a speculative verify round used out of order
    ├── StoreError              the LMDB environment itself
    │   ├── StoreFull           disk or map full
    │   └── StoreUnavailable    cannot open, wrong process (fork), file damaged
    └── RemoteError             the shared (remote) tier failed; the local tier answers
        ├── RemoteUnavailable   cannot connect, timed out, node or cluster down
        ├── RemoteCorrupt       (also CorruptEntry) a value fails its check
        ├── RemoteMissing       a manifest names a block the remote no longer holds
        ├── RemoteRefused       the remote refused a write (read-only replica, MISCONF, NOPERM)
        │   └── RemoteFull      its memory is full (noeviction)
        └── RemoteURLError      (also InvalidInput) a remote URL the tier cannot use
"""

from __future__ import annotations

__all__ = [
    "PromptStoreError",
    "InvalidInput",
    "CoverageMismatch",
    "ModelMismatch",
    "EntryNotFound",
    "CodecError",
    "UnknownStorageKind",
    "MissingCapability",
    "UnsupportedVersion",
    "CorruptEntry",
    "RoundError",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "StoreClosed",
    "RemoteError",
    "RemoteUnavailable",
    "RemoteCorrupt",
    "RemoteMissing",
    "RemoteRefused",
    "RemoteFull",
    "RemoteURLError",
]


class PromptStoreError(Exception):
    """Base class of every error promptstore raises on purpose."""


class InvalidInput(PromptStoreError, ValueError):
    """An argument from the caller is malformed (empty model id, bad tokens...)."""


class CoverageMismatch(PromptStoreError):
    """A layer's coverage differs from the number of tokens the entry claims.

    Writing such an entry would corrupt every later hit, so nothing is written.
    """


class ModelMismatch(PromptStoreError):
    """An entry was made by another model identity than the one asked for."""


class EntryNotFound(PromptStoreError, KeyError):
    """No entry exists under the given key."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CodecError(PromptStoreError):
    """A layer cache cannot be encoded or decoded."""


class UnknownStorageKind(CodecError):
    """The cache class or storage-kind string has no registered codec."""


class MissingCapability(UnknownStorageKind, InvalidInput):
    """No codec, or no capability of its codec, serves this exact cache class
    (rows of a batch, trim, speculative rounds, ...).

    An UnknownStorageKind (nothing registered for exactly this class can do
    it) and an InvalidInput (the caller passed a layer the operation cannot
    take), so callers that catch either keep working.
    """


class UnsupportedVersion(CodecError):
    """A codec or entry-format version is newer than this reader understands."""


class CorruptEntry(PromptStoreError):
    """An entry's manifest or payload is damaged (checksum, size, structure)."""


class RoundError(PromptStoreError):
    """A speculative round of an SSMCache was used out of order.

    Raised for ``commit``/``rollback`` without ``begin_round``, a second window
    call in one round, a row move or persistence while a round is open, and a
    slot written behind the cache's back during a round (install the adapter).
    """


class StoreError(PromptStoreError):
    """The LMDB environment failed as a whole."""


class StoreFull(StoreError):
    """The disk or the LMDB map is full; nothing of the failed write was kept."""


class StoreUnavailable(StoreError):
    """The store cannot be opened or used from here (damaged file, forked process)."""


class StoreClosed(PromptStoreError):
    """The PromptStore was closed (maybe by another thread while this
    operation, made of several transactions, was between two of them)."""


class RemoteError(PromptStoreError):
    """The shared (remote) tier failed; nothing it sent was used."""

    kind = "error"


class RemoteUnavailable(RemoteError):
    """The remote cannot be reached in time (refused, timed out, node or cluster down)."""

    kind = "unavailable"


class RemoteCorrupt(RemoteError, CorruptEntry):
    """A value read from the remote fails its check (magic, checksum, size,
    field, or a block whose bytes do not hash to its address)."""

    kind = "corrupt"


class RemoteMissing(RemoteError):
    """A remote manifest names a block the remote no longer holds (evicted or deleted)."""

    kind = "missing"


class RemoteRefused(RemoteError):
    """The remote answered a write with an error reply: a read-only replica
    (``READONLY``), a master that stopped accepting writes (``MISCONF``,
    ``NOREPLICAS``), a user without write permission (``NOPERM``). The
    publish is counted and dropped; reads go on, without a cool-down."""

    kind = "refused"


class RemoteFull(RemoteRefused):
    """The remote refused a write because its memory is full (``maxmemory``
    with the ``noeviction`` policy, Redis's ``OOM`` reply): the publish is
    counted and dropped; reads go on."""

    kind = "full"


class RemoteURLError(InvalidInput, RemoteError):
    """A remote URL the tier cannot use (scheme, host, port, db, namespace).

    Raised when the URL is given, or, for what only the server can tell (a
    ``/db`` other than 0 on a Redis Cluster), when the tier first connects:
    a store's reads then go on without the remote, as when it is unreachable."""

    kind = "url"
