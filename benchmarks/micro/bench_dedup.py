"""Per-request overhead of multi-turn de-duplication, each figure printed beside its target.

Run: ``.venv/bin/python benchmarks/micro/bench_dedup.py [--data-dir DIR] [--requests 3000]``.

Workload: requests of 15 blocks of about 1,000 tokens (4,000 UTF-8 bytes by
``ApproxTokenCounter``), made of real MTRAG-UN passages (govt and ibmcloud collections, whose
web pages are multi-line) concatenated in file order. Conversations of 8 turns; each turn
retrieves 5 blocks an earlier turn of the conversation already sent and 10 new ones from a
pool of 400, in a seeded random order. Timed: one ``Deduplicator.plan`` call (lookups, hints,
pointers, chunking, records), median and p99 over all requests after a warm-up of 200.

Figures:

* whole blocks (``chunker=None``), ids and token counts computed by the call; target median
  <= 0.2 ms;
* the same with ids and token counts passed in (what ``ContextPilot.plan`` has already: most
  of the whole-block time without them is hashing and counting the blocks' text, which
  ``Placement.block_id``/``tokens`` carry);
* with chunking (the default ``ContentChunker``), chunk cache off: every kept block is chunked
  on every request (the cost for blocks the process has not seen); target median <= 1 ms;
* with chunking and the chunk cache on (blocks seen before in any conversation).

On a machine shared with other jobs the p99 figures mostly show that load.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

from contextpilot_bench.workloads import load_workload

from contextpilot_integrations.core.blocks import ApproxTokenCounter, block_id
from contextpilot_integrations.core.conversations.dedup import Deduplicator

BLOCKS_PER_REQUEST = 15
REPEATED_PER_REQUEST = 5
TURNS_PER_CONVERSATION = 8
BLOCK_BYTES = 4_000  # about 1,000 tokens by ApproxTokenCounter
POOL = 400
WARMUP = 200


def block_pool(data_dir: str | None) -> list[str]:
    """``POOL`` blocks of about ``BLOCK_BYTES`` bytes from multi-line MTRAG-UN passages."""
    workload = load_workload("mtrag", data_dir)
    passages = [d.text for d in workload.corpus if d.scope in ("govt", "ibmcloud")]
    blocks, current = [], ""
    for passage in passages * 4:  # reused in other combinations if the corpus runs out
        current += passage + "\n"
        if len(current) >= BLOCK_BYTES:
            blocks.append(current[:BLOCK_BYTES])  # characters; the passages are mostly ASCII
            current = ""
            if len(blocks) == POOL:
                break
    return blocks


def request_stream(pool: list[str], n: int, seed: int = 0) -> list[tuple[str, list[str]]]:
    """``n`` requests as ``(conversation id, blocks)``, conversations of 8 turns."""
    rng = random.Random(seed)
    stream: list[tuple[str, list[str]]] = []
    sent: list[str] = []
    for i in range(n):
        turn = i % TURNS_PER_CONVERSATION
        if turn == 0:
            sent = []
        repeated = rng.sample(sent, min(REPEATED_PER_REQUEST, len(sent)))
        new = rng.sample([b for b in pool if b not in sent], BLOCKS_PER_REQUEST - len(repeated))
        blocks = repeated + new
        rng.shuffle(blocks)
        sent.extend(new)
        stream.append((f"conv-{i // TURNS_PER_CONVERSATION}", blocks))
    return stream


def time_requests(
    make: Callable[[], Deduplicator], stream: list[tuple[str, list[str]]], precomputed: bool
) -> tuple[float, float, float]:
    """Median and p99 milliseconds per ``plan`` call, and the mean share of tokens saved."""
    dedup = make()
    counter = ApproxTokenCounter()
    extras = [
        {
            "block_ids": [block_id(b) for b in blocks],
            "block_tokens": [counter.count(b) for b in blocks],
        }
        if precomputed
        else {}
        for _, blocks in stream
    ]
    times, saved, total = [], 0, 0
    for (conv, blocks), extra in zip(stream, extras, strict=True):
        start = time.perf_counter_ns()
        plan = dedup.plan("bench", conv, blocks, **extra)
        times.append((time.perf_counter_ns() - start) / 1e6)
        saved += plan.tokens_saved
        total += plan.tokens_in
    times = times[WARMUP:]
    p99 = statistics.quantiles(times, n=100)[98]
    return statistics.median(times), p99, saved / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="data directory (default: $CONTEXTPILOT_DATA_DIR)")
    parser.add_argument("--requests", type=int, default=3_000, help="requests timed per case")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    pool = block_pool(args.data_dir)
    counter = ApproxTokenCounter()
    mean_tokens = statistics.fmean(counter.count(b) for b in pool)
    stream = request_stream(pool, args.requests + WARMUP)
    print(
        f"{BLOCKS_PER_REQUEST} blocks/request, {mean_tokens:.0f} tokens/block on average, "
        f"{REPEATED_PER_REQUEST} repeated per turn, {len(stream)} requests"
    )
    cases: list[tuple[str, Callable[[], Deduplicator], bool, float | None]] = [
        ("whole blocks", lambda: Deduplicator(chunker=None), False, 0.2),
        ("whole blocks, ids+tokens given", lambda: Deduplicator(chunker=None), True, 0.2),
        ("chunking, cache off", lambda: Deduplicator(chunk_cache_size=0), False, 1.0),
        ("chunking, cache off, ids given", lambda: Deduplicator(chunk_cache_size=0), True, 1.0),
        ("chunking, cache on", lambda: Deduplicator(), False, 1.0),
    ]
    results = {}
    for name, make, precomputed, target in cases:
        median, p99, share = time_requests(make, stream, precomputed)
        verdict = "" if target is None else ("  ok" if median <= target else "  MISSED")
        print(
            f"{name:<34} median {median:6.3f} ms (target <= {target} ms){verdict}, "
            f"p99 {p99:6.3f} ms, tokens saved {100 * share:4.1f}%"
        )
        results[name] = {"median_ms": median, "p99_ms": p99, "target_ms": target, "saved": share}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
