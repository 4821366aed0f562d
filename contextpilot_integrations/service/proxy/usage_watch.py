"""The upstream's usage, read from an answer's bytes as they pass to the client.

The bytes are never changed or held back: :class:`UsageWatch` only looks at copies of them.

- A JSON answer (``application/json``): the whole body, parsed once it has ended, as
  :func:`~contextpilot_integrations.llm_call.engine_fields.read_usage` reads it.
- A stream (``text/event-stream``): each server-sent event's ``data:`` line. OpenAI's usage
  is in the chunk that carries a ``usage`` object (sent when the client asked for
  ``stream_options.include_usage``; the proxy never adds that option, so a stream without it
  reports no usage). Anthropic's is in ``message_start`` (``message.usage``: input and cache
  tokens) updated by ``message_delta`` (``usage``: the final figures it carries).

Bounded: a body or one event over :data:`MAX_WATCHED_BYTES` is not parsed (no usage read),
and a usage with a figure over :data:`MAX_TOKEN_COUNT` (the bound ``POST /v1/usage`` puts on
each figure) is no usage: an upstream's garbage never enters the totals or ``/metrics``.
"""

from __future__ import annotations

import json
from typing import Any

from contextpilot_integrations.llm_call.engine_fields import Usage, read_usage

__all__ = ["MAX_TOKEN_COUNT", "MAX_WATCHED_BYTES", "UsageWatch"]

MAX_WATCHED_BYTES = 16 * 1024 * 1024
"""Largest JSON body or server-sent event whose usage is read."""

MAX_TOKEN_COUNT = 2**62
"""Largest token figure read (``TokenCount`` of the wire schema, ``client/schemas.py``)."""


class UsageWatch:
    """Watches one answer's bytes for its usage.

    Args:
        content_type: the answer's ``content-type`` header.
    """

    def __init__(self, content_type: str) -> None:
        kind = content_type.split(";", 1)[0].strip().lower()
        self._stream = kind == "text/event-stream"
        self._json = kind == "application/json" or kind.endswith("+json")
        self._buffer = bytearray()
        self._overflow = False
        self._usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        """Look at the next bytes of the answer."""
        if not (self._stream or self._json) or not chunk:
            return
        if self._overflow:
            if self._stream and b"\n\n" in chunk:  # the oversized event ends here
                self._overflow = False
                chunk = chunk.split(b"\n\n", 1)[1]
            else:
                return
        self._buffer += chunk
        if self._stream:
            self._events()
        if len(self._buffer) > MAX_WATCHED_BYTES:
            self._buffer.clear()
            self._overflow = True

    def usage(self) -> Usage | None:
        """The usage read, once the answer has ended (``None``: none found, or a figure over
        :data:`MAX_TOKEN_COUNT`)."""
        found: Usage | None = None
        if self._json and not self._overflow and self._buffer:
            try:
                document = json.loads(bytes(self._buffer))
            except (ValueError, RecursionError):
                return None
            found = read_usage(document) if isinstance(document, dict) else None
        elif self._stream:
            self._buffer += b"\n\n"
            self._events()
            found = read_usage({"usage": self._usage}) if self._usage else None
        if found is None:
            return None
        figures = (found.prompt_tokens, found.cached_tokens, found.cache_write_tokens or 0)
        return found if max(figures) <= MAX_TOKEN_COUNT else None

    def _events(self) -> None:
        """Read every complete event in the buffer; keep the incomplete tail."""
        data = bytes(self._buffer).replace(b"\r\n", b"\n")
        *complete, tail = data.split(b"\n\n")
        self._buffer = bytearray(tail)
        for event in complete:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, payload: bytes) -> None:
        if not payload.startswith(b"{") or b"usage" not in payload:
            return
        try:
            document = json.loads(payload)
        except (ValueError, RecursionError):
            return
        if not isinstance(document, dict):
            return
        kind = document.get("type")
        if kind == "message_start":
            message = document.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                self._usage = dict(usage)
        elif kind == "message_delta":
            usage = document.get("usage")
            if isinstance(usage, dict):
                merged = dict(self._usage or {})
                merged.update({k: v for k, v in usage.items() if v is not None})
                self._usage = merged
        elif isinstance(document.get("usage"), dict):  # OpenAI's usage chunk
            self._usage = dict(document["usage"])
