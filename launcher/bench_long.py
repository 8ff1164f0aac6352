"""`kimiserve bench --long-prompt-len N`: what one long prompt does to everyone else, and what they do to it.

Three phases against a running router, each prompt fresh random ids (no prefix-cache hits):
1. long solo: one N-token prompt alone; its TTFT (and once more at the end: the solo figure is the mean of both, so
   a machine that speeds up or slows down over the run favours neither side).
2. shorts alone: `concurrency` closed-loop clients sending --input-len / --output-len requests, for as long as the
   long prompt took alone (at least 2 s); their TTFT and inter-token latency.
3. mixed: the same clients, and once they run, the long prompt again; the clients' requests sent while it prefills
   and the token gaps that fall in that window, and the long prompt's own TTFT.
The report compares phase 3 with phases 1 and 2 (ratios of medians and p99s).
"""

from __future__ import annotations

import asyncio
import time

from launcher.bench_load import Load, RequestRecord, percentiles


async def _clients(load: Load, concurrency: int, stop: asyncio.Event) -> list[RequestRecord]:
    records: list[RequestRecord] = []

    async def client() -> None:
        while not stop.is_set():
            record, _ = await load.one(load.first_prompt())
            records.append(record)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records


async def _long_ttft(load: Load, n: int) -> RequestRecord:
    record, _ = await load.one(load.tokens(n), max_tokens=2)
    if not record.ok:
        raise RuntimeError(f"the {n}-token prompt failed: {record.status}")
    return record


def _window(records: list[RequestRecord], start: float, end: float) -> dict:
    """Requests sent in [start, end) and token gaps that end in it."""
    sent = [r for r in records if start <= r.sent < end and r.ok]
    gaps = [b - a for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:]) if start <= b < end]
    return {"requests": len(sent), "ttft_ms": percentiles([r.ttft for r in sent]), "itl_ms": percentiles(gaps),
            "failures": sum(1 for r in records if not r.ok)}


def _ratio(a: dict, b: dict, key: str, p: str) -> float | None:
    return a[key][p] / b[key][p] if a[key].get(p) and b[key].get(p) else None


async def long_prompt_report(load: Load, concurrency: int, long_len: int) -> dict:
    solo = await _long_ttft(load, long_len)
    solo_s = solo.ttft

    stop = asyncio.Event()
    start = time.perf_counter()
    clients = asyncio.create_task(_clients(load, concurrency, stop))
    await asyncio.sleep(max(solo_s, 2.0))
    stop.set()
    alone = _window(await clients, start, start + max(solo_s, 2.0))

    stop = asyncio.Event()
    clients = asyncio.create_task(_clients(load, concurrency, stop))
    await asyncio.sleep(min(max(solo_s * 0.2, 0.5), 5.0))  # the clients are in steady state before it arrives
    mixed_long = await _long_ttft(load, long_len)
    stop.set()
    during = _window(await clients, mixed_long.sent, mixed_long.first)
    solos = [solo_s, (await _long_ttft(load, long_len)).ttft]
    solo_s = sum(solos) / 2
    return {
        "long_prompt_tokens": long_len, "concurrency": concurrency,
        "long_ttft_solo_s": solo_s, "long_ttft_solo_runs_s": solos, "long_ttft_mixed_s": mixed_long.ttft,
        "long_ttft_ratio": mixed_long.ttft / solo_s,
        "shorts_alone": alone, "shorts_during_long": during,
        "ttft_p50_ratio": _ratio(during, alone, "ttft_ms", "p50"),
        "ttft_p99_ratio": _ratio(during, alone, "ttft_ms", "p99"),
        "itl_p99_ratio": _ratio(during, alone, "itl_ms", "p99"),
    }


def table(report: dict) -> str:
    a, d = report["shorts_alone"], report["shorts_during_long"]
    g = lambda s, key, p: s[key].get(p, float("nan"))  # noqa: E731 - a lookup, read in the lines below
    rows = [f"long prompt {report['long_prompt_tokens']} tokens: TTFT solo {report['long_ttft_solo_s']:.2f} s, "
            f"with {report['concurrency']} short clients {report['long_ttft_mixed_s']:.2f} s "
            f"({report['long_ttft_ratio']:.2f}x)",
            f"{'short requests':>22} {'sent':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"]
    for name, s in (("alone", a), ("during the long prefill", d)):
        rows.append(f"{name:>22} {s['requests']:>5} {g(s, 'ttft_ms', 'p50'):>9.1f} {g(s, 'ttft_ms', 'p99'):>9.1f} "
                    f"{g(s, 'itl_ms', 'p50'):>8.1f} {g(s, 'itl_ms', 'p99'):>8.1f}")
    return "\n".join(rows) + "\n(times in ms)\n"
