"""``python -m contextpilot_bench.testbed``: prepare and serve the random-weights model on
vLLM's CPU build by hand.

- ``prepare --dir DIR``: write the model directory
  (:func:`~contextpilot_bench.testbed.model_dir.prepare_model_dir`, no download);
- ``serve --dir DIR``: run :class:`~contextpilot_bench.testbed.vllm_server.VllmCpuServer`
  until Ctrl-C or SIGTERM, printing its URL and KV-event endpoints; a directory with weights
  (``model.safetensors``: SmolLM2 from
  :func:`~contextpilot_bench.testbed.smollm2.ensure_smollm2_dir`) is served with them,
  one without with random weights (``--load-format`` says otherwise). ``--vllm-python`` names
  the Python that runs vLLM (default: ``$CONTEXTPILOT_VLLM_PYTHON``, else the source
  checkout's ``.venv-vllm``, else this interpreter when it has vllm;
  :mod:`~contextpilot_bench.testbed.locations`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from contextpilot_bench.testbed.locations import VLLM_PYTHON_ENV
from contextpilot_bench.testbed.model_dir import prepare_model_dir
from contextpilot_bench.testbed.stop_signals import StopSignals, Terminated
from contextpilot_bench.testbed.vllm_server import VllmCpuServer

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m contextpilot_bench.testbed``."""
    parser = argparse.ArgumentParser(
        prog="python -m contextpilot_bench.testbed",
        description="Prepare and serve a random-weights model on vLLM's CPU build.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    prepare = commands.add_parser("prepare", help="write the model directory (no download)")
    prepare.add_argument("--dir", required=True, type=Path, help="model directory to write")
    prepare.add_argument("--seed", type=int, default=0)
    prepare.add_argument("--hidden", type=int, default=512)
    prepare.add_argument("--layers", type=int, default=8)
    prepare.add_argument("--heads", type=int, default=8)
    prepare.add_argument("--kv-heads", type=int, default=2)
    prepare.add_argument("--intermediate", type=int, default=1024)
    prepare.add_argument("--vocab", type=int, default=8192)
    prepare.add_argument("--max-positions", type=int, default=8192)

    serve = commands.add_parser("serve", help="run the server until Ctrl-C")
    serve.add_argument("--dir", required=True, type=Path, help="model directory (prepare first)")
    serve.add_argument("--block-size", type=int, default=128, help="KV block tokens (x32)")
    serve.add_argument("--num-blocks", type=int, default=None, help="fix the KV block count")
    serve.add_argument("--max-model-len", type=int, default=4096)
    serve.add_argument("--kv-cache-gib", type=int, default=1)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--work-dir", type=Path, default=None)
    serve.add_argument("--startup-timeout", type=float, default=240.0)
    serve.add_argument(
        "--load-format",
        choices=("dummy", "auto"),
        default=None,
        help="dummy: random weights; auto: the directory's weights (default: auto when the "
        "directory has model.safetensors, else dummy)",
    )
    serve.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help=f"the Python that runs vLLM (default ${VLLM_PYTHON_ENV}, else the checkout's "
        ".venv-vllm, else this interpreter when it has vllm)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status: 0 after Ctrl-C, 143 after SIGTERM (the server
    stopped either way), 1 when the server exits on its own, 2 on bad arguments."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.command == "prepare":
        began = time.monotonic()
        directory = prepare_model_dir(
            args.dir,
            seed=args.seed,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            vocab=args.vocab,
            max_positions=args.max_positions,
        )
        print(f"model dir ready: {directory} ({time.monotonic() - began:.1f} s)")
        return 0
    load_format = args.load_format or (
        "auto" if (args.dir / "model.safetensors").is_file() else "dummy"
    )
    try:
        server = VllmCpuServer(
            args.dir,
            block_size=args.block_size,
            num_gpu_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
            kv_cache_space_gib=args.kv_cache_gib,
            port=args.port,
            seed=args.seed,
            work_dir=args.work_dir,
            vllm_python=args.vllm_python,
            startup_timeout=args.startup_timeout,
            load_format=load_format,
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with StopSignals(), server:
        print(f"base_url           {server.base_url}")
        print(f"model              {server.model_name}")
        print(f"kv_events_endpoint {server.kv_events_endpoint} (topic {server.kv_events_topic})")
        print(f"replay_endpoint    {server.replay_endpoint}")
        print(f"log                {server.log_path}")
        print(f"ready in {server.startup_seconds:.1f} s; Ctrl-C to stop", flush=True)
        try:
            while server.running:
                time.sleep(1.0)
        except (KeyboardInterrupt, Terminated) as stop:
            print("stopping", flush=True)
            return 0 if isinstance(stop, KeyboardInterrupt) else 143
        print(f"server exited on its own; log tail:\n{server.log_tail()}", file=sys.stderr)
    return 1
