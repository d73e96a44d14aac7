"""The terminal summary of a bench run (rich tables)."""
from __future__ import annotations

import sys
from typing import Any


def _fmt(x, spec: str = ".2f", scale: float = 1.0, none: str = "–") -> str:
    return none if x is None else format(x * scale, spec)


def _bytes(n) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _mib(n) -> str:
    return "–" if n is None else f"{n / 2**20:.2f}"


def print_bench(doc: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    cfg = doc["config"]
    first = doc["engines"][0]["label"]
    cuda = doc["engines"][0]["device"].startswith("cuda")
    title = (f"trtkv bench — prompt {cfg['prompt_len']} tokens, {cfg['gen_len']} generated, {cfg['repeat']} "
             f"repeat(s), device {doc['engines'][0]['device']}")
    t = Table(title=title + ": latency", title_justify="left")
    for col in ("engine", "batch", "prefill/req s", "TPOT p50 ms", "p90", "p99", "e2e s", "tok/s", "× first",
                "GB/s"):
        t.add_column(col, justify="left" if col == "engine" else "right", no_wrap=col == "engine")
    for r in doc["results"]:
        t.add_row(r["engine"], str(r["batch"]), _fmt(r["prefill_s_per_request"], ".3f"), _fmt(r["tpot_ms_p50"], ".1f"),
                  _fmt(r["tpot_ms_p90"], ".1f"), _fmt(r["tpot_ms_p99"], ".1f"), _fmt(r["e2e_s"], ".2f"),
                  _fmt(r["tokens_per_s"], ".1f"), _fmt(r["ratios_to_first"]["tokens_per_s"], ".2f") + "×",
                  _fmt(r["bandwidth_gb_s"], ".2f"))
    console.print(t)
    m = Table(title=title + ": KV memory (MiB)", title_justify="left")
    for col in ("engine", "batch", "KV/req end", "KV/req peak", "vs fp16", "× first", "KV total peak",
                "GPU peak" if cuda else "KV pool peak"):
        m.add_column(col, justify="left" if col == "engine" else "right", no_wrap=col == "engine")
    for r in doc["results"]:
        full = r["kv_bytes_full_fp16_per_request"]
        m.add_row(r["engine"], str(r["batch"]), _mib(r["kv_bytes_per_request_end"]),
                  _mib(r["kv_bytes_per_request_peak"]),
                  _fmt(r["kv_bytes_per_request_end"] / full if full else None, ".1%"),
                  _fmt(r["ratios_to_first"]["kv_bytes_per_request_peak"], ".2f") + "×",
                  _mib(r["kv_bytes_total_peak"]),
                  _mib(r["peak_device_bytes"] if cuda else r.get("kv_pool_peak_bytes", r["kv_pool_bytes"])))
    console.print(m)
    mem = ("torch.cuda.max_memory_allocated" if cuda else
           "pool pages and key-scale groups in use at once, at most (process RSS is in results.json)")
    console.print(f"[dim]× first: ratio to {first} at the same batch size (tok/s; per-request peak KV). GB/s = "
                  f"(weight bytes + KV bytes held) / decode step time, the achieved memory bandwidth. vs fp16: KV "
                  f"held at the end / an uncompressed fp16 cache of the same tokens. Last column: {mem}.[/dim]")
    kv = doc["config"].get("kv_memory")
    if kv:
        ft = Table(title=f"largest batch that fits {_bytes(kv)} of KV memory", title_justify="left")
        for col in ("engine", "per-request peak KV", "max batch", "uncompressed fp16 would fit"):
            ft.add_column(col, justify="left" if col == "engine" else "right")
        for name, f in doc["max_batch_fit"].items():
            ft.add_row(name, _bytes(f["per_request_peak_kv_bytes"]), str(f["max_batch"]), str(f["fit_full_fp16"]))
        console.print(ft)
        console.print(f"[dim]method: {doc['fit_method']}[/dim]")
    print_memory_limited(doc, console)
    print_tier_stats(doc, console)
    print_profile(doc, console)
    print_policy_stats(doc, console)
    for note in doc.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {note}")


def print_memory_limited(doc: dict[str, Any], console) -> None:
    """The memory-limited run, shaped like the seed paper's Table 2: each engine's largest concurrent batch in
    the KV memory, its per-request footprint vs an fp16 full cache, and the output tokens/s it reached."""
    rows = [r for r in doc["results"] if r.get("admission_batch")]
    if not rows:
        return
    from rich.table import Table

    t = Table(title=f"throughput at {_bytes(doc['config']['kv_memory'])} of KV memory", title_justify="left")
    for col in ("engine", "requests", "batch (max concurrent)", "mem. footprint %", "KV/req peak", "tok/s steady",
                "× first", "tok/s overall", "TPOT p50 ms", "p99"):
        t.add_column(col, justify="left" if col == "engine" else "right", no_wrap=col == "engine")
    ref = rows[0]["steady_tokens_per_s"]
    for r in rows:
        done = "" if r.get("cut_at_s") is None else f" ({r['requests_finished']:g} done)"
        t.add_row(r["engine"], f"{r['requests']}{done}", f"{r['max_concurrent']} (admits {r['admission_batch']})",
                  _fmt(r["kv_footprint_pct"], ".1f"), _bytes(r["kv_bytes_per_request_peak"]),
                  _fmt(r["steady_tokens_per_s"], ".1f"),
                  _fmt(r["steady_tokens_per_s"] / ref if ref else None, ".2f") + "×",
                  _fmt(r["tokens_per_s"], ".1f"), _fmt(r["tpot_ms_p50"], ".1f"), _fmt(r["tpot_ms_p99"], ".1f"))
    console.print(t)
    console.print("[dim]batch: the most requests decoding at once (admission reserves each request's worst-case "
                  "pages). mem. footprint: a request's peak KV bytes / an fp16 full cache of its tokens. tok/s "
                  "steady: output tokens/s from the step the batch first reached 90% of its maximum to the last "
                  "step with requests still waiting (newcomers' prefills included); overall: every token / the "
                  "whole run, the draining tail included.[/dim]")
    cut = [f"{r['engine']} at {r['cut_at_s']:.0f} s" for r in rows if r.get("cut_at_s") is not None]
    if cut:
        console.print(f"[dim]--duration stopped runs with requests unfinished ({', '.join(cut)}): tok/s steady is "
                      "the window reached, through the stop; overall counts the tokens generated by then.[/dim]")


def print_tier_stats(doc: dict[str, Any], console) -> None:
    """Tiered memory: device vs host bytes, transfers per step, share of step time moving KV."""
    from rich.table import Table

    rows = [r for r in doc["results"] if r.get("kv_bytes_host_peak") or r.get("transfer_bytes_per_step")]
    if not rows:
        return
    t = Table(title="tiered KV memory (per request, MiB)", title_justify="left")
    for col in ("engine", "batch", "device peak", "host peak", "transfer/step", "moving KV"):
        t.add_column(col, justify="left" if col == "engine" else "right", no_wrap=col == "engine")
    for r in rows:
        t.add_row(r["engine"], str(r["batch"]), _mib(r["kv_bytes_device_peak"]), _mib(r["kv_bytes_host_peak"]),
                  _mib(r["transfer_bytes_per_step"]), _fmt(r["kv_move_share"], ".1%"))
    console.print(t)
    console.print("[dim]device peak includes the two one-layer staging buffers; transfer/step: host->device "
                  "staging plus tier moves of all running requests, per batched decode step; moving KV: share of "
                  "step time spent copying KV between tiers (CPU: wall time of the copies; CUDA: copy-stream "
                  "time, which overlaps compute, so an upper bound on the stall).[/dim]")


def print_profile(doc: dict[str, Any], console) -> None:
    """``--profile``: where a decode step's time goes, per engine and batch (mean ms per step)."""
    from rich.table import Table

    from trtkv.runtime.observers import PROFILE_PHASES

    rows = [r for r in doc["results"] if r.get("profile_ms")]
    if not rows:
        return
    t = Table(title="decode step profile (mean ms per step)", title_justify="left")
    for col in ("engine", "batch", *PROFILE_PHASES, "step", "overhead", "× first"):
        t.add_column(col, justify="left" if col == "engine" else "right", no_wrap=col == "engine")
    for r in rows:
        t.add_row(r["engine"], str(r["batch"]), *(_fmt(r["profile_ms"][p], ".3f") for p in PROFILE_PHASES),
                  _fmt(r["step_ms_mean"], ".3f"), _fmt(r["engine_overhead_ms"], ".3f"),
                  _fmt(r["ratios_to_first"].get("engine_overhead_ms"), ".2f") + "×")
    console.print(t)
    console.print("[dim]model: embedding, projections, norms, MLP, logits; attention: the paged-attention kernel, "
                  "residual-buffer attention and the merge; kv_write: the kv_write kernel and residual-buffer copies; "
                  "policy: the policy's hooks and the attention statistics it asked for; bookkeeping: the rest of the "
                  "measured step (block tables, validity, slot allocation, eviction bookkeeping, sampling, "
                  "detokenization). overhead = kv_write + policy + bookkeeping; × first: its ratio to the first "
                  "engine's.[/dim]")


def print_policy_stats(doc: dict[str, Any], console) -> None:
    """One table per set of columns a policy declares (``KVPolicy.report_columns``), over its rows; the
    report knows no policy by name. Policies sharing columns (e.g. ThinKV's variants) share a table."""
    from rich.table import Table

    from trtkv.policies import POLICIES

    groups: dict[tuple, list[str]] = {}
    for name in dict.fromkeys(r["policy"] for r in doc["results"]):
        cls = POLICIES.get(name)
        cols = tuple(cls.report_columns()) if cls is not None else ()
        if cols:
            groups.setdefault(cols, []).append(name)
    for cols, names in groups.items():
        rows = [r for r in doc["results"] if r["policy"] in names]
        t = Table(title=f"{', '.join(names)} (mean per request)", title_justify="left")
        for col in ("engine", "batch") + tuple(c.title for c in cols):
            t.add_column(col, justify="left" if col == "engine" else "right", no_wrap=col == "engine")
        for r in rows:
            st = r.get("policy_stats", {})
            t.add_row(r["engine"], str(r["batch"]), *(_fmt(st.get(c.key), c.spec) for c in cols))
        console.print(t)
