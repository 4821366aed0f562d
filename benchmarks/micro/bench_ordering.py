"""Which ordering choices raise the hit ratio: every variant on the real workloads.

Run: ``.venv/bin/python benchmarks/micro/bench_ordering.py [--workload multihop-rag mtrag]``
(data: ``--data-dir``, else ``$CONTEXTPILOT_DATA_DIR``, else the datasets fetched into the
cache, docs/DESIGN.md, "Datasets").

Prints, per workload (BM25 top-10, embedded prefix-cache model), the hit ratio of each variant
as a ratio to the upper bound (unlimited cache, free order) and to the baseline (retriever
order, arrival order) measured in the same run:

* offline build: ``cluster`` (complete / average linkage), ``frequency``, ``auto``;
  schedule ``prefix-tree`` vs the paper's ``first-step``; weighting by tokens vs counts;
* online: the rest of a request after its matched prefix in retriever order vs by popularity
  (with and without the recency-weighted memory of evicted blocks).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from unittest import mock

from contextpilot_bench.engine import EmbeddedEngine
from contextpilot_bench.methods import (
    prepare_workload,
    resolve_cache_tokens,
    run_method,
)
from contextpilot_bench.workloads import load_workload
from scipy.cluster import hierarchy

from contextpilot_integrations import ContextPilot, OrderingConfig
from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.core.ordering import clustering

OFFLINE_VARIANTS: list[tuple[str, dict[str, object], str]] = [
    ("auto (default)", {}, "complete"),
    ("cluster, complete linkage", {"build_method": "cluster"}, "complete"),
    ("cluster, average linkage (public impl.)", {"build_method": "cluster"}, "average"),
    ("frequency tree", {"build_method": "frequency"}, "complete"),
    ("auto, first-step schedule (paper Alg. 5)", {"schedule_method": "first-step"}, "complete"),
    ("auto, weighted by block count", {"weight_by_tokens": False}, "complete"),
]
ONLINE_VARIANTS: list[tuple[str, dict[str, object]]] = [
    ("popularity + memory (default)", {}),
    ("popularity, indexed requests only", {"popularity_memory": 0}),
    ("retriever order (paper)", {"rest_order": "retriever"}),
    ("popularity, weighted by block count", {"weight_by_tokens": False}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=["multihop-rag", "mtrag"])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("-k", type=int, default=10)
    args = parser.parse_args()

    for name in args.workload:
        prepared = prepare_workload(
            load_workload(name, args.data_dir), args.k, counter=ApproxTokenCounter()
        )
        five_percent = resolve_cache_tokens(0.05, prepared.unique_block_tokens)

        def engine(capacity: int | None, counter=prepared.counter) -> Callable[[], EmbeddedEngine]:
            return lambda: EmbeddedEngine(capacity, counter=counter)

        bound = run_method(
            "upper-bound", prepared, mode="offline", engine_factory=engine(None)
        ).hit_ratio
        print(f"\n{name}: {len(prepared.retrieved)} requests, k={args.k}, upper bound {bound:.4f}")
        for label, capacity in (("5% cache", five_percent), ("unlimited cache", None)):
            baseline = run_method(
                "baseline", prepared, mode="offline", engine_factory=engine(capacity)
            ).hit_ratio
            print(f"  {label}: baseline {baseline:.4f}")

            def run(
                mode: str, options: dict[str, object], capacity=capacity, prepared=prepared
            ) -> float:
                def pilot() -> ContextPilot:
                    return ContextPilot(
                        layout=prepared.layout,
                        token_counter=prepared.counter,
                        ordering=OrderingConfig(**options),  # type: ignore[arg-type]
                    )

                return run_method(
                    "contextpilot",
                    prepared,
                    mode=mode,
                    engine_factory=engine(capacity),
                    pilot_factory=pilot,
                ).hit_ratio

            for variant, options, linkage_method in OFFLINE_VARIANTS:
                with mock.patch.object(
                    clustering,
                    "linkage",
                    lambda d, method=None, m=linkage_method: hierarchy.linkage(d, method=m),
                ):
                    hit = run("offline", options)
                print(
                    f"    offline {variant:<42} {hit:.4f}  {hit / bound:.3f} of bound  "
                    f"{hit / baseline:5.2f}x baseline"
                )
            for variant, options in ONLINE_VARIANTS:
                hit = run("online", options)
                print(
                    f"    online  {variant:<42} {hit:.4f}  {hit / bound:.3f} of bound  "
                    f"{hit / baseline:5.2f}x baseline"
                )


if __name__ == "__main__":
    main()
