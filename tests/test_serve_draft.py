"""`promptstore serve --draft-model`: speculative decoding on the fixture hybrids,
through real HTTP requests to a real server subprocess on 127.0.0.1 (the hybrids'
greedy requests through the OpenAI Python client, as a user's application sends them).

Greedy answers equal those of the same server without a draft; after a restart
the cached tokens come from the store; the counters report draft tokens and
acceptance; entries are ``ssm.gated_delta``; a request that a stop string
ends inside a verify round is cached under the tokens the server took; the
system prompt is checkpointed as without a draft, and the next conversation
starts from it."""

from __future__ import annotations

import json
import os
import urllib.request
import urllib.error
from typing import List

import mlx.core as mx
import pytest
from openai import OpenAI
from mlx_lm.generate import generate_step

from conftest import MODELS, greedy_cache, load_fixture
from _bits import bits_equal
from promptstore import PromptStore, fingerprint
from promptstore.bench._draft import smaller_draft
from test_serving_server import Server, cached, cli_json, text
from test_spec_stop import assert_greedy

SYSTEM = "You are a terse assistant that answers in one line."
# The second hybrid's server runs only under PROMPTSTORE_STRESS=1 (a server start and a dozen
# requests each; in-process, tests/test_speculative.py runs both hybrids' verify rounds by default).
HYBRID_SERVERS = ["qwen3_next", pytest.param("qwen3_5", marks=pytest.mark.skipif(
    os.environ.get("PROMPTSTORE_STRESS") != "1", reason="the second hybrid's server: PROMPTSTORE_STRESS=1"))]
PROMPTS = ["Name three colours of the rainbow, please.", "What is a prompt cache?", "Count to five."]
COMPLETION = "Once upon a time, in a land of caches,"


def _chat(user: str) -> list:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _complete(srv: Server, prompt: str, **extra) -> dict:
    """A greedy text completion (``/v1/completions``), as a dict of the response JSON."""
    body = json.dumps({"prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def _answers(srv: Server) -> List[dict]:
    """Greedy answers to PROMPTS through the OpenAI Python client, as dicts of the response JSON."""
    client = OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0, timeout=120)
    out = []
    for p in PROMPTS:
        resp = client.chat.completions.create(model="default_model", messages=_chat(p), max_tokens=12, temperature=0)
        out.append(resp.model_dump())
    return out


@pytest.mark.parametrize("model", HYBRID_SERVERS)
def test_draft_server_is_greedy_identical_and_restarts_from_the_store(tmp_path, model):
    log = tmp_path / "server.log"
    draft = ("--draft-model", str(MODELS / model), "--num-draft-tokens", "3")  # a self-draft

    with Server(tmp_path / "plain", model, log) as plain:
        want = _answers(plain)
    plain.stop()

    store = tmp_path / "store"
    with Server(store, model, log, *draft) as srv:
        got = _answers(srv)
        assert [text(r) for r in got] == [text(r) for r in want]
        assert [r["usage"]["completion_tokens"] for r in got] == [r["usage"]["completion_tokens"] for r in want]
        assert [cached(r) for r in got] == [cached(r) for r in want]  # 0, then the system checkpoint's
    first = srv.stop()
    counters = first["cache"]
    assert first["draft_model"] == str(MODELS / model)
    assert counters["speculative_requests"] == len(PROMPTS)
    assert counters["draft_tokens"] > 0 and 0 < counters["accepted_draft_tokens"] <= counters["draft_tokens"]
    assert counters["acceptance"] == counters["accepted_draft_tokens"] / counters["draft_tokens"]
    assert counters["pending"] == 0 and counters["errors"] == 0 and counters["write_failed"] == 0

    # per request: the end of the messages, the prompt checkpoint and prompt + answer, target and
    # draft layers, as ssm.gated_delta; and the system prompt's checkpoint, which the requests share:
    # what the server without a draft (batched) stores
    docs = cli_json(store, "ls")
    fp = fingerprint(MODELS / model)
    assert len(docs) == 3 * len(PROMPTS) + 1 and {d["model"] for d in docs} == {f"{fp}+draft:{fp}"}
    kept = sorted((d["tokens"], d["meta"]["cache_type"]) for d in docs)
    assert kept == sorted((d["tokens"], d["meta"]["cache_type"]) for d in cli_json(tmp_path / "plain", "ls"))
    assert sorted(d["meta"]["cache_type"] for d in docs).count("system") == 1
    for d in docs:
        assert "arrays" not in d["kinds"] and d["kinds"].count("ssm.gated_delta") == len(d["kinds"]) // 2
    lengths = sorted(d["tokens"] for d in docs)
    for r in got:
        n = r["usage"]["prompt_tokens"]
        assert n - 1 in lengths and n + r["usage"]["completion_tokens"] in lengths

    with Server(store, model, log, *draft) as srv:
        again = _answers(srv)  # memory is empty: whatever is cached came from the store
        assert [text(r) for r in again] == [text(r) for r in want]
        assert [cached(r) for r in again] == [r["usage"]["prompt_tokens"] - 1 for r in got]
    second = srv.stop()["cache"]
    assert second["store_hits"] == len(PROMPTS) and second["errors"] == 0
    assert cli_json(store, "verify")["ok"]


@pytest.mark.parametrize("model", HYBRID_SERVERS)
def test_draft_requests_checkpoint_the_system_prompt_as_requests_without_a_draft_do(tmp_path, model):
    """On a hybrid, whose entries match only at their exact length, a draft
    request stores the system prompt's checkpoint where the server without a
    draft does: the next request with the same system prompt and another
    user message starts from it, in memory and after a restart (from the
    store), with the answers and cached tokens of the server without a draft.
    The stored checkpoint holds, bit for bit in the target's and in the
    draft's layers, what prefilling the system prompt leaves. Draft requests
    used to store none: every new user message was prefilled from token 0."""
    log, store = tmp_path / "server.log", tmp_path / "store"
    draft = ("--draft-model", str(MODELS / model), "--num-draft-tokens", "3")  # a self-draft
    later = "Say hello."  # a user message none of PROMPTS' requests stored

    with Server(tmp_path / "plain", model, log) as plain:
        want = _answers(plain)
        want_later = plain.chat(_chat(later), max_tokens=12)
    plain.stop()
    systems = [d["tokens"] for d in cli_json(tmp_path / "plain", "ls") if d["meta"]["cache_type"] == "system"]
    assert len(systems) == 1 and systems[0] > 0
    n_system = systems[0]
    assert [cached(r) for r in want] == [0, n_system, n_system]  # the plain server's own hits on it

    with Server(store, model, log, *draft) as srv:
        got = _answers(srv)
        assert [text(r) for r in got] == [text(r) for r in want]
        assert [cached(r) for r in got] == [cached(r) for r in want]
    counters = srv.stop()["cache"]
    assert counters["memory_hits"] == len(PROMPTS) - 1 and counters["errors"] == 0 and counters["write_failed"] == 0

    target, tokenizer, fp, _ = load_fixture(model)
    ident = f"{fp}+draft:{fp}"
    docs = cli_json(store, "ls")
    systems = [d for d in docs if d["meta"]["cache_type"] == "system"]
    assert [(d["model"], d["tokens"]) for d in systems] == [(ident, n_system)]
    assert systems[0]["kinds"].count("ssm.gated_delta") == len(systems[0]["kinds"]) // 2  # the target's and the draft's
    head = list(tokenizer.apply_chat_template(_chat(PROMPTS[0]), add_generation_prompt=True))[:n_system]
    with PromptStore(store) as ps:
        layers = ps.get(ident, head)
    assert layers is not None, "no entry of the system prompt"
    n = len(target.layers)
    assert len(layers) == 2 * n
    assert_greedy(target, target, layers[:n], head, n_system + 1)  # one forward of the system prompt
    assert_greedy(target, target, layers[n:], head, n_system + 1)

    with Server(store, model, log, *draft) as srv:
        again = srv.chat(_chat(later), max_tokens=12)  # memory is empty: the system checkpoint comes from the store
        assert cached(again) == cached(want_later) == n_system
        assert text(again) == text(want_later)
    second = srv.stop()["cache"]
    assert second["store_hits"] == 1 and second["errors"] == 0
    assert cli_json(store, "verify")["ok"]


@pytest.mark.parametrize("alone", ["seed", "kv-bits"])
def test_requests_served_alone_without_a_draft_checkpoint_as_batched_ones(tmp_path, alone):
    """A request with a ``seed``, or any under ``--kv-bits``, is served alone
    (mlx-lm's ``_serve_single``, its own prefill). On a hybrid it now stores
    the checkpoints the batched server stores (the end of the system prompt,
    of the messages): the answers and cached tokens are those of the batched
    server, the system prompt's checkpoint holds,
    bit for bit, what prefilling the system prompt leaves, and after a
    restart a new user message starts from it (from the store). It used to
    store none: every new user message was prefilled from token 0. Under
    ``--kv-bits``, a prompt that reaches ``--quantized-kv-start`` is not
    paused (that would move the quantization): no system checkpoint then,
    and the prompt but its last token is checkpointed quantized (a request
    served alone cached only prompt + answer once: the same request sent
    again found at most the system prompt, a serving reviewer's finding)."""
    model = "qwen3_next"
    log, store = tmp_path / "server.log", tmp_path / "store"
    later = "Say hello."
    args, extra = (("--kv-bits", "8"), {}) if alone == "kv-bits" else ((), {"seed": 7})

    kept = lambda path: sorted((d["tokens"], d["meta"]["cache_type"]) for d in cli_json(path, "ls"))  # noqa: E731
    with Server(tmp_path / "plain", model, log) as plain:
        want = [plain.chat(_chat(p), max_tokens=12) for p in PROMPTS]
        want_text = _complete(plain, COMPLETION)
    plain.stop()
    batched = kept(tmp_path / "plain")  # the checkpoints mlx-lm's batched path takes, and their types
    n_system = next(n for n, kind in batched if kind == "system")
    assert [cached(r) for r in want] == [0, n_system, n_system]
    with Server(tmp_path / "plain", model, log) as plain:
        want_later = plain.chat(_chat(later), max_tokens=12)
    plain.stop()

    with Server(store, model, log, *args) as srv:
        got = [srv.chat(_chat(p), max_tokens=12, **extra) for p in PROMPTS]
        assert [text(r) for r in got] == [text(r) for r in want]
        # a text completion's prompt but its last token is typed `assistant` as the batched path types it
        # (it was `user`, which the checkpoint history keeps where it prunes an `assistant` one)
        assert _complete(srv, COMPLETION, **extra)["choices"][0]["text"] == want_text["choices"][0]["text"]
        assert [cached(r) for r in got] == [0, n_system, n_system]
    counters = srv.stop()["cache"]
    assert counters["errors"] == 0 and counters["write_failed"] == 0

    target, tokenizer, fp, _ = load_fixture(model)
    systems = [d for d in cli_json(store, "ls") if d["meta"]["cache_type"] == "system"]
    assert [(d["model"], d["tokens"]) for d in systems] == [(fp, n_system)]
    assert kept(store) == batched  # the end of the messages too (`get --messages` of the chat finds it)
    head = list(tokenizer.apply_chat_template(_chat(PROMPTS[0]), add_generation_prompt=True))[:n_system]
    with PromptStore(store) as ps:
        layers = ps.get(fp, head)
    assert layers is not None, "no entry of the system prompt"
    assert_greedy(target, target, layers, head, n_system + 1)  # one forward of the system prompt

    with Server(store, model, log, *args) as srv:
        again = srv.chat(_chat(later), max_tokens=12, **extra)  # memory is empty: the checkpoint comes from the store
        assert cached(again) == cached(want_later) == n_system
        assert text(again) == text(want_later)
    assert srv.stop()["cache"]["store_hits"] == 1
    assert cli_json(store, "verify")["ok"]
    if alone == "kv-bits":
        early = tmp_path / "early"
        with Server(early, model, log, *args, "--kv-group-size", "32", "--quantized-kv-start", str(n_system // 2)) as srv:
            first = srv.chat(_chat(PROMPTS[0]), max_tokens=12)
            second = srv.chat(_chat(PROMPTS[0]), max_tokens=12)  # the prompt but its last token, quantized
            assert (cached(first), cached(second)) == (0, first["usage"]["prompt_tokens"] - 1)
            assert text(second) == text(first)
        srv.stop()
        docs = cli_json(early, "ls")
        assert [d["meta"]["cache_type"] for d in docs].count("system") == 0
        assert all("kv.quantized" in d["kinds"] for d in docs)


def test_draft_server_refuses_what_it_cannot_run_and_keeps_serving(tmp_path):
    """Each refusal reaches the client as an error status with its reason,
    streaming or not. It used to be raised inside the generator, after the
    request's 200: the connection closed without an answer, or a stream ended
    empty, and the reason was only in the server's log."""
    model = "qwen3_next"
    with Server(tmp_path / "store", model, tmp_path / "server.log",
                "--draft-model", str(MODELS / model), "--num-draft-tokens", "2") as srv:
        refused = [({"repetition_penalty": 1.3}, "takes no logits processors"),
                   ({"logit_bias": {"5": 2.0}}, "takes no logits processors"),
                   ({"num_draft_tokens": 0}, "num_draft_tokens must be >= 1")]
        for extra, why in refused:
            with pytest.raises(urllib.error.HTTPError) as err:
                srv.chat(_chat(PROMPTS[0]), max_tokens=12, **extra)
            assert 400 <= err.value.code < 500 and why in err.value.read().decode()
            body = json.dumps({"messages": _chat(PROMPTS[0]), "max_tokens": 12, "stream": True, **extra}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=60)
            assert 400 <= err.value.code < 500 and why in err.value.read().decode()
        ok = srv.chat(_chat(PROMPTS[0]), max_tokens=12)
        assert text(ok) and ok["usage"]["completion_tokens"] > 0
    counters = srv.stop()["cache"]
    assert counters["speculative_requests"] == 1 and counters["draft_tokens"] > 0


def test_a_draft_round_longer_than_a_sliding_window_is_refused_before_the_answer(tmp_path):
    """gemma3_text's window holds 16 rotating positions: 20 draft tokens a
    round cannot run on its draft. The refusal was raised inside the
    generator, after the 200: the client got an empty reply (a stream ended
    with no event), the reason only in the server's log."""
    model = "gemma3_text"
    with Server(tmp_path / "store", model, tmp_path / "server.log",
                "--draft-model", str(MODELS / model), "--num-draft-tokens", "2") as srv:
        with pytest.raises(urllib.error.HTTPError) as err:
            srv.chat(_chat(PROMPTS[0]), max_tokens=8, num_draft_tokens=20)
        assert 400 <= err.value.code < 500 and "sliding window of 16 rotating positions" in err.value.read().decode()
        body = json.dumps({"messages": _chat(PROMPTS[0]), "max_tokens": 8, "stream": True, "num_draft_tokens": 20}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert 400 <= err.value.code < 500 and "use at most 17 draft tokens" in err.value.read().decode()
        ok = srv.chat(_chat(PROMPTS[0]), max_tokens=8)  # the server's own 2 a round still run
        assert ok["usage"]["completion_tokens"] > 0
    srv.stop()  # it stayed up after the test (a server process left running)


@pytest.mark.shape_dependent  # stored caches are compared with greedy decoding's
def test_sliding_window_draft_server_is_greedy_identical_and_continues_from_the_store(tmp_path):
    """gemma3_text (window 16) with its first two layers as the draft (one
    window layer, one global): prompts and answers run past the window and
    the draft is often wrong, so verify rounds drop rejected tails from
    wrapped rings. Answers equal the server without a draft; the stored
    prompt + answer entries hold greedy decoding's caches; second turns and a
    restart start from the store and still equal the server without a draft."""
    model, log = "gemma3_text", tmp_path / "server.log"
    draft_dir = smaller_draft(MODELS / model, tmp_path / "draft", 2)
    draft = ("--draft-model", str(draft_dir), "--num-draft-tokens", "3")

    def turns(srv: Server) -> List[dict]:
        first = [srv.chat(_chat(p), max_tokens=24) for p in PROMPTS]
        second = [srv.chat(_chat(p) + [{"role": "assistant", "content": text(r)}, {"role": "user", "content": "Again?"}],
                           max_tokens=24) for p, r in zip(PROMPTS, first)]
        return first + second

    with Server(tmp_path / "plain", model, log) as plain:
        want = turns(plain)
    plain.stop()
    assert all(r["usage"]["prompt_tokens"] > 16 for r in want)

    store = tmp_path / "store"
    with Server(store, model, log, *draft) as srv:
        got = turns(srv)
        assert [text(r) for r in got] == [text(r) for r in want]
        assert [r["usage"]["completion_tokens"] for r in got] == [r["usage"]["completion_tokens"] for r in want]
        assert all(cached(r) > 0 for r in got[len(PROMPTS):])  # second turns start from a stored window
    counters = srv.stop()["cache"]
    assert counters["speculative_requests"] == 2 * len(PROMPTS)
    assert 0 < counters["accepted_draft_tokens"] < counters["draft_tokens"]
    assert counters["pending"] == 0 and counters["errors"] == 0 and counters["write_failed"] == 0
    docs = cli_json(store, "ls")
    assert docs and all("kv.rotating" in d["kinds"] for d in docs)
    # The second turns' entries: the client sent each first answer back as text that
    # tokenizes otherwise, so the history pruned the first turns' answer checkpoints.
    seconds = [_chat(p) + [{"role": "assistant", "content": text(r)}, {"role": "user", "content": "Again?"}]
               for p, r in zip(PROMPTS, got)]
    _assert_stored_answers_are_greedy_caches(store, model, draft_dir, list(zip(seconds, got[len(PROMPTS):])))

    with Server(store, model, log, *draft) as srv:
        again = turns(srv)  # memory is empty: whatever is cached came from the store
        assert [text(r) for r in again] == [text(r) for r in want]
        assert all(cached(r) > 0 for r in again)
    assert srv.stop()["cache"]["errors"] == 0
    assert cli_json(store, "verify")["ok"]


def _assert_stored_answers_are_greedy_caches(store, model: str, draft_dir, answers: List[tuple]) -> None:
    """For each ``(messages, response)``, the prompt + answer entry (stored
    after the request's last verify round) holds, in the target's and in the
    draft's layers, what greedy decoding of the same tokens by that model
    leaves, as the next forward sees it (test_spec_window.py)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from test_spec_window import assert_seen_alike

    target, tokenizer, fp, _ = load_fixture(model)
    draft_model, _ = load(str(draft_dir))
    with PromptStore(store) as ps:
        for messages, r in answers:
            prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            assert len(prompt) == r["usage"]["prompt_tokens"]
            answer = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=r["usage"]["completion_tokens"])]
            layers = ps.get(f"{fp}+draft:{fingerprint(draft_dir)}", prompt + answer)
            assert layers is not None, "no entry of prompt + answer"
            n = len(target.layers)
            assert_seen_alike(target, layers[:n], greedy_cache(target, prompt + answer, len(prompt)))
            assert_seen_alike(draft_model, layers[n:], greedy_cache(draft_model, prompt + answer, len(prompt)))


@pytest.mark.shape_dependent  # the stored cache is compared with greedy decoding's
def test_a_stop_string_mid_round_is_answered_as_without_a_draft_and_cached(tmp_path):
    """A stop string that matches inside a verify round (a self-draft: every
    round drafts 3 and emits 4 tokens): the answer equals the server's without
    a draft, and the prompt + tokens taken entry holds greedy decoding's cache
    (the round's positions past the stop were rolled back), not refused."""
    model, log = "qwen3_next", tmp_path / "server.log"
    target, tokenizer, fp, _ = load_fixture(model)
    prompt = list(tokenizer.apply_chat_template(_chat(PROMPTS[0]), add_generation_prompt=True))
    answer = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=12)]
    # the first token that ends no round and, alone, is its own stop string
    at = next(i for i in range(1, 11) if (i + 1) % 4 and answer[i] not in answer[:i]
              and tokenizer.encode(tokenizer.decode([answer[i]]), add_special_tokens=False) == [answer[i]])
    request = {"max_tokens": 12, "stop": [tokenizer.decode([answer[at]])]}

    with Server(tmp_path / "plain", model, log) as plain:
        want = plain.chat(_chat(PROMPTS[0]), **request)
    plain.stop()
    store = tmp_path / "store"
    with Server(store, model, log, "--draft-model", str(MODELS / model), "--num-draft-tokens", "3") as srv:
        got = srv.chat(_chat(PROMPTS[0]), **request)
    counters = srv.stop()["cache"]
    assert want["choices"][0]["finish_reason"] == "stop" and text(got) == text(want)
    assert got["usage"] == want["usage"]
    assert counters["errors"] == 0 and counters["write_failed"] == 0
    taken = prompt + answer[: at + 1]  # what mlx-lm's server inserts: the prompt and every token it took
    docs = sorted((d["tokens"], d["meta"]["cache_type"]) for d in cli_json(store, "ls"))
    assert [n for n, _ in docs[2:]] == [len(prompt) - 1, len(taken)]
    assert docs[0][1] == "system" and 0 < docs[0][0] < len(prompt) - 1  # and the system prompt's checkpoint
    ended = len(tokenizer.apply_chat_template(_chat(PROMPTS[0]), add_generation_prompt=False))
    assert docs[1] == (ended, "user")  # and the messages' (what `get --messages` of the chat asks for)
    with PromptStore(store) as ps:
        layers = ps.get(f"{fp}+draft:{fp}", taken)
    assert layers is not None, "no entry of prompt + the tokens taken"
    n = len(target.layers)
    assert_greedy(target, target, layers[:n], taken, len(prompt))
    assert_greedy(target, target, layers[n:], taken, len(prompt))


def test_a_paused_prefill_generates_as_mlx_lm_and_reports_progress_once_per_step():
    """In-process, mlx-lm's own stream_generate against the one the server
    gets (``make_stream_generate``) pausing at two breaks: the same tokens and
    logprobs, bit for bit; checkpoints at both breaks and at the prompt but
    its last token; progress rising once per step to the whole prompt (the
    pause reported its step twice once)."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from promptstore.serving._speculative import DraftCounters, make_stream_generate

    model, tokenizer, _, _ = load_fixture("qwen3_next")
    prompt = list(tokenizer.apply_chat_template(_chat(PROMPTS[0]), add_generation_prompt=True))
    stored: List[int] = []
    seen: List[tuple] = []
    paused = make_stream_generate(stream_generate, DraftCounters(), lambda cache, n: stored.append(n), lambda: [7, 20])
    got = list(paused(model, tokenizer, prompt, max_tokens=8, prompt_cache=make_prompt_cache(model), prefill_step_size=5,
                      prompt_progress_callback=lambda done, total: seen.append((done, total))))
    want = list(stream_generate(model, tokenizer, prompt, max_tokens=8, prompt_cache=make_prompt_cache(model),
                                prefill_step_size=5))
    assert [r.token for r in got] == [r.token for r in want]
    assert all(bits_equal(a.logprobs, b.logprobs).item() for a, b in zip(got, want))
    assert stored == [7, 20, len(prompt) - 1]
    dones = [d for d, _ in seen]
    assert {t for _, t in seen} == {len(prompt)} and dones[0] == 0 and dones[-1] == len(prompt)
    assert dones == sorted(set(dones)), dones
