"""The KV-event mirror's memory under its block bound: RSS while 1M ``BlockStored`` events go in.

Each event stores one page of ``--page`` random token ids (vLLM's default page is 16 tokens)
under a recently stored block (70 %) or the root, with a session id on most of them (so that
request attribution and the evictions of the bound are part of the figure), the hash a random
signed 64-bit int, sent unsigned a third of the time. Nothing is ever removed: without a bound
the mirror would hold every block. The events are made in chunks and applied through
``CacheMirror.apply_events`` (the subscriber's handler), so what stays in memory is the
mirror's own state. RSS (``VmRSS``) is printed every ``--report-every`` events.

Target: mirror memory bounded by its configured block limit, RSS reported for 1M
events.

Usage: ``.venv/bin/python benchmarks/micro/bench_mirror_memory.py [--events 1000000
--max-blocks 100000 --page 16]`` (``--max-blocks`` defaults to the bound under test; pass
1000000, the package default, to see the cost of a full default-sized mirror).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np

from contextpilot_integrations.sync.cache_mirror import CacheMirror
from contextpilot_integrations.sync.kv_events import BlockStored


def rss_mib() -> float:
    """Resident set size of this process now, in MiB (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def events(total: int, page: int, seed: int, chunk: int = 10_000):  # type: ignore[no-untyped-def]
    """``total`` single-page BlockStored events, made ``chunk`` at a time."""
    rng = np.random.default_rng(seed)
    recent: list[int] = []
    made = 0
    while made < total:
        count = min(chunk, total - made)
        hashes = rng.integers(-(2**63), 2**63 - 1, size=count, dtype=np.int64).tolist()
        tokens = rng.integers(0, 150_000, size=(count, page)).tolist()
        under = rng.random(count) < 0.7
        unsigned = rng.random(count) < 1 / 3
        sessions = rng.random(count) < 0.8
        for k in range(count):
            h = hashes[k]
            parent = recent[-1 - int(k % min(len(recent), 64))] if recent and under[k] else None
            yield BlockStored(
                [h + 2**64 if unsigned[k] and h < 0 else h],
                parent,
                tokens[k],
                block_size=page,
                session_id=f"rid-{made + k}" if sessions[k] else None,
            )
            recent.append(h)
            if len(recent) > 256:
                del recent[:128]
        made += count


def run(total: int, max_blocks: int, page: int, report_every: int, seed: int) -> dict:
    gc.collect()
    baseline = rss_mib()
    evicted = 0

    def on_evict(rid: str) -> None:
        nonlocal evicted
        evicted += 1

    mirror = CacheMirror(on_evict, max_blocks=max_blocks)
    rows = []
    batch: list[BlockStored] = []
    started = time.perf_counter()
    applying = 0.0
    for index, event in enumerate(events(total, page, seed), start=1):
        batch.append(event)
        if len(batch) == 16 or index == total:  # a batch per engine step
            t0 = time.perf_counter()
            mirror.apply_events(0, batch)
            applying += time.perf_counter() - t0
            batch = []
        if index % report_every == 0 or index == total:
            stats = mirror.stats()
            rows.append(
                {
                    "events": index,
                    "blocks": stats["blocks"],
                    "bound_evictions": stats["bound_evictions"],
                    "tracked_requests": stats["tracked_requests"],
                    "rss_mib": round(rss_mib(), 1),
                    "rss_above_baseline_mib": round(rss_mib() - baseline, 1),
                }
            )
            print(
                f"{index:>9,} events  {stats['blocks']:>9,} blocks  "
                f"{stats['bound_evictions']:>9,} bound evictions  "
                f"{stats['tracked_requests']:>7,} requests  RSS {rows[-1]['rss_mib']:>7.1f} MiB "
                f"(+{rows[-1]['rss_above_baseline_mib']:.1f})",
                flush=True,
            )
    stats = mirror.stats()
    return {
        "events": total,
        "max_blocks": max_blocks,
        "page_tokens": page,
        "baseline_rss_mib": round(baseline, 1),
        "final_rss_mib": rows[-1]["rss_mib"],
        "peak_rss_above_baseline_mib": max(r["rss_above_baseline_mib"] for r in rows),
        "blocks_held": stats["blocks"],
        "bound_respected": stats["blocks"] <= max_blocks,
        "requests_evicted": evicted,
        "apply_us_per_event": round(applying / total * 1e6, 2),
        "wall_s": round(time.perf_counter() - started, 1),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--max-blocks", type=int, default=100_000)
    parser.add_argument("--page", type=int, default=16, help="tokens per page")
    parser.add_argument("--report-every", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = run(args.events, args.max_blocks, args.page, args.report_every, args.seed)
    summary = {k: v for k, v in result.items() if k != "rows"}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
