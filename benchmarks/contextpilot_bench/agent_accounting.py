"""What the agent replays' model calls cost: prompt and prefill tokens, dangling pointers, prefix
breaks and the hosted Anthropic bill, all read from the prompts the models received.

A prompt (:class:`AgentPrompt`) is one model call as the OpenAI chat format sends it: the tools
(function schemas) and the messages (``role``, ``content``, an assistant's ``tool_calls`` with
``json.dumps`` arguments, a tool message's ``tool_call_id``). Anthropic ``cache_control``
markers are taken off the content and kept as breakpoint positions, and a content that is one
text block is its text: a marker moves between calls, the prefix it closes does not change.

Units (:func:`prompt_units`): the tools, then each message, keyed by its canonical JSON and
weighted by that JSON's tokens (the bench's counter). A chat template renders each message
between special tokens, so a message's tokens depend on its own bytes only; the prefix-cache
model (:class:`~contextpilot_bench.prefix_cache_model.PrefixCacheModel`) then reuses a call's
messages up to the first one that differs, as the engine reuses their KV.

The checks are independent of the library: :func:`dangling_pointers` reads the pointers in the
sent text with its own pattern, maps each back to the tool's own output, and looks for that
text in the earlier result the pointer names, in the same prompt (a run of lines: the stretch
its quotes and line count find there is put back in its place first); :func:`prefix_breaks`
counts the calls whose prompt does not start with the previous call's of the same session.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

from contextpilot_bench.hosted_cache_model import AnthropicCacheModel, HostedUsage
from contextpilot_bench.prefix_cache_model import PrefixCacheModel
from contextpilot_integrations.core.blocks import TokenCounter

__all__ = [
    "AgentPrompt",
    "anthropic_usage",
    "dangling_pointers",
    "langchain_prompt",
    "pointer_count",
    "prefill_tokens",
    "prefix_breaks",
    "prompt_units",
    "unique_tokens",
]

CALL_GAP_S = 2.0
"""Virtual seconds between two model calls (hosted cache lifetimes are counted in these)."""

_POINTER = re.compile(
    r"\[Same (?:(?:result as|as document (?P<label>.+?) of|as the result of) "
    r"(?P<call>\w+\(.+?) above\.\]"
    r"|(?P<lines>[1-9][0-9]*) lines as in the result of (?P<run_call>.+?) "
    r'above, from the line starting "(?P<first>[^\n]*?)" to the line starting '
    r'"(?P<last>[^\n]*?)"\.\]'
    r"|line as in the result of (?P<line_call>.+?) above, the line starting "
    r'"(?P<line_first>[^\n]*?)"\.\])'
)
"""The library's pointers: a whole result, a document, or a run of lines (``[Same 46 lines as
in the result of f(...) above, from the line starting "a" to the line
starting "b".]``: the first line of that result starting with ``a``, the first at or after it
starting with ``b``, that many lines; a quote ending in an ellipsis is cut there; one line:
``[Same line as in the result of f(...) above, the line starting "a".]``)."""


@dataclass(frozen=True)
class AgentPrompt:
    """One model call's prompt.

    Attributes:
        session: the session (agent thread) it belongs to.
        tools: the tool schemas, markers removed.
        messages: the messages in OpenAI chat format, markers removed.
        breakpoints: unit positions (:func:`prompt_units`: 0 the tools, ``i + 1`` message
            ``i``) that carry an Anthropic ``cache_control`` marker, ascending.
    """

    session: str
    tools: tuple[Mapping[str, Any], ...]
    messages: tuple[Mapping[str, Any], ...]
    breakpoints: tuple[int, ...] = ()


# ---------------------------------------------------------------------------------- prompts
def _strip(content: Any) -> tuple[Any, bool]:
    """``content`` without markers, a lone text block as its text; whether it carried one."""
    if isinstance(content, str):
        return content, False
    marked = False
    blocks: list[Any] = []
    for block in content or ():
        if isinstance(block, Mapping):
            block = dict(block)
            marked = block.pop("cache_control", None) is not None or marked
            if block.get("type") == "tool_result":
                inner, inner_marked = _strip(block.get("content"))
                marked = marked or inner_marked
                blocks.append(inner if isinstance(inner, str) else {**block, "content": inner})
                continue
        blocks.append(block)
    if len(blocks) == 1 and isinstance(blocks[0], str):
        return blocks[0], marked
    if len(blocks) == 1 and isinstance(blocks[0], Mapping) and blocks[0].get("type") == "text":
        return blocks[0].get("text", ""), marked
    return blocks, marked


def _openai_message(message: BaseMessage) -> tuple[dict[str, Any], bool]:
    content, marked = _strip(message.content)
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": content}, marked
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": content}, marked
    if isinstance(message, ToolMessage):
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": content}, marked
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.get("id") or "",
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": json.dumps(call["args"], ensure_ascii=False),
                    },
                }
                for call in message.tool_calls
            ]
        return out, marked
    return {"role": message.type, "content": content}, marked


def langchain_prompt(
    session: str, messages: Sequence[BaseMessage], kwargs: Mapping[str, Any]
) -> AgentPrompt:
    """The prompt a LangChain chat model received: its messages and call keywords (``tools``
    as bound; a ``cache_control`` keyword marks the last message, as ``ChatAnthropic`` sends
    it)."""
    tools: list[dict[str, Any]] = []
    breakpoints: list[int] = []
    for tool in kwargs.get("tools") or ():
        tool = dict(tool)
        if tool.pop("cache_control", None) is not None and 0 not in breakpoints:
            breakpoints.append(0)
        tools.append(tool)
    sent: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        converted, marked = _openai_message(message)
        sent.append(converted)
        if marked:
            breakpoints.append(position + 1)
    if kwargs.get("cache_control") and messages and len(messages) not in breakpoints:
        breakpoints.append(len(messages))
    return AgentPrompt(session, tuple(tools), tuple(sent), tuple(sorted(breakpoints)))


def prompt_units(prompt: AgentPrompt, counter: TokenCounter) -> list[tuple[str, int]]:
    """``(key, tokens)`` per unit: the tools, then each message (module docstring)."""
    keys = [json.dumps(list(prompt.tools), ensure_ascii=False, sort_keys=True)]
    keys += [json.dumps(m, ensure_ascii=False, sort_keys=True) for m in prompt.messages]
    return [(key, counter.count(key)) for key in keys]


# ---------------------------------------------------------------------------------- figures
def unique_tokens(prompts: Sequence[AgentPrompt], counter: TokenCounter) -> int:
    """Tokens of the distinct units over ``prompts`` (the base of a fractional capacity)."""
    seen: dict[str, int] = {}
    for prompt in prompts:
        seen.update(prompt_units(prompt, counter))
    return sum(seen.values())


def prefill_tokens(
    prompts: Sequence[AgentPrompt], counter: TokenCounter, capacity_tokens: int | None
) -> list[tuple[int, int]]:
    """``(prompt tokens, prefill tokens)`` per call, the calls served in order by one
    :class:`PrefixCacheModel` of ``capacity_tokens`` (``None``: unlimited)."""
    cache = PrefixCacheModel(capacity_tokens)
    out = []
    for prompt in prompts:
        units = prompt_units(prompt, counter)
        weights = [w for _, w in units]
        cached = cache.serve([k for k, _ in units], weights)
        out.append((sum(weights), sum(weights) - cached))
    return out


def prefix_breaks(prompts: Sequence[AgentPrompt]) -> list[int]:
    """Positions of the calls whose tools and messages do not start with the previous call's
    of the same session (a session's first call never breaks)."""
    last: dict[str, AgentPrompt] = {}
    out = []
    for position, prompt in enumerate(prompts):
        before = last.get(prompt.session)
        if before is not None:
            n = len(before.messages)
            if prompt.tools != before.tools or tuple(prompt.messages[:n]) != before.messages:
                out.append(position)
        last[prompt.session] = prompt
    return out


def anthropic_usage(
    prompts: Sequence[AgentPrompt], counter: TokenCounter, *, min_tokens: int, ttl_s: float
) -> list[HostedUsage]:
    """What each call is billed by :class:`AnthropicCacheModel` at its breakpoints, the calls
    :data:`CALL_GAP_S` apart in virtual time."""
    cache = AnthropicCacheModel(ttl_s, min_tokens)
    out = []
    for position, prompt in enumerate(prompts):
        units = [
            (int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "big"), w)
            for k, w in prompt_units(prompt, counter)
        ]
        out.append(cache.serve(position * CALL_GAP_S, units, prompt.breakpoints))
    return out


# ---------------------------------------------------------------------------------- pointers
def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], Mapping):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def pointer_count(prompt: AgentPrompt) -> int:
    """Pointers in ``prompt``'s tool messages (by this module's pattern)."""
    return sum(
        len(_POINTER.findall(_text(m.get("content")) or ""))
        for m in prompt.messages
        if m.get("role") == "tool"
    )


def dangling_pointers(prompt: AgentPrompt, originals: Mapping[str, str]) -> list[str]:
    """What is wrong with the pointers in ``prompt``'s tool messages, one line per problem.

    ``originals`` maps a tool call id to what the tool returned. A pointer is sound when the
    sent text, each run pointer replaced by the stretch it names (:func:`_run_text`) and each
    other pointer by some text, is the tool's output; each other pointer's replaced text
    stands verbatim (a whole result: equal up to surrounding whitespace) in an earlier tool
    result of the same prompt answering a call with a signature it names (:func:`_names`),
    with the document label it names; and every earlier result of such a signature that is
    not itself a pointer reads so.

    A run pointer is put back before the rest is mapped because the sent text alone does not
    say where its stretch ends: the text between two pointers (a blank line) may stand inside
    the stretch too.

    Raises:
        KeyError: a tool message whose call id ``originals`` does not have.
    """
    signatures: dict[str, str] = {}
    results: list[tuple[int, str, str]] = []  # (position, signature, sent text)
    problems: list[str] = []
    for position, message in enumerate(prompt.messages):
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or ():
                function = call["function"]
                signatures[call["id"]] = f"{function['name']}({function['arguments']})"
            continue
        if message.get("role") != "tool":
            continue
        call_id = str(message["tool_call_id"])
        sent = _text(message.get("content"))
        signature = signatures.get(call_id, "")
        if sent is None:
            continue
        found = list(_POINTER.finditer(sent))
        if found:
            problems += _check_result(position, sent, originals[call_id], found, results)
        results.append((position, signature, sent))
    return problems


def _check_result(
    position: int,
    sent: str,
    original: str,
    found: Sequence[re.Match[str]],
    earlier: Sequence[tuple[int, str, str]],
) -> list[str]:
    pieces: list[str] = []  # the sent text, run pointers put back, between the other pointers
    others: list[re.Match[str]] = []
    current: list[str] = []
    start = 0
    for match in found:
        current.append(sent[start : match.start()])
        start = match.end()
        if match.group("lines") is None and match.group("line_call") is None:
            pieces.append("".join(current))
            current = []
            others.append(match)
            continue
        stretch = _run_text(position, match, earlier)
        if not isinstance(stretch, tuple):
            return [stretch]
        current.append(stretch[0])
    current.append(sent[start:])
    pieces.append("".join(current))
    spans = _replaced_spans(tuple(pieces), original)
    if spans is None:
        return [f"message {position}: the sent text does not map back to the tool's output"]
    problems = []
    for k, match in enumerate(others):
        replaced = spans[k].strip()
        label, call = match.group("label"), match.group("call")
        candidates = [
            text
            for _, signature, text in earlier
            if _names(call, signature) and not _is_pointer(text)
        ]
        if not candidates:
            problems.append(f"message {position}: pointer to {call} names no earlier result")
            continue
        for text in candidates:
            if label is None and match.group(0).startswith("[Same result as"):
                ok = text.strip() == replaced
            else:
                ok = replaced in text and (label is None or label in text)
            if not ok:
                problems.append(
                    f"message {position}: pointer to {call} {label or ''}: the replaced text is "
                    "not in the earlier result"
                )
                break
    return problems


def _run_text(
    position: int, match: re.Match[str], earlier: Sequence[tuple[int, str, str]]
) -> tuple[str] | str:
    """What one run pointer stands for, ``(text,)``: the stretch its quotes and count find in
    the earlier results of the calls it names, without its last line's ending (the sent text
    keeps the line ending after the pointer), the same in every one of them; else the
    problem."""
    if match.group("lines") is not None:
        call, lines = match.group("run_call"), int(match.group("lines"))
        first, last = match.group("first"), match.group("last")
    else:
        call, lines = match.group("line_call"), 1
        first = last = match.group("line_first")
    candidates = [
        text for _, signature, text in earlier if _names(call, signature) and not _is_pointer(text)
    ]
    if not candidates:
        return f"message {position}: pointer to {call} names no earlier result"
    found = {_stretch(text, lines, first, last) for text in candidates}
    stretch = found.pop()
    if found or stretch is None:
        return (
            f"message {position}: pointer to {call} ({lines} lines): the quotes find no stretch, "
            "or another one in each earlier result"
        )
    for ending in ("\r\n", "\n"):
        if stretch.endswith(ending):
            return (stretch[: -len(ending)],)
    return (stretch,)


def _stretch(text: str, lines: int, first: str, last: str) -> str | None:
    """The ``lines`` lines of ``text`` from the first line starting with the quote ``first``
    to the first line at or after it starting with ``last``; ``None`` when there is none."""
    split = text.split("\n")
    rows = [line + "\n" for line in split[:-1]] + ([split[-1]] if split[-1] else [])

    def starts(row: str, quote: str) -> bool:
        bare = row[:-1] if row.endswith("\n") else row
        bare = bare[:-1] if bare.endswith("\r") and row.endswith("\n") else bare
        return bare.startswith(quote[:-1] if quote.endswith("\u2026") else quote)

    start = next((i for i, row in enumerate(rows) if starts(row, first)), None)
    if start is None:
        return None
    end = next((i for i in range(start, len(rows)) if starts(rows[i], last)), None)
    if end is None or end - start + 1 != lines:
        return None
    return "".join(rows[start : end + 1])


@functools.lru_cache(maxsize=4096)
def _replaced_spans(pieces: tuple[str, ...], original: str) -> tuple[str, ...] | None:
    """The texts of ``original`` between the literal ``pieces`` (the sent text around its
    pointers), or ``None`` when ``original`` is not ``pieces[0] + x1 + pieces[1] + ...``.

    The first occurrence of each piece is tried first; only when that does not fit is the
    general (backtracking) match run. A tool message stands in every later prompt of its
    session, so the same pair is mapped many times: cached.
    """
    first, last = pieces[0], pieces[-1]
    if original.startswith(first) and original.endswith(last):
        spans, pos, end = [], len(first), len(original) - len(last)
        for piece in pieces[1:-1]:
            found = original.find(piece, pos, end)
            if found < 0:
                break
            spans.append(original[pos:found])
            pos = found + len(piece)
        else:
            if pos <= end:
                return (*spans, original[pos:end])
    pattern = "(.*?)".join(re.escape(piece) for piece in pieces)
    mapped = re.fullmatch(pattern, original, flags=re.DOTALL)
    return None if mapped is None else mapped.groups()


def _names(call: str, signature: str) -> bool:
    """Whether a pointer's ``call`` names ``signature``: the same text, or arguments cut short,
    ``name(prefix…)``, that ``signature`` starts with (``prefix`` without the ellipsis)."""
    return signature == call or (call.endswith("\u2026)") and signature.startswith(call[:-2]))


def _is_pointer(text: str) -> bool:
    match = _POINTER.fullmatch(text.strip())
    return match is not None and match.group(0).startswith("[Same result as")
