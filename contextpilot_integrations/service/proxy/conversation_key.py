"""Which conversation a proxied request belongs to (docs/DESIGN.md, "The proxy").

In order, the first that is given:

1. the header ``x-contextpilot-session`` (:data:`SESSION_HEADER`), or the body extension's
   ``contextpilot.conversation_id`` (:mod:`.request_planning`);
2. the body's ``user`` (OpenAI) or ``metadata.user_id`` (Anthropic): the end user the app
   names, one conversation per user (a value that cannot be an id: too long, a control
   character, a lone surrogate, is passed over: it is the API's field, not the proxy's);
3. the conversation's opening: a hash of the model, the system prompt and the first user
   message. Two conversations that open alike then share a key; that is safe, because a
   history is replayed only where the messages given extend what was sent, and every pointer
   is checked on the request itself (docs/DESIGN.md, "Planning over messages").

A header or extension value that cannot be an id (``Scope``'s rules: 1 to ``MAX_ID_CHARS``
characters, no C0 or C1 control character, no lone surrogate) is refused naming that field.

The key is namespaced by the tenant of the request's API key (``Scope(tenant=...,
conversation_id=...)``), so the same key of two tenants is two conversations.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from contextpilot_integrations.core.request import CONTROL_CHARACTERS, MAX_ID_CHARS

__all__ = ["SESSION_HEADER", "ConversationSource", "conversation_key"]

SESSION_HEADER = "x-contextpilot-session"
"""The request header that names the conversation."""

ConversationSource = Literal["header", "body", "user", "opening"]

_CONTROL = re.compile(f"[{CONTROL_CHARACTERS}]")


def conversation_key(
    header: str | None, extension: object, body: Mapping[str, Any], api: str
) -> tuple[str, ConversationSource]:
    """The conversation id of a request and where it came from.

    Args:
        header: the :data:`SESSION_HEADER` value (``None``: absent).
        extension: the body extension's ``conversation_id`` (``None``: absent).
        body: the request body (``user``, ``metadata.user_id``, ``model``, ``messages``,
            ``system``).
        api: ``"openai"`` or ``"anthropic"``.

    Raises:
        ValueError: a header or extension that cannot be an id (module docstring), or an
            extension that is not a str (named).
    """
    if header is not None:
        return _checked(header, SESSION_HEADER), "header"
    if extension is not None:
        if not isinstance(extension, str):
            raise ValueError(
                "contextpilot.conversation_id must be a str, got "
                f"{type(extension).__name__}: {extension!r:.80}"
            )
        return _checked(extension, "contextpilot.conversation_id"), "body"
    user = body.get("user") if api == "openai" else _get(body.get("metadata"), "user_id")
    if isinstance(user, str) and _id_fault(f"user:{user}") is None:
        return f"user:{user}", "user"
    return _opening(body, api), "opening"


def _checked(value: str, field: str) -> str:
    fault = _id_fault(value)
    if fault is not None:
        raise ValueError(f"{field} {fault}, got {value!r:.80}")
    return value


def _id_fault(value: str) -> str | None:
    """Why ``value`` cannot be a conversation id (``None``: it can; the rules of ``Scope``)."""
    if not value or len(value) > MAX_ID_CHARS:
        return f"must be 1..{MAX_ID_CHARS} characters"
    bad = _CONTROL.search(value)
    if bad is not None:
        return f"must not contain control characters ({bad.group()!r} at character {bad.start()})"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"must be Unicode text (a lone surrogate at character {exc.start})"
    return None


def _get(value: object, name: str) -> object:
    return value.get(name) if isinstance(value, Mapping) else None


def _opening(body: Mapping[str, Any], api: str) -> str:
    """``opening:`` and a hash of the model, the system prompt and the first user message."""
    messages = body.get("messages")
    first_user: object = None
    system: object = body.get("system") if api == "anthropic" else None
    if isinstance(messages, Sequence) and not isinstance(messages, str):
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            role = message.get("role")
            if role in ("system", "developer") and system is None:
                system = message.get("content")
            elif role == "user":
                first_user = message.get("content")
                break
    text = json.dumps(
        [body.get("model"), system, first_user], sort_keys=True, ensure_ascii=False, default=str
    )
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12)
    return f"opening:{digest.hexdigest()}"
