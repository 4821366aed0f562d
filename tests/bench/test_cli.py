"""The ``contextpilot-bench`` command: real data, the table, JSON, the plot, a real HTTP engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from contextpilot_bench.cli import main


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
    assert set(rows) == {"baseline", "contextpilot", "upper-bound", "clairvoyant-arrival"}
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


@pytest.mark.parametrize("cache", ["unlimited", "0.05"])
def test_online_run_prints_its_share_of_the_clairvoyant_order(
    data_dir: Path, tmp_path: Path, cache: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "online.json"
    args = ["--data-dir", str(data_dir), "--limit", "60", "--mode", "online", "--no-plot"]
    assert main([*args, "--cache-tokens", cache, "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["summary"]}
    online, clairvoyant = rows["contextpilot"], rows["clairvoyant-arrival"]
    share = online["hit_ratio"] / clairvoyant["hit_ratio"]
    assert online["vs_clairvoyant_arrival"] == pytest.approx(share)
    line = next(x for x in capsys.readouterr().out.splitlines() if "vs clairvoyant" in x)
    assert f"({clairvoyant['hit_ratio']:.4f}, the offline plan" in line
    assert "mode online" in line and f"contextpilot {share:.4f}" in line


def test_engine_url_runs_methods_on_a_real_http_engine(
    data_dir: Path, tmp_path: Path, engine_server, capsys: pytest.CaptureFixture[str]
) -> None:
    url, state = engine_server
    out = tmp_path / "engine.json"
    args = ["--data-dir", str(data_dir), "--limit", "40", "--engine-url", url, "--no-plot"]
    assert main([*args, "--out", str(out)]) == 0
    assert "TTFT mean s" in capsys.readouterr().out
    # Each real method starts on a flushed cache; every request went out once per method.
    assert state.flushes == 3  # baseline, contextpilot, clairvoyant-arrival
    assert len(state.bodies) == 120
    rids = [b["rid"] for b in state.bodies]
    assert len(set(rids)) == 120 and all(b["max_tokens"] == 1 for b in state.bodies)
    rows = {r["method"]: r for r in json.loads(out.read_text())["summary"]}
    assert rows["contextpilot"]["hit_ratio"] > rows["baseline"]["hit_ratio"]
    assert rows["contextpilot"]["ttft_p50_s"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cache-tokens", "lots"], "--cache-tokens must be"),
        (["--methods", "baseline,fast"], "unknown ['fast']"),
        (["--cache-tokens", "inf"], "--cache-tokens must be a finite number > 0"),
        (["--tokenizer", "/nonexistent/tokenizer.json"], "/nonexistent/tokenizer.json"),
        (["--block-size", "0"], "--block-size must be >= 1"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    data_dir: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--data-dir", str(data_dir), "--no-plot", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-k", "0"], "argument -k/--top-k: must be an int >= 1, got '0'"),
        (["--limit", "0"], "argument --limit: must be an int >= 1, got '0'"),
        (["--replicas", "0"], "argument --replicas: --replicas must be integers >= 1, got '0'"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--no-plot", *args])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_data_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--data-dir", str(tmp_path), "--workload", "locomo"]) == 2
    err = capsys.readouterr().err
    assert "locomo/locomo10.json" in err and "snap-research/LoCoMo" in err


def test_module_entry_point(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "contextpilot_bench", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert "--cache-tokens" in done.stdout and "--engine-url" in done.stdout


# --- planning windows --------------------------------------------------------------------------


def _window_run(
    data_dir: Path, tmp_path: Path, workload: str, *extra: str
) -> tuple[dict, dict[str, dict]]:
    out = tmp_path / f"{workload}.json"
    args = ["--data-dir", str(data_dir), "--workload", workload, "--limit", "120"]
    assert main([*args, "--mode", "online", "--no-plot", "--out", str(out), *extra]) == 0
    document = json.loads(out.read_text())
    return document, {r["method"]: r for r in document["summary"]}


@pytest.mark.parametrize("workload", ["multihop-rag", "mtrag"])
def test_window_zero_gives_the_online_figures(
    data_dir: Path, tmp_path: Path, workload: str
) -> None:
    _, online = _window_run(data_dir, tmp_path, workload)
    arrival = ["--arrival", "poisson", "--rate", "1600", "--window-ms", "0,10"]
    document, rows = _window_run(data_dir, tmp_path, workload, *arrival)
    for key in ("hit_ratio", "prefill_tokens", "prompt_tokens"):
        assert rows["window 0 ms"][key] == rows["contextpilot"][key] == online["contextpilot"][key]
    assert rows["baseline"] == online["baseline"]
    window_records = document["methods"]["window 0 ms"]["records"]
    assert window_records == document["methods"]["contextpilot"]["records"]
    # The offline reference is the offline run's figure.
    _, offline = _window_run(data_dir, tmp_path, workload, "--mode", "offline")
    assert rows["contextpilot offline"]["hit_ratio"] == offline["contextpilot"]["hit_ratio"]


def test_window_run_prints_the_windows_and_writes_json_and_the_tradeoff_plot(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "w.json"
    args = ["--data-dir", str(data_dir), "--limit", "120", "--mode", "online", "--out", str(out)]
    windows = ["--arrival", "poisson", "--rate", "3200,1600", "--window-ms", "5,10"]
    assert main([*args, *windows, "--max-batch", "12", "--seed", "4"]) == 0
    text = capsys.readouterr().out
    assert "arrivals poisson" in text and "planning windows (adaptive closing, at most 12" in text
    for header in ("req/window", "vs offline", "added p50 ms", "added p99 ms", "target"):
        assert header in text
    assert "target: hit ratio >= 0.6 of the offline figure" in text
    assert "prefill tokens vs baseline: " in text
    assert (tmp_path / "results" / "multihop-rag-window.png").read_bytes()[:4] == b"\x89PNG"
    document = json.loads(out.read_text())
    run = document["run"]
    assert run["arrival"] == "poisson" and run["window_ms"] == [5.0, 10.0]
    assert run["rate_per_s"] == [3200.0, 1600.0] and run["max_batch"] == 12 and run["seed"] == 4
    first, second = document["windows"]
    assert first["method"] == "window 5 ms" and second["rate_per_s"] == 1600.0
    for row in (first, second):
        assert sum(row["window_sizes"]) == 120 and max(row["window_sizes"]) <= 12
        assert len(row["added_latency_ms"]) == 120
        assert row["requests_per_window"] == pytest.approx(120 / len(row["window_sizes"]))
        latencies = sorted(row["added_latency_ms"])
        assert row["added_p50_ms"] == pytest.approx((latencies[59] + latencies[60]) / 2)
        # No request waits longer than its window plus the slowest window's planning.
        assert latencies[-1] <= row["window_ms"] + max(row["window_plan_ms"]) + 1e-9
        assert row["target"] in ("met", "missed")
    records = document["methods"]["window 10 ms"]["records"]
    assert sorted(r["request_index"] for r in records) == list(range(120))


def test_the_window_target_is_judged_only_for_a_five_percent_cache(
    data_dir: Path, tmp_path: Path
) -> None:
    windows = ["--arrival", "poisson", "--rate", "1600", "--window-ms", "10"]
    document, _ = _window_run(data_dir, tmp_path, "multihop-rag", *windows)
    assert document["windows"][0]["target"] in ("met", "missed")
    unlimited = [*windows, "--cache-tokens", "unlimited"]
    document, _ = _window_run(data_dir, tmp_path, "multihop-rag", *unlimited)
    assert document["windows"][0]["target"] is None


def test_replay_runs_on_mtrag_in_the_recorded_order(data_dir: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    replay = ["--arrival", "replay", "--window-ms", "0,50", "--rate", "100"]
    document, rows = _window_run(data_dir, tmp_path, "mtrag", *replay)
    assert "arrivals replay" in capsys.readouterr().out
    assert document["run"]["rate_per_s"] == pytest.approx([100.0, 100.0])
    assert rows["window 0 ms"]["hit_ratio"] == rows["contextpilot"]["hit_ratio"]


def test_every_run_says_whether_prefill_is_above_the_baseline(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--data-dir", str(data_dir), "--limit", "60", "--no-plot"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("prefill tokens"))
    assert "contextpilot" in line and ("none above" in line or "ABOVE" in line)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--window-ms", "10"], "--window-ms needs --arrival"),
        (["--rate", "100"], "--rate needs --arrival"),
        (["--max-batch", "8"], "--max-batch needs --arrival"),
        (["--no-window-adaptive"], "--window-adaptive needs --arrival"),
        (["--arrival", "poisson", "--rate", "-5"], "--rate must be finite numbers > 0"),
        (["--arrival", "poisson", "--rate", "0"], "--rate must be finite numbers > 0"),
        (["--arrival", "poisson"], "--arrival poisson needs --rate"),
        (["--arrival", "poisson", "--rate", "1", "--window-ms", "-1"], "--window-ms must be"),
        (["--arrival", "poisson", "--rate", "1", "--window-ms", "5,5"], "must not repeat"),
        (["--arrival", "poisson", "--rate", "1,2", "--window-ms", "0,5,10"], "one per window"),
        (["--arrival", "poisson", "--rate", "1", "--max-batch", "0"], "--max-batch must be >= 1"),
        (["--arrival", "replay"], "multihop-rag records none for 500 of its 500 requests"),
        (["--arrival", "replay", "--workload", "locomo"], "locomo records none"),
        (["--arrival", "poisson", "--rate", "1", "--mode", "offline"], "needs --mode online"),
        (["--arrival", "replay", "--workload", "mtrag-conversations"], "with --sessions"),
    ],
)
def test_bad_window_options_exit_2_with_a_message(
    data_dir: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    mode = [] if "--mode" in args else ["--mode", "online"]
    assert main(["--data-dir", str(data_dir), "--no-plot", *mode, *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no-proxy-kv-capacity"], "--no-proxy-kv-capacity: options of the proxy method"),
        (["--proxy-max-in-flight", "2"], "--proxy-max-in-flight: options of the proxy method"),
        (["--proxy-target-workers"], "--proxy-target-workers: options of the proxy method"),
        (["--proxy-window-hold-ms", "100"], "--proxy-window-hold-ms: options of the proxy"),
        (
            ["--replicas", "2", "--engine", "vllm-cpu", "--methods", "baseline-round_robin",
             "--no-proxy-kv-capacity"],
            "--no-proxy-kv-capacity: options of the contextpilot-proxy-smg method, which "
            "--methods baseline-round_robin does not run",
        ),
    ],
)  # fmt: skip
def test_a_proxy_option_without_the_proxy_method_exits_2_naming_it(
    data_dir: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--data-dir", str(data_dir), "--no-plot", *args]) == 2
    assert message in capsys.readouterr().err


def test_the_proxy_methods_window_hold_defaults_with_a_window_and_is_checked() -> None:
    import argparse

    from contextpilot_bench.proxy_fleet import DEFAULT_PROXY_HOLD_MS
    from contextpilot_bench.replicas_vllm import _proxy_hold_ms

    args = lambda hold: argparse.Namespace(proxy_window_hold_ms=hold)  # noqa: E731
    assert _proxy_hold_ms(args(None), 500.0) == DEFAULT_PROXY_HOLD_MS
    assert _proxy_hold_ms(args(None), 0.0) == 0.0 and _proxy_hold_ms(args(250.0), 500.0) == 250
    with pytest.raises(ValueError, match=r"--proxy-window-hold-ms 100 holds .* --window-ms is 0"):
        _proxy_hold_ms(args(100.0), 0.0)
    with pytest.raises(ValueError, match=r"--proxy-window-hold-ms must be from 0 to 60000"):
        _proxy_hold_ms(args(-1.0), 500.0)


def test_windows_run_on_a_real_http_engine(data_dir: Path, tmp_path: Path, engine_server) -> None:  # type: ignore[no-untyped-def]
    url, state = engine_server
    out = tmp_path / "engine-window.json"
    args = ["--data-dir", str(data_dir), "--limit", "30", "--engine-url", url, "--no-plot"]
    windows = ["--mode", "online", "--arrival", "poisson", "--rate", "1600", "--window-ms", "0,10"]
    assert main([*args, *windows, "--out", str(out)]) == 0
    # baseline, online, clairvoyant-arrival, offline reference, two windows: six engines, each
    # on a flushed cache.
    assert state.flushes == 6 and len(state.bodies) == 180
    rows = {r["method"]: r for r in json.loads(out.read_text())["summary"]}
    assert rows["window 0 ms"]["hit_ratio"] == rows["contextpilot"]["hit_ratio"]
