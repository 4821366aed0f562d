"""Hosted APIs' prompt-cache controls, placed from the plan: Anthropic breakpoints, OpenAI keys.

The one import point for the request fields hosted APIs cache by (docs/DESIGN.md, "Engine
request fields and hosted prompt caches"): the ids of self-hosted engines and the usage parser
stay in :mod:`contextpilot_integrations.llm_call.engine_fields`, which sends
:func:`openai_cache_fields` for ``engine="openai"``; everything else a hosted prompt cache needs
is here, built in:

- :mod:`~contextpilot_integrations.llm_call.cache_prefix`: :class:`CachePrefix`, what both
  providers' controls need to know of one plan;
- :mod:`~contextpilot_integrations.llm_call.provider_minimums`: the providers' minimum
  cacheable lengths;
- :mod:`~contextpilot_integrations.llm_call.anthropic_breakpoints`: Anthropic's limits and
  :func:`anthropic_prompt`, the ``cache_control`` breakpoints placed where the plan knows
  reuse starts or ends;
- :mod:`~contextpilot_integrations.llm_call.openai_cache_key`: OpenAI's :func:`prompt_cache_key` and
  :func:`openai_cache_fields`;
- this module: :func:`create_message` and :func:`acreate_message`, an Anthropic SDK call with
  the plan's prompt and breakpoints, its usage recorded.

Example (the plain SDK)::

    prompt = anthropic_prompt(plan.messages, CachePrefix.of(plan),
                              AnthropicCachePolicy(model="claude-sonnet-4-5"))
    response = anthropic_client.messages.create(model=..., max_tokens=..., **prompt.kwargs())
    tracker.record(plan, response)    # engine_fields.CacheUsageTracker: reads and writes
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from contextpilot_integrations.core.blocks import TokenCounter
from contextpilot_integrations.llm_call.anthropic_breakpoints import (
    AnthropicCachePolicy,
    AnthropicPrompt,
    anthropic_prompt,
)
from contextpilot_integrations.llm_call.cache_prefix import CachePrefix

if TYPE_CHECKING:
    from contextpilot_integrations.core.plan import Plan
    from contextpilot_integrations.llm_call.engine_fields import CacheUsageTracker

__all__ = ["acreate_message", "create_message"]


def create_message(
    client: Any,
    plan: Plan,
    *,
    policy: AnthropicCachePolicy | None = None,
    history: Sequence[Mapping[str, Any]] = (),
    token_counter: TokenCounter | None = None,
    tracker: CacheUsageTracker | None = None,
    **kwargs: Any,
) -> Any:
    """``client.messages.create(...)`` with the plan's prompt and breakpoints, and the
    response's reads and writes recorded with ``tracker``.

    Args:
        client: an ``anthropic.Anthropic`` client (any object with ``messages.create``).
        plan: the plan; its system prompt, then ``history``, then its user message are sent.
        policy: placement and limits (:class:`AnthropicCachePolicy`; give ``model`` for its
            minimum length, default the ``model`` keyword's).
        history: earlier turns as ``{"role", "content"}`` dicts, between the system prompt and
            the plan's user message (their end is the ``history`` breakpoint).
        token_counter: counts prefix tokens (default the approximate counter).
        tracker: where the usage goes (None: not recorded).
        kwargs: the other arguments of ``create`` (``model``, ``max_tokens``, ``tools``, ...).
            A ``system`` of the app's own (a str or text blocks) goes first, then the plan's
            system prompt, in one system prompt: the app's instructions, then how to use the
            documents, both before the documents, so both stay in the cached prefix; with no
            system prompt in the plan it is sent alone. ``tools`` are sent as given, and the
            ``cache_control`` markers on them count against the breakpoint limit, as do
            those in ``system`` and ``history``.

    Returns:
        The response (a stream is returned as is and not recorded).

    Raises:
        ValueError: more ``cache_control`` markers in ``tools``, ``system`` and ``history``
            than the policy's ``max_breakpoints``.
        TypeError: a ``system`` that is neither a str nor a list of text blocks.
    """
    prompt = _plan_prompt(plan, policy, history, token_counter, kwargs)
    response = client.messages.create(**prompt.kwargs(), **kwargs)
    if tracker is not None and not kwargs.get("stream"):
        tracker.record(plan, response)
    return response


async def acreate_message(
    client: Any,
    plan: Plan,
    *,
    policy: AnthropicCachePolicy | None = None,
    history: Sequence[Mapping[str, Any]] = (),
    token_counter: TokenCounter | None = None,
    tracker: CacheUsageTracker | None = None,
    **kwargs: Any,
) -> Any:
    """:func:`create_message` for an ``anthropic.AsyncAnthropic`` client."""
    import asyncio

    prompt = _plan_prompt(plan, policy, history, token_counter, kwargs)
    response = await client.messages.create(**prompt.kwargs(), **kwargs)
    if tracker is not None and not kwargs.get("stream"):
        await asyncio.to_thread(tracker.record, plan, response)
    return response


# ---------------------------------------------------------------------- internals
def _plan_prompt(
    plan: Plan,
    policy: AnthropicCachePolicy | None,
    history: Sequence[Mapping[str, Any]],
    token_counter: TokenCounter | None,
    kwargs: dict[str, Any],
) -> AnthropicPrompt:
    """The prompt for ``create``; takes the app's ``system`` out of ``kwargs`` (merged into
    the prompt's, :func:`create_message`)."""
    if policy is None:
        model = kwargs.get("model")
        policy = AnthropicCachePolicy(model=model if isinstance(model, str) else None)
    messages: list[Mapping[str, Any]] = list(plan.messages)
    system, user = (
        (messages[:1], messages[1:]) if messages[0]["role"] == "system" else ([], messages)
    )
    own = kwargs.pop("system", None)
    if own is not None:
        blocks = _system_blocks(own)
        for message in system:
            blocks += _system_blocks(message["content"])
        system = [{"role": "system", "content": blocks}]
    return anthropic_prompt(
        [*system, *history, *user],
        CachePrefix.of(plan),
        policy,
        token_counter,
        tools=kwargs.get("tools"),
    )


def _system_blocks(content: Any) -> list[Any]:
    """A system prompt (a str or a list of text blocks) as a list of blocks."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if isinstance(content, Sequence):
        return list(content)
    raise TypeError(f"system must be a str or a list of text blocks, got {type(content).__name__}")
