"""Walking every table of a data file in a child process, before ``verify`` reads it.

LMDB checks some page types with assertions (``mdb_cursor_next`` asserts
that the page it moved to is a leaf), and a failed assertion aborts the
process. A read that looks entries up by key rarely meets such a page; a
walk over whole tables does, so ``verify``, the command meant for a damaged
store, died on one without a word. It now walks every table in a child
first, keys only, as it then reads them itself: a child that dies, or that
LMDB refuses, is reported as :class:`StoreUnavailable`, pointing at
``salvage``, as a read of such a file is.

The child opens the environment read-only, with the lock file, as another
reader would, and reads the tables through the snapshot of its one
transaction: a writer in another process is not disturbed, and what it
commits meanwhile is not read.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from promptstore.errors import StoreUnavailable
from promptstore.store._schema import DUPSORT, TABLES

log = logging.getLogger("promptstore")

# Run as ``python -I -c _CHILD DIR MAX_DBS NAMES DUPSORT``: exit 0 when every
# table was walked; LMDB's error on stderr and exit 3 when it refused a page,
# 4 when it could not open the file at all (a folder this user may not lock:
# the walk in this process says what is wrong).
_CHILD = r"""
import sys
import lmdb
where, max_dbs, names, dupsort = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), set(sys.argv[4].split(","))
try:
    env = lmdb.open(where, readonly=True, max_dbs=max_dbs, subdir=True, max_readers=1024)
except lmdb.Error as err:
    sys.stderr.write(f"{type(err).__name__}: {err}")
    sys.exit(4)
try:
    with env.begin(buffers=True) as txn:
        for name in names:
            try:
                db = env.open_db(name.encode(), txn=txn, create=False, dupsort=name in dupsort)
            except lmdb.NotFoundError:
                continue
            for _ in txn.cursor(db=db).iternext(keys=True, values=False):
                pass
except lmdb.Error as err:
    sys.stderr.write(f"{type(err).__name__}: {err}")
    sys.exit(3)
"""


def walk_tables(where: Path) -> None:
    """Walk every table of the data file in folder ``where`` in a child process.

    Raises:
        StoreUnavailable: LMDB aborted the child, or refused a page of the file.
    """
    data = where / "data.mdb"
    argv = [sys.executable, "-I", "-c", _CHILD, str(where), str(len(TABLES) + 1),
            ",".join(n.decode() for n in TABLES), ",".join(n.decode() for n in DUPSORT)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
    except OSError as err:  # no interpreter to run (an embedded one): verify goes on without the walk
        log.warning("promptstore: cannot walk %s in a child process (%s); verify reads it in this one", data, err)
        return
    if proc.returncode == 0:
        return
    if proc.returncode < 0 or proc.returncode == 3:
        what = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        if proc.returncode < 0:
            what = f"LMDB aborted reading it: {what} (signal {-proc.returncode})"
        raise StoreUnavailable(
            f"{data}: the data file is damaged ({what}); `promptstore salvage {where} NEW_DIR` "
            "copies every entry that survives into a new store"
        )
    log.warning("promptstore: the walk of %s in a child process failed (exit %d: %s); verify reads it in this one",
                data, proc.returncode, proc.stderr.strip()[-300:])
