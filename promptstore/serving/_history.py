"""The bounded checkpoint history of caches that cannot be trimmed.

Shared blocks store each token's KV once, however many entries of a
conversation cover it, but recurrent state (``ssm.gated_delta``, ``arrays``)
cannot be shared between coverages: every checkpoint of a hybrid
conversation carries all of it. So, after the writer thread commits an
entry that cannot be trimmed, :class:`History` prunes its *chain*:

* the chain: the stored entries of the same model whose tokens are a prefix
  of the new entry's (``PromptStore.prefixes``; the entry itself included).
  Its cost grows with the entry's length, never with the number of entries;
* governed: chain entries this serving cache wrote (meta ``source`` is
  ``promptstore.serving``), that cannot be trimmed, are not the
  system-prompt checkpoint (meta ``cache_type`` ``"system"``) and are not
  pinned;
* kept: the ``keep`` longest governed entries (the latest turn boundaries,
  the new entry first among them); the rest of the governed entries are
  deleted, in one transaction. Everything not governed is left alone: the
  system-prompt checkpoint, pinned entries, trimmable entries (their KV is
  shared, they cost little) and entries written by anyone else (``promptstore
  put``, warm-up jobs, imports).

Superseded checkpoints of a chain are the ones deleted; a conversation that
branched off (another chat sharing the system prompt, an edited turn) is a
chain of its own past the branch point and is pruned only by its own writes.

One branch is superseded too: an answer checkpoint (``cache_type``
``"assistant"``) whose parent, the governed checkpoint it extends, is in the
chain of a later write while the answer itself is not. That is what a
client leaves that sends the answer back as text which tokenizes otherwise
(a leading space the server dropped, reasoning a template strips), and what
a regenerated answer leaves: without this, each turn of such a conversation
kept one more checkpoint for good. An answer written after such an answer
(a thinking model's: mlx-lm checkpoints the prompt but its last token, typed
by its "<think>" tail, then the answer after it, and the next prompt renders
the answer without its reasoning) goes with it. Parents are remembered in this process
only (the latest :data:`_ANSWERS`), so after a restart such an answer stays
until the byte budget evicts it. Two conversations whose turns share a
checkpoint (the same first user message) share its answers' parent: a write
of one prunes the other's answer to it, which costs the other the prefill of
that answer again, never a wrong restore.
An entry shared by two chains (e.g. the same first user turn) is deleted
when it falls out of the latest ``keep`` of either. Pruning never raises:
failures are logged and counted.
"""

from __future__ import annotations

import logging
import numbers
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from promptstore.errors import InvalidInput, PromptStoreError
from promptstore.store import EntryInfo, PromptStore, _keys

__all__ = ["History", "DEFAULT_CHECKPOINTS", "SOURCE", "checkpoint_limit"]

log = logging.getLogger("promptstore")

SOURCE = "promptstore.serving"  # meta["source"] of every entry the serving cache writes
DEFAULT_CHECKPOINTS = 4  # two turns: a user boundary and an answer each
_ANSWERS = 4096  # parents remembered, each with the answer checkpoints written after it


def checkpoint_limit(value: Any) -> int:
    """``value`` as a history bound: a count of checkpoints, 0 for unbounded.

    Raises:
        InvalidInput: not None and not an integer >= 0.
    """
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InvalidInput(
            f"checkpoints must be a number of checkpoints >= 0 (0 or None keeps every one), not {value!r}"
        )
    return int(value)


def governed(info: EntryInfo) -> bool:
    """Whether the history policy may delete ``info`` (pins aside)."""
    meta = info.meta if isinstance(info.meta, dict) else {}
    return not info.trimmable and meta.get("source") == SOURCE and meta.get("cache_type") != "system"


class History:
    """Prunes the checkpoint chain of each untrimmable entry the serving cache writes.

    Args:
        store: the PromptStore the entries are in.
        keep: the most governed checkpoints a chain keeps; 0 keeps every one.
        on_removed: called with ``(model, tokens)`` of each deleted entry.

    Runs on the writer thread; :meth:`prune` never raises.
    """

    def __init__(self, store: PromptStore, keep: int, on_removed: Optional[Callable[[str, np.ndarray], None]] = None):
        self.store = store
        self.keep = checkpoint_limit(keep)
        self._on_removed = on_removed
        self.pruned = 0  # entries deleted
        self.failed = 0  # prunes that failed (logged)
        # (model, parent's length, its prefix hash) -> the answer checkpoints written after it, with their tokens
        self._answers: "OrderedDict[Tuple[str, int, int], List[Tuple[EntryInfo, np.ndarray]]]" = OrderedDict()

    def superseded(self, chain: Sequence[EntryInfo], pinned: Callable[[], Sequence[str]]) -> List[EntryInfo]:
        """The entries of ``chain`` the policy deletes, longest first.

        ``pinned`` lists the pinned ids; it is called only when there is
        something to delete.
        """
        mine = sorted((e for e in chain if governed(e)), key=lambda e: e.n_tokens, reverse=True)
        if len(mine) <= self.keep:
            return []
        pins = set(pinned())
        return [e for e in mine if e.id not in pins][self.keep:]

    def _diverged(self, chain: Sequence[EntryInfo], info: EntryInfo,
                  tokens: np.ndarray) -> Dict[str, Tuple[EntryInfo, np.ndarray]]:
        """The answer checkpoints (with their tokens) whose parent's tokens
        begin ``tokens`` but which are not in ``chain``, and the answers
        written after those, which diverged with them; and remember ``info``
        under its parent when it is an answer checkpoint extending a governed
        one. Parents are matched by their tokens (found by their prefix
        hash), so an answer is found even when its parent entry was pruned
        since. An answer still in the chain stays remembered: a later write
        may leave it."""
        toks = np.asarray(tokens, dtype=np.uint32)
        hashes = _keys.prefix_hashes(toks)
        ids = {e.id for e in chain}
        out: Dict[str, Tuple[EntryInfo, np.ndarray]] = {}
        parents = [k for k in self._answers if k[0] == info.model and k[1] < len(hashes) and int(hashes[k[1]]) == k[2]]
        todo: List[np.ndarray] = []  # tokens of diverged answers, whose own answers diverged too
        for k in parents:
            kept = []
            for child, ctoks in self._answers.pop(k):
                if child.id in ids or child.id == info.id or not np.array_equal(ctoks[: k[1]], toks[: k[1]]):
                    kept.append((child, ctoks))  # in the chain (the keep rule governs it), or another parent's under one hash
                else:
                    out[child.id] = (child, ctoks)
                    todo.append(ctoks)
            if kept:
                self._answers[k] = kept
        while todo:
            ptoks = todo.pop()
            k = (info.model, len(ptoks), int(_keys.prefix_hashes(ptoks.astype(np.uint32))[len(ptoks)]))
            kept = []
            for child, ctoks in self._answers.pop(k, []):
                if child.id in ids or child.id == info.id or not np.array_equal(ctoks[: len(ptoks)], ptoks):
                    kept.append((child, ctoks))
                elif child.id not in out:
                    out[child.id] = (child, ctoks)
                    todo.append(ctoks)
            if kept:
                self._answers[k] = kept
        meta = info.meta if isinstance(info.meta, dict) else {}
        if governed(info) and meta.get("cache_type") == "assistant":
            below = [e.n_tokens for e in chain if e.n_tokens < info.n_tokens and governed(e)]
            if below:
                n = max(below)
                k = (info.model, n, int(hashes[n]))
                self._answers.setdefault(k, []).append((info, np.array(tokens, copy=True)))
                self._answers.move_to_end(k)
                while len(self._answers) > _ANSWERS:
                    self._answers.popitem(last=False)
        return out

    def prune(self, tokens: np.ndarray, info: EntryInfo) -> List[EntryInfo]:
        """Delete what :meth:`superseded` names in the chain of the entry just written.

        Args:
            tokens: the tokens of the entry just written.
            info: its EntryInfo, as ``PromptStore.put`` returned it.

        Returns:
            The entries deleted; none when the entry is trimmable, the history
            is unbounded, or pruning failed (logged).
        """
        if not self.keep or info.trimmable:
            return []
        try:
            chain = self.store.prefixes(info.model, tokens)
            victims = self.superseded(chain, self.store.pinned)
            diverged = self._diverged(chain, info, tokens)
            if diverged:
                pins = set(self.store.pinned())
                planned = {v.id for v in victims}
                victims += [e for e, _ in diverged.values() if e.id not in pins and e.id not in planned]
            if not victims:
                return []
            # remove_planned leaves alone an entry replaced (or deleted) since
            # it was listed, e.g. by another process: only what was planned goes.
            removed, _ = self.store.remove_planned(victims)
            self.pruned += len(removed)
            if self._on_removed is not None:
                for e in removed:
                    self._on_removed(e.model, diverged[e.id][1] if e.id in diverged else tokens[: e.n_tokens])
        except PromptStoreError as err:
            self.failed += 1
            log.warning("promptstore: could not prune the checkpoints of a %d-token cache: %s", len(tokens), err)
            return []
        except Exception:  # a cache must never take the server down
            self.failed += 1
            log.exception("promptstore: unexpected error pruning the checkpoints of a %d-token cache", len(tokens))
            return []
        log.debug("promptstore: pruned %d superseded checkpoints of a %d-token cache", len(removed), len(tokens))
        return removed
