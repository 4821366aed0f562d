"""The main job runs on the benchmark's own dependencies: `contextpilot-bench` imports and parses
its options without the agent frameworks (they are the `agents` extra, for --workload agentic-*)."""

from __future__ import annotations

import subprocess
import sys

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"langchain", "langchain_core", "langchain_anthropic",
                                  "langgraph", "llama_index"}:
            raise ModuleNotFoundError(f"blocked: {name}")
        return None
sys.meta_path.insert(0, Block())
import contextpilot_bench.cli
from contextpilot_bench.cli_arguments import build_parser
args = build_parser().parse_args(["--workload", "multihop-rag"])
assert args.workload == "multihop-rag"
print("ok")
"""


def test_the_command_line_needs_no_agent_framework() -> None:
    command = [sys.executable, "-c", BLOCK]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
