"""Engine-facing request fields, built in one place, and the engine's usage read back.

Every face that hands a plan to an LLM call (LangChain's ``with_request_id``, LlamaIndex's
``ContextPilotOpenAILike``, the Mem0 agent middleware, the benchmark's engine client) takes the
body fields from here, so the engine's cache events and evictions name the request the plan was
indexed under (``shared/notes/engine-kv-events.md``, "Request ids on the OpenAI-compatible
APIs"):

- SGLang takes ``rid`` on ``/v1/chat/completions`` and ``/v1/completions`` (all 0.5.x) and a
  top-level ``session_id`` since 0.5.15, echoed on ``BlockStored`` events since 0.5.20;
- vLLM takes ``request_id`` and, in recent releases, ``session_id`` (echoed on ``BlockStored``);
- openai-python sends non-standard fields through ``extra_body={...}``; LangChain's
  ``ChatOpenAI(..., extra_body=...)`` or ``.bind(extra_body=...)`` forwards them.

Hosted APIs (OpenAI, Anthropic) refuse unknown fields: use ``engine="hosted"`` (no ids) there,
with the TTL cache model.

The engine reports how much of the prompt it served from its prefix cache as
``usage.prompt_tokens_details.cached_tokens`` (SGLang; vLLM with
``--enable-prompt-tokens-details``; OpenAI). :func:`read_usage` parses it (the one parser of
the package); :class:`CacheUsageTracker` keeps the hit ratio of the planned requests and passes
each figure to the planner's ``record_usage`` (``ContextPilot`` and the service client), which
marks a hit request as recently used.

Example::

    tracker = CacheUsageTracker(pilot)          # ContextPilot or ContextPilotClient
    plan = pilot.plan(question, texts)
    response = openai_client.chat.completions.create(
        model=model, messages=plan.messages, **with_engine_fields({}, plan))
    tracker.record(plan, response)
    tracker.stats()  # {"requests": 1, "prompt_tokens": ..., "cached_tokens": ..., ...}

or, in one call, :func:`create_chat_completion` (and :func:`acreate_chat_completion`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

__all__ = [
    "REQUEST_ID_FIELDS",
    "CacheUsageTracker",
    "EngineKind",
    "Usage",
    "acreate_chat_completion",
    "create_chat_completion",
    "read_usage",
    "engine_body_fields",
    "with_engine_fields",
]

logger = logging.getLogger(__name__)

EngineKind = Literal["any", "sglang", "vllm", "hosted"]

REQUEST_ID_FIELDS: tuple[str, ...] = ("rid", "request_id", "session_id")
"""The body fields that carry a plan's rid to SGLang and vLLM alike (``engine="any"``)."""

_ID_FIELDS: dict[str, tuple[str, ...]] = {
    "any": REQUEST_ID_FIELDS,
    "sglang": ("rid", "session_id"),
    "vllm": ("request_id", "session_id"),
    "hosted": (),
}


class _HasRid(Protocol):
    rid: str


def _rid_of(plan: _HasRid | str) -> str:
    rid = plan if isinstance(plan, str) else getattr(plan, "rid", None)
    if not isinstance(rid, str) or not rid:
        raise TypeError(
            f"plan must be a Plan (with a non-empty .rid) or a rid str, got {plan!r:.80}"
        )
    return rid


def engine_body_fields(plan: _HasRid | str, engine: EngineKind = "any") -> dict[str, str]:
    """The request-body fields a plan sends to ``engine``: its rid, and its tenant's
    ``cache_salt`` when it has one.

    ``cache_salt`` (vLLM's request field; SGLang's since 0.5.18, which also reports it on its
    KV events) keys the engine's prefix cache per tenant: requests with different salts never
    share cached blocks, so one tenant cannot learn from cache hits what another sent.

    Args:
        plan: a ``Plan`` (its ``rid`` and ``cache_salt``) or the rid itself.
        engine: ``"any"`` (SGLang and vLLM fields: ``rid``, ``request_id``, ``session_id``),
            ``"sglang"``, ``"vllm"``, or ``"hosted"`` (none: hosted APIs refuse them).

    Returns:
        e.g. ``{"rid": r, "request_id": r, "session_id": r}`` (plus ``"cache_salt"``).

    Raises:
        TypeError: ``plan`` has no rid.
        ValueError: an unknown ``engine``.
    """
    if engine not in _ID_FIELDS:
        raise ValueError(f"engine must be one of {sorted(_ID_FIELDS)}, got {engine!r}")
    rid = _rid_of(plan)
    fields = dict.fromkeys(_ID_FIELDS[engine], rid)
    salt = None if isinstance(plan, str) else getattr(plan, "cache_salt", None)
    if salt is not None and engine != "hosted":
        fields["cache_salt"] = salt
    return fields


def with_engine_fields(
    kwargs: Mapping[str, Any], plan: _HasRid | str, engine: EngineKind = "any"
) -> dict[str, Any]:
    """A copy of an OpenAI call's keyword arguments with the plan ids merged into
    ``extra_body`` (fields already in ``extra_body`` are kept; the ids win on a clash).

    Raises:
        TypeError: ``kwargs["extra_body"]`` is not a mapping, or ``plan`` has no rid.
    """
    merged = dict(kwargs)
    extra = merged.get("extra_body") or {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra_body must be a mapping, got {type(extra).__name__}")
    merged["extra_body"] = {**extra, **engine_body_fields(plan, engine)}
    return merged


@dataclass(frozen=True)
class Usage:
    """The prompt-side usage of one response.

    Attributes:
        prompt_tokens: tokens of the prompt.
        cached_tokens: of those, tokens served from the engine's prefix cache (0 when the
            engine reported usage but no ``prompt_tokens_details``).
    """

    prompt_tokens: int
    cached_tokens: int


def _field(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def read_usage(response: Any) -> Usage | None:
    """``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens`` of a
    response: an openai-python ``ChatCompletion`` / ``Completion`` (or the final chunk of a
    stream with ``stream_options={"include_usage": True}``), or the same as a dict.

    Returns:
        None when the response has no usage with an integer ``prompt_tokens``.
    """
    usage = _field(response, "usage")
    prompt = _field(usage, "prompt_tokens")
    if isinstance(prompt, bool) or not isinstance(prompt, int):
        return None
    cached = _field(_field(usage, "prompt_tokens_details"), "cached_tokens")
    if isinstance(cached, bool) or not isinstance(cached, int):
        cached = 0
    return Usage(prompt_tokens=prompt, cached_tokens=max(0, min(cached, prompt)))


class CacheUsageTracker:
    """Reads cached-token usage back from responses into statistics (thread-safe).

    Args:
        pilot: the planner; when it has ``record_usage(rid, prompt_tokens, cached_tokens)``
            (``ContextPilot``, the service's ``ContextPilotClient``), each figure is passed
            on, so the index (and a shared service) counts it too. Any object, or None.
    """

    def __init__(self, pilot: object | None = None) -> None:
        self._forward = getattr(pilot, "record_usage", None)
        self._lock = threading.Lock()
        self._counts = {"requests": 0, "without_usage": 0, "prompt_tokens": 0, "cached_tokens": 0}

    def record(self, plan: _HasRid | str, response: Any) -> Usage | None:
        """Add the usage of ``response`` (the call made for ``plan``) to the statistics.

        Returns:
            The usage read, or None when the response carries none (counted as
            ``without_usage``). Forwarding failures are logged, never raised.
        """
        rid = _rid_of(plan)
        usage = read_usage(response)
        with self._lock:
            self._counts["requests"] += 1
            if usage is None:
                self._counts["without_usage"] += 1
                return None
            self._counts["prompt_tokens"] += usage.prompt_tokens
            self._counts["cached_tokens"] += usage.cached_tokens
        if self._forward is not None:
            try:
                self._forward(rid, usage.prompt_tokens, usage.cached_tokens)
            except Exception:
                logger.exception("record_usage(%r) failed; the figure is kept locally", rid)
        return usage

    def stats(self) -> dict[str, float | int]:
        """``requests``, ``without_usage``, ``prompt_tokens``, ``cached_tokens`` and
        ``hit_ratio`` (cached / prompt tokens; 0.0 before any usage)."""
        with self._lock:
            out: dict[str, float | int] = dict(self._counts)
        prompt = self._counts["prompt_tokens"]
        out["hit_ratio"] = self._counts["cached_tokens"] / prompt if prompt else 0.0
        return out


def create_chat_completion(
    client: Any,
    plan: Any,
    *,
    tracker: CacheUsageTracker | None = None,
    engine: EngineKind = "any",
    **kwargs: Any,
) -> Any:
    """``client.chat.completions.create(messages=plan.messages, ...)`` with the plan ids in
    ``extra_body``, and the response's usage recorded with ``tracker``.

    Args:
        client: an ``openai.OpenAI`` client (any object with ``chat.completions.create``).
        plan: the ``Plan`` (its ``messages`` and ``rid``).
        tracker: where the usage goes (None: not recorded).
        engine: which id fields to send (:func:`engine_body_fields`).
        kwargs: the other arguments of ``create`` (``model``, ``max_tokens``, ...).

    Returns:
        The response (a stream is returned as is and not recorded).
    """
    response = client.chat.completions.create(
        messages=plan.messages, **with_engine_fields(kwargs, plan, engine)
    )
    if tracker is not None and not kwargs.get("stream"):
        tracker.record(plan, response)
    return response


async def acreate_chat_completion(
    client: Any,
    plan: Any,
    *,
    tracker: CacheUsageTracker | None = None,
    engine: EngineKind = "any",
    **kwargs: Any,
) -> Any:
    """:func:`create_chat_completion` for an ``openai.AsyncOpenAI`` client. A tracker whose
    pilot is a blocking client forwards from a worker thread."""
    response = await client.chat.completions.create(
        messages=plan.messages, **with_engine_fields(kwargs, plan, engine)
    )
    if tracker is not None and not kwargs.get("stream"):
        await asyncio.to_thread(tracker.record, plan, response)
    return response
