"""Child process of ``promptstore bench``: one throughput case in a fresh process.

Run as ``python -m promptstore.bench._child WORKDIR SHAPE_JSON TOKENS REPEATS``;
prints the case's JSON. A fresh process per case keeps one case's heap and
mlx buffer cache out of the next, and lets the bench measure the same case
under another environment (e.g. ``GLIBC_TUNABLES``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict

from promptstore.bench import _cases as cases
from promptstore.bench import _data as data


def main(argv) -> None:
    workdir, shape, n_tokens, repeats = argv
    shape_kw: Dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(shape).items()}
    out = cases.throughput(Path(workdir), data.Shape(**shape_kw), int(n_tokens), int(repeats))
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
