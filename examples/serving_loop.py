"""A custom serving loop that keeps its prompt caches in promptstore."""
import sys

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import make_prompt_cache

from promptstore import PersistentPromptCache, fingerprint


def answer(prompt_cache, model, tokenizer, model_id, messages, max_tokens=8):
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    cache, rest = prompt_cache.fetch_nearest_cache(model_id, prompt)  # memory, then the store
    cached = len(prompt) - len(rest)
    cache = cache if cache is not None else make_prompt_cache(model)
    if len(rest) > 1:  # checkpoint the prompt: hybrid caches cannot be trimmed back to it later
        model(mx.array(rest[:-1])[None], cache=cache)
        prompt_cache.insert_cache(model_id, prompt[:-1], cache, cache_type="user")
        rest = rest[-1:]
    tokens, text = list(prompt), ""
    for r in stream_generate(model, tokenizer, rest, max_tokens=max_tokens, prompt_cache=cache):
        text, tokens = text + r.text, tokens + [r.token]
    prompt_cache.insert_cache(model_id, tokens, cache)  # returns at once; written in the background
    return text, cached


model_dir = sys.argv[1] if len(sys.argv) > 1 else "fixtures/models/llama"
model, tokenizer = load(model_dir)
model_id = fingerprint(model_dir)  # the identity `promptstore put/get --model DIR` use
chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
for run in ("first", "restarted"):
    with PersistentPromptCache() as prompt_cache:  # $PROMPTSTORE_DIR; close() flushes the writes
        text, cached = answer(prompt_cache, model, tokenizer, model_id, chat)
        print(f"{run}: {cached} cached prompt tokens, answer {text!r}")
