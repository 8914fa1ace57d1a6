"""``promptstore bench``: throughput, lookup, memory and TTFT beside references."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import click

from promptstore.cli._common import command, emit_json, format_size, guarded, json_option
from promptstore.bench import gbps, run


@command()
@click.option("--quick", is_flag=True, help="Tiny sizes and few repeats (seconds; for CI). No time is asserted.")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the results as Markdown to this file.")
@click.option("--dir", "scratch", type=click.Path(file_okay=False, exists=True), default=None,
              help="Directory for the scratch stores and files (on the disk to measure) [default: system temp].")
@json_option
@guarded
def bench(quick, out_file, scratch, as_json):
    """Measure promptstore against mlx-lm, plain files and memcpy.

    Builds a Qwen3-Next-80B-shaped prompt cache (36 gated-DeltaNet layers,
    12 attention layers) at 4K and 32K tokens and measures durable put and
    get beside mlx-lm save/load_prompt_cache, file write+fsync/read and
    memcpy of the same bytes; lookup latency against store size; the peak
    memory of a get; time to first token on the fixture hybrid, cold and
    restored; and the bytes written saving one row of a batch of 8. Prints
    each ratio against its target (PASS/MISS). Uses scratch stores only,
    never the --store directory. A full run takes a few minutes and several
    GB of scratch disk.
    """
    def progress(line: str) -> None:
        click.echo(f"bench: {line}", err=True)

    results = run(quick=quick, workdir=Path(scratch) if scratch else None, progress=progress)
    results["command"] = "promptstore bench" + "".join(
        f" {flag}" for flag, on in (("--quick", quick), ("--json", as_json)) if on
    ) + "".join(f" {flag} {value}" for flag, value in (("--out", out_file), ("--dir", scratch)) if value)
    text = render(results)
    if out_file:
        Path(out_file).write_text(text)
    if as_json:
        emit_json(results)
    else:
        click.echo(text)


def _size(n: float) -> str:
    return format_size(int(n))


def render(res: Dict[str, Any]) -> str:
    """The results as Markdown: targets first, then every measured figure."""
    lines: List[str] = []
    add = lines.append
    mode = "quick" if res["quick"] else "full"
    m = res["machine"]
    add(f"# promptstore bench ({mode} run)")
    add("")
    if res.get("command"):
        add(f"`{res['command']}`")
        add("")
    add(f"{m['platform']}, {m['processor']}, mlx {m['mlx']} on {m['device']}; {res['seconds']:.0f} s. "
        "Times are medians; reads are from a warm page cache.")
    add("")
    add("## Targets")
    add("")
    add("| target | measured | goal | result |")
    add("| --- | ---: | ---: | --- |")
    for t in res["targets"]:
        add(f"| {t['name']} | {t['value']:.2f} | {t['op']} {t['target']:g} | {'PASS' if t['ok'] else 'MISS'} |")
    add("")
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
        "Bytes written per put: /proc/self/io write_bytes of one put (payload, manifest, index, LMDB pages).")
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
    add("## Lookup latency (ms, median)")
    add("")
    add("| entries | store file | 1K-token query | 32K-token query |")
    add("| ---: | ---: | ---: | ---: |")
    for r in res["lookup"]:
        add(f"| {r['entries']} | {_size(r['file_bytes'])} | {r['q1024'] * 1e3:.2f} | {r['q32768'] * 1e3:.2f} |")
    add("")
    rs = res["row_save"]
    add(f"## Saving row {rs['row']} of a batch of {rs['rows']}")
    add("")
    add("| row tokens | row bytes | batch bytes | entry payload | bytes written | written / row | extract s | put s |")
    add("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    add(f"| {rs['row_tokens']} | {_size(rs['row_bytes'])} | {_size(rs['batch_bytes'])} | {_size(rs['entry_bytes'])} | "
        f"{_size(rs['written'])} | {rs['written'] / rs['row_bytes']:.3f} | {rs['extract_s']:.3f} | {rs['put_s']:.3f} |")
    add("")
    add(f"Saved with {rs['method']}; recurrent layers are {rs['ssm_class']}. Bytes written: /proc/self/io "
        "write_bytes of the put (payload, manifest, index and LMDB pages).")
    add("")
    add("## Time to first token on fixtures/models/qwen3_next (ms)")
    add("")
    add("| prompt tokens | cold prefill | restored + 1 step | speedup | entry | same first token |")
    add("| ---: | ---: | ---: | ---: | ---: | --- |")
    for p in res["prefill"]:
        add(f"| {p['tokens']} | {p['cold_s'] * 1e3:.1f} | {p['restored_s'] * 1e3:.1f} | {p['cold_s'] / p['restored_s']:.1f}x | "
            f"{_size(p['entry_bytes'])} | {p['same_first_token']} |")
    add("")
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
