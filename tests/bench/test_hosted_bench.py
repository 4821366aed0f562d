"""The hosted-API mode of the benchmark: the providers' cache models and the cost report."""

from __future__ import annotations

import json

import pytest
from contextpilot_bench.cli import main
from contextpilot_bench.hosted_cache_model import (
    AnthropicCacheModel,
    OpenAICacheModel,
    TooManyBreakpoints,
)

UNITS = [(1, 30), (2, 500), (3, 500), (4, 500), (5, 20)]  # system, three documents, tail


def test_anthropic_model_writes_at_breakpoints_and_reads_through_the_lookback():
    model = AnthropicCacheModel(300.0, 1024)
    first = model.serve(0.0, UNITS, [3])  # breakpoint after the third document
    assert (first.cache_read_tokens, first.cache_write_tokens) == (0, 1530)
    assert (
        first.input_tokens == 20
        and first.response()["usage"]["cache_creation_input_tokens"] == 1530
    )
    # a later prompt that shares the three documents reads them through its later breakpoint
    longer = [*UNITS[:4], (9, 700), (5, 20)]
    second = model.serve(10.0, longer, [4])
    assert (second.cache_read_tokens, second.cache_write_tokens) == (1530, 700)
    # below the minimum: no write, no read
    short = model.serve(20.0, UNITS[:2], [1])
    assert (short.cache_read_tokens, short.cache_write_tokens) == (0, 0)
    # a read refreshes the lifetime: 290 s after the read it is still there, not 310 after
    assert model.serve(300.0, UNITS, [3]).cache_read_tokens == 1530
    assert model.serve(590.0, UNITS, [3]).cache_read_tokens == 1530
    assert model.serve(900.0, UNITS, [3]).cache_read_tokens == 0
    with pytest.raises(TooManyBreakpoints):
        model.serve(0.0, UNITS, [0, 1, 2, 3, 4])


def test_openai_model_rounds_to_steps_and_routes_by_key():
    model = OpenAICacheModel(300.0)
    assert model.serve(0.0, UNITS, None).cache_read_tokens == 0
    hit = model.serve(1.0, UNITS, None).cache_read_tokens
    assert hit >= 1024 and (hit - 1024) % 128 == 0 and hit <= 1550
    assert model.serve(2.0, UNITS, "other key").cache_read_tokens == 0  # another machine
    assert model.serve(3.0, UNITS[:2], None).cache_read_tokens == 0  # below 1,024
    busy = OpenAICacheModel(300.0, overflow_per_minute=2)
    hits = [busy.serve(float(i), UNITS, "k").cache_read_tokens for i in range(4)]
    assert hits[1] > 0 and hits[2] == 0  # the third within a minute overflows to a cold machine


def test_cli_cost_report(tmp_path, capsys, data_dir):
    out = tmp_path / "hosted.json"
    argv = [
        "--engine",
        "hosted-anthropic",
        "--hosted-model",
        "claude-sonnet-4-6",
        "--rate",
        "1",
        "--price-write",
        "1.25",
        "--price-read",
        "0.1",
        "-k",
        "20",
        "--limit",
        "120",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "cache writes" in text and "contextpilot input cost =" in text
    assert "breakpoints whose prefix is below the minimum (1,024 tokens): 0" in text
    document = json.loads(out.read_text())
    rows = {row["method"]: row for row in document["summary"]}
    assert rows["baseline"]["vs_baseline"] == 1.0
    assert rows["contextpilot"]["max_breakpoints"] <= 4
    assert rows["contextpilot"]["vs_baseline"] < 1.0
    assert document["run"]["settings"]["price_write"] == 1.25


def test_cli_openai_and_missing_prices(capsys, data_dir):
    assert main(["--engine", "hosted-openai", "--price-read", "0.1", "--limit", "40"]) == 0
    assert "n/a" in capsys.readouterr().out  # OpenAI reports no writes
    assert main(["--engine", "hosted-anthropic", "--price-read", "0.1", "--limit", "5"]) == 2
    assert "needs --price-write and --price-read" in capsys.readouterr().err
    assert (
        main(
            [
                "--engine",
                "hosted-anthropic",
                "--mode",
                "offline",
                "--price-write",
                "1",
                "--price-read",
                "1",
                "--limit",
                "5",
            ]
        )
        == 2
    )
