"""The pointers that stand in for repeated tool output, and their check on the sent messages.

A pointer names an earlier tool call the way the model can find it, by the tool's name and its
arguments exactly as that call states them::

    [Same result as the earlier call search({"query": "kv cache"}) above.]
    [Same as document [2] in the result of the earlier call search({"query": "kv cache"}) above.]
    [Same as the result of the earlier call fetch({"url": "https://a.example"}) above.]
    [Same as document id "d7" in the result of the earlier call search({"query": "kv"}) above.]

A document's label is shown as its result writes it (``[Doc 2]``, ``[2]``, ``2.``,
``index="2"``), except a JSON document's: its label is the literal ``"id": "d7"`` (or
``"id":7``) as the result writes it, which reads badly inside a sentence, so the pointer shows
the key and the value, ``id "d7"`` (``id 7``). The check still finds the literal itself in the
earlier result, so the model finds the document by the key and value it is shown.

docs/DESIGN.md, "Sure hints": a pointer is only as good as the text it points at, so every
pointer is checked on the final messages of the request that carries it (:func:`check_pointer`),
never taken from memory: the pointer stands in its result; the result it names stands earlier
in the same request and holds the replaced text verbatim (for a whole result: the same text up
to surrounding whitespace), and the document label when one is named; the named call is the
nearest earlier assistant tool call with that result's call id; and every earlier result of a
call with the same name and arguments reads the same (else "the earlier call" would be
ambiguous).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from contextpilot_integrations.core.messages.documents import span_text
from contextpilot_integrations.core.messages.message_plan import ResultPlacement
from contextpilot_integrations.core.messages.message_shapes import (
    Api,
    ToolCall,
    ToolResult,
    find_tool_calls,
    find_tool_results,
)

__all__ = [
    "RequestView",
    "check_pointer",
    "document_pointer",
    "names_one_result",
    "result_pointer",
    "shown_label",
]

_SAME_RESULT = "[Same result as the earlier call {call} above.]"
_SAME_DOCUMENT = "[Same as document {label} in the result of the earlier call {call} above.]"
_SAME_AS_RESULT = "[Same as the result of the earlier call {call} above.]"
_JSON_LABEL = re.compile(r'"(\w+)": ?(\S.*)', re.S)
"""A JSON document's label, ``"key": value`` (:mod:`.documents`; no other layout's label
starts with a quote)."""


def shown_label(label: str) -> str:
    """How a pointer names the document ``label``: as written, but a JSON label
    ``"id": "d7"`` as ``id "d7"``."""
    match = _JSON_LABEL.fullmatch(label)
    if match is None:
        return label
    return f"{match.group(1)} {match.group(2)}"


def result_pointer(call: str) -> str:
    """The pointer replacing a whole result equal to the result of ``call``."""
    return _SAME_RESULT.format(call=call)


def document_pointer(call: str, label: str | None) -> str:
    """The pointer replacing a document that stands as document ``label`` of ``call``'s
    result, or (``label`` ``None``) as that whole result."""
    if label is None:
        return _SAME_AS_RESULT.format(call=call)
    return _SAME_DOCUMENT.format(label=shown_label(label), call=call)


def names_one_result(call: str, target_text: str, earlier_texts: Sequence[str | None]) -> bool:
    """Whether ``call`` names one reading: each text in ``earlier_texts`` (the results of the
    calls with that signature before the pointer) is the target's up to surrounding whitespace,
    or a pointer to that same call."""
    want = target_text.strip()
    pointer = result_pointer(call)
    return all(t is not None and (t.strip() == want or t == pointer) for t in earlier_texts)


class RequestView:
    """The tool calls and tool results of one request's messages, and which call each result
    answers (the nearest earlier assistant tool call with its id)."""

    __slots__ = ("by_position", "by_signature", "calls", "results")

    def __init__(self, messages: Sequence[Mapping[str, Any]], api: Api) -> None:
        self.results: list[ToolResult] = find_tool_results(messages, api)
        self.by_position = {r.position: k for k, r in enumerate(self.results)}
        self.calls: list[ToolCall | None] = []
        latest: dict[str, ToolCall] = {}
        pending = iter(find_tool_calls(messages, api))
        call = next(pending, None)
        for result in self.results:
            while call is not None and (call.message, call.slot) < result.position:
                latest[call.call_id] = call
                call = next(pending, None)
            self.calls.append(latest.get(result.call_id))
        self.by_signature: dict[str, list[int]] = {}
        for k, answered in enumerate(self.calls):
            if answered is not None:
                self.by_signature.setdefault(answered.signature, []).append(k)

    def signature(self, k: int) -> str | None:
        call = self.calls[k]
        return None if call is None else call.signature


def check_pointer(view: RequestView, placement: ResultPlacement) -> bool:
    """Whether ``placement`` (a pointer) holds on the messages ``view`` was made of."""
    if (
        placement.pointer is None
        or placement.original is None
        or placement.offset is None
        or placement.target_message is None
    ):
        return False
    here = (placement.message, -1 if placement.block is None else placement.block)
    there = (
        placement.target_message,
        -1 if placement.target_block is None else placement.target_block,
    )
    k_here, k_there = view.by_position.get(here), view.by_position.get(there)
    if k_here is None or k_there is None or not there < here:
        return False
    text, target = view.results[k_here].text, view.results[k_there].text
    if text is None or target is None:
        return False
    call = placement.target_call
    if call is None or view.signature(k_there) != call:
        return False
    if placement.document is None:
        if text != placement.pointer or placement.pointer != result_pointer(call):
            return False
        if target.strip() != placement.original.strip():
            return False
    else:
        expected = document_pointer(call, placement.target_label)
        if placement.pointer not in (expected, span_text("json", expected)):
            return False
        if not text.startswith(placement.pointer, placement.offset):
            return False
        if placement.original not in target:
            return False
        if placement.target_label is not None and placement.target_label not in target:
            return False
    earlier = [view.results[k].text for k in view.by_signature[call] if k < k_here and k != k_there]
    return names_one_result(call, target, earlier)
