"""The engine a ``contextpilot-bench`` run goes through, as the CLI's one driver sees it.

Every engine is set up the same way (:class:`EngineSetup`): it names the token counter the
workload is counted with, is sized and started for the retrieved workload, hands the methods
runner a fresh engine (an empty cache) per method, adds its own lines to the report, and is
closed. Three setups:

- :class:`EmbeddedSetup`: the prefix-cache model (``--cache-tokens``, ``--block-size``,
  ``--tokenizer``);
- :class:`EngineURLSetup`: an OpenAI-compatible server the user started (``--engine-url``);
- :class:`~contextpilot_bench.vllm_setup.VllmCpuSetup`: vLLM's CPU build, started
  and stopped by the run (``--engine vllm-cpu``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from contextpilot_bench.engine import EmbeddedEngine, Engine
from contextpilot_bench.engine_client import EngineClient, OpenAIEngine
from contextpilot_bench.methods import (
    MethodResult,
    PreparedWorkload,
    parse_cache_tokens,
    resolve_cache_tokens,
)
from contextpilot_integrations.core.blocks import ApproxTokenCounter, TokenCounter, TokenizerCounter
from contextpilot_integrations.core.rendering import PromptLayout

if TYPE_CHECKING:
    from contextpilot_bench.prepared_conversations import PreparedConversations

__all__ = ["EmbeddedSetup", "EngineSetup", "EngineURLSetup", "engine_setup", "load_tokenizer"]

logger = logging.getLogger(__name__)


class EngineSetup(Protocol):
    """One run's engine.

    Attributes:
        counter: the token counter the workload (and ContextPilot) counts with.
        counter_description: how the run's JSON names it.
        block_size: the engine's block size, for the upper bound.
        plot_suffix: appended to the default plot file name (``""``, ``"-vllm-cpu"``).
        plot_label: the engine in the plot's title (set by :meth:`start`).
    """

    counter: TokenCounter
    counter_description: str
    block_size: int
    plot_suffix: str
    plot_label: str

    def start(self, prepared: PreparedWorkload | PreparedConversations, run: dict[str, Any]) -> str:
        """Size and start the engine for the retrieved workload; add its settings to ``run``.

        Returns:
            The report's line describing the engine (``"engine: ..."``).
        """
        ...

    def new_engine(self) -> Engine:
        """A fresh engine on an empty cache, for one method."""
        ...

    def report(self, results: Sequence[MethodResult], run: dict[str, Any]) -> list[str]:
        """Lines printed after the methods' table; adds the engine's own figures to ``run``."""
        ...

    def close(self) -> None:
        """Stop what :meth:`start` started (idempotent)."""
        ...


def load_tokenizer(path: str) -> TokenizerCounter:
    """``--tokenizer``: a HuggingFace ``tokenizer.json`` as a token counter.

    Raises:
        FileNotFoundError: no such file.  ValueError: the ``tokenizers`` package is missing.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"--tokenizer: {path} does not exist")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(
            "--tokenizer needs the 'tokenizers' package (pip install tokenizers)"
        ) from None
    return TokenizerCounter(Tokenizer.from_file(path))


class _CounterFromArguments:
    """The token counter of ``--tokenizer`` (default :class:`ApproxTokenCounter`)."""

    plot_suffix = ""

    def __init__(self, args: argparse.Namespace) -> None:
        if args.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
        self.tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        self.counter: TokenCounter = self.tokenizer or ApproxTokenCounter()
        self.counter_description = (
            repr(self.counter) if self.tokenizer is None else f"tokenizer {args.tokenizer}"
        )
        self.plot_label = ""
        self._layout = PromptLayout()

    def report(self, results: Sequence[MethodResult], run: dict[str, Any]) -> list[str]:
        return []

    def _started(self, line: str, layout: PromptLayout) -> str:
        self.plot_label = line.removeprefix("engine: ")
        self._layout = layout
        return line


class EmbeddedSetup(_CounterFromArguments):
    """The embedded prefix-cache model: ``--cache-tokens`` (default ``default_cache``) of the
    workload's unique block tokens, ``--block-size``."""

    def __init__(self, args: argparse.Namespace, default_cache: str) -> None:
        super().__init__(args)
        self.block_size = args.block_size
        self.cache_spec = args.cache_tokens or default_cache
        self.spec = parse_cache_tokens(self.cache_spec)
        self.capacity: int | None = None

    def start(self, prepared: PreparedWorkload | PreparedConversations, run: dict[str, Any]) -> str:
        unique = prepared.unique_block_tokens
        self.capacity = resolve_cache_tokens(self.spec, unique)
        run.update(
            engine="embedded",
            cache_tokens_arg=self.cache_spec,
            cache_tokens=self.capacity,
            block_size=self.block_size,
        )
        if self.capacity is None:
            size = "unlimited"
        elif isinstance(self.spec, float):
            size = f"{self.capacity:,} tokens ({self.spec:g} of {unique:,} unique block tokens)"
        else:
            size = f"{self.capacity:,} tokens"
        line = f"engine: embedded prefix-cache model, capacity {size}, block size {self.block_size}"
        return self._started(line, prepared.layout)

    def new_engine(self) -> Engine:
        return EmbeddedEngine(
            self.capacity,
            counter=self.counter,
            tokenizer=self.tokenizer,
            block_size=self.block_size,
        )

    def close(self) -> None:
        """Nothing to stop."""


class EngineURLSetup(_CounterFromArguments):
    """An OpenAI-compatible server the user started (``--engine-url``, ``--model``,
    ``--api-key``); its prefix cache is flushed before each method."""

    block_size = 1  # the engine's own block size is not known here

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        if args.cache_tokens is not None:
            logger.warning(
                "--cache-tokens is ignored with --engine-url: the engine's memory decides"
            )
        self.url = args.engine_url
        self.client = EngineClient(self.url, model=args.model, api_key=args.api_key)

    def start(self, prepared: PreparedWorkload | PreparedConversations, run: dict[str, Any]) -> str:
        run.update(engine=self.url, model=self.client.model)
        return self._started(f"engine: {self.url} (model {self.client.model})", prepared.layout)

    def new_engine(self) -> Engine:
        self.client.flush_cache()
        return OpenAIEngine(self.client, self._layout)

    def close(self) -> None:
        self.client.close()


def engine_setup(
    args: argparse.Namespace,
    *,
    default_cache: str,
    multiturn: bool,
    stop_check: Callable[[], None],
) -> EngineSetup:
    """The setup the arguments choose: ``--engine vllm-cpu``, ``--engine-url`` or the embedded
    model.

    Raises:
        ValueError, FileNotFoundError: arguments that do not apply to the engine, or what it
            needs is missing (the message names the option).
    """
    from contextpilot_bench.vllm_setup import VLLM_ENGINE, VllmCpuSetup

    if args.engine == VLLM_ENGINE:
        return VllmCpuSetup(args, multiturn=multiturn, stop_check=stop_check)
    if args.engine_url:
        return EngineURLSetup(args)
    return EmbeddedSetup(args, default_cache)
