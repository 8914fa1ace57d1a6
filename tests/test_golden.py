"""Golden entries of every (kind, codec version) still decode, losslessly."""

from __future__ import annotations

import msgpack
import pytest

from conftest import ROOT
from _samples import assert_same
from promptstore.format import _entry, _payload
from promptstore.codecs import codecs, encode_layer
from promptstore.errors import CorruptEntry

GOLDEN = ROOT / "fixtures" / "golden"


def _files():
    return sorted(GOLDEN.glob("*.msgpack"))


def test_every_codec_version_has_a_golden_file():
    missing = [
        f"{c.kind}.v{v}" for c in codecs() for v in range(1, c.version + 1)
        if not (GOLDEN / f"{c.kind}.v{v}.msgpack").exists()
    ]
    assert not missing, f"run fixtures/make_golden.py and commit: {missing}"


@pytest.mark.parametrize("path", _files(), ids=lambda p: p.stem)
def test_golden_decodes(path):
    doc = msgpack.unpackb(path.read_bytes(), raw=False)
    assert doc["entries"]
    for e, entry in enumerate(doc["entries"]):
        where = f"{path.name} entry {e}"
        man = _entry.unpack_manifest(entry["manifest"], where)
        assert man.intact  # golden manifests carry their checksum
        chunks = entry["chunks"]
        arrays = _payload.read_arrays(man, lambda i: chunks[i] if i < len(chunks) else None, where)
        layers = _entry.decode_layers(man, arrays, where)
        assert [r.kind.split("(")[0] for r in man.layers] == [doc["kind"]] * len(layers)
        for rec, stored, layer in zip(man.layers, arrays, layers):
            enc = encode_layer(layer)
            if enc.version == rec.version:  # same version: re-encoding reproduces the entry
                assert enc.meta == rec.meta and enc.kind == rec.kind
                assert_same(dict(stored), dict(enc.arrays), where)


def test_every_entry_format_has_a_golden_file():
    for fmt in (_entry.BLOB_FORMAT, _entry.BLOCKS_FORMAT, _entry.PACKS_FORMAT):
        assert (GOLDEN / "entry-format" / f"v{fmt}.msgpack").exists(), "run fixtures/make_golden.py and commit"


@pytest.mark.parametrize("path", [GOLDEN / "entry-format" / f"v{_entry.BLOB_FORMAT}.msgpack"], ids=lambda p: p.stem)
def test_golden_blob_entries_read(path, tmp_path):
    """Entries whose payload is in a blob file, as written when the format
    was introduced: the manifest parses, the file reads and checks, the
    layers decode, and re-encoding them gives the stored arrays."""
    from promptstore.format import _blobs

    doc = msgpack.unpackb(path.read_bytes(), raw=False)
    assert doc["entries"]
    blobs = _blobs.Blobs(tmp_path)
    blobs.dir.mkdir()
    for e, entry in enumerate(doc["entries"]):
        where = f"{path.name} entry {e}"
        man = _entry.unpack_manifest(entry["manifest"], where)
        assert man.intact and man.blob == entry["blob_name"]
        (blobs.dir / man.blob).write_bytes(entry["blob"])
        arrays = blobs.read(man, where)
        for rec, stored, layer in zip(man.layers, arrays, _entry.decode_layers(man, arrays, where)):
            enc = encode_layer(layer)
            assert enc.kind == rec.kind and enc.meta == rec.meta
            assert_same(dict(stored), dict(enc.arrays), where)


def test_golden_shared_block_entries_read():
    """Entries whose KV arrays are in shared blocks (format 3), as written when
    the format was introduced: every block checks against its address, the
    arrays assemble and decode, re-encoding gives the stored arrays, and the
    shorter entry of each pair shares the longer one's full blocks."""
    from promptstore.format import _payload
    from promptstore.store._read import assemble

    doc = msgpack.unpackb((GOLDEN / "entry-format" / f"v{_entry.BLOCKS_FORMAT}.msgpack").read_bytes(), raw=False)
    assert doc["format"] == _entry.BLOCKS_FORMAT and len(doc["entries"]) >= 10
    mans = []
    for e, entry in enumerate(doc["entries"]):
        where = f"golden format 3 entry {e}"
        man = _entry.unpack_manifest(entry["manifest"], where)
        assert man.intact and man.bounds and any(True for _ in man.parted())
        blocks = {bytes(k): v for k, v in entry["blocks"]}
        arrays = _payload.read_arrays(man.payload_only(), lambda i: entry["chunks"][i], where)
        assemble(blocks.get, man, arrays, where)
        for rec, stored, layer in zip(man.layers, arrays, _entry.decode_layers(man, arrays, where)):
            enc = encode_layer(layer)
            assert enc.kind == rec.kind and enc.meta == rec.meta
            assert_same(dict(stored), dict(enc.arrays), where)
        mans.append(man)
    for long_, short in zip(mans[::2], mans[1::2]):
        # Every block the shorter entry has whole is the longer one's; a block cut short is its own.
        same = [i for i, end in enumerate(short.bounds) if long_.bounds[i] == end]
        assert len(same) >= len(short.bounds) - 1
        for (_, a), (_, b) in zip(long_.parted(), short.parted()):
            assert [a.parts[i] == b.parts[i] for i in range(len(short.bounds))] == [i in same for i in range(len(short.bounds))]


@pytest.mark.parametrize("damage", ["text", "short", "long", "missing", "extra", "not-a-list"])
def test_malformed_block_references_are_refused(damage):
    """A manifest whose block references are not one 16-byte address per
    block bound is damaged: refused, whatever the damage."""
    doc = msgpack.unpackb((GOLDEN / "entry-format" / f"v{_entry.BLOCKS_FORMAT}.msgpack").read_bytes(), raw=False)
    raw = doc["entries"][0]["manifest"]
    assert _entry.unpack_manifest(raw, "golden").intact
    man = msgpack.unpackb(raw, raw=False)
    arrays = [ra for layer in man["layers"] for ra in layer["arrays"] if len(ra) == 7]
    parts = arrays[0][6]
    assert parts and all(isinstance(k, bytes) and len(k) == _entry.ADDRESS for k in parts)
    arrays[0][6] = {
        "text": parts[:-1] + [parts[-1].hex()[:16]],
        "short": parts[:-1] + [parts[-1][:-1]],
        "long": parts[:-1] + [parts[-1] + b"\0"],
        "missing": parts[:-1],
        "extra": parts + parts[-1:],
        "not-a-list": parts[0],
    }[damage]
    with pytest.raises(CorruptEntry, match="malformed block references"):
        _entry.unpack_manifest(msgpack.packb(man, use_bin_type=True), "golden")


def test_golden_pack_entries_read(tmp_path):
    """Entries of format 4, whose shared blocks are in pack files, as written
    when the format was introduced: every block is read from its pack and
    checks against its address, the arrays decode, and re-encoding them gives
    the stored arrays."""
    import os

    from promptstore.format import _payload
    from promptstore.store._read import InFile, assemble

    doc = msgpack.unpackb((GOLDEN / "entry-format" / f"v{_entry.PACKS_FORMAT}.msgpack").read_bytes(), raw=False)
    assert doc["format"] == _entry.PACKS_FORMAT and len(doc["entries"]) >= 6 and doc["packs"]
    fds = {}
    for name, data in doc["packs"].items():
        (tmp_path / name).write_bytes(data)
        fds[name] = os.open(tmp_path / name, os.O_RDONLY)
    try:
        for e, entry in enumerate(doc["entries"]):
            where = f"golden format 4 entry {e}"
            man = _entry.unpack_manifest(entry["manifest"], where)
            assert man.intact and man.bounds
            places = {bytes(k): InFile(fds[pack], offset) for k, pack, offset in entry["blocks"]}
            arrays = _payload.read_arrays(man.payload_only(), lambda i: entry["chunks"][i], where)
            assemble(places.get, man, arrays, where)
            for rec, stored, layer in zip(man.layers, arrays, _entry.decode_layers(man, arrays, where)):
                enc = encode_layer(layer)
                assert enc.kind == rec.kind and enc.meta == rec.meta
                assert_same(dict(stored), dict(enc.arrays), where)
    finally:
        for fd in fds.values():
            os.close(fd)
