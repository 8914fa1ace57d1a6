"""The draft row of ``promptstore bench``: greedy decode on the fixture hybrid
without a draft, with a self-draft and with a smaller draft, with the acceptance.

* no draft: mlx-lm's own ``generate_step`` on mlx-lm's cache (what a user
  runs without promptstore);
* self-draft: :func:`promptstore.ssm.speculative.speculative_generate_step`
  with a second copy of the target as the draft (every draft token accepted:
  the cost of verify rounds with nothing gained);
* smaller draft: the same with the target's first ``draft_layers`` layers as
  the draft, written to a scratch folder: config.json with fewer layers, the
  target's tensors of those layers (and its embeddings and final norm), and
  the target's tokenizer files. ``fixtures/make_fixtures.py`` seeds every
  tensor by its name, so for the fixture this is the model it would write
  with that many layers.

Each variant prefills the prompt but its last token untimed, then is timed
from the last prompt token to ``max_tokens`` generated tokens (decode only).
The variants run interleaved, one of each per repeat, so a noisy machine
slows them alike, after one untimed warm-up run each; times are medians. Every run of a variant
must give the same tokens as its first run, and, where the backend's kernels do not depend on
the call shape (the CPU), every variant the same tokens as plain greedy decoding (greedy
identity, ``==``); else the case raises. On a GPU backend the identity is compared and reported
(``tokens_identical``), not required: the fidelity contract does not promise it there.

``one_at_a_time``: the price of mlx-lm's server serving draft requests alone.
``concurrent`` requests (distinct seeded prompts) arrive together; timed from
their prompts to every answer (prefill included), they are served one after
another with the self-draft, one after another without a draft, and in one
mlx-lm ``BatchGenerator`` batch without a draft (what the server does without
a draft). The one-at-a-time runs must give the same tokens where the kernels
do not depend on the call shape (reported as ``self_draft_tokens_identical``
everywhere); the batch's tokens are compared and reported, not required (a
batch computes in other shapes).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import mlx.core as mx
import numpy as np

from promptstore._backend import shape_exact
from promptstore.bench._fixture import HYBRID, fixture_model
from promptstore.errors import InvalidInput, PromptStoreError
from promptstore.jobs.prefill import load_model
from promptstore.ssm import adapt, make_prompt_cache
from promptstore.ssm.speculative import SpeculativeStats, speculative_generate_step

__all__ = ["draft_cases", "one_at_a_time", "smaller_draft"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def smaller_draft(model_dir: Path, out: Path, layers: int) -> Path:
    """Write the first ``layers`` layers of ``model_dir`` as a model folder ``out``.

    Raises:
        InvalidInput: ``layers`` is not between 1 and the model's layer count
            less one, or the folder has no config.json / model.safetensors.
    """
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise InvalidInput(f"{model_dir}: no readable config.json ({err}); pass an mlx-lm model folder") from err
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= layers < total:
        raise InvalidInput(f"a smaller draft of {model_dir} needs 1 <= layers < num_hidden_layers ({total}), got {layers}")
    weights_file = model_dir / "model.safetensors"
    if not weights_file.is_file():
        raise InvalidInput(f"{model_dir}: no model.safetensors (a sharded model is not cut into a draft)")
    weights = cast(Dict[str, mx.array], mx.load(str(weights_file)))  # a .safetensors file: a dict

    def kept(name: str) -> bool:
        parts = name.split(".")
        return not (len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and int(parts[2]) >= layers)

    out.mkdir(parents=True)
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(out / "model.safetensors"), {k: v for k, v in sorted(weights.items()) if kept(k)},
                        metadata={"format": "mlx"})
    for name in _TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    return out


def _prefilled(model: Any, prompt: List[int], cache: List[Any]) -> List[Any]:
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _plain(model: Any, prompt: List[int], max_tokens: int) -> Tuple[List[int], float]:
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

    cache = _prefilled(model, prompt[:-1], mlx_make_prompt_cache(model))
    t0 = time.perf_counter()
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt[-1:]), model, max_tokens=max_tokens, prompt_cache=cache)]
    return tokens, time.perf_counter() - t0


def _speculative(model: Any, draft: Any, prompt: List[int], max_tokens: int, k: int,
                 stats: SpeculativeStats) -> Tuple[List[int], float]:
    cache = _prefilled(model, prompt[:-1], make_prompt_cache(model))
    dcache = _prefilled(draft, prompt[:-1], make_prompt_cache(draft))
    t0 = time.perf_counter()
    tokens = [t for t, _, _ in speculative_generate_step(
        mx.array(prompt[-1:]), model, draft, num_draft_tokens=k, max_tokens=max_tokens,
        prompt_cache=cache, draft_cache=dcache, stats=stats)]
    return tokens, time.perf_counter() - t0


def _serial(run: Callable[[List[int]], List[int]], prompts: List[List[int]]) -> Tuple[List[List[int]], float]:
    t0 = time.perf_counter()
    tokens = [run(p) for p in prompts]
    return tokens, time.perf_counter() - t0


def _batched(model: Any, prompts: List[List[int]], max_tokens: int) -> Tuple[List[List[int]], float]:
    from mlx_lm.generate import BatchGenerator

    t0 = time.perf_counter()
    gen = BatchGenerator(model, max_tokens=max_tokens, prefill_batch_size=len(prompts),
                         completion_batch_size=len(prompts))
    try:
        uids = gen.insert(prompts)
        out: Dict[int, List[int]] = {u: [] for u in uids}
        while True:
            responses = gen.next_generated()
            if not responses:
                break
            for r in responses:
                out[r.uid].append(int(r.token))
    finally:
        gen.close()
    return [out[u] for u in uids], time.perf_counter() - t0


def one_at_a_time(plain: Any, target: Any, self_draft: Any, prompts: List[List[int]], max_tokens: int,
                  num_draft_tokens: int, repeats: int) -> Dict[str, Any]:
    """Concurrent requests served one at a time with a self-draft, against a batch without one.

    Args:
        plain: the target as mlx-lm loads it (no draft: serial and batched).
        target, self_draft: the target and a copy of it, adapted
            (:func:`promptstore.ssm.adapt`), for the speculative requests.
        prompts: one prompt per concurrent request.
        max_tokens: tokens generated per request.
        num_draft_tokens: tokens drafted per verify round.
        repeats: timed runs of each variant, after one untimed warm-up run.

    Returns:
        ``{"requests", "tokens", "repeats", "serial_self_draft", "serial_no_draft",
        "batched_no_draft", "self_draft_vs_batched", "batched_tokens_identical"}``;
        each variant has ``seconds`` (median, all requests, prefill
        included) and ``tokens_per_s`` (every request's tokens over that
        time); ``self_draft_vs_batched`` is the batch's seconds over the
        self-draft's (below 1: serving one at a time costs that much).

    Raises:
        PromptStoreError: the self-draft's tokens differ from greedy decoding
            one request at a time.
    """
    from mlx_lm.generate import generate_step

    def speculative(p: List[int]) -> List[int]:
        return [t for t, _, _ in speculative_generate_step(
            mx.array(p), target, self_draft, num_draft_tokens=num_draft_tokens, max_tokens=max_tokens)]

    def greedy(p: List[int]) -> List[int]:
        return [int(t) for t, _ in generate_step(mx.array(p), plain, max_tokens=max_tokens)]

    runs: Dict[str, Callable[[], Tuple[List[List[int]], float]]] = {
        "serial_self_draft": lambda: _serial(speculative, prompts),
        "serial_no_draft": lambda: _serial(greedy, prompts),
        "batched_no_draft": lambda: _batched(plain, prompts, max_tokens),
    }
    times: Dict[str, List[float]] = {name: [] for name in runs}
    tokens: Dict[str, List[List[int]]] = {}
    exact = shape_exact()
    for r in range(repeats + 1):  # run 0 warms up (checked, not timed)
        for name, run in runs.items():
            got, seconds = run()
            first = tokens.setdefault(name, got)
            if first != got or (exact and name == "serial_no_draft" and got != tokens["serial_self_draft"]):
                want = first if first != got else tokens["serial_self_draft"]
                raise PromptStoreError(
                    f"bench draft: {name} (repeat {r}) generated {got} where {want} was "
                    "generated before; greedy decoding one request at a time must give the same tokens"
                )
            if r:
                times[name].append(seconds)
    total = len(prompts) * max_tokens
    out: Dict[str, Any] = {"requests": len(prompts), "tokens": total, "repeats": repeats}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"seconds": med, "tokens_per_s": total / med}
    out["self_draft_vs_batched"] = out["batched_no_draft"]["seconds"] / out["serial_self_draft"]["seconds"]
    out["self_draft_tokens_identical"] = tokens["serial_self_draft"] == tokens["serial_no_draft"]
    out["batched_tokens_identical"] = tokens["batched_no_draft"] == tokens["serial_no_draft"]
    return out


def draft_cases(
    repeats: int,
    max_tokens: int,
    *,
    model_dir: Optional[Path] = None,
    num_draft_tokens: int = 3,
    prompt_tokens: int = 32,
    draft_layers: int = 2,
    concurrent: int = 4,
    workdir: Optional[Path] = None,
    seed: int = 0,
) -> Dict[str, Any]:
    """Greedy decode tokens/s without a draft, with a self-draft and with a smaller draft.

    Args:
        repeats: timed runs of each variant (median reported).
        max_tokens: tokens generated per run.
        model_dir: the target model (default: the fixture hybrid, qwen3_next:
            the repository's, else one built into the scratch folder).
        num_draft_tokens: tokens drafted per verify round.
        prompt_tokens: length of the (random, seeded) prompt.
        draft_layers: layers of the smaller draft.
        concurrent: requests of the ``one_at_a_time`` measurement
            (:func:`one_at_a_time`, at most 3 repeats); 0 leaves it out.
        workdir: where the smaller draft's scratch folder goes (removed after).
        seed: the prompt's seed.

    Returns:
        ``{"model", "prompt_tokens", "max_tokens", "num_draft_tokens",
        "repeats", "layers": {"target", "small_draft"}, "tokens_identical",
        "no_draft": {...}, "self_draft": {...}, "small_draft": {...},
        "one_at_a_time": {...}}`` (the last with ``concurrent`` > 0);
        each variant has ``seconds`` (median), ``tokens_per_s`` and, with a
        draft, ``speedup`` (over no draft, same run), ``rounds``,
        ``draft_tokens``, ``accepted`` and ``acceptance`` (over every run,
        the warm-up included).

    Raises:
        InvalidInput: a size below 1 or a model that cannot be cut.
        PromptStoreError: a variant's tokens differ from its first run's, or
            (where :func:`~promptstore._backend.shape_exact`) from plain greedy
            decoding.
    """
    if repeats < 1 or max_tokens < 1 or prompt_tokens < 2 or num_draft_tokens < 1 or concurrent < 0:
        raise InvalidInput("draft_cases needs repeats >= 1, max_tokens >= 1, prompt_tokens >= 2, "
                           "num_draft_tokens >= 1, concurrent >= 0")
    tmp = Path(tempfile.mkdtemp(prefix="promptstore-draft-", dir=workdir))
    try:
        model_dir = fixture_model(HYBRID, tmp) if model_dir is None else Path(model_dir)
        small_dir = smaller_draft(model_dir, tmp / "draft", draft_layers)
        plain, tokenizer = load_model(str(model_dir))
        target, _ = load_model(str(model_dir))
        self_draft, _ = load_model(str(model_dir))
        small, _ = load_model(str(small_dir))
        for m in (target, self_draft, small):
            adapt(m)  # before the untimed prefill into SSMCache layers (bit-identical)
        vocab = int(tokenizer.vocab_size)
        prompt = np.random.default_rng(seed).integers(3, vocab, size=prompt_tokens).tolist()
        stats = {"self_draft": SpeculativeStats(), "small_draft": SpeculativeStats()}
        runs: Dict[str, Callable[[], Tuple[List[int], float]]] = {
            "no_draft": lambda: _plain(plain, prompt, max_tokens),
            "self_draft": lambda: _speculative(target, self_draft, prompt, max_tokens, num_draft_tokens, stats["self_draft"]),
            "small_draft": lambda: _speculative(target, small, prompt, max_tokens, num_draft_tokens, stats["small_draft"]),
        }
        times: Dict[str, List[float]] = {name: [] for name in runs}
        firsts: Dict[str, List[int]] = {}
        exact = shape_exact()
        for r in range(repeats + 1):  # run 0 warms up (checked, not timed)
            for name, run in runs.items():
                tokens, seconds = run()
                first = firsts.setdefault(name, tokens)
                if tokens != first:
                    raise PromptStoreError(
                        f"bench draft: {name} (repeat {r}) generated {tokens} where its first run generated "
                        f"{first}; the same call must give the same tokens"
                    )
                if exact and tokens != firsts["no_draft"]:
                    raise PromptStoreError(
                        f"bench draft: {name} (repeat {r}) generated {tokens} where plain greedy decoding "
                        f"generated {firsts['no_draft']}; speculative decoding must be greedy-identical"
                    )
                if r:
                    times[name].append(seconds)
        out: Dict[str, Any] = {
            "model": str(model_dir),
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "num_draft_tokens": num_draft_tokens,
            "repeats": repeats,
            "layers": {"target": len(target.layers), "small_draft": len(small.layers)},
            "tokens_identical": all(t == firsts["no_draft"] for t in firsts.values()),
        }
        base = statistics.median(times["no_draft"])
        for name, ts in times.items():
            med = statistics.median(ts)
            row: Dict[str, Any] = {"seconds": med, "tokens_per_s": max_tokens / med}
            if name in stats:
                st = stats[name]
                row.update(speedup=base / med, rounds=st.rounds, draft_tokens=st.drafted,
                           accepted=st.accepted, acceptance=st.acceptance)
            out[name] = row
        if concurrent:
            rng = np.random.default_rng(seed + 1)
            prompts = [rng.integers(3, vocab, size=prompt_tokens).tolist() for _ in range(concurrent)]
            out["one_at_a_time"] = one_at_a_time(plain, target, self_draft, prompts, max_tokens, num_draft_tokens,
                                                 min(repeats, 3))
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
