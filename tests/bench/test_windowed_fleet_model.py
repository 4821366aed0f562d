"""The window model: the proxy's arrivals and window replayed on paged models of N replicas."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from contextpilot_bench.arrivals import Arrivals
from contextpilot_bench.methods import PreparedWorkload, prepare_workload
from contextpilot_bench.prefix_cache_model import PrefixCacheModel
from contextpilot_bench.windowed_fleet_model import run_windowed_fleet_model
from contextpilot_bench.workloads import load_workload

from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.request import PlanRequest

BLOCK = 16


@pytest.fixture(scope="module")
def prepared(data_dir: Path) -> PreparedWorkload:
    workload = load_workload("multihop-rag", data_dir).head(40)
    return prepare_workload(workload, 10, counter=ApproxTokenCounter())


class _Words:
    """Chat messages -> one id per word (a stand-in tokenizer: stable within a test)."""

    def __init__(self) -> None:
        self.vocabulary: dict[str, int] = {}

    def __call__(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        words = [w for m in messages for w in f"<{m['role']}> {m['content']}".split()]
        return [self.vocabulary.setdefault(w, len(self.vocabulary)) for w in words]


def _at(times: Sequence[float]) -> Arrivals:
    return Arrivals("replay", tuple(range(len(times))), np.asarray(times, dtype=float), 1.0)


def test_one_window_of_everything_on_one_replica_is_the_offline_reference(
    prepared: PreparedWorkload,
) -> None:
    n, capacity = len(prepared.workload.requests), 4_000
    tokenize = _Words()
    model = run_windowed_fleet_model(
        prepared, _at([0.0] * n), 1_000, replicas=1, capacity_tokens=capacity,
        block_size=BLOCK, tokenize=tokenize, max_batch=n, adaptive=False,
    )  # fmt: skip
    assert (model.windows, model.requests) == (1, n)
    # The reference row: one replica-blind ContextPilot plans the whole workload at once.
    pilot = ContextPilot(layout=prepared.layout, token_counter=prepared.counter)
    batch = pilot.plan_batch(
        [PlanRequest(r.query, prepared.block_texts(i), f"ref-{r.id}")
         for i, r in enumerate(prepared.workload.requests)]
    )  # fmt: skip
    cache = PrefixCacheModel(capacity, block_size=BLOCK, paged=True)
    cached = prompt = 0
    for i in batch.schedule:
        ids = tokenize(batch.plans[i].messages)
        cached, prompt = cached + cache.serve(ids), prompt + len(ids)
    assert model.hit_ratio == pytest.approx(cached / prompt)
    assert 0 < model.hit_ratio < 1
    # One window: planned ahead of the previous one or not, it is served once, the same.
    ahead = run_windowed_fleet_model(
        prepared, _at([0.0] * n), 1_000, replicas=1, capacity_tokens=capacity,
        block_size=BLOCK, tokenize=tokenize, max_batch=n, adaptive=False, pipelined=True,
    )  # fmt: skip
    assert ahead.pipelined and (ahead.prompt_tokens, ahead.cached_tokens) == (prompt, cached)


def test_windows_follow_the_arrivals_and_replicas_share_the_stream(
    prepared: PreparedWorkload,
) -> None:
    n = len(prepared.workload.requests)
    apart = _at([float(i) for i in range(n)])  # a second apart: each call its own window
    one = run_windowed_fleet_model(
        prepared, apart, 100, replicas=1, capacity_tokens=8_000, block_size=BLOCK,
        tokenize=_Words(),
    )  # fmt: skip
    two = run_windowed_fleet_model(
        prepared, apart, 100, replicas=2, capacity_tokens=4_000, block_size=BLOCK,
        tokenize=_Words(),
    )  # fmt: skip
    assert one.windows == two.windows == n and one.mean_batch == 1.0
    assert two.prompt_tokens == sum(two.prompt_tokens_per_replica)
    assert min(two.prompt_tokens_per_replica) > 0
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        run_windowed_fleet_model(
            prepared, apart, 100, replicas=0, capacity_tokens=1, block_size=BLOCK,
            tokenize=_Words(),
        )  # fmt: skip
