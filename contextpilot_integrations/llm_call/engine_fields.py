"""Engine-facing request fields, built in one place, and the engine's usage read back.

Every face that hands a plan to an LLM call (LangChain's ``with_plan_fields``, LlamaIndex's
``ContextPilotOpenAILike``, the Mem0 agent middleware, the benchmark's engine client) takes the
body fields from here, so the engine's cache events and evictions name the request the plan was
indexed under (docs/DESIGN.md, "Engine facts"): SGLang takes ``rid`` (all 0.5.x) and a
top-level ``session_id`` (0.5.15+, echoed on ``BlockStored`` from 0.5.20); vLLM takes
``request_id`` and, in recent releases, ``session_id``; openai-python sends them through
``extra_body={...}``.

With several engine replicas (:class:`~contextpilot_integrations.core.replicas.routing.
ReplicaRouter`) the plan also says how to reach its replica: behind a gateway its
``routing_key`` goes in a header (:data:`ROUTING_HEADER`; :func:`engine_headers`, merged by
:func:`with_engine_fields` into ``extra_headers``); in the router's ``"direct"`` mode its
``base_url`` is the replica's own (:func:`engine_base_url`).

Hosted APIs refuse unknown fields, so they get no ids: ``engine="openai"`` sends the plan's
``prompt_cache_key`` (:func:`~contextpilot_integrations.llm_call.openai_cache_key.
openai_cache_fields`), ``engine="anthropic"`` nothing in the body (its cache controls are
``cache_control`` markers: :mod:`~contextpilot_integrations.llm_call.anthropic_breakpoints`),
``engine="hosted"`` nothing at all; follow them with the TTL cache model.

:func:`read_usage` is the package's one parser of the engine's cache figures
(``usage.prompt_tokens_details.cached_tokens``; Anthropic's ``cache_read_input_tokens`` and
``cache_creation_input_tokens``), from SDK responses, their dicts, LangChain's
``usage_metadata`` and LlamaIndex's ``raw``. :class:`CacheUsageTracker` keeps the hit ratio of
the planned requests and passes each figure to the planner's ``record_usage``.
:func:`create_chat_completion` (and :func:`acreate_chat_completion`) does all of it in one call.
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
    "ROUTING_HEADER",
    "CacheUsageTracker",
    "EngineKind",
    "Usage",
    "acreate_chat_completion",
    "create_chat_completion",
    "engine_base_url",
    "engine_body_fields",
    "engine_headers",
    "read_usage",
    "routing_headers",
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

ROUTING_HEADER = "x-contextpilot-route"
"""The header a plan's ``routing_key`` goes in by default (configure the gateway to route on
it: SMG ``--routing-key-headers x-contextpilot-route --routing-key-override``)."""


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
        from contextpilot_integrations.llm_call.cache_prefix import CachePrefix
        from contextpilot_integrations.llm_call.openai_cache_key import openai_cache_fields

        fields.update(openai_cache_fields(CachePrefix.of(plan)))  # type: ignore[arg-type]
    salt = None if isinstance(plan, str) else getattr(plan, "cache_salt", None)
    if salt is not None and engine not in _HOSTED:
        fields["cache_salt"] = salt
    return fields


def engine_headers(
    plan: object, engine: EngineKind = "any", routing_header: str = ROUTING_HEADER
) -> dict[str, str]:
    """The request headers a plan sends: :func:`routing_headers` of its ``routing_key`` (none
    for a plan without one, or a bare rid)."""
    return routing_headers(getattr(plan, "routing_key", None), engine, routing_header)


def routing_headers(
    routing_key: str | None, engine: EngineKind = "any", routing_header: str = ROUTING_HEADER
) -> dict[str, str]:
    """``{routing_header: routing_key}``, for a gateway in front of engine replicas; empty
    without a key or for a hosted ``engine``.

    Raises:
        ValueError: an unknown ``engine``, or an empty ``routing_header``.
    """
    if engine not in _ID_FIELDS:
        raise ValueError(f"engine must be one of {sorted(_ID_FIELDS)}, got {engine!r}")
    if not isinstance(routing_header, str) or not routing_header:
        raise ValueError(f"routing_header must be a non-empty str, got {routing_header!r}")
    if not isinstance(routing_key, str) or not routing_key or engine in _HOSTED:
        return {}
    return {routing_header: routing_key}


def engine_base_url(plan: object) -> str | None:
    """The base URL of the replica a plan was planned for, in a router's ``"direct"`` mode
    (call it instead of a gateway); None otherwise."""
    url = getattr(plan, "base_url", None)
    return url if isinstance(url, str) and url else None


def with_engine_fields(
    kwargs: Mapping[str, Any],
    plan: _HasRid | str,
    engine: EngineKind = "any",
    *,
    routing_header: str = ROUTING_HEADER,
) -> dict[str, Any]:
    """A copy of an OpenAI call's keyword arguments with the plan ids merged into
    ``extra_body`` and its routing key into ``extra_headers`` (:func:`engine_headers`;
    entries already there are kept; the plan's win on a clash).

    Raises:
        TypeError: ``kwargs["extra_body"]`` or ``kwargs["extra_headers"]`` is not a mapping,
            or ``plan`` has no rid.
    """
    merged = dict(kwargs)
    extra = merged.get("extra_body") or {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra_body must be a mapping, got {type(extra).__name__}")
    merged["extra_body"] = {**extra, **engine_body_fields(plan, engine)}
    headers = engine_headers(plan, engine, routing_header)
    if headers:
        given = merged.get("extra_headers") or {}
        if not isinstance(given, Mapping):
            raise TypeError(f"extra_headers must be a mapping, got {type(given).__name__}")
        merged["extra_headers"] = {**given, **headers}
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
    routing_header: str = ROUTING_HEADER,
    **kwargs: Any,
) -> Any:
    """``client.chat.completions.create(messages=plan.messages, ...)`` with the plan ids in
    ``extra_body`` and its routing key in ``extra_headers``, sent to the plan's replica when it
    carries its ``base_url`` (``client.with_options(base_url=...)``: the router's direct
    mode), and the response's usage recorded with ``tracker``.

    Args:
        client: an ``openai.OpenAI`` client (any object with ``chat.completions.create``;
            ``with_options`` for a plan with a ``base_url``).
        plan: the ``Plan`` (its ``messages`` and ``rid``).
        tracker: where the usage goes (None: not recorded).
        engine: which id fields to send (:func:`engine_body_fields`).
        routing_header: the header the plan's routing key goes in (:func:`engine_headers`).
        kwargs: the other arguments of ``create`` (``model``, ``max_tokens``, ...).

    Returns:
        The response (a stream is returned as is and not recorded).
    """
    response = _replica_client(client, plan).chat.completions.create(
        messages=plan.messages,
        **with_engine_fields(kwargs, plan, engine, routing_header=routing_header),
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
    routing_header: str = ROUTING_HEADER,
    **kwargs: Any,
) -> Any:
    """:func:`create_chat_completion` for an ``openai.AsyncOpenAI`` client. A tracker whose
    pilot is a blocking client forwards from a worker thread."""
    response = await _replica_client(client, plan).chat.completions.create(
        messages=plan.messages,
        **with_engine_fields(kwargs, plan, engine, routing_header=routing_header),
    )
    if tracker is not None and not kwargs.get("stream"):
        await asyncio.to_thread(tracker.record, plan, response)
    return response


def _replica_client(client: Any, plan: Any) -> Any:
    """``client``, or a copy of it bound to the plan's replica (direct mode; it shares the
    client's connection pool)."""
    url = engine_base_url(plan)
    return client if url is None else client.with_options(base_url=url)
