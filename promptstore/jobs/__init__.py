"""Jobs that make caches: prefill, offline warm-up, checkpoints at turn boundaries, mlx-lm file interop.

* ``prefill``: load a model, template and encode a prompt, prefill a cache;
* ``warmup``: pre-compute caches for a file of prompts, batched where the kinds allow;
* ``checkpoints``: caches at the message boundaries of a chat, for untrimmable models;
* ``interop``: mlx-lm prompt-cache files in and out.
"""
