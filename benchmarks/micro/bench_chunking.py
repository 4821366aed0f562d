"""How much partial overlap content-defined chunking finds, and at what cost, on real data.

Run: ``.venv/bin/python benchmarks/micro/bench_chunking.py [--data-dir DIR] [--k 10]``.

Replays multi-turn conversations through
:class:`~contextpilot_integrations.core.conversations.dedup.Deduplicator` (default wording,
``min_tokens_saved=16``, every earlier turn visible) once with whole-block de-duplication only
and once per chunking setting ``(M, min, max)`` (bytes), and prints per setting:

* ``rep%``: share of the tokens of blocks *not* replaced whole whose sub-block already appeared
  in an earlier turn of the conversation (gross: before pointer cost and the saving threshold;
  it includes whole repeats too short to be worth a hint);
* ``all%``: tokens saved by whole-block hints and sub-block pointers, net of the hints and
  pointers, over all retrieved tokens; ``gain``: ``all%`` minus the whole-block-only row;
* ``ptr/req``, ``subs/blk``, ``bytes/sub``: sub-block pointers per request, sub-blocks per
  distinct block and their mean size; ``us/blk``, ``us/req``: median time to chunk one distinct
  block (no cache) and of ``Deduplicator.plan`` per request (chunk cache off).

Workloads (top-``k`` BM25 in each request's scope): ``mtrag``, each MTRAG-UN conversation turn
by turn, also by collection (govt and ibmcloud passages are multi-line web pages, clapnq and
fiqa mostly one short paragraph, left whole); ``multihop-rag`` and ``locomo``, sessions of
``--session`` consecutive questions (an assumption of this benchmark; LoCoMo's within one
conversation). Savings are exact and deterministic; timings depend on the machine. The
defaults of :class:`~contextpilot_integrations.core.conversations.chunking.ContentChunker` are
the setting with the best gain that keeps a 15-block request within the 1 ms target of
``benchmarks/micro/bench_dedup.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from contextpilot_bench.retrieval import ScopedBM25
from contextpilot_bench.workloads import Request, load_workload

from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.core.conversations.chunking import ContentChunker
from contextpilot_integrations.core.conversations.dedup import Deduplicator

SETTINGS: list[tuple[int, int, int] | None] = [
    None,  # whole blocks only
    (1, 64, 256),
    (2, 64, 256),
    (2, 128, 512),
    (4, 128, 512),
    (2, 256, 1024),
    (4, 256, 1024),
    (4, 512, 2048),
    (8, 512, 2048),
    (4, 1024, 4096),
]


@dataclass
class Turn:
    conversation: str
    scope: str
    blocks: list[str]


def conversations(name: str, data_dir: str | None, k: int, session: int) -> list[list[Turn]]:
    """Each conversation's turns, in order, with their top-``k`` BM25 blocks."""
    workload = load_workload(name, data_dir)
    retriever = ScopedBM25(workload)
    grouped: dict[str, list[Request]] = defaultdict(list)
    asked: dict[str, int] = defaultdict(int)  # questions so far per conversation id
    for request in workload.requests:
        base = request.conversation_id or ""
        if name == "mtrag":
            key = base
        else:  # no multi-turn sessions in the data: consecutive questions form one
            key = f"{base}#{asked[base] // session}"
            asked[base] += 1
        grouped[key].append(request)
    return [
        [Turn(key, r.scope, [d.text for d in retriever.retrieve(r, k)]) for r in requests]
        for key, requests in grouped.items()
    ]


def replay(convs: list[list[Turn]], setting: tuple[int, int, int] | None) -> dict[str, float]:
    chunker = None if setting is None else ContentChunker(*setting)
    counter = ApproxTokenCounter()
    dedup = Deduplicator(chunker=chunker, token_counter=counter, chunk_cache_size=0)
    tokens_in = saved = runs = repeated = kept_tokens = 0
    by_scope: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    times: list[float] = []
    for conv in convs:
        seen_earlier: set[int] = set()
        for turn in conv:
            start = time.perf_counter()
            plan = dedup.plan("bench", turn.conversation, turn.blocks)
            times.append(time.perf_counter() - start)
            tokens_in += plan.tokens_in
            saved += plan.tokens_saved
            by_scope[turn.scope][0] += plan.tokens_in
            by_scope[turn.scope][1] += plan.tokens_saved
            this_turn: set[int] = set()
            for block in plan.blocks:
                runs += len(block.pointers)
                if not block.kept or chunker is None:
                    continue
                kept_tokens += block.tokens
                for sub in chunker.split(turn.blocks[block.index]):
                    if sub.sub_block_id in seen_earlier:
                        repeated += counter.count(sub.text)
                    this_turn.add(sub.sub_block_id)
            seen_earlier |= this_turn
    row: dict[str, float] = {
        "rep%": 100 * repeated / kept_tokens if kept_tokens else 0.0,
        "ptr/req": runs / sum(len(c) for c in convs),
        "all%": 100 * saved / tokens_in,
        "us/req": 1e6 * statistics.median(times),
    }
    distinct = list({b: None for conv in convs for t in conv for b in t.blocks})
    if chunker is not None:
        split_times, counts, sizes = [], [], []
        for text in distinct:
            start = time.perf_counter()
            subs = chunker.split(text)
            split_times.append(time.perf_counter() - start)
            counts.append(len(subs))
            sizes.extend(len(s.text.encode()) for s in subs)
        row["subs/blk"] = statistics.fmean(counts)
        row["bytes/sub"] = statistics.fmean(sizes)
        row["us/blk"] = 1e6 * statistics.median(split_times)
    row.update({f"all% {s}": 100 * v[1] / v[0] for s, v in sorted(by_scope.items()) if v[0]})
    return row


def print_table(title: str, rows: Sequence[tuple[str, dict[str, float]]]) -> None:
    columns = ["rep%", "all%", "gain", "ptr/req", "subs/blk", "bytes/sub", "us/blk", "us/req"]
    print(f"\n{title}")
    print(f"{'(M, min, max)':<18}" + "".join(f"{c:>10}" for c in columns))
    for label, row in rows:
        cells = "".join(f"{row[c]:>10.1f}" if c in row else f"{'-':>10}" for c in columns)
        print(f"{label:<18}{cells}")
    scopes = sorted({key for _, row in rows for key in row if key.startswith("all% ")})
    if 1 < len(scopes) <= 8:
        print(f"{'by scope, all%':<18}" + "".join(f"{s[5:]:>10}" for s in scopes))
        for label, row in rows:
            print(f"{label:<18}" + "".join(f"{row[s]:>10.1f}" for s in scopes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="data directory (default: $CONTEXTPILOT_DATA_DIR)")
    parser.add_argument("--k", type=int, default=10, help="blocks retrieved per turn")
    parser.add_argument("--session", type=int, default=8, help="questions per session")
    parser.add_argument(
        "--workloads", nargs="+", default=["mtrag", "multihop-rag", "locomo"], help="workloads"
    )
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name in args.workloads:
        convs = conversations(name, args.data_dir, args.k, args.session)
        turns = sum(len(c) for c in convs)
        rows = []
        for setting in SETTINGS:
            label = "whole blocks" if setting is None else str(setting)
            row = replay(convs, setting)
            row["gain"] = row["all%"] - (rows[0][1]["all%"] if rows else row["all%"])
            rows.append((label, row))
        results[name] = dict(rows)
        print_table(f"{name}: {len(convs)} conversations, {turns} turns, k={args.k}", rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
