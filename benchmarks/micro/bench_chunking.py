"""How much partial overlap content-defined chunking finds, and at what cost, on real data.

Run: ``.venv/bin/python benchmarks/bench_chunking.py [--data-dir DIR] [--k 10]``.

Replays multi-turn conversations through :class:`~contextpilot_integrations.core.conversations.dedup.
Deduplicator` (default wording, ``min_tokens_saved=16``, every earlier turn visible) once with
whole-block de-duplication only and once per chunking setting ``(M, min, max)`` (bytes), and
prints per setting:

* ``rep%``: share of the tokens of blocks *not* replaced whole whose sub-block already appeared
  in an earlier turn of the conversation (gross: before pointer cost and the saving threshold;
  it includes whole repeats too short to be worth a hint);
* ``all%``: tokens saved by whole-block hints and sub-block pointers, net of the hints and
  pointers, over all retrieved tokens; ``gain``: ``all%`` minus the whole-block-only row;
* ``ptr/req``: sub-block pointers per request;
* ``subs/blk`` and ``bytes/sub``: sub-blocks per distinct block and their mean size;
* ``us/blk``: median time to chunk one distinct block (``ContentChunker.split``, no cache);
* ``us/req``: median ``Deduplicator.plan`` time per request with the chunk cache off.

Workloads (real data, loaded by :mod:`contextpilot_bench.workloads`, top-``k`` BM25
in each request's scope by :mod:`contextpilot_bench.retrieval`):

* ``mtrag``: MTRAG-UN, each of the 507 conversations turn by turn (its user turns in order);
  also broken down by collection (govt and ibmcloud passages are multi-line web pages,
  clapnq and fiqa mostly one paragraph under 1 KB, left whole);
* ``multihop-rag``: no conversations in the data; sessions of ``--session`` consecutive
  questions (an assumption of this benchmark). Blocks are articles: title plus facts, one per
  line;
* ``locomo``: sessions of ``--session`` consecutive questions of one LoCoMo conversation;
  blocks are single dialog turns (one line, never cut).

Measured with ``--k 10 --session 8`` on the team's 2-core machine while it was shared with other
jobs (timings are upper bounds; savings are exact and deterministic):

=================  =====  =====  =====  =======  ========  =========  ======  ======
mtrag (M,min,max)   rep%   all%   gain  ptr/req  subs/blk  bytes/sub  us/blk  us/req
=================  =====  =====  =====  =======  ========  =========  ======  ======
whole blocks only      -   27.3    0.0        -         -          -       -      90
(1, 64, 256)         4.8   28.9    1.5      1.7      10.7        137      31     601
(2, 64, 256)         4.7   28.8    1.5      1.6      10.1        145      33     616
(2, 128, 512)        2.3   28.6    1.3      0.7       5.9        248      23     419
(4, 128, 512)        2.2   28.6    1.3      0.7       5.7        258      26     428
(2, 256, 1024)       1.3   28.1    0.8      0.4       3.7        397      17     322
(4, 256, 1024)       1.2   28.1    0.8      0.4       3.6        411      18     326
(4, 512, 2048)       0.7   27.9    0.6      0.2       2.3        629      13     265
(8, 512, 2048)       0.4   27.6    0.3      0.1       1.8        829      17     331
(4, 1024, 4096)      0.2   27.5    0.2      0.1       1.6        929      10     251
=================  =====  =====  =====  =======  ========  =========  ======  ======

By collection (``all%``, whole blocks -> ``(4, 512, 2048)`` -> ``(2, 128, 512)``): govt 24.6 ->
25.1 -> 26.4, ibmcloud 30.5 -> 31.5 -> 31.9, clapnq 26.3 and fiqa 29.5 unchanged.
MultiHop-RAG (63 sessions, 500 turns): whole blocks save 19.4%, no setting adds anything (the
articles share no lines). LoCoMo (253 sessions, 1,986 turns): whole blocks save 12.1%; ``rep%``
3.7 is whole dialog turns too short to be worth a hint, no setting adds anything.
The defaults of :class:`~contextpilot_integrations.core.conversations.chunking.ContentChunker` are
``(4, 512, 2048)``: the best gain that keeps a 15-block request under 1 ms
(``benchmarks/bench_dedup.py``).
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
