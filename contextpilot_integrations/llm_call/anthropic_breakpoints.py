"""Anthropic's prompt-cache breakpoints, placed from the plan.

Anthropic ("Prompt caching", platform.claude.com/docs/en/build-with-claude/prompt-caching):

- a prefix is cached only up to an explicit ``cache_control`` breakpoint on a content block
  (system, tools or messages), at most **4** per request, those on tools included (a fifth
  is refused with HTTP 400);
- the prefix up to a breakpoint must hold a **minimum cacheable length**, per model (below it
  the request succeeds uncached, silently: :mod:`.provider_minimums`, configurable);
- a read looks for cached prefixes at the content-block boundaries up to about **20** blocks
  before a breakpoint; a write happens at the breakpoint itself;
- the lifetime is 5 minutes (``"ttl": "1h"`` for an hour), refreshed at no cost by each read;
- usage reports ``cache_creation_input_tokens`` (written), ``cache_read_input_tokens`` (read)
  and ``input_tokens`` (after the last breakpoint); writes and reads are priced as multiples of
  the base input price (the benchmark takes those ratios as options, never as facts here).

So :func:`anthropic_prompt` places breakpoints where the plan knows reuse starts or ends:
after the system prompt, after the last block another indexed request also starts with
(``Plan.shared_prefix_blocks``), where a conversation's stable history ends, and (in a
conversation) after this turn's documents, which the next turn resends; never more than
allowed, none whose prefix is below the model's minimum. Every rendered block is its own text
block, so the block structure of a shared prefix is the same in every request.

Public API: :func:`anthropic_prompt`, :class:`AnthropicPrompt`, :class:`Breakpoint`,
:class:`AnthropicCachePolicy`, :func:`tool_breakpoints`, :data:`ANTHROPIC_MAX_BREAKPOINTS`,
:data:`ANTHROPIC_LOOKBACK_BLOCKS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from contextpilot_integrations.core.blocks import ApproxTokenCounter, TokenCounter
from contextpilot_integrations.llm_call.cache_prefix import CachePrefix
from contextpilot_integrations.llm_call.provider_minimums import anthropic_min_cacheable_tokens

__all__ = [
    "ANTHROPIC_LOOKBACK_BLOCKS",
    "ANTHROPIC_MAX_BREAKPOINTS",
    "AnthropicCachePolicy",
    "AnthropicPrompt",
    "Breakpoint",
    "anthropic_prompt",
    "tool_breakpoints",
]

ANTHROPIC_MAX_BREAKPOINTS = 4
"""Explicit ``cache_control`` breakpoints Anthropic accepts in one request."""

ANTHROPIC_LOOKBACK_BLOCKS = 20
"""Content-block boundaries before a breakpoint at which Anthropic looks for a cached prefix."""

Reason = Literal["system", "history", "shared-prefix", "within-shared", "documents"]


@dataclass(frozen=True)
class AnthropicCachePolicy:
    """Where breakpoints go, and the provider's limits.

    Attributes:
        model: the model id; decides the minimum cacheable length unless ``min_tokens``.
        min_tokens: the minimum cacheable prefix in tokens (``None``: by ``model``).
        ttl: ``"5m"`` (default) or ``"1h"``, the breakpoints' cache lifetime.
        max_breakpoints: at most this many (the provider allows
            :data:`ANTHROPIC_MAX_BREAKPOINTS`; breakpoints already in the messages or on the
            tools count).
        system: a breakpoint after the system prompt.
        shared_prefix: a breakpoint after the plan's shared prefix.
        history: a breakpoint where earlier turns end (messages before the plan's, or text
            before its blocks in the same message).
        documents: a breakpoint after the plan's last block: ``"conversation"`` (default: in a
            conversation, whose next turn resends it), ``"always"`` or ``"never"``.

    Raises:
        ValueError: a bad ``ttl``, ``documents`` or limit.
    """

    model: str | None = None
    min_tokens: int | None = None
    ttl: Literal["5m", "1h"] = "5m"
    max_breakpoints: int = ANTHROPIC_MAX_BREAKPOINTS
    system: bool = True
    shared_prefix: bool = True
    history: bool = True
    documents: Literal["conversation", "always", "never"] = "conversation"

    def __post_init__(self) -> None:
        if self.ttl not in ("5m", "1h"):
            raise ValueError(f"ttl must be '5m' or '1h', got {self.ttl!r}")
        if self.documents not in ("conversation", "always", "never"):
            raise ValueError(
                f"documents must be 'conversation', 'always' or 'never', got {self.documents!r}"
            )
        if not 0 <= self.max_breakpoints <= ANTHROPIC_MAX_BREAKPOINTS:
            raise ValueError(
                f"max_breakpoints must be in 0..{ANTHROPIC_MAX_BREAKPOINTS}, "
                f"got {self.max_breakpoints!r}"
            )
        if self.min_tokens is not None and self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")

    @property
    def min_cacheable_tokens(self) -> int:
        """The minimum in force: ``min_tokens``, else by ``model``."""
        if self.min_tokens is not None:
            return self.min_tokens
        return anthropic_min_cacheable_tokens(self.model)

    @property
    def cache_control(self) -> dict[str, str]:
        """The ``cache_control`` value a breakpoint carries."""
        return {"type": "ephemeral"} if self.ttl == "5m" else {"type": "ephemeral", "ttl": "1h"}


@dataclass(frozen=True)
class Breakpoint:
    """One ``cache_control`` breakpoint placed.

    Attributes:
        message: index of the message it stands in (-1: the system prompt).
        block: index of the content block it ends, in that message's content.
        tokens: tokens of the prefix up to and including that block (by the counter given).
        reason: ``"system"``, ``"history"``, ``"shared-prefix"`` or ``"documents"``.
    """

    message: int
    block: int
    tokens: int
    reason: Reason


@dataclass(frozen=True)
class AnthropicPrompt:
    """A prompt in Anthropic's Messages form with its breakpoints.

    Attributes:
        system: the system prompt as text blocks (``None``: no system message).
        messages: ``{"role", "content": [blocks]}`` dicts, system excluded; a message given
            with the content ``""`` keeps it (an empty block list is invalid at Anthropic).
        breakpoints: the breakpoints placed, in prompt order.
        found_plan: whether the plan's blocks were found in the messages (otherwise only
            system and history breakpoints could be placed).
    """

    system: list[dict[str, Any]] | None
    messages: list[dict[str, Any]]
    breakpoints: tuple[Breakpoint, ...] = ()
    found_plan: bool = False
    existing_breakpoints: int = field(default=0, repr=False)

    def kwargs(self) -> dict[str, Any]:
        """``messages=`` (and ``system=``) for ``anthropic.Anthropic().messages.create``."""
        out: dict[str, Any] = {"messages": self.messages}
        if self.system is not None:
            out["system"] = self.system
        return out


def anthropic_prompt(
    messages: Sequence[Mapping[str, Any]],
    prefix: CachePrefix | None,
    policy: AnthropicCachePolicy | None = None,
    token_counter: TokenCounter | None = None,
    *,
    tools: Sequence[Any] | None = (),
) -> AnthropicPrompt:
    """Turn chat messages into Anthropic's content-block form with breakpoints from the plan.

    Args:
        messages: ``{"role": "system" | "user" | "assistant", "content": str | [blocks]}``
            in prompt order (``plan.messages``, or a framework's messages with history); a
            system message must come first. Content given as blocks is kept as it is, and
            the ``cache_control`` markers it already carries count against the limit.
        prefix: the plan (:meth:`CachePrefix.of`); its rendered blocks are looked up in the
            last message holding them all, and split into one text block each. ``None``: no
            plan (only system and history breakpoints).
        policy: placement and limits (default :class:`AnthropicCachePolicy`).
        token_counter: counts prefix tokens for the minimum length (default
            :class:`~contextpilot_integrations.core.blocks.ApproxTokenCounter`; give the
            planner's counter, or a tokenizer close to the model's).
        tools: the request's ``tools=`` (Anthropic's tool definitions, as sent): a tool
            carrying ``cache_control`` is a breakpoint of the request too, and counts against
            the limit like the markers in the messages. Not changed; their tokens are not
            counted towards the minimum (a breakpoint is then placed only where the messages
            alone reach it).

    Returns:
        An :class:`AnthropicPrompt`; the text it sends is the messages' text, unchanged.

    Raises:
        ValueError: a system message after the first message, or more breakpoints in the
            given tools and content than the policy allows.
    """
    policy = policy or AnthropicCachePolicy()
    counter = token_counter or _DEFAULT_COUNTER
    system: list[dict[str, Any]] | None = None
    out: list[dict[str, Any]] = []
    empty: list[int] = []  # messages given as "": sent so (Anthropic refuses an empty list)
    for i, message in enumerate(messages):
        role = message.get("role")
        content = message.get("content")
        blocks = _as_blocks(content)
        if role == "system":
            if i != 0:
                raise ValueError(f"the system message must come first, found at {i}")
            system = blocks
        else:
            out.append({"role": role, "content": blocks})
            if content == "":
                empty.append(len(out) - 1)
    on_tools = tool_breakpoints(tools)
    existing = on_tools + sum(
        1
        for b in [*(system or []), *(b for m in out for b in m["content"])]
        if "cache_control" in b
    )
    if existing > policy.max_breakpoints:
        raise ValueError(
            f"the messages and tools already carry {existing} cache_control breakpoints "
            f"({on_tools} on tools), more than max_breakpoints={policy.max_breakpoints}"
        )
    found = _split_plan_blocks(out, system, prefix)
    # Every content block in prompt order: (message index, block index, tokens).
    positions: list[tuple[int, int]] = [(-1, b) for b in range(len(system or []))]
    positions += [(m, b) for m, msg in enumerate(out) for b in range(len(msg["content"]))]
    cumulative: list[int] = []
    total = 0
    for position in positions:
        block = _block_at(system, out, position)
        total += counter.count(block.get("text", "")) if block.get("type") == "text" else 0
        cumulative.append(total)
    candidates = [
        (at, reason)
        for at, reason in _candidates(positions, cumulative, system, out, found, prefix, policy)
        if "cache_control" not in _block_at(system, out, positions[at])  # one there already
    ]
    chosen = _choose(candidates, cumulative, policy, policy.max_breakpoints - existing)
    # The client's own markers' lifetimes by position (tools stand before every position).
    given = [_lifetime(_block_at(system, out, position)) for position in positions]
    tools_short = any(_lifetime(tool) == "5m" for tool in tools or ())
    placed = []
    for at, reason in chosen:
        m, b = positions[at]
        block = _block_at(system, out, positions[at])
        block["cache_control"] = _marker(policy, _ttl_at(at, given, tools_short, policy.ttl))
        placed.append(Breakpoint(m, b, cumulative[at], reason))
    for m in empty:  # no block, so no breakpoint, stands in it
        out[m]["content"] = ""
    return AnthropicPrompt(system, out, tuple(placed), found is not None, existing)


def tool_breakpoints(tools: Sequence[Any] | None) -> int:
    """How many of ``tools`` (Anthropic tool definitions: mappings, or objects with the same
    attributes) carry a ``cache_control`` breakpoint."""
    return sum(_lifetime(tool) is not None for tool in tools or ())


_DEFAULT_COUNTER = ApproxTokenCounter()


def _lifetime(item: Any) -> str | None:
    """The lifetime of the ``cache_control`` marker ``item`` (a content block or a tool, a
    mapping or an object) carries: ``"1h"``, ``"5m"``, or ``None`` when it carries none."""
    marker = item.get("cache_control") if isinstance(item, Mapping) else None
    if marker is None and not isinstance(item, Mapping):
        marker = getattr(item, "cache_control", None)
    if marker is None:
        return None
    ttl = marker.get("ttl") if isinstance(marker, Mapping) else getattr(marker, "ttl", None)
    return "1h" if ttl == "1h" else "5m"


def _ttl_at(at: int, given: Sequence[str | None], tools_short: bool, wanted: str) -> str:
    """The lifetime of a breakpoint added at position ``at``. Anthropic requires every 1-hour
    entry to come before every 5-minute one (tools, then system, then messages): an added
    breakpoint before a client's 1-hour marker is 1-hour too, and one after a client's
    5-minute marker (or a tool's) is 5-minute, whatever the policy asks (with the client's own
    markers in a valid order, the two never meet)."""
    if any(ttl == "1h" for ttl in given[at + 1 :]):
        return "1h"
    if wanted == "1h" and (tools_short or any(ttl == "5m" for ttl in given[:at])):
        return "5m"
    return wanted


def _marker(policy: AnthropicCachePolicy, ttl: str) -> dict[str, str]:
    """The ``cache_control`` marker of lifetime ``ttl`` (the policy's own when it matches)."""
    if ttl == policy.ttl:
        return dict(policy.cache_control)
    return {"type": "ephemeral"} if ttl == "5m" else {"type": "ephemeral", "ttl": "1h"}


_PRIORITY: dict[Reason, int] = {
    "shared-prefix": 0,
    "history": 1,
    "documents": 2,
    "system": 3,
    "within-shared": 4,
}
"""Which breakpoints stay when there are more than allowed (lowest first)."""


@dataclass(frozen=True)
class _Found:
    """Where the plan's blocks stand: message ``message`` (-1: system), content blocks
    ``first`` .. ``first + count - 1``."""

    message: int
    first: int
    count: int


def _block_at(
    system: list[dict[str, Any]] | None, out: list[dict[str, Any]], position: tuple[int, int]
) -> dict[str, Any]:
    m, b = position
    return (system or [])[b] if m == -1 else out[m]["content"][b]


def _as_blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if isinstance(content, Sequence):
        return [
            dict(b) if isinstance(b, Mapping) else {"type": "text", "text": str(b)} for b in content
        ]
    raise TypeError(
        f"message content must be a str or a list of blocks, got {type(content).__name__}"
    )


def _split_plan_blocks(
    out: list[dict[str, Any]], system: list[dict[str, Any]] | None, prefix: CachePrefix | None
) -> _Found | None:
    """Split the text block holding the plan's rendered blocks into one block per rendered
    block (text before and after kept as blocks of their own); where it stands, or None."""
    if prefix is None or not prefix.blocks:
        return None
    joined = "".join(prefix.blocks)
    holders = [(-1, system or [])] + [(m, msg["content"]) for m, msg in enumerate(out)]
    for m, content in reversed(holders):
        for b in range(len(content) - 1, -1, -1):
            block = content[b]
            text = block.get("text")
            if block.get("type") != "text" or not isinstance(text, str):
                continue
            at = text.rfind(joined)
            if at < 0:
                continue
            pieces = [text[:at], *prefix.blocks, text[at + len(joined) :]]
            extra = {k: v for k, v in block.items() if k not in ("type", "text", "cache_control")}
            replacement = [{"type": "text", "text": p, **extra} for p in pieces if p]
            if "cache_control" in block:  # a marker given on the whole block stays at its end
                replacement[-1]["cache_control"] = block["cache_control"]
            content[b : b + 1] = replacement
            return _Found(m, b + (1 if pieces[0] else 0), len(prefix.blocks))
    return None


def _candidates(
    positions: Sequence[tuple[int, int]],
    cumulative: Sequence[int],
    system: list[dict[str, Any]] | None,
    out: list[dict[str, Any]],
    found: _Found | None,
    prefix: CachePrefix | None,
    policy: AnthropicCachePolicy,
) -> list[tuple[int, Reason]]:
    """``(position in positions, reason)`` of every breakpoint the policy wants."""
    index = {p: i for i, p in enumerate(positions)}
    wanted: list[tuple[int, Reason]] = []
    in_system = found is not None and found.message == -1
    if policy.system and system and not in_system:
        wanted.append((index[(-1, len(system) - 1)], "system"))
    if found is not None:
        first = index[(found.message, found.first)]
        if first > 0 and in_system and (policy.system or policy.history):
            # The documents stand in the system message (LlamaIndex's chat template): the
            # text before them is the system prompt and the earlier turns' sections.
            wanted.append((first - 1, "history" if policy.history else "system"))
        elif policy.history and first > 0 and (first - 1) != (len(system or []) - 1):
            wanted.append((first - 1, "history"))  # earlier turns end before this turn's blocks
        assert prefix is not None
        shared = min(prefix.shared_blocks, found.count)
        if policy.shared_prefix and shared > 0:
            end = first + shared - 1
            wanted.append((end, "shared-prefix"))
            # The same write also leaves entries at the shortest cacheable prefix and halfway
            # (tokens are billed once, up to the last breakpoint): later requests that share
            # less than this one read those.
            minimum = policy.min_cacheable_tokens
            start = next((at for at in range(first, end) if cumulative[at] >= minimum), None)
            if start is not None:
                wanted.append((start, "within-shared"))
                middle = (cumulative[start] + cumulative[end]) / 2
                half = next(at for at in range(start, end + 1) if cumulative[at] >= middle)
                wanted.append((half, "within-shared"))
        documents = policy.documents == "always" or (
            policy.documents == "conversation" and prefix.conversation
        )
        if documents:
            wanted.append((first + found.count - 1, "documents"))
    elif policy.history and len(out) > 1 and out[-2]["content"]:
        # No plan found: the conversation so far is stable; the last message is the new one.
        wanted.append((index[(len(out) - 2, len(out[-2]["content"]) - 1)], "history"))
    return wanted


def _choose(
    wanted: Sequence[tuple[int, Reason]],
    cumulative: Sequence[int],
    policy: AnthropicCachePolicy,
    slots: int,
) -> list[tuple[int, Reason]]:
    """Drop breakpoints below the minimum and repeats of a position; keep at most ``slots``,
    by priority; return them in prompt order."""
    minimum = policy.min_cacheable_tokens
    by_position: dict[int, Reason] = {}
    for at, reason in wanted:
        if cumulative[at] < minimum:
            continue
        if at not in by_position or _PRIORITY[reason] < _PRIORITY[by_position[at]]:
            by_position[at] = reason
    kept = sorted(by_position.items(), key=lambda item: (_PRIORITY[item[1]], -item[0]))
    return sorted(kept[: max(slots, 0)])
