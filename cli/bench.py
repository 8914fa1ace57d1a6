"""``promptstore bench``: throughput, lookup, memory, TTFT and shared blocks beside references."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import click

from promptstore.cli._common import check_output, command, emit_json, format_size, guarded, json_option
from promptstore.bench import CASES, gbps, run


@command()
@click.option("--quick", is_flag=True, help="Tiny sizes and few repeats (seconds; for CI). No time is asserted.")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the results as Markdown to this file.")
@click.option("--dir", "scratch", type=click.Path(file_okay=False, exists=True), default=None,
              help="Directory for the scratch stores and files (on the disk to measure) [default: system temp].")
@click.option("--only", "only", default=None, metavar="CASE[,CASE...]",
              help=f"Run only these cases (and judge only their targets): {', '.join(CASES)}.")
@json_option
@guarded
def bench(quick, out_file, scratch, only, as_json):
    """Measure promptstore against mlx-lm, plain files and memcpy.

    Builds a Qwen3-Next-80B-shaped prompt cache (36 gated-DeltaNet layers,
    12 attention layers) at 4K and 32K tokens and measures durable put and
    get beside mlx-lm save/load_prompt_cache, file write+fsync/read and
    memcpy of the same bytes; lookup latency against store size; the peak
    memory of a get; time to first token on the fixture hybrid, cold and
    restored; and the bytes written saving one row of a batch of 8. Then
    shared blocks: a multi-turn chat through PersistentPromptCache (dense
    fixture shape and Qwen3-Next-80B shape: bytes stored and written per
    turn against unique and new bytes), conversations sharing one system
    prompt, a prefix hit on a long entry (bytes read), and in a full run the
    same at several block sizes. Prints each ratio against its target
    (PASS/MISS). Uses scratch stores only, never the --store directory. A
    full run takes several minutes and several GB of scratch disk.
    """
    def progress(line: str) -> None:
        click.echo(f"bench: {line}", err=True)

    cases = None if only is None else [c.strip() for c in only.split(",") if c.strip()]
    unknown = sorted(set(cases or ()) - set(CASES))
    if unknown or cases == []:
        raise click.BadParameter(f"{', '.join(unknown) or 'no case'}: choose among {', '.join(CASES)}", param_hint="--only")
    if out_file:
        out_file = check_output(out_file, "--out")  # before a run of minutes, not after it
    results = run(quick=quick, workdir=Path(scratch) if scratch else None, progress=progress, only=cases)
    results["command"] = "promptstore bench" + "".join(
        f" {flag}" for flag, on in (("--quick", quick), ("--json", as_json)) if on
    ) + "".join(f" {flag} {value}" for flag, value in (("--out", out_file), ("--dir", scratch), ("--only", only)) if value)
    text = render(results)
    if as_json:  # printed first: a file that cannot be written loses no result
        emit_json(results)
    else:
        click.echo(text)
    if out_file:
        Path(out_file).write_text(text)


def _size(n: float) -> str:
    return format_size(int(n))


def render(res: Dict[str, Any]) -> str:
    """The results as Markdown: targets first, then every measured figure."""
    lines: List[str] = []
    add = lines.append
    mode = "quick" if res["quick"] else "full"
    if res.get("only"):
        mode += ", only " + ", ".join(res["only"])
    m = res["machine"]
    add(f"# promptstore bench ({mode} run)")
    add("")
    if res.get("command"):
        add(f"`{res['command']}`")
        add("")
    restore = ""
    if "restore" in m:  # how gets filled their buffers (reports from before it have no such field)
        restore = f", restores {m['restore']}" + (f" with {m['loaders']} loaders" if m["restore"] != "direct" else "")
    add(f"{m['platform']}, {m['processor']}, mlx {m['mlx']} on {m['device']}{restore}; {res['seconds']:.0f} s. "
        "Times are medians; reads are from a warm page cache.")
    add("")
    add("## Targets")
    add("")
    add("| target | measured | goal | result |")
    add("| --- | ---: | ---: | --- |")
    for t in res["targets"]:
        add(f"| {t['name']} | {t['value']:.2f} | {t['op']} {t['target']:g} | {'PASS' if t['ok'] else 'MISS'} |")
    add("")
    if res.get("throughput"):
        add("## Throughput (GB/s; ratio = promptstore / reference)")
        add("")
        lines.extend(_throughput(res["throughput"], gbps))
        add("*fresh*: the mlx buffer cache is emptied (`mx.clear_cache()`) before each get/load, and memcpy "
            "goes into a newly allocated buffer, so page faults on the destination are paid. *reuse*: "
            "`mx.set_cache_limit` leaves room for the previous repeat's buffers (the mlx buffer cache) and "
            "memcpy reuses one numpy buffer. *put*: the store at a steady size, as the reference replaces its "
            "file: the entry of two puts ago is deleted (untimed) before the next put, which unlinks its blob "
            "file as the reference unlinks its file. *grow*: every entry (in a store of "
            "its own) and every reference file is kept, so both sides take new "
            "space (on this VM, first-touched memory for the page cache is what that costs). mlx-lm's save is "
            "followed by an fsync of the file so both sides are durable. "
            "The operations run interleaved, one of each per round, every other round in reverse order, in a "
            "fresh process per cache size; before each of the first set (put, write, save, fresh get/load/read/"
            "memcpy) N bytes are touched and freed, so each starts with the same warm free memory (on this VM, "
            "memory freed seconds earlier goes back to the host and costs host faults to touch again). "
            "Bytes written per put: what one steady put passed to write calls (`/proc/self/io` wchar: payload, "
            "blocks, manifest, index, LMDB pages).")
        add("")
        if res.get("throughput_hugetlb"):
            add("### The same, with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`")
            add("")
            lines.extend(_throughput(res["throughput_hugetlb"], gbps))
            add("glibc then backs large mallocs (mlx's buffers, LMDB's dirty pages) with transparent huge "
                "pages, so a fresh destination costs one fault per 2 MiB instead of per 4 KiB.")
            add("")
        add("## Peak memory of a get (fresh process)")
        add("")
        add("| entry | N | RSS peak delta / N | private (RssAnon) peak / N | LMDB pages left mapped / N | mlx allocator peak / N | get s |")
        add("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for mm in res["memory"]:
            n = mm["bytes"]
            add(f"| {mm['tokens']} tokens | {_size(n)} | {mm['rss_delta'] / n:.2f} | {mm['anon_delta'] / n:.2f} | "
                f"{mm.get('file_delta', 0) / n:.2f} | {mm['mlx_peak'] / n:.2f} | {mm['get_s']:.3f} |")
        add("")
        add("RSS: `VmHWM` after the get minus `VmRSS` before it, in a fresh process that first restored a "
            "1-token entry (so code and imports do not count). RssAnon is sampled every millisecond.")
        add("")
    if res.get("lookup"):
        add("## Lookup latency (ms, median)")
        add("")
        add("| entries | store file | 1K-token query | 32K-token query | 1K, index only (peek) | 32K, index only (peek) |")
        add("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in res["lookup"]:
            add(f"| {r['entries']} | {_size(r['file_bytes'])} | {r['q1024'] * 1e3:.2f} | {r['q32768'] * 1e3:.2f} | "
                f"{r.get('peek1024', 0) * 1e3:.2f} | {r.get('peek32768', 0) * 1e3:.2f} |")
        add("")
        add("lookup: the index, then the hit restored (900 and 31000 tokens of a 2-byte-per-token cache); "
            "peek: the index alone.")
        add("")
    if res.get("eviction"):
        add("## Eviction vs store size (ms, median)")
        add("")
        add("| entries | put | put that evicts the LRU entry |")
        add("| ---: | ---: | ---: |")
        for r in res["eviction"]:
            add(f"| {r['entries']} | {r['put'] * 1e3:.2f} | {r['put_evict'] * 1e3:.2f} |")
        add("")
        add("Durable puts of an 8-token entry; with the budget at the store's usage each put evicts the least "
            "recently used entry, found by walking the ordered last-use index (`lru`) from its start. The stores are "
            "built first, then their puts run interleaved, one into each per round.")
        add("")
    d = res.get("draft")
    if d:
        add(f"## Speculative decoding on the fixture hybrid ({d['layers']['target']} layers)")
        add("")
        add("| draft | tokens/s | vs no draft | draft tokens | accepted | acceptance |")
        add("| --- | ---: | ---: | ---: | ---: | ---: |")
        add(f"| none (mlx-lm generate_step) | {d['no_draft']['tokens_per_s']:.1f} | 1.00 | | | |")
        for key, label in (("self_draft", "the target itself"), ("small_draft", f"its first {d['layers']['small_draft']} layers")):
            v = d[key]
            add(f"| {label} | {v['tokens_per_s']:.1f} | {v['speedup']:.2f} | {v['draft_tokens']} | {v['accepted']} | {v['acceptance']:.2f} |")
        add("")
        add(f"Greedy decoding of {d['max_tokens']} tokens after a {d['prompt_tokens']}-token prompt, {d['num_draft_tokens']} draft "
            f"tokens per verify round, median of {d['repeats']} runs; the three produce the same tokens: {d['tokens_identical']}. "
            "Random-weight fixtures: the acceptance of the smaller draft says nothing about real models.")
        add("")
        o = d.get("one_at_a_time")
        if o:
            add(f"{o['requests']} concurrent requests of {d['max_tokens']} tokens each, prompt to last token (prefill "
                f"included), median of {o['repeats']} runs:")
            add("")
            add("| served | seconds | tokens/s |")
            add("| --- | ---: | ---: |")
            for key, label in (("serial_self_draft", "one at a time, self-draft (the server with a draft)"),
                               ("serial_no_draft", "one at a time, no draft"),
                               ("batched_no_draft", "one BatchGenerator batch, no draft (the server without a draft)")):
                add(f"| {label} | {o[key]['seconds']:.3f} | {o[key]['tokens_per_s']:.1f} |")
            add("")
            add(f"Served one at a time with the self-draft, the requests take {1 / o['self_draft_vs_batched']:.2f}x the "
                f"batch's time; the self-draft's tokens equal those without a draft: "
                f"{o['self_draft_tokens_identical']}; the batch's tokens equal the one-at-a-time tokens: "
                f"{o['batched_tokens_identical']}.")
            add("")
    r = res.get("remote")
    if r:
        add("## Remote tier (one redis-server on loopback)")
        add("")
        if "skipped" in r:
            add(f"Skipped: {r['skipped']}")
        else:
            add("| cache | keys | bytes | remote get s | raw pipelined GETs s | get / raw | read-through into a local store s | bit-exact |")
            add("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
            add(f"| {r['n_tokens']} tokens | {r['keys']} | {_size(r['bytes'])} | {r['fetch_s']:.3f} | {r['raw_s']:.3f} | "
                f"{r['ratio']:.2f} | {r['lookup_s']:.3f} | {r['bits_exact']} |")
            add("")
            add("*remote get*: a second store finds the entry by its tokens and fetches, checks (every block against "
                "its address) and assembles it; *raw*: one redis-py pipeline of GETs of the same keys; *read-through*: "
                "`lookup` on a store without the entry, which also writes it into the local store.")
        add("")
        rt = res.get("remote_ttft") or {}
        if rt.get("rows"):
            add("| fixture hybrid, prompt tokens | cold prefill + first token s | from the remote + first token s | speedup | same first token |")
            add("| ---: | ---: | ---: | ---: | --- |")
            for row in rt["rows"]:
                add(f"| {row['tokens']} | {row['cold_s']:.3f} | {row['remote_s']:.3f} | {row['cold_s'] / row['remote_s']:.1f}x | {row['same_first_token']} |")
            add("")
            add("Store A prefilled and published the prompt; store B (local copy deleted before each repeat) reads it "
                "through from the remote, writes it locally and runs the last token.")
        add("")
    rs = res.get("row_save")
    if rs:
        add(f"## Saving row {rs['row']} of a batch of {rs['rows']}")
        add("")
        add("| row tokens | row bytes | batch bytes | entry payload | bytes written | written / row | extract s | put s |")
        add("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        add(f"| {rs['row_tokens']} | {_size(rs['row_bytes'])} | {_size(rs['batch_bytes'])} | {_size(rs['entry_bytes'])} | "
            f"{_size(rs['written'])} | {rs['written'] / rs['row_bytes']:.3f} | {rs['extract_s']:.3f} | {rs['put_s']:.3f} |")
        add("")
        add(f"Saved with {rs['method']}; recurrent layers are {rs['ssm_class']}. Bytes written: what the put passed "
            "to write calls (`/proc/self/io` wchar: payload, blocks, manifest, index and LMDB pages).")
        add("")
    if res.get("prefill"):
        add("## Time to first token on fixtures/models/qwen3_next (ms)")
        add("")
        add("| prompt tokens | cold prefill | restored + 1 step | speedup | entry | same first token |")
        add("| ---: | ---: | ---: | ---: | ---: | --- |")
        for p in res["prefill"]:
            add(f"| {p['tokens']} | {p['cold_s'] * 1e3:.1f} | {p['restored_s'] * 1e3:.1f} | {p['cold_s'] / p['restored_s']:.1f}x | "
                f"{_size(p['entry_bytes'])} | {p['same_first_token']} |")
        add("")
    lines.extend(_sharing(res))
    return "\n".join(lines)


def _throughput(rows: List[Dict[str, Any]], gbps) -> List[str]:
    out = [
        "| cache | bytes | ps put | ps put grow | ps get fresh | ps get reuse | mlx-lm save+fsync | mlx-lm load fresh | mlx-lm load reuse | file write+fsync | file write+fsync grow | file read | memcpy fresh | memcpy reuse |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    keys = ("put", "put_grow", "get_fresh", "get_reuse", "mlx_save", "mlx_load_fresh", "mlx_load_reuse", "file_write", "file_write_grow", "file_read", "memcpy_fresh", "memcpy_reuse")
    for t in rows:
        b = t["bytes"]
        out.append(f"| {t['tokens']} tokens | {_size(b)} | " + " | ".join(f"{gbps(b, t[k]):.2f}" for k in keys) + " |")
    out += [
        "",
        "| cache | put / file write | put grow / file write grow | put / mlx-lm save | get / mlx-lm load (fresh) | get / mlx-lm load (reuse) | get / file read | get / memcpy (fresh) | get / memcpy (reuse) | bytes written per put / N | bit-exact |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for t in rows:
        out.append(
            f"| {t['tokens']} tokens | {t['file_write'] / t['put']:.2f} | {t['file_write_grow'] / t['put_grow']:.2f} | "
            f"{t['mlx_save'] / t['put']:.2f} | "
            f"{t['mlx_load_fresh'] / t['get_fresh']:.2f} | {t['mlx_load_reuse'] / t['get_reuse']:.2f} | "
            f"{t['file_read'] / t['get_fresh']:.2f} | {t['memcpy_fresh'] / t['get_fresh']:.2f} | "
            f"{t['memcpy_reuse'] / t['get_reuse']:.2f} | {t['put_written_per_put'] / t['bytes']:.2f} | {t['bit_exact']} |"
        )
    out.append("")
    return out


def _sharing(res: Dict[str, Any]) -> List[str]:
    """The shared-block sections: chat, shared system prompt, prefix hit, block sizes."""
    out: List[str] = []
    add = out.append
    chats = res.get("chat", {})
    if chats:
        first = next(iter(chats.values()))
        c0 = first["chat"]
        per_turn = c0["user"] + c0["tail"] + c0["answer"]
        add(f"## A {c0['turns']}-turn chat through PersistentPromptCache")
        add("")
        add("| cache | final tokens | entries kept | stored | unique | stored / unique | unshared / unique | manifests / stored "
            "| written / new, median turn | worst turn | of which files / new, median | LMDB / new, median | worst "
            "| page cache dirtied / new, median | worst | put s | restored bit-exact |")
        add("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for c in chats.values():
            add(f"| {c['shape']} | {c['final_tokens']} | {c['entries']} | {_size(c['stored'])} | {_size(c['unique'])} | "
                f"{c['stored'] / c['unique']:.3f} | {c['logical'] / c['unique']:.2f} | {c['manifests'] / c['stored']:.3f} | "
                f"{c['written_median']:.2f} | {c['written_max']:.2f} | {c['files_median']:.2f} | {c['lmdb_median']:.2f} | "
                f"{c['lmdb_max']:.2f} | {c['dirtied_median']:.2f} | {c['dirtied_max']:.2f} | "
                f"{c['put_s']:.3f} | {c['bit_exact']} |")
        add("")
        for c in chats.values():
            add(f"- {c['shape']}, written / new by turn: " + " ".join(f"{t['written'] / t['new']:.2f}" for t in c["turns"]))
        add("")
        add(f"A {c0['system']}-token system prompt, then each turn a {c0['user']}-token user message, a "
            f"{c0['tail']}-token generation prompt and a {c0['answer']}-token answer ({per_turn} new tokens), driven as "
            "mlx-lm's server drives its prompt cache: `fetch_nearest_cache`, the cache extended (never recomputed), "
            "`insert_cache` at the end of the system prompt (first turn), of the user message (`\"user\"`) and of the "
            "answer (`\"assistant\"`), the writer flushed every turn. Recurrent layers get a new state at every insert. "
            f"The serving cache keeps the latest {first['checkpoints']} checkpoints of a chain that cannot be trimmed, "
            "plus the system prompt's (trimmable entries are all kept). *unique*: the final KV once "
            "plus one recurrent state per entry kept; *unshared*: the entries' array bytes summed; *new*: the KV of a "
            "turn's new tokens plus the recurrent states it inserted; *written*: the bytes the turn passed to write "
            "calls (`/proc/self/io` wchar), of which *files*: the block and blob files the turn created (each "
            "written once), and *LMDB*: the rest, LMDB's pages and meta; *page cache dirtied*: its write_bytes, "
            "which on Linux >= 6.16 (ext4 large folios) counts every page-cache folio a write touches, whole: far "
            "more than the device writes when writes are small and scattered.")
        add("")
    shared = res.get("shared_prompt", [])
    if shared:
        add("## Conversations sharing one system prompt (dense fixture shape)")
        add("")
        add("| conversations | system tokens | own tokens | put | stored | unique | stored / unique | unshared / unique | manifests / stored | put s |")
        add("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for s in shared:
            how = "system prompt first" if s["system_entry"] else "whole conversations"
            add(f"| {s['conversations']} | {s['system']} | {s['own_tokens']} | {how} | {_size(s['stored'])} | {_size(s['unique'])} | "
                f"{s['stored'] / s['unique']:.3f} | {s['logical'] / s['unique']:.2f} | {s['manifests'] / s['stored']:.3f} | {s['put_s']:.3f} |")
        add("")
        add("Each conversation continues the system prompt's KV rows and adds 200-500 tokens of its own; put one by one "
            "with `PromptStore.put`. *system prompt first*: its cache is put before the conversations, as mlx-lm's server "
            "stores it; *whole conversations*: only they are put, as a warm-up of whole prompts does, so the block that "
            "holds the end of the system prompt is stored again by each conversation.")
        add("")
    p = res.get("prefix_read")
    if p:
        add("## A prefix hit on a long trimmable entry (dense fixture shape)")
        add("")
        add("| entry | prefix | entry bytes | prefix bytes | bytes read | read / prefix | bit-exact | lookup ms | get of the entry ms | put GB/s |")
        add("| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
        add(f"| {p['tokens']} | {p['prefix']} | {_size(p['bytes'])} | {_size(p['prefix_bytes'])} | {_size(p['bytes_read'])} | "
            f"{p['bytes_read'] / p['prefix_bytes']:.3f} | {p['bit_exact']} | {p['lookup_s'] * 1e3:.1f} | {p['get_s'] * 1e3:.1f} | "
            f"{gbps(p['bytes'], p['put_s']):.2f} |")
        add("")
        add("The query shares the entry's first tokens, then differs: `lookup` trims the entry to the common prefix, "
            "reading only the blocks that cover it (`Hit.bytes_read`); the restored rows are compared with the stored "
            "entry's, bit for bit.")
        add("")
    sizes = res.get("block_sizes", [])
    if sizes:
        e0 = sizes[0]["entry"]
        add("## Block size (`PromptStore(block_tokens=N)`, dense fixture shape)")
        add("")
        add(f"| block tokens | block bytes | chat stored / unique | chat written / new | shared stored / unique | "
            f"shared, whole conversations | put GB/s ({e0['tokens']}) | get GB/s | lookup ms ({e0['prefix']}-token prefix) | "
            "prefix read / prefix | manifest | store file / stored |")
        add("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for b in sizes:
            e = b["entry"]
            add(f"| {b['block_tokens']} | {_size(b['block_bytes'])} | {b['chat_ratio']:.3f} | {b['chat_written_median']:.2f} | "
                f"{b['shared_ratio']:.3f} | {b['shared_whole_ratio']:.3f} | {gbps(e['bytes'], e['put_s']):.2f} | "
                f"{gbps(e['bytes'], e['get_s']):.2f} | {e['lookup_s'] * 1e3:.1f} | {e['bytes_read'] / e['prefix_bytes']:.3f} | "
                f"{_size(e['manifest'])} | {e['file'] / e['stored']:.2f} |")
        add("")
        add("The chat, the shared system prompt (both ways) and the long entry above, at each block size. *block bytes*: "
            "one block of one array (a layer's keys or values); *chat written / new*: median turn; *manifest*: of one "
            "entry of the long entry's length; *store file / stored*: the long entries' store file against `usage()`.")
        add("")
    return out

