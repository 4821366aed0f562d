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

Hosted APIs (OpenAI, Anthropic) refuse unknown fields, so they get no ids: ``engine="openai"``
sends the plan's ``prompt_cache_key``
(:func:`contextpilot_integrations.hosted_cache.openai_cache_fields`),
``engine="anthropic"`` nothing in the body (its cache controls are ``cache_control`` markers on
content blocks: :func:`contextpilot_integrations.hosted_cache.anthropic_prompt`), and
``engine="hosted"`` nothing at all; follow them with the TTL cache model.

The engine reports how much of the prompt it served from its prefix cache:
``usage.prompt_tokens_details.cached_tokens`` (SGLang; vLLM with
``--enable-prompt-tokens-details``; OpenAI) or Anthropic's ``usage.cache_read_input_tokens``
and ``cache_creation_input_tokens`` (what the request wrote). :func:`read_usage` parses every
form (the one parser of the package: openai-python and anthropic responses, their dicts,
LangChain messages' ``usage_metadata``, LlamaIndex responses' ``raw``);
:class:`CacheUsageTracker` keeps the hit ratio of the planned requests and passes each figure
to the planner's ``record_usage`` (``ContextPilot`` and the service client), which marks a
cached request as recently used and, where the provider reports writes, forgets a request
whose prompt was not cached at all (below the minimum length, or no breakpoint).

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

EngineKind = Literal["any", "sglang", "vllm", "hosted", "openai", "anthropic"]

REQUEST_ID_FIELDS: tuple[str, ...] = ("rid", "request_id", "session_id")
"""The body fields that carry a plan's rid to SGLang and vLLM alike (``engine="any"``)."""

_ID_FIELDS: dict[str, tuple[str, ...]] = {
    "any": REQUEST_ID_FIELDS,
    "sglang": ("rid", "session_id"),
    "vllm": ("request_id", "session_id"),
    "hosted": (),
    "openai": (),
    "anthropic": (),
}
_HOSTED = ("hosted", "openai", "anthropic")


class _HasRid(Protocol):
    @property
    def rid(self) -> str: ...


def _rid_of(plan: _HasRid | str) -> str:
    rid = plan if isinstance(plan, str) else getattr(plan, "rid", None)
    if not isinstance(rid, str) or not rid:
        raise TypeError(
            f"plan must be a Plan (with a non-empty .rid) or a rid str, got {plan!r:.80}"
        )
    return rid


def engine_body_fields(plan: _HasRid | str, engine: EngineKind = "any") -> dict[str, str]:
    """The request-body fields a plan sends to ``engine``: its rid, and its tenant's
    ``cache_salt`` when it has one; for OpenAI its ``prompt_cache_key``.

    ``cache_salt`` (vLLM's request field; SGLang's since 0.5.18, which also reports it on its
    KV events) keys the engine's prefix cache per tenant: requests with different salts never
    share cached blocks, so one tenant cannot learn from cache hits what another sent.

    Args:
        plan: a ``Plan`` (its ``rid`` and ``cache_salt``) or the rid itself.
        engine: ``"any"`` (SGLang and vLLM fields: ``rid``, ``request_id``, ``session_id``),
            ``"sglang"``, ``"vllm"``; hosted APIs, which refuse unknown fields: ``"openai"``
            (``prompt_cache_key`` of a Plan; nothing for a bare rid), ``"anthropic"`` and
            ``"hosted"`` (none).

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
    if engine == "openai" and not isinstance(plan, str):
        from contextpilot_integrations.hosted_cache import CachePrefix, openai_cache_fields

        fields.update(openai_cache_fields(CachePrefix.of(plan)))  # type: ignore[arg-type]
    salt = None if isinstance(plan, str) else getattr(plan, "cache_salt", None)
    if salt is not None and engine not in _HOSTED:
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
        prompt_tokens: tokens of the whole prompt (Anthropic: ``input_tokens`` plus the cache
            reads and writes, which its ``input_tokens`` leaves out).
        cached_tokens: of those, tokens served from the prefix cache (OpenAI, SGLang, vLLM
            ``prompt_tokens_details.cached_tokens``; Anthropic ``cache_read_input_tokens``; 0
            when the engine reported usage but no cache figure).
        cache_write_tokens: of those, tokens written to the cache (Anthropic
            ``cache_creation_input_tokens``); ``None`` where the provider does not report
            writes (OpenAI and the self-hosted engines cache every prompt unasked).
    """

    prompt_tokens: int
    cached_tokens: int
    cache_write_tokens: int | None = None

    @property
    def uncached(self) -> bool:
        """True when the provider reports writes and the request neither read nor wrote the
        cache: nothing of its prompt is cached (below the minimum length, no breakpoint)."""
        return self.cache_write_tokens == 0 and self.cached_tokens == 0


def _field(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def read_usage(response: Any) -> Usage | None:
    """The prompt-side usage of a response, in any of the forms the package meets.

    - OpenAI form (openai-python ``ChatCompletion`` / ``Completion``, the final chunk of a
      stream with ``stream_options={"include_usage": True}``, SGLang, vLLM, or the same as a
      dict): ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``;
    - Anthropic form (anthropic ``Message`` or its dict; Messages API "Prompt caching"):
      ``usage.input_tokens`` + ``cache_read_input_tokens`` + ``cache_creation_input_tokens``;
    - LangChain ``AIMessage``: ``usage_metadata`` (``input_tokens`` is the whole prompt;
      ``input_token_details.cache_read``, and ``cache_creation`` plus
      ``ephemeral_5m_input_tokens`` / ``ephemeral_1h_input_tokens`` from ChatAnthropic);
    - LlamaIndex ``ChatResponse`` / ``CompletionResponse``: its ``raw`` response.

    Returns:
        None when the response has no usage with an integer prompt count.
    """
    metadata = _field(response, "usage_metadata")
    if isinstance(metadata, Mapping) and _count(metadata.get("input_tokens")) is not None:
        return _from_langchain(metadata)
    usage = _field(response, "usage")
    if usage is None and _field(response, "raw") is not None:
        usage = _field(_field(response, "raw"), "usage")
    prompt = _count(_field(usage, "prompt_tokens"))
    if prompt is not None:
        cached = _count(_field(_field(usage, "prompt_tokens_details"), "cached_tokens")) or 0
        return Usage(prompt_tokens=prompt, cached_tokens=min(cached, prompt))
    uncached = _count(_field(usage, "input_tokens"))
    if uncached is None:
        return None
    read = _count(_field(usage, "cache_read_input_tokens")) or 0
    written = _count(_field(usage, "cache_creation_input_tokens")) or 0
    return Usage(uncached + read + written, read, written)


def _from_langchain(metadata: Mapping[str, Any]) -> Usage:
    prompt: int = metadata["input_tokens"]
    details = metadata.get("input_token_details") or {}
    read = min(_count(details.get("cache_read")) or 0, prompt)
    keys = ("cache_creation", "ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens")
    written = [_count(details.get(key)) for key in keys if key in details]
    if not written:  # ChatOpenAI and the self-hosted engines report no writes
        return Usage(prompt, read)
    return Usage(prompt, read, min(sum(w or 0 for w in written), prompt - read))


class CacheUsageTracker:
    """Reads cache usage back from responses into statistics (thread-safe).

    Args:
        pilot: the planner; when it has ``record_usage(rid, prompt_tokens, cached_tokens,
            cache_write_tokens=...)`` (``ContextPilot``, the service's ``ContextPilotClient``),
            each figure is passed on, so the index (and a shared service) counts it too. Any
            object, or None. A ``record_usage`` that takes no ``cache_write_tokens`` gets the
            first three figures only.
    """

    def __init__(self, pilot: object | None = None) -> None:
        self._forward = getattr(pilot, "record_usage", None)
        self._lock = threading.Lock()
        self._counts = {
            "requests": 0,
            "without_usage": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "uncached_requests": 0,
        }
        self._writes_accepted = True

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
            self._counts["cache_write_tokens"] += usage.cache_write_tokens or 0
            self._counts["uncached_requests"] += usage.uncached
        if self._forward is not None:
            self._send(rid, usage)
        return usage

    def stats(self) -> dict[str, float | int]:
        """``requests``, ``without_usage``, ``prompt_tokens``, ``cached_tokens``,
        ``cache_write_tokens`` (Anthropic's writes), ``uncached_requests`` (a provider that
        reports writes neither read nor wrote) and ``hit_ratio`` (cached / prompt tokens; 0.0
        before any usage)."""
        with self._lock:
            out: dict[str, float | int] = dict(self._counts)
        prompt = self._counts["prompt_tokens"]
        out["hit_ratio"] = self._counts["cached_tokens"] / prompt if prompt else 0.0
        return out

    def _send(self, rid: str, usage: Usage) -> None:
        assert self._forward is not None
        try:
            if usage.cache_write_tokens is not None and self._writes_accepted:
                try:
                    self._forward(
                        rid,
                        usage.prompt_tokens,
                        usage.cached_tokens,
                        cache_write_tokens=usage.cache_write_tokens,
                    )
                    return
                except TypeError:
                    # A planner from before cache writes were reported: send what it takes.
                    self._writes_accepted = False
                    logger.warning("record_usage takes no cache_write_tokens; sending reads only")
            self._forward(rid, usage.prompt_tokens, usage.cached_tokens)
        except Exception:
            logger.exception("record_usage(%r) failed; the figure is kept locally", rid)


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
