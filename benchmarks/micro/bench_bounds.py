"""How close the offline ordering is to what is reachable: bounds and the exact optimum.

Run: ``.venv/bin/python benchmarks/micro/bench_bounds.py [--workload multihop-rag mtrag locomo]
[--slice-size 16] [--slices 20]`` (data: ``--data-dir``, else ``$CONTEXTPILOT_DATA_DIR``, else
the datasets fetched into the cache, docs/DESIGN.md, "Datasets").

Prints, per workload (BM25 top-k, the embedded prefix-cache model, the benchmark's token
counter), with the hit ratio of a bound over the baseline prompt tokens (as the benchmark's
upper bound) and the library's over its own prompts (order annotations included):

* the best-pair bound (each request's best overlap with any other,
  ``methods.upper_bound_records``) and the three bounds of :mod:`contextpilot_bench.bounds`
  (spanning forest, prefix intersection, two-level LP; the tighter is the smallest), with
  their CPU time;
* the library's offline figure (``ContextPilot.plan_batch`` of the whole workload, sent in
  schedule order) with an unlimited and a 5% cache, as a ratio to each bound;
* on ``--slices`` connected groups of ``--slice-size`` requests: the exact optimum, the
  library's figure on the same group (a fresh pilot, unlimited cache) and their ratio, by hit
  ratio, by cached tokens, and with the library's orders weighed like the optimum; and how far
  the bounds sit above the optimum there.

Then the offline target per workload and whether it holds: within 0.95 of the tighter bound
with a 5% cache, or of the exact optimum on the slices (unlimited cache). ``--proposal`` also
measures a candidate offline build (not in the library): agglomerate by the objective itself,
then subtree prune and regraft until no move gains, in place of the cluster build inside
``order_batch`` for the run.
"""

from __future__ import annotations

import argparse
import heapq
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from unittest import mock

from contextpilot_bench.bounds import offline_bounds
from contextpilot_bench.engine import EmbeddedEngine
from contextpilot_bench.methods import (
    MethodResult,
    PreparedWorkload,
    prepare_workload,
    resolve_cache_tokens,
    run_method,
    upper_bound_records,
)
from contextpilot_bench.optimal_orders import connected_slices, optimal_orders
from contextpilot_bench.ordering_problem import (
    OrderingProblem,
    cached_tokens,
    ordering_problem,
    orders_of_plans,
)
from contextpilot_bench.workloads import Workload, load_workload

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.core import clustering
from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.core.request import PlanRequest

TARGET = 0.95


# --- the proposal: agglomerate by the objective, then regraft subtrees ------------------------


class _MergeTree:
    """A binary tree over contexts, worth ``sum over internal nodes of w(blocks all its leaves
    hold)``: the cached tokens its top-down order reaches (bench/optimal_orders.py, the theorem).
    Leaves are the contexts ``0..n-1``; ``common[node]`` is the blocks all its leaves hold."""

    def __init__(self, contexts: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]):
        self.contexts = [list(c) for c in contexts]
        self.n = len(contexts)
        self.token = {b: t for c, ts in zip(contexts, tokens) for b, t in zip(c, ts)}
        self.common = {i: frozenset(c) for i, c in enumerate(contexts)}
        self.parent: dict[int, int | None] = dict.fromkeys(range(self.n))
        self.kids: dict[int, list[int]] = {}
        self.holding: dict[int, set[int]] = {}  # block -> nodes whose common holds it
        for node, blocks in self.common.items():
            for b in blocks:
                self.holding.setdefault(b, set()).add(node)

    def weight(self, blocks: frozenset[int]) -> int:
        return sum(self.token[b] for b in blocks)

    def join(self, a: int, b: int) -> int:
        node = len(self.parent)
        self.kids[node] = [a, b]
        self.parent[a] = self.parent[b] = node
        self.parent[node] = None
        self._set_common(node, self.common[a] & self.common[b])
        return node

    def root(self) -> int:
        node = 0
        while (up := self.parent[node]) is not None:
            node = up
        return node

    @classmethod
    def agglomerate(
        cls, contexts: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]
    ) -> _MergeTree:
        """Repeatedly merge the two groups whose common blocks weigh the most (ties: the
        smaller pair, then the lower ids); groups sharing nothing are joined last."""
        tree = cls(contexts, tokens)
        size = dict.fromkeys(range(tree.n), 1)
        heap: list[tuple[int, int, int, int]] = []
        active = set(range(tree.n))

        def offer(node: int) -> None:
            near = set().union(*(tree.holding[b] for b in tree.common[node])) & active
            for other in near - {node}:
                gain = tree.weight(tree.common[node] & tree.common[other])
                pair = (min(node, other), max(node, other))
                heapq.heappush(heap, (-gain, size[node] + size[other], *pair))

        for i in range(tree.n):
            offer(i)
        while heap:
            _, _, a, b = heapq.heappop(heap)
            if a in active and b in active:
                node = tree.join(a, b)
                size[node] = size[a] + size[b]
                active -= {a, b}
                active.add(node)
                offer(node)
        rest = sorted(active)
        node = rest[0]
        for other in rest[1:]:
            node = tree.join(node, other)
        return tree

    def regraft(self) -> int:
        """One pass of subtree prune and regraft: every subtree moves to where its gain is
        largest, if positive. Returns the number of moves."""
        moves = 0
        for x in list(self.parent):
            if self.parent[x] is not None:
                target = self._best_target(x)
                if target is not None:
                    self._move(x, target)
                    moves += 1
        return moves

    def _best_target(self, x: int) -> int | None:
        parent = self.parent[x]
        assert parent is not None
        sibling = next(k for k in self.kids[parent] if k != x)
        # Detaching x removes its parent; each ancestor then keeps what only x lacked.
        gain = -self.weight(self.common[parent])
        detached: dict[int, frozenset[int]] = {}
        kept, below, node = self.common[sibling], parent, self.parent[parent]
        while node is not None:
            other = next(k for k in self.kids[node] if k != below)
            kept = kept & self.common[other]
            gain += self.weight(kept) - self.weight(self.common[node])
            detached[node] = kept
            below, node = node, self.parent[node]
        inside, stack = set(), [x]
        while stack:
            node = stack.pop()
            inside.add(node)
            stack.extend(self.kids.get(node, ()))
        mine = self.common[x]
        # A block x holds is in an ancestor's detached common only if it was there before.
        candidates = set().union(*(self.holding[b] for b in mine)) - inside - {parent}
        scored = sorted(
            ((self.weight(mine & detached.get(y, self.common[y])), y) for y in candidates),
            reverse=True,
        )
        best, target = (gain, self.root()) if gain > 0 else (0, None)
        for upper, y in scored:
            total = gain + upper  # inserting above y, before its ancestors lose what x lacks
            if total <= best:
                break
            node = self.parent[y]
            while node is not None and total > best:
                if node != parent:
                    blocks = detached.get(node, self.common[node])
                    total += self.weight(blocks & mine) - self.weight(blocks)
                node = self.parent[node]
            if total > best:
                best, target = total, y
        if target in (parent, sibling):
            return None
        return target

    def _move(self, x: int, target: int) -> None:
        """Hang ``x`` beside ``target``, reusing x's old parent as the new node."""
        parent = self.parent[x]
        assert parent is not None
        sibling = next(k for k in self.kids[parent] if k != x)
        grand = self.parent[parent]
        self._relink(parent, sibling, grand)
        up = self.parent[target]
        self._relink(target, parent, up)
        self.kids[parent] = [target, x]
        self.parent[target] = self.parent[x] = parent
        for start in (grand, parent, grand):
            node = start
            while node is not None:
                a, b = self.kids[node]
                self._set_common(node, self.common[a] & self.common[b])
                node = self.parent[node]

    def _relink(self, old: int, new: int, up: int | None) -> None:
        """Put ``new`` where ``old`` hangs under ``up``."""
        self.parent[new] = up
        if up is not None:
            self.kids[up] = [new if k == old else k for k in self.kids[up]]

    def _set_common(self, node: int, blocks: frozenset[int]) -> None:
        old = self.common.get(node, frozenset())
        for b in old - blocks:
            self.holding[b].discard(node)
        for b in blocks - old:
            self.holding.setdefault(b, set()).add(node)
        self.common[node] = blocks

    def orders(self) -> list[list[int]]:
        """Top-down: each node appends its new common blocks (in its first leaf's order),
        each leaf the rest in retriever order."""
        orders: list[list[int]] = [[] for _ in range(self.n)]
        stack: list[tuple[int, list[int], frozenset[int]]] = [(self.root(), [], frozenset())]
        while stack:
            node, prefix, placed = stack.pop()
            if node < self.n:
                orders[node] = prefix + [b for b in self.contexts[node] if b not in placed]
                continue
            new = self.common[node] - placed
            if new:
                leaf = node
                while leaf >= self.n:
                    leaf = self.kids[leaf][0]
                prefix = prefix + [b for b in self.contexts[leaf] if b in new]
                placed = placed | new
            for kid in self.kids[node]:
                stack.append((kid, prefix, placed))
        return orders


def proposal_orders(
    contexts: Sequence[Sequence[int]], weights: Sequence[Sequence[int]] | None
) -> list[list[int]]:
    """The proposed build: :meth:`_MergeTree.agglomerate`, then up to 10 regraft passes."""
    tokens = weights if weights is not None else [[1] * len(c) for c in contexts]
    tree = _MergeTree.agglomerate(contexts, tokens)
    for _ in range(10):
        if not tree.regraft():
            break
    return tree.orders()


@contextmanager
def _proposal_build() -> Iterator[None]:
    """The proposal in place of the cluster build inside ``order_batch`` ("auto" still keeps
    the smaller trie of it and the frequency tree)."""
    with mock.patch.object(
        clustering,
        "_order_by_clustering",
        lambda contexts, weights, alpha: proposal_orders(contexts, weights),
    ):
        yield


BUILDS: dict[str, Callable[[], AbstractContextManager[None]]] = {
    "library": nullcontext,
    "proposal": _proposal_build,
}


def _engine(prepared: PreparedWorkload, capacity: int | None) -> Callable[[], EmbeddedEngine]:
    return lambda: EmbeddedEngine(capacity, counter=prepared.counter)


def _offline(prepared: PreparedWorkload, capacity: int | None, build: str) -> MethodResult:
    """ContextPilot offline (a fresh pilot, the whole batch, schedule order) with ``build``."""
    with BUILDS[build]():
        return run_method(
            "contextpilot", prepared, mode="offline", engine_factory=_engine(prepared, capacity)
        )


def _orders(prepared: PreparedWorkload, problem: OrderingProblem, build: str) -> list[list[int]]:
    """The unit orders ``plan_batch`` gives the batch with ``build``."""
    requests = [
        PlanRequest(r.query, prepared.block_texts(i), f"bound-{r.id}")
        for i, r in enumerate(prepared.workload.requests)
    ]
    with BUILDS[build](), ContextPilot(layout=prepared.layout, token_counter=prepared.counter) as p:
        return orders_of_plans(problem, p.plan_batch(requests).plans)


def _slice(prepared: PreparedWorkload, indices: list[int]) -> PreparedWorkload:
    workload = prepared.workload
    requests = tuple(workload.requests[i] for i in indices)
    return PreparedWorkload(
        Workload(workload.name, workload.corpus, requests),
        prepared.k,
        [prepared.retrieved[i] for i in indices],
        prepared.layout,
        prepared.counter,
    )


def run_workload(name: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Print one workload's figures; return per build its ratios for the target."""
    builds = ["library", "proposal"] if args.proposal else ["library"]
    prepared = prepare_workload(
        load_workload(name, args.data_dir), args.k, counter=ApproxTokenCounter()
    )
    problem = ordering_problem(prepared)
    assert problem.prompt_tokens is not None
    prompt = int(problem.prompt_tokens.sum())
    loose = sum(r.cached_tokens or 0 for r in upper_bound_records(prepared))
    start = time.process_time()
    bounds = offline_bounds(problem)
    bound_seconds = time.process_time() - start
    five_percent = resolve_cache_tokens(0.05, prepared.unique_block_tokens)
    runs = {b: (_offline(prepared, None, b), _offline(prepared, five_percent, b)) for b in builds}
    library = runs["library"][0]

    print(
        f"\n{name}: {problem.requests} requests, k={args.k}, {prompt:,} baseline prompt tokens; "
        f"bounds computed in {bound_seconds:.1f} s CPU"
    )
    print(f"  {'upper bound':<36} {'cached':>11} {'hit':>7}  library offline (unlimited) / it")
    for label, cached in (
        ("today's (best pair overlap)", loose),
        ("spanning forest", bounds.spanning_forest),
        ("prefix intersection", bounds.prefix_intersection),
        ("two-level LP", bounds.two_level_lp),
        ("tighter (the smallest)", bounds.tighter),
    ):
        if cached is None:
            continue
        print(
            f"  {label:<36} {cached:>11,} {cached / prompt:>7.4f}  "
            f"{library.hit_ratio * prompt / cached:.3f} by hit ratio, "
            f"{library.cached_tokens / cached:.3f} by cached tokens"
        )
    tight_hit = bounds.tighter / prompt
    figures: dict[str, dict[str, float]] = {b: {} for b in builds}
    for build in builds:
        for label, result in zip(("unlimited cache", "5% cache"), runs[build]):
            print(
                f"  {build} offline, {label:<17} {result.cached_tokens:>11,} "
                f"{result.hit_ratio:>7.4f}  {result.hit_ratio / (loose / prompt):.3f} of "
                f"today's bound, {result.hit_ratio / tight_hit:.3f} of the tighter "
                f"(plan {result.plan_seconds:.2f} s)"
            )
        figures[build]["tight"] = runs[build][1].hit_ratio / tight_hit

    slices = connected_slices(problem, args.slice_size, args.slices, seed=args.seed)
    if not slices:
        return figures
    totals: dict[str, int] = {}

    def add(key: str, value: int) -> None:
        totals[key] = totals.get(key, 0) + value

    start = time.process_time()
    for indices in slices:
        part = problem.restrict(indices)
        assert part.prompt_tokens is not None
        sub = _slice(prepared, indices)
        part_bounds = offline_bounds(part)
        add("optimum", optimal_orders(part).cached_tokens)
        add("prompt", int(part.prompt_tokens.sum()))
        add("tighter", part_bounds.tighter)
        add("prefix", part_bounds.prefix_intersection)
        for build in builds:
            realised = _offline(sub, None, build)
            add(f"{build} cached", realised.cached_tokens)
            add(f"{build} prompt", realised.prompt_tokens)
            add(f"{build} ordering", cached_tokens(part, _orders(sub, part, build)))
    optimum = totals["optimum"]
    optimum_hit = optimum / totals["prompt"]
    print(
        f"  slices: {len(slices)} connected groups of {args.slice_size} requests, unlimited "
        f"cache ({time.process_time() - start:.1f} s CPU); optimum {optimum:,} cached, "
        f"hit {optimum_hit:.4f}; bounds / optimum: tighter {totals['tighter'] / optimum:.3f}, "
        f"prefix intersection {totals['prefix'] / optimum:.3f}"
    )
    for build in builds:
        hit = totals[f"{build} cached"] / totals[f"{build} prompt"]
        figures[build]["slices"] = hit / optimum_hit
        print(
            f"    {build:<8} hit {hit:.4f}: {hit / optimum_hit:.3f} of the optimum by hit ratio, "
            f"{totals[f'{build} cached'] / optimum:.3f} by cached tokens, "
            f"{totals[f'{build} ordering'] / optimum:.3f} by the ordering alone"
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=["multihop-rag", "mtrag", "locomo"])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("-k", type=int, default=10)
    parser.add_argument("--slice-size", type=int, default=16)
    parser.add_argument("--slices", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--proposal", action="store_true", help="also measure the proposal")
    args = parser.parse_args()

    results = {name: run_workload(name, args) for name in args.workload}
    print(
        f"\nOffline target: within {TARGET} of the tighter bound (5% cache) or of the exact "
        "optimum on the slices (unlimited cache), by hit ratio"
    )
    for name, per_build in results.items():
        for build, figures in per_build.items():
            line = f"  {name:<13} {build:<8} {figures['tight']:.3f} of the tighter bound"
            line += f" ({_verdict(figures['tight'])})"
            if "slices" in figures:
                line += f", {figures['slices']:.3f} of the optimum ({_verdict(figures['slices'])})"
            print(line)


def _verdict(ratio: float) -> str:
    return "holds" if ratio >= TARGET else "not met"


if __name__ == "__main__":
    main()
