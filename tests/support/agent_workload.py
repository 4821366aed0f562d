"""Small agent workloads for the agent replays' tests: a synthetic MTRAG-shaped workload (two
conversations of two turns over a few sentences) and a slice of the real MTRAG-UN tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from contextpilot_bench.workloads import Document, Request, Workload

from support.data_dir import data_dir_or_skip

TEXTS = [
    "Paged attention keeps the KV cache in fixed-size blocks of GPU memory.",
    "A radix tree over token ids lets requests share a cached prompt prefix.",
    "Prefix caching reuses the KV cache of a shared system prompt across requests.",
    "Speculative decoding drafts tokens with a small model and verifies them.",
    "Continuous batching admits new requests at every decoding step.",
    "Quantized KV caches store keys and values in eight bits.",
    "Chunked prefill splits a long prompt into pieces scheduled with decodes.",
]
MTRAG_FILE = Path("mtrag/mtragun-human/generation_tasks/reference.jsonl")


def small_mtrag_workload() -> Workload:
    """Conversations ``a`` and ``b`` of two user turns each (request ids ``a::0`` .. ``b::3``),
    one scope over :data:`TEXTS`."""
    corpus = tuple(Document(f"d{i}", text, "c") for i, text in enumerate(TEXTS))
    asked = [
        ("a", "How does paged attention store the KV cache?"),
        ("a", "And prefix caching of the KV cache?"),
        ("b", "What is continuous batching?"),
        ("b", "How does chunked prefill work with batching?"),
    ]
    requests = tuple(
        Request(f"{c}::{n}", q, conversation_id=c, scope="c") for n, (c, q) in enumerate(asked)
    )
    return Workload("mtrag", corpus, requests)


def mtrag_slice(target: Path, sessions: int, user_turns: int) -> list[dict[str, Any]]:
    """Write a data directory at ``target`` with the first ``sessions`` MTRAG-UN tasks of
    ``user_turns`` user turns from different conversations, copied from the real data; returns
    those tasks (skips when the real data lacks MTRAG-UN)."""
    source = data_dir_or_skip() / MTRAG_FILE
    if not source.is_file():
        pytest.skip(f"MTRAG-UN not in the data directory ({source} missing)")
    chosen: list[str] = []
    tasks: list[dict[str, Any]] = []
    with source.open(encoding="utf-8") as lines:
        for line in lines:
            task: dict[str, Any] = json.loads(line)
            users = [m for m in task["input"] if m["speaker"] == "user"]
            if len(users) == user_turns and all(
                t["conversation_id"] != task["conversation_id"] for t in tasks
            ):
                tasks.append(task)
                chosen.append(line.strip())
            if len(chosen) == sessions:
                break
    assert len(chosen) == sessions, f"fewer than {sessions} such tasks in {source}"
    path = target / MTRAG_FILE
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(chosen) + "\n", encoding="utf-8")
    return tasks


def run_bench(argv: list[str], timeout_s: float = 600.0) -> str:
    """``python -m contextpilot_bench ARGV`` in a subprocess with the hub offline; its stdout
    (fails the test with the output's tail on a non-zero exit)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "contextpilot_bench", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout
