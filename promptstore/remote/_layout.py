"""The key layout of the remote tier: every key name is made here.

All keys start with the namespace (``ns``, from the URL). No hash tags: the
blocks of one entry spread over the cluster's slots, so a fetch reads from
every master at once.

==============================  =======  ==================================================
key                             type     value
==============================  =======  ==================================================
``ns:b:<address>``              string   a block: bytes of one array's token range (or of
                                         one piece of an array that spans no tokens). The
                                         address is the xxh3-128 of kind, codec version,
                                         dtype, shape and bytes (``format._blocks``):
                                         immutable, written only when absent, checked on
                                         every read.
``ns:m:<entry key>``            string   an entry's manifest (``_wire``): magic, xxh3-64,
                                         msgpack. The entry key is the local one (model id
                                         + token digest + count).
``ns:e:<model id>:<hash>:<k>``  hash     entry ends: under the node of an entry's last
                                         whole ``NODE``-token prefix (k nodes, ``hash`` the
                                         prefix hash of its ``k*NODE`` tokens), field
                                         entry key, value ``n:<prefix hash of all n tokens>``.
``ns:t:<model id>:<hash>:<k>``  string   one trimmable entry passing through node k (the
                                         latest published), for a longer trimmable match.
==============================  =======  ==================================================

A lookup of L tokens reads one ``e`` and one ``t`` key per node from the local
match's node to ``L // NODE``, pipelined: its cost grows with the query, never
with the number of entries. Model identity is in every index key and in the
manifest, which is checked against the model asked for.
"""

from __future__ import annotations

NODE = 64  # tokens per index node
ENTRY_KEY = 36  # bytes of a local entry key


class Layout:
    """Key names under one namespace."""

    def __init__(self, namespace: str):
        self.ns = namespace
        self._pre = f"{namespace}:".encode()

    def block(self, address: bytes) -> bytes:
        return self._pre + b"b:" + address.hex().encode()

    def manifest(self, ekey: bytes) -> bytes:
        return self._pre + b"m:" + ekey.hex().encode()

    def ends(self, mid: bytes, node_hash: int, k: int) -> bytes:
        return self._pre + f"e:{mid.hex()}:{node_hash:016x}:{k}".encode()

    def trims(self, mid: bytes, node_hash: int, k: int) -> bytes:
        return self._pre + f"t:{mid.hex()}:{node_hash:016x}:{k}".encode()

    def manifest_pattern(self) -> bytes:
        """SCAN pattern of every manifest of the namespace (``ls --remote``)."""
        return self._pre + b"m:*"

    def block_pattern(self) -> bytes:
        return self._pre + b"b:*"

    def ekey_of(self, manifest_key: bytes) -> bytes:
        """The entry key a manifest key names.

        Raises:
            ValueError: not a manifest key of this namespace.
        """
        head = self._pre + b"m:"
        if not manifest_key.startswith(head):
            raise ValueError(f"{manifest_key!r} is not a manifest key of namespace {self.ns!r}")
        ekey = bytes.fromhex(manifest_key[len(head):].decode())
        if len(ekey) != ENTRY_KEY:
            raise ValueError(f"{manifest_key!r}: entry key of {len(ekey)} bytes")
        return ekey
