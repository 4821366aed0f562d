"""The ``contextpilot-bench`` command: real data, the table, JSON, the plot, a real HTTP engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from contextpilot_integrations.bench.cli import main


def test_offline_run_prints_table_and_writes_json_and_plot(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, plot = tmp_path / "r.json", tmp_path / "plots" / "p.png"
    code = main(
        ["--data-dir", str(data_dir), "--limit", "120", "--out", str(out), "--plot", str(plot)]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "workload multihop-rag: 120 requests" in text
    assert "capacity" in text and "0.05 of" in text
    for header in ("hit ratio", "vs upper bound", "vs baseline", "prefill tokens"):
        assert header in text
    document = json.loads(out.read_text())
    assert document["run"]["mode"] == "offline" and document["run"]["k"] == 10
    rows = {r["method"]: r for r in document["summary"]}
    assert set(rows) == {"baseline", "contextpilot", "upper-bound"}
    assert rows["contextpilot"]["hit_ratio"] > rows["baseline"]["hit_ratio"]
    assert rows["upper-bound"]["vs_upper_bound"] == 1.0
    records = document["methods"]["contextpilot"]["records"]
    assert sorted(r["request_index"] for r in records) == list(range(120))
    assert sum(r["cached_tokens"] for r in records) == rows["contextpilot"]["cached_tokens"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_plot_path_and_online_mode(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["--data-dir", str(data_dir), "--workload", "mtrag", "--mode", "online"]
    assert main([*args, "--limit", "60", "--cache-tokens", "unlimited", "-k", "4"]) == 0
    assert (tmp_path / "results" / "mtrag-online.png").is_file()


def test_engine_url_runs_methods_on_a_real_http_engine(
    data_dir: Path, tmp_path: Path, engine_server, capsys: pytest.CaptureFixture[str]
) -> None:
    url, state = engine_server
    out = tmp_path / "engine.json"
    args = ["--data-dir", str(data_dir), "--limit", "40", "--engine-url", url, "--no-plot"]
    assert main([*args, "--out", str(out)]) == 0
    assert "TTFT mean s" in capsys.readouterr().out
    # Each real method starts on a flushed cache; every request went out once per method.
    assert state.flushes == 2
    assert len(state.bodies) == 80
    rids = [b["rid"] for b in state.bodies]
    assert len(set(rids)) == 80 and all(b["max_tokens"] == 1 for b in state.bodies)
    rows = {r["method"]: r for r in json.loads(out.read_text())["summary"]}
    assert rows["contextpilot"]["hit_ratio"] > rows["baseline"]["hit_ratio"]
    assert rows["contextpilot"]["ttft_p50_s"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cache-tokens", "lots"], "--cache-tokens must be"),
        (["--methods", "baseline,fast"], "unknown ['fast']"),
        (["-k", "0"], "k must be >= 1"),
        (["--limit", "0"], "limit must be a positive integer"),
        (["--tokenizer", "/nonexistent/tokenizer.json"], "/nonexistent/tokenizer.json"),
        (["--block-size", "0"], "--block-size must be >= 1"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    data_dir: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--data-dir", str(data_dir), "--no-plot", *args]) == 2
    assert message in capsys.readouterr().err


def test_missing_data_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--data-dir", str(tmp_path), "--workload", "locomo"]) == 2
    err = capsys.readouterr().err
    assert "locomo/locomo10.json" in err and "snap-research/LoCoMo" in err


def test_module_entry_point(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "contextpilot_integrations.bench", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert "--cache-tokens" in done.stdout and "--engine-url" in done.stdout
