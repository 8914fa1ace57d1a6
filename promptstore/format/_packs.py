"""Pack files: the shared blocks one put adds, back to back in one file.

A put that adds at least :data:`MIN_BYTES` of new shared blocks writes them
to a new pack file in ``<store>/packs/`` instead of into LMDB: LMDB copies a
value into a malloc'd dirty page and again into the page cache at commit,
where a file write copies once (``format._blobs`` says why that matters);
and a restore reads a pack with ``preadv`` straight into the destination,
as it reads a blob. Fewer new bytes stay LMDB values (a file and two fsyncs
cost more than they save there).

The store keeps, in the transaction that commits the manifests referencing
them, where each block is (``places``: pack and offset) and how many of a
pack's bytes are still referenced (``packs``); ``store._write`` has the
bookkeeping. The rules that keep a pack as safe as a blob file:

- A pack is created, written and fsynced (with its directory) under the
  writer lock, inside the transaction that records it; a crash before the
  commit leaves a pack no record names, removed by ``gc`` and
  ``verify --fix`` under the writer lock. A retried transaction writes a new
  pack.
- A pack is unlinked only after the commit that dropped its last
  referenced block; a reader on an older snapshot then finds no file
  (:class:`~promptstore.format._blobs.Vanished`) and looks again.
- Names are never reused (64 random bits, created with ``O_EXCL``).
- Every block is checked against its address whenever it is read.

A pack ends with a footer naming its blocks (address and size of each, in
file order, then their count and a magic string), so that ``salvage`` can
find every block of a store whose data file lost the records that say where
they are.

Dead bytes (blocks no entry references any more, in a pack that still has
live ones) stay on disk until the pack's last block goes, or until the pack is
rewritten (``store._packing``).
"""

from __future__ import annotations

import os
import secrets
import struct
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

from promptstore.errors import StoreError
from promptstore.format._blobs import Blobs, Vanished

MIN_BYTES = 64 << 10  # a put's new blocks of at least this many bytes go to a pack file
DIRNAME = "packs"
SUFFIX = ".pack"
_HEX = frozenset("0123456789abcdef")
MAGIC = b"PSPACK01"
_ITEM = struct.Struct(">16sQ")  # address, size
_TAIL = struct.Struct(">Q8s")  # count, magic


def footer(blocks: Sequence[Tuple[bytes, int]]) -> bytes:
    """The footer of a pack holding ``blocks`` (address, size) back to back from offset 0."""
    return b"".join(_ITEM.pack(key, size) for key, size in blocks) + _TAIL.pack(len(blocks), MAGIC)


def parse_footer(data: bytes, file_size: int) -> Optional[List[Tuple[bytes, int, int]]]:
    """``(address, offset, size)`` of each block a pack's footer names, from
    the file's last bytes ``data`` (at least the whole footer); None when
    there is no intact footer."""
    if len(data) < _TAIL.size:
        return None
    n, magic = _TAIL.unpack(data[-_TAIL.size :])
    need = n * _ITEM.size + _TAIL.size
    if magic != MAGIC or need > len(data) or need > file_size:
        return None
    out, offset = [], 0
    body = data[len(data) - need : len(data) - _TAIL.size]
    for i in range(n):
        key, size = _ITEM.unpack_from(body, i * _ITEM.size)
        out.append((key, offset, size))
        offset += size
    if offset + need != file_size:
        return None
    return out


def name(pack: int) -> str:
    return f"{pack:016x}{SUFFIX}"


def pack_of(filename: str) -> Optional[int]:
    """The pack number of a pack file name, or None for any other name."""
    head = filename[: -len(SUFFIX)]
    if filename.endswith(SUFFIX) and len(head) == 16 and set(head) <= _HEX:
        return int(head, 16)
    return None


class Packs:
    """The pack files of one store (``<store>/packs``)."""

    def __init__(self, root: Path):
        self.files = Blobs(root, DIRNAME, lambda n: pack_of(n) is not None, "pack file")

    @staticmethod
    def new_number() -> int:
        return secrets.randbits(64) or 1

    def write(self, pack: int, views, blocks: Sequence[Tuple[bytes, int]]) -> None:
        """Write ``views`` (the bytes of ``blocks``: address, size) back to
        back to a new pack file, and its footer, durably (see ``Blobs.write``)."""
        self.files.write(name(pack), list(views) + [memoryview(footer(blocks))])

    def contents(self, pack: int, where: str) -> Optional[List[Tuple[bytes, int, int]]]:
        """What a pack's footer says it holds (see :func:`parse_footer`); None without one."""
        fd = self.open(pack, where)
        try:
            size = os.fstat(fd).st_size
            tail = os.pread(fd, min(size, _TAIL.size), max(0, size - _TAIL.size))
            if len(tail) < _TAIL.size or tail[-8:] != MAGIC:
                return None
            n = _TAIL.unpack(tail)[0]
            need = min(size, n * _ITEM.size + _TAIL.size)
            return parse_footer(os.pread(fd, need, size - need), size)
        except OSError as err:
            raise StoreError(f"{where}: cannot read pack file {name(pack)} ({err})") from err
        finally:
            os.close(fd)

    def footers(self, where: str) -> Iterator[Tuple[int, bytes, int, int]]:
        """``(pack, address, offset, size)`` of every block the pack files'
        footers name; packs without an intact or readable footer, and a
        directory that cannot be listed, give none."""
        try:
            numbers = self.numbers()
        except StoreError:
            return
        for pack in numbers:
            try:
                held = self.contents(pack, where)
            except StoreError:
                continue
            for key, offset, size in held or ():
                yield pack, key, offset, size

    def unlink(self, pack: int) -> None:
        self.files.unlink(name(pack))

    def numbers(self) -> List[int]:
        """The packs present (StoreError when the directory cannot be listed)."""
        return [p for p in (pack_of(n) for n in self.files.names()) if p is not None]

    def nbytes(self) -> int:
        return self.files.nbytes()

    def open(self, pack: int, where: str) -> int:
        """A read-only descriptor of ``pack``.

        Raises:
            Vanished: no such file.
            StoreError: it cannot be opened.
        """
        path = self.files.path(name(pack))
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as err:
            raise Vanished(f"{where}: pack file {name(pack)} is missing", name(pack)) from err
        except OSError as err:
            raise StoreError(f"{where}: cannot open pack file {name(pack)} ({err})") from err

    def read(self, pack: int, offset: int, size: int, where: str) -> bytes:
        """``size`` bytes at ``offset`` of a pack (fewer when the file is short)."""
        fd = self.open(pack, where)
        try:
            return os.pread(fd, size, offset)
        except OSError as err:
            raise StoreError(f"{where}: cannot read pack file {name(pack)} ({err})") from err
        finally:
            os.close(fd)
