"""A folder whose data.mdb is another program's LMDB database.

Every command refuses it as "not a promptstore store", the API raises
StoreUnavailable, and the other program's file is left as it was: a write
no longer adds the store's tables to it (found by a reviewer: reads failed
with LMDB's bare MDB_NOTFOUND, and a put converted the file).
"""

from __future__ import annotations

import hashlib

import lmdb
import pytest
from conftest import MODELS
from test_cli_newcomer import error

from promptstore import PromptStore
from promptstore.bench import _data as data
from promptstore.errors import StoreUnavailable


def _foreign(path):
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 24)
    users = env.open_db(b"users")
    with env.begin(write=True) as txn:
        txn.put(b"alice", b"1", db=users)
    env.close()
    return hashlib.sha256((path / "data.mdb").read_bytes()).hexdigest()


@pytest.mark.parametrize("readonly", [False, True])
def test_the_api_refuses_another_programs_lmdb_file(tmp_path, readonly):
    before = _foreign(tmp_path / "db")
    with pytest.raises(StoreUnavailable, match="is an LMDB database, but not a promptstore store .*'users'"):
        PromptStore(tmp_path / "db", readonly=readonly)
    assert hashlib.sha256((tmp_path / "db" / "data.mdb").read_bytes()).hexdigest() == before
    assert not (tmp_path / "db" / "STORE_ID").exists()


@pytest.mark.parametrize("command", [["ls"], ["stats"], ["verify"], ["verify", "--fix"], ["gc", "--budget", "1MB", "--yes"], ["rm", "--older-than", "1d", "--yes"], ["put", "--model", str(MODELS / "llama"), "--prompt", "x"]])
def test_commands_refuse_another_programs_lmdb_file(tmp_path, command):
    before = _foreign(tmp_path / "db")
    doc = error(tmp_path / "db", *command)
    assert "not a promptstore store" in doc["message"]
    assert hashlib.sha256((tmp_path / "db" / "data.mdb").read_bytes()).hexdigest() == before


def test_a_new_store_and_an_existing_one_still_open(tmp_path):
    with PromptStore(tmp_path / "new") as store:
        store.put("m", [1, 2, 3], data.tiny_kv(3))
    with PromptStore(tmp_path / "new", readonly=True) as store:
        assert store.get("m", [1, 2, 3]) is not None


def test_an_empty_data_file_is_not_a_store_to_read(tmp_path):
    """Read-only, LMDB cannot start an empty file and said "Bad file descriptor"."""
    (tmp_path / "db").mkdir()
    (tmp_path / "db" / "data.mdb").touch()
    doc = error(tmp_path / "db", "ls")
    assert "not a promptstore store (its data.mdb is empty)" in doc["message"]
    assert (tmp_path / "db" / "data.mdb").stat().st_size == 0
