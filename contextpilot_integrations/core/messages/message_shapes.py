"""Chat message shapes: their validation, and the tool calls and tool results inside them.

Two wire shapes are read (``api``):

- ``"openai"``: a list of ``{"role": "system" | "developer" | "user" | "assistant" | "tool",
  "content": str | list of parts}``; a part is ``{"type": "text", "text": str}`` or any other
  typed part (images, audio, files), which passes through untouched. An assistant message may
  carry ``"tool_calls": [{"id", "type": "function", "function": {"name", "arguments": str}}]``
  (``content`` may then be ``None`` or absent); a ``"tool"`` message answers one call through
  ``"tool_call_id"``.
- ``"anthropic"``: a list of ``{"role": "user" | "assistant", "content": str | list of blocks}``
  with blocks ``{"type": "text", "text"}``, ``{"type": "tool_use", "id", "name", "input": dict}``
  (assistant) and ``{"type": "tool_result", "tool_use_id", "content": str | list of blocks}``
  (user); other block types pass through untouched. The system prompt is separate (``system``:
  a str or a list of text blocks).

A tool result's *text* is its content when that is a str, or the text of its only part when it
is a list of exactly one text part; any other content (images, several parts, text that UTF-8
cannot encode) has no text: it is never rewritten and never pointed at.

Messages are plain JSON-like values (dicts, lists, str, numbers); :func:`copy_message` copies
the containers and shares the immutable leaves, so a returned message never aliases the caller's.
A message is a tree: a container holding itself (a cycle) is a ValueError naming the field
path, and so is nesting deeper than :data:`MAX_DEPTH` containers (the message dict is depth 1),
which no chat API takes and which copying and fingerprinting would otherwise recurse through.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "API_NAMES",
    "MAX_DEPTH",
    "Api",
    "ToolCall",
    "ToolResult",
    "check_api",
    "check_message_list",
    "copy_message",
    "find_tool_calls",
    "find_tool_results",
    "result_text",
    "tool_calls_in",
    "tool_results_in",
    "validate_message",
    "validate_messages",
    "validate_system",
    "with_result_text",
]

Api = Literal["openai", "anthropic"]
API_NAMES: tuple[Api, ...] = ("openai", "anthropic")

MAX_DEPTH = 64
"""Most nested containers (dicts, lists, tuples) in one message or system prompt."""

_OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")
_ANTHROPIC_ROLES = ("user", "assistant")

Message = dict[str, Any]

_NONE = type(None)
_SHALLOW = 8
"""Nesting (at most :data:`MAX_DEPTH`) up to which a tree of exact dicts, lists and leaves is
checked by :func:`_shallow` alone."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call the model made.

    Attributes:
        message: index of the assistant message holding it.
        slot: its index in ``tool_calls`` (OpenAI) or in ``content`` (Anthropic).
        call_id: the call's id (``tool_calls[k].id`` / ``tool_use.id``).
        signature: the tool's name and arguments as the call states them, ``name(arguments)``:
            OpenAI's ``arguments`` string as given; Anthropic's ``input`` as JSON
            (``json.dumps(input, ensure_ascii=False)``, the API's own serialisation).
    """

    message: int
    slot: int
    call_id: str
    signature: str


@dataclass(frozen=True, slots=True)
class ToolResult:
    """One tool result.

    Attributes:
        message: index of the message holding it (OpenAI ``"tool"`` message; Anthropic user
            message).
        block: index of the ``tool_result`` block in ``content`` (Anthropic); ``None`` (OpenAI).
        call_id: the call it answers (``tool_call_id`` / ``tool_use_id``).
        text: its text (see the module docstring); ``None``: not plain text, left alone.
    """

    message: int
    block: int | None
    call_id: str
    text: str | None

    @property
    def position(self) -> tuple[int, int]:
        """Order within the request: ``(message, block)``, ``block`` -1 for OpenAI."""
        return self.message, -1 if self.block is None else self.block


def check_api(api: object) -> Api:
    """``api`` if it names a known shape.

    Raises:
        ValueError: another value (named with the allowed ones).
    """
    if api not in API_NAMES:
        raise ValueError(f"api must be one of {', '.join(map(repr, API_NAMES))}, got {api!r:.80}")
    return api  # type: ignore[return-value]


def copy_message(value: Any) -> Any:
    """A copy of a JSON-like value: dicts and lists copied, other values shared."""
    kind = type(value)
    if kind is str or kind is _NONE or kind is int or kind is bool or kind is float:
        return value
    if kind is dict or isinstance(value, Mapping):
        return {
            key: item if type(item) is str else copy_message(item) for key, item in value.items()
        }
    if kind is list or isinstance(value, tuple):
        return [item if type(item) is str else copy_message(item) for item in value]
    return value


# ---------------------------------------------------------------------------------- validation
def validate_messages(messages: object, api: Api) -> Sequence[Mapping[str, Any]]:
    """Check a message list of shape ``api`` and return it.

    Raises:
        ValueError: a bad shape; the message names the field path (``messages[3].content``)
            and the value.
    """
    listed = check_message_list(messages)
    for i, message in enumerate(listed):
        validate_message(i, message, api)
    return listed


def check_message_list(messages: object) -> Sequence[Any]:
    """``messages`` if it is a list (a sequence other than a str or bytes); its messages are
    not read.

    Raises:
        ValueError: another value.
    """
    if type(messages) is not list and (
        isinstance(messages, str | bytes) or not isinstance(messages, Sequence)
    ):
        raise ValueError(f"messages must be a list of messages, got {_show(messages)}")
    return messages


def validate_message(i: int, message: object, api: Api) -> None:
    """Check message ``i`` of a list of shape ``api`` (the checks of :func:`validate_messages`
    for one message).

    Raises:
        ValueError: a bad shape, naming the field path (``messages[3].content``) and the value.
    """
    path = f"messages[{i}]"
    if type(message) is not dict and not isinstance(message, Mapping):
        raise ValueError(f"{path} must be a message dict, got {_show(message)}")
    _check_tree(path, message)
    role = message.get("role")
    if api == "openai":
        _check_openai(path, role, message)
    else:
        _check_anthropic(path, role, message)


def validate_system(system: object, api: Api) -> None:
    """Check Anthropic's separate system prompt (``None``, a str or a list of text blocks).

    Raises:
        ValueError: a bad shape, or a ``system`` with ``api="openai"`` (its system prompt is a
            message).
    """
    if system is None:
        return
    if api == "openai":
        raise ValueError(
            "system is only for api='anthropic'; an OpenAI system prompt is a message with "
            f"role 'system', got system={_show(system)}"
        )
    if isinstance(system, str):
        return
    _check_tree("system", system)
    _check_parts("system", system)


def _check_tree(path: str, value: object) -> None:
    """``value`` holds no container inside itself and nests at most :data:`MAX_DEPTH` deep.

    Raises:
        ValueError: a cycle or a deeper nesting, naming the field path where it shows.
    """
    if (type(value) is dict or type(value) is list) and _shallow(value, _SHALLOW):
        return
    if not isinstance(value, Mapping | list | tuple):
        return
    ancestors: set[int] = set()
    # depth-first with an explicit stack: (path, container, its items, depth); ancestors holds
    # the ids of the containers on the current path, so a value shared by two fields is fine
    stack: list[tuple[str, object, Any, int]] = []

    def enter(where: str, container: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ValueError(
                f"{where} nests deeper than {MAX_DEPTH} containers (MAX_DEPTH), got a "
                f"{type(container).__name__} at depth {depth}"
            )
        if id(container) in ancestors:
            raise ValueError(f"{where} is a container it is inside of (a cycle)")
        ancestors.add(id(container))
        items = container.items() if isinstance(container, Mapping) else enumerate(container)
        stack.append((where, container, iter(items), depth))

    enter(path, value, 1)
    while stack:
        where, container, items, depth = stack[-1]
        step = next(items, None)
        if step is None:
            stack.pop()
            ancestors.discard(id(container))
            continue
        key, item = step
        if isinstance(item, Mapping | list | tuple):
            if isinstance(container, Mapping):
                field = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key!r}]"
            else:
                field = f"{where}[{key}]"
            enter(field, item, depth + 1)


def _shallow(container: dict[Any, Any] | list[Any], budget: int) -> bool:
    """Whether ``container`` holds only str, int, float, bool and ``None`` leaves (exact types)
    and exact dicts and lists of them, nested at most ``budget`` deep: such a tree has no cycle
    (that would nest without end) and is within :data:`MAX_DEPTH` (``budget`` is no more)."""
    if budget <= 0:
        return False
    for item in container.values() if type(container) is dict else container:
        kind = type(item)
        if kind is str or kind is _NONE or kind is int or kind is bool or kind is float:
            continue
        if (kind is dict or kind is list) and _shallow(item, budget - 1):
            continue
        return False
    return True


def _check_openai(path: str, role: object, message: Mapping[str, Any]) -> None:
    if role not in _OPENAI_ROLES:
        raise ValueError(
            f"{path}.role must be one of {', '.join(map(repr, _OPENAI_ROLES))}, got {_show(role)}"
        )
    content = message.get("content")
    if "content" not in message or content is None:
        if role != "assistant":
            raise ValueError(f"{path}.content is missing (a str or a list of parts)")
    elif not isinstance(content, str):
        _check_parts(f"{path}.content", content)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ValueError(f"{path}.tool_call_id must be a non-empty str, got {_show(call_id)}")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if role != "assistant":
        raise ValueError(f"{path}.tool_calls is only for role 'assistant', got role {role!r}")
    if type(calls) is not list and (
        isinstance(calls, str | bytes) or not isinstance(calls, Sequence)
    ):
        raise ValueError(f"{path}.tool_calls must be a list, got {_show(calls)}")
    for k, call in enumerate(calls):
        where = f"{path}.tool_calls[{k}]"
        if type(call) is not dict and not isinstance(call, Mapping):
            raise ValueError(f"{where} must be a dict, got {_show(call)}")
        for name in ("id", "type"):
            if not isinstance(call.get(name), str):
                raise ValueError(f"{where}.{name} must be a str, got {_show(call.get(name))}")
        if call["type"] != "function":
            continue  # other call types (custom tools) pass through
        function = call.get("function")
        if type(function) is not dict and not isinstance(function, Mapping):
            raise ValueError(f"{where}.function must be a dict, got {_show(function)}")
        for name in ("name", "arguments"):
            if not isinstance(function.get(name), str):
                raise ValueError(
                    f"{where}.function.{name} must be a str, got {_show(function.get(name))}"
                )


def _check_anthropic(path: str, role: object, message: Mapping[str, Any]) -> None:
    if role not in _ANTHROPIC_ROLES:
        raise ValueError(
            f"{path}.role must be one of {', '.join(map(repr, _ANTHROPIC_ROLES))}, got "
            f"{_show(role)} (the system prompt is passed as system=)"
        )
    if "content" not in message:
        raise ValueError(f"{path}.content is missing (a str or a list of blocks)")
    content = message["content"]
    if isinstance(content, str):
        return
    _check_parts(f"{path}.content", content)
    for j, block in enumerate(content):
        where = f"{path}.content[{j}]"
        kind = block["type"]
        if kind == "tool_use":
            for name in ("id", "name"):
                if not isinstance(block.get(name), str):
                    raise ValueError(f"{where}.{name} must be a str, got {_show(block.get(name))}")
            if not isinstance(block.get("input"), Mapping):
                raise ValueError(f"{where}.input must be a dict, got {_show(block.get('input'))}")
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(
                    f"{where}.tool_use_id must be a non-empty str, got {_show(call_id)}"
                )
            inner = block.get("content")
            if inner is not None and not isinstance(inner, str):
                _check_parts(f"{where}.content", inner)


def _check_parts(path: str, parts: object) -> None:
    """A list of typed parts or blocks; text ones need a str ``text``."""
    if type(parts) is not list and (
        isinstance(parts, str | bytes) or not isinstance(parts, Sequence)
    ):
        raise ValueError(f"{path} must be a str or a list of parts, got {_show(parts)}")
    for j, part in enumerate(parts):
        if type(part) is not dict and not isinstance(part, Mapping):
            raise ValueError(f"{path}[{j}] must be a dict, got {_show(part)}")
        if not isinstance(part.get("type"), str):
            raise ValueError(f"{path}[{j}].type must be a str, got {_show(part.get('type'))}")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise ValueError(f"{path}[{j}].text must be a str, got {_show(part.get('text'))}")


def _show(value: object) -> str:
    try:
        return f"{type(value).__name__}: {value!r:.80}"
    except RecursionError:  # a value nested too deep for repr
        return f"{type(value).__name__} nested too deep to show"


# ---------------------------------------------------------------------------------- extraction
def find_tool_calls(messages: Sequence[Mapping[str, Any]], api: Api) -> list[ToolCall]:
    """The tool calls of the assistant messages, in order (calls with an unknown type skipped)."""
    calls: list[ToolCall] = []
    for i, message in enumerate(messages):
        calls.extend(tool_calls_in(i, message, api))
    return calls


def tool_calls_in(i: int, message: Mapping[str, Any], api: Api) -> list[ToolCall]:
    """The tool calls of message ``i`` (:func:`find_tool_calls` of one message)."""
    calls: list[ToolCall] = []
    if message.get("role") != "assistant":
        return calls
    if api == "openai":
        for k, call in enumerate(message.get("tool_calls") or ()):
            if call.get("type") == "function":
                function = call["function"]
                signature = f"{function['name']}({function['arguments']})"
                calls.append(ToolCall(i, k, call["id"], signature))
        return calls
    content = message.get("content")
    if isinstance(content, str):
        return calls
    for k, block in enumerate(content or ()):
        if block.get("type") == "tool_use":
            try:
                arguments = json.dumps(block["input"], ensure_ascii=False)
            except (TypeError, ValueError):
                continue  # an input JSON cannot render cannot be named
            calls.append(ToolCall(i, k, block["id"], f"{block['name']}({arguments})"))
    return calls


def find_tool_results(messages: Sequence[Mapping[str, Any]], api: Api) -> list[ToolResult]:
    """The tool results, in order of position."""
    results: list[ToolResult] = []
    for i, message in enumerate(messages):
        results.extend(tool_results_in(i, message, api))
    return results


def tool_results_in(i: int, message: Mapping[str, Any], api: Api) -> list[ToolResult]:
    """The tool results of message ``i`` (:func:`find_tool_results` of one message)."""
    results: list[ToolResult] = []
    if api == "openai":
        if message.get("role") == "tool":
            text = _plain_text(message.get("content"))
            results.append(ToolResult(i, None, message["tool_call_id"], text))
        return results
    content = message.get("content")
    if message.get("role") != "user" or isinstance(content, str):
        return results
    for j, block in enumerate(content or ()):
        if block.get("type") == "tool_result":
            text = _plain_text(block.get("content"))
            results.append(ToolResult(i, j, block["tool_use_id"], text))
    return results


def result_text(message: Mapping[str, Any], block: int | None) -> str | None:
    """The text of the tool result in ``message`` (at content block ``block``, Anthropic; the
    message itself, ``None``, OpenAI); ``None``: not plain text, or no such block."""
    if block is None:
        return _plain_text(message.get("content"))
    content = message.get("content")
    if not isinstance(content, list) or not 0 <= block < len(content):
        return None
    inner = content[block]
    if not isinstance(inner, Mapping) or inner.get("type") != "tool_result":
        return None
    return _plain_text(inner.get("content"))


def _plain_text(content: object) -> str | None:
    text: object = None
    if isinstance(content, str):
        text = content
    elif isinstance(content, list) and len(content) == 1:
        part = content[0]
        if isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
    if not isinstance(text, str):
        return None
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return None
    return text


def with_result_text(message: Message, result: ToolResult, text: str) -> Message:
    """A copy of ``message`` (which holds ``result``) with the result's text set to ``text``;
    the content keeps its shape (a str stays a str, a one-part list stays one part)."""
    copied = dict(message)
    if result.block is None:
        copied["content"] = _set_text(copied.get("content"), text)
        return copied
    blocks = list(copied["content"])
    block = dict(blocks[result.block])
    block["content"] = _set_text(block.get("content"), text)
    blocks[result.block] = block
    copied["content"] = blocks
    return copied


def _set_text(content: Any, text: str) -> Any:
    if isinstance(content, str):
        return text
    part = dict(content[0])
    part["text"] = text
    return [part]
