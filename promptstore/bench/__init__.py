"""``promptstore bench``: promptstore measured beside what a user would otherwise do.

* ``_run``: the plan, the run and the targets;
* ``_cases``: one function per measured case;
* ``_data``: the Qwen3-Next-80B-shaped (and dense fixture) caches it measures;
* ``_chat``: a multi-turn chat through ``PersistentPromptCache``, as mlx-lm's server drives it;
* ``_sharing``: shared blocks: a shared system prompt, a prefix hit, block sizes;
* ``_child`` and ``_mem``: cases that run in a fresh subprocess.
"""

from promptstore.bench._run import CASES, FULL, QUICK, Plan, gbps, run, targets

__all__ = ["Plan", "FULL", "QUICK", "CASES", "run", "targets", "gbps"]
