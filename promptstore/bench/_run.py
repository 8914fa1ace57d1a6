"""``promptstore bench``: promptstore measured beside what a user would otherwise do.

One run measures, on the same data:

* throughput of a durable ``put`` (a blob file written and fsynced, then an
  LMDB sync commit) and of ``get``, beside
  mlx-lm's ``save_prompt_cache`` (+ fsync) / ``load_prompt_cache``, a plain
  file write+fsync / read of the same bytes, and memcpy of the same bytes,
  for a Qwen3-Next-80B-shaped cache at 4K and 32K tokens;
* longest-prefix lookup latency against store size;
* peak memory a get adds (in a subprocess);
* time to first token on the fixture hybrid, cold vs from a restored cache;
* bytes written when one row of a batch of 8 is saved;
* shared blocks: a multi-turn chat through ``PersistentPromptCache`` on the
  dense fixture's cache shape and on the Qwen3-Next-80B shape (bytes
  stored against unique bytes, bytes written per turn against new bytes),
  conversations sharing one system prompt, a prefix hit on a long entry
  (bytes read against the prefix's), and (full run) the same at several
  block sizes.

The CLI (``cli/bench.py``) renders the Markdown tables. Ratios are computed against references measured in the same run and judged
against the targets of :func:`targets` (PASS/MISS), the goals of the README's Performance table.
Nothing here asserts on time.

Usage::

    from promptstore.bench import run
    results = run(quick=True)      # the CLI renders it: promptstore bench --quick
"""

from __future__ import annotations

import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from promptstore._backend import backend
from promptstore.bench import _cases as cases
from promptstore.bench import _data as data
from promptstore.bench import _sharing as sharing
from promptstore.bench._fixture import HYBRID, fixture_model
from promptstore.bench._draft import draft_cases
from promptstore.bench._remote import remote_cases, remote_ttft
from promptstore.bench._chat import FULL_CHAT, Chat, serve_chat
from promptstore.format import _blank

__all__ = ["Plan", "FULL", "QUICK", "CASES", "run", "targets", "gbps"]


def _hugetlb_tunable() -> Optional[str]:
    """glibc >= 2.35 on Linux can back large mallocs (mlx buffers, LMDB dirty
    pages) with transparent huge pages: the bench measures that setting too."""
    lib, version = platform.libc_ver()
    try:
        ok = platform.system() == "Linux" and lib == "glibc" and tuple(int(x) for x in version.split(".")[:2]) >= (2, 35)
    except ValueError:
        ok = False
    return "glibc.malloc.hugetlb=1" if ok else None


HUGETLB = _hugetlb_tunable()


@dataclass(frozen=True)
class Plan:
    """What one bench run measures."""

    shape: data.Shape
    sizes: tuple  # tokens of the throughput caches
    repeats: tuple  # rounds of the throughput case, per size (more where a round is short and noise large)
    lookup_sizes: tuple
    lookup_repeats: int
    evict_sizes: tuple
    prefill_lengths: tuple
    prefill_repeats: int
    row_tokens: int
    chat: Chat  # the multi-turn conversation (on the dense shape and on ``shape``)
    shared: Tuple[int, int]  # (conversations, system-prompt tokens)
    prefix: Tuple[int, int]  # (tokens of the long entry, tokens of the prefix hit)
    block_sizes: Tuple[int, ...]  # block_tokens compared (full run)
    dense: data.Shape = data.DENSE


FULL = Plan(
    data.QWEN3_NEXT_80B, (4096, 32768), (15, 5), (100, 1000, 10000), 50, (1000, 100_000), (256, 512, 1024, 2048), 3, 4096,
    chat=FULL_CHAT,
    shared=(100, 8100),  # not a multiple of any block size compared: whole conversations pay a partial block
    prefix=(32768, 4000),  # not a multiple of the block size: the partial block is paid
    block_sizes=(16, 64, 256, 512, 1024),
)
QUICK = Plan(
    data.QUICK, (256, 1024), (2, 2), (10, 50), 3, (100, 1000), (64,), 1, 256,
    chat=Chat(turns=5, system=256, user=100, tail=6, answer=150),
    shared=(20, 2000),
    prefix=(8192, 1000),
    block_sizes=(),
)


#: The cases a run can be limited to (``promptstore bench --only``), in the order they run.
#: ``throughput`` includes the peak memory of a get; ``remote`` the remote tier's time to first token.
CASES = ("throughput", "lookup", "eviction", "row_save", "prefill", "chat", "shared_prompt", "prefix_read",
         "block_sizes", "draft", "remote")


def run(quick: bool = False, workdir: Optional[Path] = None, progress: Callable[[str], None] = lambda s: None,
        only: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run every case (or those of ``only``) and return the raw figures plus the judged targets.

    Args:
        quick: tiny sizes and few repeats (seconds; for CI).
        workdir: where the scratch stores and files go (a temporary
            directory inside it, removed afterwards); None: the system temp.
        progress: called with a short line before each case.
        only: names from :data:`CASES`; None: all of them. A run of some
            cases judges only the targets of those.

    Returns:
        A JSON-serialisable dict: ``plan``, ``machine``, ``only``, one key
        per case run, and ``targets`` (see :func:`targets`).

    Raises:
        ValueError: a name of ``only`` is not in :data:`CASES`.
    """
    unknown = sorted(set(only or ()) - set(CASES))
    if unknown:
        raise ValueError(f"unknown bench case(s) {', '.join(unknown)}; the cases are {', '.join(CASES)}")
    chosen = [c for c in CASES if only is None or c in only]
    plan = QUICK if quick else FULL
    tmp = Path(tempfile.mkdtemp(prefix="promptstore-bench-", dir=workdir))
    started = time.time()
    out: Dict[str, Any] = {
        "quick": quick,
        "only": None if only is None else chosen,
        "plan": {k: v for k, v in asdict(plan).items() if k not in ("shape", "dense")},
        "shape": asdict(plan.shape),
        "dense_shape": asdict(plan.dense),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "mlx": mx.__version__,  # type: ignore[attr-defined]  # not in mlx's stubs
            "device": str(mx.default_device()),
            "backend": backend(),
            "restore": _blank.mode(),  # how gets fill their buffers (format._blank)
            "loaders": _blank.loaders(),  # mx.load calls at once, where restores are staged
            "scratch": str(tmp),
        },
    }
    try:
        if {"prefill", "draft", "remote"} & set(chosen):
            # the repository's fixture hybrid, or (an installed package) one built here
            hybrid = fixture_model(HYBRID, tmp)
            out["fixture_hybrid"] = str(hybrid)
        if "throughput" in chosen:
            out["throughput"] = []
            out["memory"] = []
            out["throughput_hugetlb"] = []
            for n, repeats in zip(plan.sizes, plan.repeats):
                work = tmp / f"t{n}"
                work.mkdir()
                progress(f"throughput: {n}-token cache")
                out["throughput"].append(cases.throughput_child(work, plan.shape, n, repeats))
                progress(f"peak memory: get of the {n}-token entry")
                out["memory"].append(cases.peak_memory(work, n))
                shutil.rmtree(work, ignore_errors=True)
                if HUGETLB:
                    work.mkdir()
                    progress(f"throughput: {n}-token cache, GLIBC_TUNABLES={HUGETLB}")
                    out["throughput_hugetlb"].append(cases.throughput_child(work, plan.shape, n, repeats, {"GLIBC_TUNABLES": HUGETLB}))
                    shutil.rmtree(work, ignore_errors=True)
        if "lookup" in chosen:
            progress("lookup latency vs store size")
            out["lookup"] = cases.lookup(tmp, plan.lookup_sizes, plan.lookup_repeats)
        if "eviction" in chosen:
            progress("eviction vs store size")
            out["eviction"] = cases.eviction(tmp, plan.evict_sizes, 21 if not quick else 5)
        if "row_save" in chosen:
            progress("row save from a batch of 8")
            out["row_save"] = cases.row_save(tmp, plan.shape, plan.row_tokens)
        if "prefill" in chosen:
            progress("restore vs prefill on the fixture hybrid")
            out["prefill"] = cases.restore_vs_prefill(tmp, hybrid, plan.prefill_lengths, plan.prefill_repeats)
        out.update(_sharing_cases(tmp, plan, progress, chosen))
        if "draft" in chosen:
            progress("speculative decoding on the fixture hybrid: no draft, self-draft, a smaller draft")
            out["draft"] = draft_cases(5 if not quick else 1, 64 if not quick else 8, model_dir=hybrid, workdir=tmp)
        if "remote" in chosen:
            progress(f"remote tier: {plan.sizes[0]}-token cache through a local redis-server")
            (tmp / "remote").mkdir()
            out["remote"] = remote_cases(tmp / "remote", plan.shape, plan.sizes[0], 5 if not quick else 2)
            progress("remote tier: time to first token on a second store, the prompt prefilled by the first")
            (tmp / "remote-ttft").mkdir()
            out["remote_ttft"] = remote_ttft(tmp / "remote-ttft", hybrid, list(plan.prefill_lengths[-2:]), plan.prefill_repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["seconds"] = time.time() - started
    out["targets"] = targets(out)
    return out


def _sharing_cases(tmp: Path, plan: Plan, progress: Callable[[str], None], chosen: Sequence[str]) -> Dict[str, Any]:
    """The shared-block cases among ``chosen``, each in a scratch directory removed afterwards."""
    out: Dict[str, Any] = {}
    c = plan.chat
    if "chat" in chosen:
        out["chat"] = {}
        for name, shape in (("dense", plan.dense), ("hybrid", plan.shape)):
            progress(f"{c.turns}-turn chat through PersistentPromptCache, {name} cache")
            out["chat"][name] = {**serve_chat(tmp / f"chat-{name}", shape, c), "shape": shape_name(shape)}
            shutil.rmtree(tmp / f"chat-{name}", ignore_errors=True)
    if "shared_prompt" in chosen:
        out["shared_prompt"] = []
        for first in (True, False):
            progress(f"{plan.shared[0]} conversations sharing a {plan.shared[1]}-token system prompt"
                     + ("" if first else ", no system-prompt entry"))
            out["shared_prompt"].append(sharing.shared_prompt(tmp / "shared", plan.dense, *plan.shared, system_entry=first))
            shutil.rmtree(tmp / "shared", ignore_errors=True)
    if "prefix_read" in chosen:
        progress(f"prefix hit: {plan.prefix[1]} tokens of a {plan.prefix[0]}-token entry")
        out["prefix_read"] = sharing.entry_reads(tmp / "prefix", plan.dense, *plan.prefix, 3)
        shutil.rmtree(tmp / "prefix", ignore_errors=True)
    if plan.block_sizes and "block_sizes" in chosen:
        progress(f"block sizes {', '.join(map(str, plan.block_sizes))}: chat, shared prompt, long entry")
        out["block_sizes"] = sharing.block_sizes(tmp, plan.dense, plan.block_sizes, c, plan.shared, plan.prefix, repeats=3)
    return out


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def targets(res: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The targets (the goals of the README's Performance table) judged on a run's figures.

    Each item: ``name``, ``value``, ``op`` (``>=`` or ``<=``), ``target``,
    ``ok``, ``what`` (which figures were compared).
    """
    out: List[Dict[str, Any]] = []

    def judge(name: str, value: float, op: str, target: float, what: str, holds: bool = True) -> None:
        ok = holds and (value >= target if op == ">=" else value <= target)
        out.append({"name": name, "value": value, "op": op, "target": target, "ok": bool(ok), "what": what})

    for t in res.get("throughput", []):
        k = f"{t['tokens'] // 1024}K" if t["tokens"] >= 1024 else str(t["tokens"])
        judge(f"get vs mlx-lm load_prompt_cache ({k})", t["mlx_load_fresh"] / t["get_fresh"], ">=", 1.0,
              "fresh allocations both sides (mx.clear_cache() before each repeat); aim 1.5")
        judge(f"get vs memcpy ({k})", t["memcpy_fresh"] / t["get_fresh"], ">=", 0.6,
              "get with fresh allocations vs memcpy into a fresh buffer")
        judge(f"durable put vs file write+fsync ({k})", t["file_write"] / t["put"], ">=", 0.9,
              "blob file write+fsync and LMDB sync commit vs write+fsync of the same bytes; the store at a steady "
              "size (the entry of two puts ago deleted untimed), the file replaced")
        if "put_grow" in t:
            judge(f"durable put vs file write+fsync, both growing ({k})", t["file_write_grow"] / t["put_grow"], ">=", 0.9,
                  "every entry and every reference file kept: both sides take new space")
    for m in res.get("memory", []):
        k = f"{m['tokens'] // 1024}K" if m["tokens"] >= 1024 else str(m["tokens"])
        judge(f"peak memory of a get / N ({k})", m["rss_delta"] / m["bytes"], "<=", 1.25,
              "RSS high-water mark after the get minus RSS before, in a fresh process")
    lk = res.get("lookup", [])
    if lk:
        last = lk[-1]
        judge(f"lookup, 32K-token query, {last['entries']} entries (ms)", last["q32768"] * 1e3, "<=", 5.0,
              "median PromptStore.lookup incl. restoring the (tiny) hit")
    ev = res.get("eviction", [])
    if len(ev) >= 2:
        judge(f"put that evicts, {ev[-1]['entries']} vs {ev[0]['entries']} entries (time ratio)", ev[-1]["put_evict"] / ev[0]["put_evict"],
              "<=", 1.5, "median durable put that evicts the least recently used entry; flat means eviction does not scan the store")
    rs = res.get("row_save")
    if rs:
        judge("row save bytes written / row bytes", rs["written"] / rs["row_bytes"], "<=", 1.05,
              "bytes the put passed to write calls (/proc/self/io wchar) vs the extracted row's array bytes")
    for name, c in res.get("chat", {}).items():
        which = f"{c['chat']['turns']}-turn chat, {c.get('shape', name)}"
        judge(f"stored / unique bytes ({which})", c["stored"] / c["unique"], "<=", 1.10,
              "store.usage() after the chat vs its final KV once plus one recurrent state per entry kept")
        for stat, label in (("median", "median turn"), ("max", "worst turn")):
            judge(f"bytes written / new bytes, {label} ({which})", c[f"written_{stat}"], "<=", 1.10,
                  "bytes a turn (fetch, inserts, flush) passed to write calls (/proc/self/io wchar; write_bytes "
                  "counts whole page-cache folios) vs the KV of its new tokens plus the recurrent states it inserted")
    for s in res.get("shared_prompt", []):
        how = "system prompt put first" if s["system_entry"] else "whole conversations only"
        judge(f"stored / unique bytes ({s['conversations']} conversations sharing a {s['system']}-token system prompt, {how})",
              s["stored"] / s["unique"], "<=", 1.10,
              "store.usage() vs the system prompt's KV once plus each conversation's own")
    r = res.get("remote")
    if r and "skipped" not in r:
        k = f"{r['n_tokens'] // 1024}K" if r["n_tokens"] >= 1024 else str(r["n_tokens"])
        judge(f"remote get vs raw redis-py pipelined GETs ({k}), bit-exact", r["ratio"], ">=", 0.8,
              "find + fetch + check + assemble of the entry vs one pipeline of GETs of the same keys, one "
              "redis-server on loopback", holds=r["bits_exact"])
    p = res.get("prefix_read")
    if p:
        judge(f"prefix hit: bytes read / prefix bytes ({p['prefix']} of a {p['tokens']}-token entry), bit-exact",
              p["bytes_read"] / p["prefix_bytes"], "<=", 1.10,
              "Hit.bytes_read of the lookup vs the prefix's KV bytes; fails too if the restored prefix "
              "differs from the stored rows", holds=p["bit_exact"])
    return out


def shape_name(shape: data.Shape) -> str:
    """How the tables name a cache shape."""
    if shape == data.QWEN3_NEXT_80B:
        return "Qwen3-Next-80B shape"
    if shape == data.DENSE:
        return "dense fixture shape"
    return f"{shape.ssm_layers} recurrent + {shape.attn_layers} attention layers"
