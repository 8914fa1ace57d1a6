"""The bounded checkpoint history of PersistentPromptCache for caches that cannot be trimmed.

Conversations are driven through ``fetch_nearest_cache``/``insert_cache`` the
way mlx-lm's server does, on the real fixture models and a real store.
"""

from __future__ import annotations

import json
import logging
import sys
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from conftest import MODELS, load_fixture, sample_tokens
from promptstore import PromptStore
from promptstore.cli import main
from promptstore.codecs import encode_layer
from promptstore.errors import InvalidInput, StoreUnavailable
from promptstore.serving import DEFAULT_CHECKPOINTS, PersistentPromptCache
from promptstore.serving import _server

SYSTEM = sample_tokens(12, seed=100)


def key(path):
    """The model key mlx-lm's server passes."""
    return (str(path), None, None)


def feed(model, cache, toks):
    if toks:
        out = model(mx.array(toks)[None], cache=cache)
        mx.eval(out, [c.state for c in cache])


def states(cache):
    """Every array of a cache as its codec stores it."""
    return [a for layer in cache for _, a in sorted(encode_layer(layer).arrays.items())]


def identical(a, b) -> bool:
    sa, sb = states(a), states(b)
    return len(sa) == len(sb) and all(x.dtype == y.dtype and mx.array_equal(x, y).item() for x, y in zip(sa, sb))


class Chat:
    """One conversation, served as mlx-lm's server serves it: fetch the nearest
    cache, prefill the system prompt (checkpoint "system") if it was not
    cached, then the prompt up to its last token (checkpoint "user"), then the
    last token and the answer (checkpoint "assistant")."""

    def __init__(self, pc, model, path, system=SYSTEM, seed=0):
        self.pc, self.model, self.key = pc, model, key(path)
        self.system, self.seed = list(system), seed
        self.tokens = list(system)
        self.turns = 0
        self.cache = None
        self.boundaries = []  # (n_tokens, cache_type) of every checkpoint inserted

    def turn(self, user_len=6, answer_len=5, resent=None):
        """One turn. ``resent``: what the client sends the answer back as in
        the next turn's prompt, when not the tokens generated (text that
        tokenizes otherwise): a function of the generated tokens."""
        self.turns += 1
        user = sample_tokens(user_len, seed=self.seed * 1000 + 2 * self.turns)
        answer = sample_tokens(answer_len, seed=self.seed * 1000 + 2 * self.turns + 1)
        prompt = self.tokens + user
        cache, rest = self.pc.fetch_nearest_cache(self.key, prompt)
        done = len(prompt) - len(rest)
        if cache is None:
            cache = make_prompt_cache(self.model)
        if done < len(self.system):
            feed(self.model, cache, prompt[done:len(self.system)])
            self._insert(prompt[: len(self.system)], cache, "system")
            done = len(self.system)
        feed(self.model, cache, prompt[done:-1])
        self._insert(prompt[:-1], cache, "user")
        feed(self.model, cache, prompt[-1:] + answer)
        self._insert(prompt + answer, cache, "assistant")
        self.tokens = prompt + (resent(answer) if resent is not None else answer)
        self.cache = cache
        return self

    def _insert(self, toks, cache, cache_type):
        self.pc.insert_cache(self.key, list(toks), cache, cache_type=cache_type)
        self.boundaries.append((len(toks), cache_type))


def stored(store, model=None):
    """``(n_tokens, cache_type)`` of every stored entry, shortest first."""
    return sorted((e.n_tokens, e.meta.get("cache_type")) for e in store.entries(model))


@pytest.fixture
def hybrid():
    return load_fixture("qwen3_next")


@pytest.fixture
def llama():
    return load_fixture("llama")


def test_a_hybrid_conversation_keeps_the_system_checkpoint_and_the_latest_k(store_path, hybrid):
    model, _, fp, path = hybrid
    assert not all(c.is_trimmable() for c in make_prompt_cache(model))  # ArraysCache layers
    with PromptStore(store_path) as store:
        with PersistentPromptCache(store, checkpoints=3) as pc:
            chat = Chat(pc, model, path)
            for t in range(10):
                chat.turn()
                pc.flush()
                assert len(list(store.entries())) <= 1 + 3
            assert pc.stats()["pruned"] == len(chat.boundaries) - 4 and pc.stats()["prune_failed"] == 0
            assert pc.checkpoints == 3
        turns = [b for b in chat.boundaries if b[1] != "system"]
        assert len(turns) == 20
        assert stored(store) == [(len(SYSTEM), "system")] + turns[-3:]  # system + asst 9, user 10, asst 10

    # A restarted server (nothing in memory, the store reopened) restores the
    # latest checkpoint bit-exactly and continues exactly as the live cache does.
    nxt = sample_tokens(4, seed=999)
    with PersistentPromptCache(store_path, checkpoints=3) as pc:
        got, rest = pc.fetch_nearest_cache(key(path), chat.tokens + nxt)
        assert rest == nxt and pc.stats()["store_hits"] == 1
        assert identical(got, chat.cache)
        a = model(mx.array(nxt)[None], cache=got)
        b = model(mx.array(nxt)[None], cache=chat.cache)
        assert mx.array_equal(a, b).item()


def test_a_second_conversation_sharing_the_system_prompt_is_not_pruned_by_the_first(store_path, hybrid):
    model, _, fp, path = hybrid
    with PromptStore(store_path) as store, PersistentPromptCache(store, checkpoints=3) as pc:
        other = Chat(pc, model, path, seed=2)
        other.turn()
        pc.flush()
        before = stored(store)
        assert before == sorted(other.boundaries) and len(before) == 3  # system, user, assistant
        first = Chat(pc, model, path, seed=1)
        for _ in range(10):
            first.turn()
        pc.flush()
        mine = [b for b in first.boundaries if b[1] != "system"]
        assert first.boundaries[0][1] == "user"  # the system prefix came from memory: no second checkpoint
        assert stored(store) == sorted(before + mine[-3:])
        # The other conversation goes on: it prunes its own chain only.
        other.turn()
        pc.flush()
        theirs = [b for b in other.boundaries if b[1] != "system"]
        assert stored(store) == sorted([(len(SYSTEM), "system")] + theirs[-3:] + mine[-3:])


def test_answers_a_client_sends_back_otherwise_are_superseded_too(store_path, hybrid):
    """A client that sends the answer back as text which tokenizes otherwise
    leaves each turn's answer checkpoint outside the next turn's chain (a
    reviewer counted 12 entries after 10 turns under `promptstore serve`):
    the answer is pruned once a later write extends its parent instead."""
    model, _, fp, path = hybrid
    with PromptStore(store_path) as store, PersistentPromptCache(store, checkpoints=3) as pc:
        chat = Chat(pc, model, path)
        for t in range(8):
            chat.turn(resent=lambda answer: [(answer[0] + 1) % 500 + 3] + answer[1:])
            pc.flush()
            assert len(list(store.entries())) <= 1 + 3 + 1, stored(store)  # + the answer of the turn just written
        kinds = [k for _, k in stored(store)]
        assert kinds == ["system", "user", "user", "assistant"], stored(store)
        users = [b for b in chat.boundaries if b[1] == "user"]
        assert stored(store) == sorted([(len(SYSTEM), "system"), users[-2], users[-1], chat.boundaries[-1]])


def test_a_thinking_models_tail_and_answer_checkpoints_are_superseded_too(store_path, hybrid):
    """mlx-lm's server cuts a thinking model's prompt into [system, user,
    tail] (the tail: the generation prompt's "<think>"): per turn it inserts
    the user boundary, the prompt but its last token (typed "assistant", as
    its tail) and the answer. The next prompt renders the answer without its
    reasoning, so neither of the last two is a prefix of it: 10 turns left
    23 entries, two more for good each turn (a serving reviewer's finding).
    The tail checkpoint was forgotten as its answer's parent once the answer
    was written, and the answer remembered under it, which no later write
    extends."""
    model, _, fp, path = hybrid
    hdr, think, end = [301, 302], [303, 304], [305]
    history = []
    with PromptStore(store_path) as store, PersistentPromptCache(store, checkpoints=4) as pc:
        for turn in range(10):
            body = history + sample_tokens(6, seed=200 + turn) + hdr
            prompt = SYSTEM + body + think
            cache, rest = pc.fetch_nearest_cache(key(path), prompt)
            done = len(prompt) - len(rest)
            cache = cache if cache is not None else make_prompt_cache(model)
            for end_at, kind in ((len(SYSTEM), "system"), (len(SYSTEM) + len(body), "user"), (len(prompt) - 1, "assistant")):
                if end_at > done:
                    feed(model, cache, prompt[done:end_at])
                    pc.insert_cache(key(path), prompt[:end_at], cache, cache_type=kind)
                    done = end_at
            answer = sample_tokens(4, seed=300 + turn)
            feed(model, cache, prompt[done:] + answer)
            pc.insert_cache(key(path), prompt + answer, cache, cache_type="assistant")
            history = body + answer + end  # the reasoning stripped: no think tokens
            pc.flush()
            assert len(list(store.entries())) <= 1 + 4 + 2, stored(store)  # + the turn's tail and answer, until the next write
        assert [k for _, k in stored(store)][0] == "system" and len(list(store.entries())) <= 1 + 4
        assert pc.stats()["prune_failed"] == 0


def test_trimmable_conversations_are_untouched(store_path, llama):
    model, _, _, path = llama
    assert all(c.is_trimmable() for c in make_prompt_cache(model))
    with PromptStore(store_path) as store, PersistentPromptCache(store, checkpoints=1) as pc:
        chat = Chat(pc, model, path)
        for _ in range(10):
            chat.turn()
        pc.flush()
        assert stored(store) == sorted(chat.boundaries) and len(chat.boundaries) == 21
        assert pc.stats()["pruned"] == 0


def test_a_sliding_window_model_bounds_only_the_entries_past_its_window(store_path):
    """A RotatingKVCache can be trimmed until it has wrapped: the early, trimmable
    checkpoints of a chain are left alone, the ones past the window are bounded."""
    model, _, fp, path = load_fixture("gemma3_text")
    window = min(c.max_size for c in make_prompt_cache(model) if hasattr(c, "max_size"))
    with PromptStore(store_path) as store, PersistentPromptCache(store, checkpoints=1) as pc:
        chat = Chat(pc, model, path, system=sample_tokens(4, seed=5))
        for _ in range(4):
            chat.turn()
        pc.flush()
        early = [b for b in chat.boundaries if b[0] < window]
        assert len(early) == 3 and early[0][1] == "system"  # system, user 1, answer 1
        assert stored(store) == early + chat.boundaries[-1:]
        assert [e.trimmable for e in sorted(store.entries(), key=lambda e: e.n_tokens)] == [True] * 3 + [False]


@pytest.mark.parametrize("checkpoints", [0, None])
def test_zero_or_none_keeps_every_checkpoint(store_path, hybrid, checkpoints):
    model, _, _, path = hybrid
    with PromptStore(store_path) as store, PersistentPromptCache(store, checkpoints=checkpoints) as pc:
        assert pc.checkpoints == 0
        chat = Chat(pc, model, path)
        for _ in range(6):
            chat.turn()
        pc.flush()
        assert stored(store) == sorted(chat.boundaries) and len(chat.boundaries) == 13


@pytest.mark.parametrize("bad", [-1, True, 2.0, "3", [3]])
def test_a_bad_bound_is_refused_before_anything_opens(tmp_path, bad):
    with pytest.raises(InvalidInput, match="checkpoints"):
        PersistentPromptCache(tmp_path / "store", checkpoints=bad)
    assert not (tmp_path / "store").exists()
    with pytest.raises(InvalidInput, match="checkpoints"):
        _server.serve(str(MODELS / "qwen3_next"), checkpoints=bad)


def test_pinned_cli_and_warmup_entries_survive_and_do_not_count(tmp_path, hybrid):
    model, _, fp, path = hybrid
    store_dir = tmp_path / "store"
    # `promptstore put` stores the start of what becomes the conversation's system prompt.
    res = CliRunner().invoke(main, ["--store", str(store_dir), "put", "--model", str(path), "--prompt",
                                    "You are terse.", "--no-chat-template", "--json"])
    assert res.exit_code == 0, res.output
    cli_entry = json.loads(res.stdout)
    with PromptStore(store_dir) as store:
        head = store.tokens(cli_entry["id"])
        system = head + SYSTEM
        with PersistentPromptCache(store, checkpoints=2) as pc:
            chat = Chat(pc, model, path, system=system)
            chat.turn()
            pc.flush()
            # A warm-up job's entry inside the conversation, and a pinned serving checkpoint.
            warm = make_prompt_cache(model)
            feed(model, warm, chat.tokens[:-2])
            store.put(fp, chat.tokens[:-2], warm, meta={"source": "promptstore.warmup"})
            pinned = next(e for e in store.prefixes(fp, chat.tokens) if e.meta.get("cache_type") == "user")
            store.pin(pinned.id)
            for _ in range(7):
                chat.turn()
            pc.flush()
            turns = [b for b in chat.boundaries if b[1] != "system"]
            assert pinned.n_tokens == turns[0][0]
            # Kept: the CLI entry, the system checkpoint, the pinned one, the
            # warm-up entry, and the 2 latest serving checkpoints: pinned and
            # foreign entries do not count towards the 2.
            assert stored(store) == sorted([(len(head), None), (len(system), "system"), turns[0],
                                            (turns[1][0] - 2, None)] + turns[-2:])
            assert store.pinned() == [pinned.id]
            assert pc.stats()["pruned"] == len(turns) - 1 - 2


def test_pruning_tolerates_entries_deleted_elsewhere_and_logs_failures(store_path, hybrid, caplog, monkeypatch):
    model, _, fp, path = hybrid
    caplog.set_level(logging.WARNING, logger="promptstore")
    with PromptStore(store_path) as store, PersistentPromptCache(store, checkpoints=1) as pc:
        chat = Chat(pc, model, path)
        chat.turn()
        pc.flush()
        real = store.prefixes

        def racing(model_id, tokens):
            found = real(model_id, tokens)
            for e in found[1:]:
                store.delete(fp, tokens[: e.n_tokens])  # another process got there first
            return found

        monkeypatch.setattr(store, "prefixes", racing)
        chat.turn()
        assert pc.flush()
        assert stored(store) == [chat.boundaries[-1]]
        assert pc.stats()["prune_failed"] == 0 and not caplog.records

        def broken(model_id, tokens):
            raise StoreUnavailable("the disk went away")

        monkeypatch.setattr(store, "prefixes", broken)
        chat.turn()
        assert pc.flush()  # the writer goes on; the entries are written, unpruned
        st = pc.stats()
        assert st["prune_failed"] == 2 and st["write_failed"] == 0 and st["errors"] == 0
        assert len(list(store.entries())) == 3
        assert sum("could not prune" in r.getMessage() for r in caplog.records) == 2


def test_hybrid_shaped_caches_built_by_hand(store_path):
    """ArraysCache (recurrent, untrimmable) + KVCache layers, no model: the policy
    depends only on the entries' trimmability and metadata."""
    ident = "handmade@0123456789abcdef"

    def cache_for(n):
        kv, rec = KVCache(), ArraysCache(size=2)
        kv.update_and_fetch(mx.full((1, 1, n, 4), float(n)), mx.full((1, 1, n, 4), -float(n)))
        rec[0], rec[1] = mx.full((1, 3, 8), float(n)), mx.full((1, 2, 4, 4), float(n))
        return [rec, kv]

    toks = sample_tokens(40, seed=7)
    with PromptStore(store_path) as store, PersistentPromptCache(store, model_id=lambda k: k, checkpoints=2) as pc:
        for n in (5, 10, 15, 20, 25, 30):
            pc.insert_cache(ident, toks[:n], cache_for(n), cache_type="system" if n == 5 else "user")
        pc.flush()
        assert stored(store) == [(5, "system"), (25, "user"), (30, "user")]
        got = store.get(ident, toks[:30])
        assert type(got[0]) is ArraysCache and not got[0].is_trimmable()
        assert np.array_equal(np.array(got[0][1]), np.full((1, 2, 4, 4), 30.0, np.float32))
        assert np.array_equal(np.array(got[1].state[0]), np.full((1, 1, 30, 4), 30.0, np.float32))


def test_serve_takes_checkpoints_and_passes_the_rest_to_mlx_lm(tmp_path, monkeypatch):
    """`promptstore serve --checkpoints K` reaches the PersistentPromptCache that
    replaces mlx-lm's LRUPromptCache; other options go to mlx_lm.server."""
    from mlx_lm import server as mlx_server

    seen = {}

    def fake_main():  # what mlx_lm.server.main does, minus loading a model and serving
        seen["argv"] = list(sys.argv)
        provider = SimpleNamespace(cli_args=SimpleNamespace(prompt_cache_size=7, prompt_cache_bytes=None))
        mlx_server.run("127.0.0.1", 0, provider)

    class Generator:
        def __init__(self, provider, cache):
            seen["checkpoints"], seen["max_size"] = cache.checkpoints, cache.max_size

        def stop_and_join(self):
            pass

    monkeypatch.setattr(mlx_server, "main", fake_main)
    monkeypatch.setattr(mlx_server, "_run_http_server", lambda host, port, generator: None)
    monkeypatch.setattr(_server, "_generator_class", lambda m: Generator)
    model = str(MODELS / "qwen3_next")
    runner = CliRunner()

    def serve(*args, code=0):
        res = runner.invoke(main, ["--store", str(tmp_path / "store"), "serve", "--model", model, *args])
        assert res.exit_code == code, (res.output, res.exception)
        return res

    res = serve("--port", "8123", "--checkpoints", "2", "--json")
    assert seen["checkpoints"] == 2 and seen["max_size"] == 7
    assert seen["argv"][1:] == ["--model", model, "--port", "8123"]
    stats = json.loads(res.stdout)["cache"]
    assert stats["pruned"] == 0 and stats["prune_failed"] == 0
    serve("--checkpoints", "0")
    assert seen["checkpoints"] == 0
    serve()
    assert seen["checkpoints"] == DEFAULT_CHECKPOINTS == 4
    seen.clear()
    bad = serve("--checkpoints", "-1", code=2)
    assert "--checkpoints" in bad.output and seen == {}


def test_an_answers_parent_is_matched_by_its_tokens_not_its_hash_alone(store_path, hybrid):
    """Two 1024-token prompts that differ everywhere (a Thue-Morse sequence
    and its complement) have one prefix hash: a write in one conversation
    pruned the other's answer checkpoint (a serving reviewer's finding)."""
    from promptstore.store._keys import prefix_hashes

    model, _, fp, path = hybrid
    bits = [bin(i).count("1") & 1 for i in range(1024)]
    a, b = [7 if x == 0 else 9 for x in bits], [9 if x == 0 else 7 for x in bits]
    assert prefix_hashes(np.array(a, np.uint32))[-1] == prefix_hashes(np.array(b, np.uint32))[-1]
    with PromptStore(store_path) as store, PersistentPromptCache(store, checkpoints=4) as pc:
        cache = make_prompt_cache(model)
        feed(model, cache, a)
        pc.insert_cache(key(path), a, cache, cache_type="user")
        feed(model, cache, [11, 12, 13])
        pc.insert_cache(key(path), a + [11, 12, 13], cache, cache_type="assistant")
        other = make_prompt_cache(model)
        feed(model, other, b + [20])
        pc.insert_cache(key(path), b + [20], other, cache_type="user")
        pc.flush()
        assert stored(store) == [(1024, "user"), (1025, "user"), (1027, "assistant")] and pc.stats()["pruned"] == 0


def test_answers_after_a_diverged_answer_are_matched_by_tokens_too():
    """The pass that prunes the answers written after a diverged answer
    matched their parent by hash alone: another conversation's answer under
    a colliding hash went with them (a reviewer's finding)."""
    from datetime import datetime, timezone

    from promptstore.serving._history import SOURCE, History
    from promptstore.store import EntryInfo

    bits = [bin(i).count("1") & 1 for i in range(1024)]
    a, b = [7 if x == 0 else 9 for x in bits], [9 if x == 0 else 7 for x in bits]
    now = datetime.now(timezone.utc)

    def info(name, toks, ctype):
        return EntryInfo(id=name, model="m@x", model_name="m", n_tokens=len(toks), kinds=("ssm.gated_delta",), nbytes=1,
                         created=now, last_used=now, trimmable=False, meta={"source": SOURCE, "cache_type": ctype})

    history = History(store=None, keep=4)

    def write(entry, toks, chain):
        return history._diverged(chain + [entry], entry, np.array(toks))

    pa, a1, a2 = info("PA", a[:512], "user"), info("A1", a, "assistant"), info("A2", a + [11], "assistant")
    pb, b1, b2 = info("PB", b[:512], "user"), info("B1", b, "assistant"), info("B2", b + [12], "assistant")
    write(pa, a[:512], [])
    write(a1, a, [pa])
    write(a2, a + [11], [pa, a1])
    write(pb, b[:512], [])
    write(b1, b, [pb])
    write(b2, b + [12], [pb, b1])
    assert sorted(write(info("U2", a[:512] + [99], "user"), a[:512] + [99], [pa])) == ["A1", "A2"]
