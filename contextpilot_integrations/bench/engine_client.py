"""Client for an OpenAI-compatible engine (SGLang or vLLM): real prompts, real cache figures.

Each request is a streamed ``POST /v1/chat/completions`` with ``max_tokens=1`` (prefill is what
is measured) and ``stream_options={"include_usage": true}`` (OpenAI chat completions API: the
last chunk then carries ``usage``). The plan's request id goes out as ``rid`` (SGLang's
``ChatCompletionRequest.rid``), ``request_id`` (vLLM's ``ChatCompletionRequest.request_id``)
and ``session_id``, so the engine's cache events and evictions name the same request the
context index knows.

Figures read back:

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
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import httpx

from contextpilot_integrations.bench.methods import Served
from contextpilot_integrations.core.rendering import PromptLayout

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
    """

    prompt_tokens: int
    cached_tokens: int | None
    ttft_s: float
    total_s: float
    text: str


class EngineClient:
    """A synchronous client for one OpenAI-compatible server.

    Args:
        base_url: the server root, with or without a trailing ``/v1``
            (``http://127.0.0.1:30000``).
        model: the model name to send; ``None``: the first id of ``GET /v1/models``.
        timeout_s: per-request timeout in seconds.
        api_key: sent as ``Authorization: Bearer ...`` when given.

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
    ) -> None:
        url = base_url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://, got {base_url!r}")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        self.base_url = url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=url, timeout=timeout_s, headers=headers)
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
        self, messages: Sequence[dict[str, str]], *, rid: str, max_tokens: int = 1
    ) -> Completion:
        """Send one streamed chat completion and measure it.

        Args:
            messages: OpenAI chat messages.
            rid: request id (sent as ``rid``, ``request_id`` and ``session_id``).
            max_tokens: tokens to generate (1: prefill only).

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
            "rid": rid,
            "request_id": rid,
            "session_id": rid,
        }
        start = time.perf_counter()
        first_token: float | None = None
        finished_at: float | None = None
        usage: dict | None = None
        text: list[str] = []
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
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
                        if choice.get("finish_reason") and finished_at is None:
                            finished_at = now
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        except httpx.HTTPError as exc:
            raise EngineError(f"engine {self.base_url} unreachable or failed: {exc}") from exc
        end = time.perf_counter()
        if usage is None:
            raise EngineError(
                f"rid {rid!r}: the stream carried no usage; the engine must support "
                "stream_options.include_usage"
            )
        ttft_at = first_token if first_token is not None else finished_at
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if cached is None and not self._warned_no_cached:
            logger.warning(
                "%s reports no usage.prompt_tokens_details.cached_tokens (start SGLang with "
                "--enable-cache-report, vLLM with --enable-prompt-tokens-details)",
                self.base_url,
            )
            self._warned_no_cached = True
        return Completion(
            prompt_tokens=int(usage["prompt_tokens"]),
            cached_tokens=None if cached is None else int(cached),
            ttft_s=(ttft_at if ttft_at is not None else end) - start,
            total_s=end - start,
            text="".join(text),
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


class OpenAIEngine:
    """The benchmark's engine interface (:class:`~contextpilot_integrations.bench.methods.Engine`)
    over an :class:`EngineClient`: segments become chat messages with the layout.

    The engine's evictions are not observed here (that is the ``sync`` package's job), so
    :meth:`take_evicted_rids` returns nothing.
    """

    def __init__(self, client: EngineClient, layout: PromptLayout) -> None:
        self.client = client
        self.layout = layout

    def serve(self, rid: str, segments: Sequence[str]) -> Served:
        completion = self.client.chat(self.layout.messages_from_segments(segments), rid=rid)
        return Served(completion.prompt_tokens, completion.cached_tokens, completion.ttft_s)

    def take_evicted_rids(self) -> list[str]:
        return []
