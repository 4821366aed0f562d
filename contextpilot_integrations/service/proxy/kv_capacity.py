"""A replica's KV capacity in tokens, asked of its engine when the proxy starts
(docs/DESIGN.md, "The proxy", "Engine facts").

A replica whose ``kv_capacity_tokens`` the fleet leaves at ``"auto"`` (the default) has it
learnt from its engine's root (its ``base_url`` less ``/v1``) by :func:`learn_kv_capacity`:

- vLLM: ``GET /metrics``, the gauge ``vllm:cache_config_info`` whose labels carry
  ``num_gpu_blocks`` and ``block_size``: the capacity is ``(num_gpu_blocks - 1) *
  block_size`` (one block is vLLM's null block, never a request's), summed over its
  ``engine`` label (the data-parallel ranks of one replica), read with prometheus_client's
  text parser (:func:`capacity_from_vllm_metrics`);
- SGLang: ``GET /get_server_info``, a JSON object with ``max_total_num_tokens`` (one
  scheduler's), times its ``dp_size`` (:func:`capacity_from_sglang_server_info`).

Anything else (a hosted API, an engine that answers neither, an answer too long, not parsed,
or with a count that is not a positive integer of sensible size) leaves the capacity not
known, with one log line. Each request is bounded by :data:`REQUEST_TIMEOUT_S` and each
answer read by :data:`MAX_ANSWER_BYTES`; an engine that does not answer yet (refused, timed
out, a 5xx while it starts) is asked again every :data:`RETRY_S`, an engine that answered
without the fact is not, and the whole learning, tries and waits together, ends within
:data:`LEARN_DEADLINE_S` (an engine that hangs on every request is given up on then, as one
that keeps refusing is).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from contextpilot_integrations.core.replicas.routing_config import MAX_CAPACITY_TOKENS
from contextpilot_integrations.service.proxy.upstream import engine_root

__all__ = [
    "MAX_ANSWER_BYTES",
    "LEARN_DEADLINE_S",
    "REQUEST_TIMEOUT_S",
    "RETRY_S",
    "capacity_from_sglang_server_info",
    "capacity_from_vllm_metrics",
    "learn_kv_capacity",
]

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0
"""Longest wait for one answer (connect and read together)."""

MAX_ANSWER_BYTES = 2 * 1024 * 1024
"""Longest answer read; a longer one leaves the capacity not known."""

RETRY_S = 2.0
"""Seconds between tries while the engine does not answer yet."""

LEARN_DEADLINE_S = 60.0
"""Longest the learning of one engine's capacity takes, its tries and the waits between them
together."""

VLLM_CACHE_INFO = "vllm:cache_config_info"
"""vLLM's gauge whose labels are its cache configuration (its ``log_metrics_info``)."""

_MAX_DIGITS = 15


class _NotAnswering(Exception):
    """The engine refused, timed out or answered a 5xx: it may still be starting."""


def capacity_from_vllm_metrics(text: str) -> int | None:
    """The KV capacity in tokens a vLLM ``GET /metrics`` answer ``text`` states
    (``num_gpu_blocks`` less the null block, times ``block_size``, of
    ``vllm:cache_config_info``, summed over its ``engine`` label); None: not stated, or a
    label that is not a positive integer."""
    per_engine: dict[str, int] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name != VLLM_CACHE_INFO:
                continue
            for sample in family.samples:
                blocks = _label_count(sample.labels.get("num_gpu_blocks"))
                block_size = _label_count(sample.labels.get("block_size"))
                if blocks is None or blocks < 2 or block_size is None:
                    return None
                per_engine[sample.labels.get("engine", "")] = (blocks - 1) * block_size
    except (ValueError, TypeError, IndexError, KeyError):  # not the exposition format
        return None
    return _bounded(sum(per_engine.values())) if per_engine else None


def capacity_from_sglang_server_info(body: bytes | str) -> int | None:
    """The KV capacity in tokens an SGLang ``GET /get_server_info`` answer ``body`` states
    (``max_total_num_tokens`` times ``dp_size``, 1 when absent); None: not stated, or not
    a positive integer."""
    try:
        info = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(info, Mapping):
        return None
    tokens = _json_count(info.get("max_total_num_tokens"))
    ranks = _json_count(info.get("dp_size", 1))
    if tokens is None or ranks is None:
        return None
    return _bounded(tokens * ranks)


async def learn_kv_capacity(
    base_url: str,
    *,
    retry_s: float = RETRY_S,
    deadline_s: float = LEARN_DEADLINE_S,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> int | None:
    """The KV capacity in tokens of the engine at ``base_url`` (module docstring), within
    ``deadline_s``; None: not known (logged once). Never raises but for cancellation."""
    root = engine_root(base_url)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # Answers read as sent, uncompressed asked: a compressed one cannot outgrow the bound.
    async with aiohttp.ClientSession(
        timeout=timeout,
        trust_env=False,
        auto_decompress=False,
        headers={"accept-encoding": "identity"},
    ) as client:
        while True:
            try:
                too_long: list[str] = []
                metrics = await _answer(client, f"{root}/metrics", deadline - loop.time(), too_long)
                if metrics is not None:
                    text = metrics.decode("utf-8", errors="replace")
                    found = await asyncio.to_thread(capacity_from_vllm_metrics, text)
                    if found is not None:
                        return found
                info = await _answer(
                    client, f"{root}/get_server_info", deadline - loop.time(), too_long
                )
                if info is not None:
                    found = capacity_from_sglang_server_info(info)
                    if found is not None:
                        return found
                logger.info(
                    "%s states no KV capacity (GET /metrics, GET /get_server_info%s): the "
                    "replica's capacity is not known",
                    root,
                    "".join(f"; {what}" for what in too_long),
                )
                return None
            except _NotAnswering as exc:
                if loop.time() + retry_s < deadline:
                    await asyncio.sleep(retry_s)
                    continue
                logger.warning(
                    "%s did not answer for its KV capacity within %g s (%s): the replica's "
                    "capacity is not known",
                    root,
                    deadline_s,
                    exc,
                )
                return None


async def _answer(
    client: aiohttp.ClientSession, url: str, left_s: float, too_long: list[str]
) -> bytes | None:
    """The body of a 200 answer to ``GET url`` within the session's timeout and ``left_s``
    (None: another status, or longer than :data:`MAX_ANSWER_BYTES`, said in ``too_long``
    for the one log line).

    Raises:
        _NotAnswering: refused, timed out, or a 5xx.
    """
    if left_s <= 0:
        raise _NotAnswering(f"GET {url}: no time left")
    session_s = client.timeout.total
    timeout = aiohttp.ClientTimeout(total=min(left_s, session_s) if session_s else left_s)
    try:
        async with client.get(url, allow_redirects=False, timeout=timeout) as answer:
            if answer.status >= 500:
                raise _NotAnswering(f"GET {url}: {answer.status}")
            if answer.status != 200:
                return None
            body = bytearray()
            async for chunk in answer.content.iter_chunked(65_536):
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    too_long.append(f"{url} answered over {MAX_ANSWER_BYTES} bytes: not read")
                    return None
            return bytes(body)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise _NotAnswering(f"GET {url}: {type(exc).__name__}") from None


def _label_count(value: str | None) -> int | None:
    """A label's decimal digits as a positive integer; None: not one."""
    if value is None or not 0 < len(value) <= _MAX_DIGITS or not value.isascii():
        return None
    return _bounded(int(value)) if value.isdigit() else None


def _json_count(value: Any) -> int | None:
    """A JSON number that is a positive integer; None: not one (a bool, a float, text)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return _bounded(value)


def _bounded(tokens: int) -> int | None:
    return tokens if 0 < tokens <= MAX_CAPACITY_TOKENS else None
