"""Client for an OpenAI-compatible engine (SGLang or vLLM): real prompts, real cache figures.

Each request is a streamed ``POST /v1/chat/completions`` with ``max_tokens=1`` (prefill is what
is measured) and ``stream_options={"include_usage": true}`` (OpenAI chat completions API: the
last chunk then carries ``usage``). The plan's request id goes out in the body fields of
:func:`~contextpilot_integrations.llm_call.engine_fields.engine_body_fields` (``rid`` for SGLang,
``request_id`` for vLLM, ``session_id`` for both), so the engine's cache events and evictions
name the same request the context index knows.

Figures read back (:func:`~contextpilot_integrations.llm_call.engine_fields.read_usage`):

* ``prompt_tokens``: ``usage.prompt_tokens`` (after the chat template).
* ``cached_tokens``: ``usage.prompt_tokens_details.cached_tokens``. SGLang reports it with
  ``--enable-cache-report``, vLLM with ``--enable-prompt-tokens-details``; without it the value
  is ``None`` and a warning is logged once.
* TTFT: seconds from sending the request to the first streamed chunk that carries generated
  text (``delta.content`` or ``delta.reasoning_content``); a first token that decodes to ""
  falls back to the first chunk with a ``finish_reason``.

Between methods, :meth:`EngineClient.flush_cache` empties the engine's prefix cache (SGLang
``POST /flush_cache``; vLLM ``POST /reset_prefix_cache``, which needs
``VLLM_SERVER_DEV_MODE=1``), so one method does not run on another's warm cache.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from contextpilot_bench.engine import Served
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.llm_call.engine_fields import engine_body_fields, read_usage

if TYPE_CHECKING:
    from contextpilot_integrations.core.pilot import ContextPilot

__all__ = ["Completion", "EngineClient", "EngineError", "OpenAIEngine"]

logger = logging.getLogger(__name__)

FLUSH_PATHS = ("/flush_cache", "/reset_prefix_cache")


class EngineError(RuntimeError):
    """The engine answered with an error or with a response the benchmark cannot use."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One streamed completion.

    Attributes:
        prompt_tokens: ``usage.prompt_tokens``.
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` or ``None`` if absent.
        ttft_s: time to first token, seconds.
        total_s: time to the end of the stream, seconds.
        text: the generated text.
        token_ids: the generated token ids, the stop token included (asked with
            ``chat(..., token_ids=True)``, vLLM's ``return_token_ids``; else ``None``).
    """

    prompt_tokens: int
    cached_tokens: int | None
    ttft_s: float
    total_s: float
    text: str
    token_ids: tuple[int, ...] | None = None


class EngineClient:
    """A synchronous client for one OpenAI-compatible server.

    Args:
        base_url: the server root, with or without a trailing ``/v1``
            (``http://127.0.0.1:30000``).
        model: the model name to send; ``None``: the first id of ``GET /v1/models``.
        timeout_s: per-request timeout in seconds.
        api_key: sent as ``Authorization: Bearer ...`` when given.
        max_connections: most connections open at once (requests beyond wait for one).

    Raises:
        ValueError: ``base_url`` is not an http(s) URL.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        max_connections: int = 100,
    ) -> None:
        url = base_url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://, got {base_url!r}")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        self.base_url = url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=url,
            timeout=timeout_s,
            headers=headers,
            limits=httpx.Limits(max_connections=max_connections),
        )
        self._model = model
        self._warned_no_cached = False

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    @property
    def model(self) -> str:
        """The model name sent with requests (asked from the server once when not given).

        Raises:
            EngineError: the server lists no model.
        """
        if self._model is None:
            models = self.list_models()
            if not models:
                raise EngineError(f"{self.base_url}/v1/models lists no model; pass --model")
            self._model = models[0]
        return self._model

    def list_models(self) -> list[str]:
        """Model ids from ``GET /v1/models``.

        Raises:
            EngineError: an error status or an unreachable server.
        """
        response = self._request("GET", "/v1/models")
        return [str(m["id"]) for m in response.json().get("data", [])]

    def flush_cache(self) -> bool:
        """Empty the engine's prefix cache; ``False`` (and a warning) if no endpoint accepted."""
        for path in FLUSH_PATHS:
            try:
                response = self._http.post(path)
            except httpx.HTTPError:
                continue
            if response.status_code < 400:
                logger.info("flushed the engine's prefix cache with POST %s", path)
                return True
        logger.warning(
            "could not flush the prefix cache of %s (tried %s); methods run on a warm cache",
            self.base_url,
            ", ".join(FLUSH_PATHS),
        )
        return False

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        *,
        rid: str,
        max_tokens: int = 1,
        headers: Mapping[str, str] | None = None,
        token_ids: bool = False,
        extra_body: Mapping[str, Any] | None = None,
    ) -> Completion:
        """Send one streamed chat completion and measure it.

        Args:
            messages: OpenAI chat messages.
            rid: request id (sent as ``rid``, ``request_id`` and ``session_id``,
                :func:`~contextpilot_integrations.llm_call.engine_fields.engine_body_fields`).
            max_tokens: tokens to generate (1: prefill only).
            headers: more request headers (a gateway's routing key:
                :func:`~contextpilot_integrations.llm_call.engine_fields.engine_headers`).
            token_ids: ask for the generated token ids (vLLM's ``return_token_ids``).
            extra_body: more body fields (the proxy's ``contextpilot`` extension).

        Returns:
            :class:`Completion`.

        Raises:
            EngineError: an error status, an unreachable server, a malformed stream, or no
                ``usage`` in the stream.
        """
        body = {
            "model": self.model,
            "messages": list(messages),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **engine_body_fields(rid),
        }
        if token_ids:
            body["return_token_ids"] = True
        body.update(extra_body or {})
        start = time.perf_counter()
        first_token: float | None = None
        finished_at: float | None = None
        final: dict[str, Any] | None = None  # the chunk that carries usage
        text: list[str] = []
        ids: list[int] = []
        try:
            with self._http.stream(
                "POST", "/v1/chat/completions", json=body, headers=dict(headers or {})
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise EngineError(
                        f"POST {self.base_url}/v1/chat/completions (rid {rid!r}) returned "
                        f"{response.status_code}: {response.text[:300]}"
                    )
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:") :].strip()
                    if payload == "[DONE]":
                        break
                    try:
                        chunk = json.loads(payload)
                    except json.JSONDecodeError as exc:
                        raise EngineError(
                            f"rid {rid!r}: bad stream chunk {payload[:200]!r}"
                        ) from exc
                    now = time.perf_counter()
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        piece = delta.get("content") or delta.get("reasoning_content") or ""
                        if piece:
                            text.append(piece)
                            if first_token is None:
                                first_token = now
                        ids.extend(choice.get("token_ids") or ())
                        if choice.get("finish_reason") and finished_at is None:
                            finished_at = now
                    if chunk.get("usage"):
                        final = chunk
        except httpx.HTTPError as exc:
            raise EngineError(f"engine {self.base_url} unreachable or failed: {exc}") from exc
        end = time.perf_counter()
        usage = read_usage(final)
        if usage is None:
            raise EngineError(
                f"rid {rid!r}: the stream carried no usage; the engine must support "
                "stream_options.include_usage"
            )
        ttft_at = first_token if first_token is not None else finished_at
        reported = _reports_cached_tokens(final)
        if not reported and not self._warned_no_cached:
            logger.warning(
                "%s reports no usage.prompt_tokens_details.cached_tokens (start SGLang with "
                "--enable-cache-report, vLLM with --enable-prompt-tokens-details)",
                self.base_url,
            )
            self._warned_no_cached = True
        return Completion(
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens if reported else None,
            ttft_s=(ttft_at if ttft_at is not None else end) - start,
            total_s=end - start,
            text="".join(text),
            token_ids=tuple(ids) if token_ids else None,
        )

    def _request(self, method: str, path: str) -> httpx.Response:
        try:
            response = self._http.request(method, path)
        except httpx.HTTPError as exc:
            raise EngineError(f"engine {self.base_url} unreachable: {exc}") from exc
        if response.status_code >= 400:
            raise EngineError(
                f"{method} {self.base_url}{path} returned {response.status_code}: "
                f"{response.text[:300]}"
            )
        return response


def _reports_cached_tokens(chunk: Mapping[str, Any] | None) -> bool:
    # read_usage counts a missing figure as 0; the benchmark tells "not reported" apart (a
    # server started without the flag) so that it can say so.
    details = ((chunk or {}).get("usage") or {}).get("prompt_tokens_details")
    return isinstance(details, Mapping) and details.get("cached_tokens") is not None


class OpenAIEngine:
    """The benchmark's :class:`~contextpilot_bench.engine.Engine` over an
    :class:`EngineClient`: segments become chat messages with the layout.

    The engine's evictions are not followed here (the vLLM CPU engine the benchmark starts
    itself is, through its KV events:
    :class:`~contextpilot_bench.vllm_engine.VllmCpuEngine`), so :attr:`cache_sync`
    is None and :meth:`take_evicted_rids` returns nothing.
    """

    cache_sync: Mapping[str, Any] | None = None

    def __init__(self, client: EngineClient, layout: PromptLayout) -> None:
        self.client = client
        self.layout = layout

    def serve(self, rid: str, segments: Sequence[str]) -> Served:
        completion = self.client.chat(self.layout.messages_from_segments(segments), rid=rid)
        return Served(completion.prompt_tokens, completion.cached_tokens, completion.ttft_s)

    def take_evicted_rids(self) -> list[str]:
        return []

    def sync(self, pilot: ContextPilot | None) -> None:
        """Nothing to wait for: the usage comes with each response."""
