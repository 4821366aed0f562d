"""The pointers that stand in for repeated tool output, and their check on the sent messages.

A pointer names an earlier tool call the way the model can find it, by the tool's name and its
arguments exactly as that call states them::

    [Same result as search({"query": "kv cache"}) above.]
    [Same as document [2] of search({"query": "kv cache"}) above.]
    [Same as the result of fetch({"url": "https://a.example"}) above.]
    [Same as document id "d7" of search({"query": "kv"}) above.]

and a run of whole lines, made and checked by :mod:`.repeated_lines`::

    [Same 46 lines as in the result of read_file({"path": "a.py"}) above,
    from the line starting "import os" to the line starting "    return x".]

(one line in the result).

Long arguments (a question as the query) make a long name, so a call may be named by its
arguments cut short, a verbatim prefix of its signature followed by an ellipsis
(:func:`short_name`)::

    [Same result as search({"query": "Who founded the company…) above.]

The prefix keeps at least :data:`MIN_SHOWN` characters of the arguments and ends at a word's
end, so the model can find the call, and is longer than what the signature shares with any
other signature of a call standing before the pointer, so it names one call there. The check
reads a name ending in the ellipsis as standing for every signature that starts with the text
before it (:func:`named_by`), a whole signature that happens to end so included.

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
nearest earlier assistant tool call with that result's call id, and the name stands for its
signature; and every earlier result of a call whose signature the name stands for reads the
same (else the pointer would name two readings).
"""

from __future__ import annotations

import os
import re
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any

from contextpilot_integrations.core.messages.documents import find_text, span_text
from contextpilot_integrations.core.messages.message_plan import ResultPlacement
from contextpilot_integrations.core.messages.message_shapes import (
    Api,
    ToolCall,
    ToolResult,
    tool_calls_in,
    tool_results_in,
)

__all__ = [
    "ELLIPSIS",
    "MIN_SHOWN",
    "POINTER_MARK",
    "RequestView",
    "check_pointer",
    "pointer_results",
    "document_pointer",
    "holds",
    "named_by",
    "named_signatures",
    "names_one_result",
    "result_pointer",
    "short_name",
    "shown_label",
]

ELLIPSIS = "\u2026"
"""What ends the arguments a short name cuts (one character, ``…``)."""
MIN_SHOWN = 32
"""Least characters of a call's arguments a short name keeps, key and quotes included
(``{"query": "`` is 11): a few words of a query, enough for the model to find the call by eye,
whatever the other calls of the request."""
_CUT = ELLIPSIS + ")"

POINTER_MARK = "[Same "
"""How every pointer starts (each template below), and so how it stands in a message,
JSON-escaped or not (escaping leaves these characters alone). The planner relies on it: a
message with no key or str holding it is no message the conversation was sent with pointers,
so it is not looked up as one (``message_planner._Given.may_be_sent``); a new kind of
pointer must start with it too."""
_SAME_RESULT = "[Same result as {call} above.]"
_SAME_DOCUMENT = "[Same as document {label} of {call} above.]"
_SAME_AS_RESULT = "[Same as the result of {call} above.]"
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


def named_by(name: str, signature: str) -> bool:
    """Whether the pointer name ``name`` stands for a call of ``signature`` (``name(arguments)``):
    the same text, or, for a name ending in ``…)``, a signature starting with what precedes
    that."""
    if signature == name:
        return True
    return name.endswith(_CUT) and signature.startswith(name[: -len(_CUT)])


def named_signatures(name: str, signatures: Sequence[str]) -> list[str]:
    """The signatures of ``signatures`` (sorted, distinct) that ``name`` stands for
    (:func:`named_by`), in order."""
    stem = name[: -len(_CUT)] if name.endswith(_CUT) else name
    found = []
    for k in range(bisect_left(signatures, stem), len(signatures)):
        if not signatures[k].startswith(stem):
            break
        if named_by(name, signatures[k]):
            found.append(signatures[k])
    return found


def short_name(signature: str, others: Sequence[str]) -> str | None:
    """``signature`` (``name(arguments)``) cut short, ``name(prefix…)``, or ``None`` when no cut
    is shorter than ``signature`` itself.

    The prefix is verbatim and the shortest that keeps :data:`MIN_SHOWN` characters of the
    arguments, that no signature of ``others`` (sorted, distinct; ``signature`` itself may be
    among them) starts with, so the name stands for ``signature`` alone among them, and that
    does not end inside a word (letters and digits). The signature sharing the longest prefix
    with ``signature`` is a neighbour of it in sorted order, so two comparisons find how long
    the prefix must be.
    """
    opening = signature.find("(")
    if opening < 0:
        return None
    keep = opening + 1 + MIN_SHOWN
    at = bisect_left(others, signature)
    for other in others[max(at - 1, 0) : at + 2]:
        if other != signature:
            keep = max(keep, len(os.path.commonprefix([signature, other])) + 1)
    while keep < len(signature) and signature[keep - 1].isalnum() and signature[keep].isalnum():
        keep += 1  # never cut inside a word: the model finds the call by whole words
    if keep + len(_CUT) >= len(signature):
        return None
    return signature[:keep] + _CUT


def names_one_result(call: str, target_text: str, earlier_texts: Sequence[str | None]) -> bool:
    """Whether the name ``call`` names one reading: each text in ``earlier_texts`` (the results
    of the calls before the pointer whose signature ``call`` stands for) is the target's up to
    surrounding whitespace, or a pointer naming the same ``call``."""
    want = target_text.strip()
    pointer = result_pointer(call)
    return all(t is not None and (t.strip() == want or t == pointer) for t in earlier_texts)


class RequestView:
    """The tool calls and tool results of one request's messages, and which call each result
    answers (the nearest earlier assistant tool call with its id).

    Args:
        messages: the request's messages, shape ``api``.
        api: ``"openai"`` or ``"anthropic"``.
        previous: a view of an earlier state of the same list: the calls and results of each
            message that is still the same object at the same index are taken from it, not
            read again, and its answers (which call each result answers) for the messages
            before the first one that is not (only for messages never changed in place, as
            the planner's are).

    Attributes:
        results: the tool results, in order of position.
        by_position: result index by position, ``(message, block or -1)``.
        calls: per result, the call it answers; ``None`` when no earlier call has its id.
        tool_calls: every tool call, in order of position, answered or not.
        by_signature: the results answering calls of each signature, in order.
        memo: what a check derives from the view's results, kept with the view so that it is
            derived once however many pointers are checked on it (the view's messages are
            never changed in place); each module under its own key, starting empty.
    """

    __slots__ = (
        "_api",
        "_parts",
        "_read",
        "_signatures",
        "by_position",
        "by_signature",
        "calls",
        "memo",
        "results",
        "tool_calls",
    )
    results: list[ToolResult]
    by_position: dict[tuple[int, int], int]
    calls: list[ToolCall | None]
    tool_calls: list[ToolCall]
    by_signature: dict[str, list[int]]
    memo: dict[str, Any]
    _signatures: list[str]

    def __init__(
        self,
        messages: Sequence[Mapping[str, Any]],
        api: Api,
        previous: RequestView | None = None,
    ) -> None:
        self._api = api
        self._read = list(messages)
        self.memo = {}
        # per message: its tool results and tool calls
        self._parts: list[tuple[list[ToolResult], list[ToolCall]]] = []
        earlier = previous._read if previous is not None and previous._api == api else []
        reread = len(earlier) != len(self._read)
        first_read = min(len(earlier), len(self._read))  # the first message read here
        for i, message in enumerate(self._read):
            if i < len(earlier) and earlier[i] is message:
                self._parts.append(previous._parts[i])  # type: ignore[union-attr]
            else:
                first_read = min(first_read, i)
                reread = True
                role = message.get("role")  # calls are an assistant's, results another's
                if role == "assistant":
                    self._parts.append(([], tool_calls_in(i, message, api)))
                else:
                    self._parts.append((tool_results_in(i, message, api), []))
        if not reread and previous is not None:  # the same messages: the same answers
            self.results = previous.results
            self.by_position = previous.by_position
            self.calls = previous.calls
            self.tool_calls = previous.tool_calls
            self.by_signature = previous.by_signature
            self._signatures = previous._signatures
            return
        self.results = []
        self.by_position = {}
        self.calls = []
        self.tool_calls = []
        self.by_signature = {}
        # A message holds tool calls (assistant) or tool results (tool, or Anthropic user),
        # never both: the calls standing before a message's results are those of the
        # messages before it, taken in order (a later call with the same id wins).
        latest: dict[str, ToolCall] = {}
        start = 0
        if previous is not None and earlier:
            # the messages before the first one read stand as in `previous`: its answers for
            # them, taken as they are, then the rest read on from there
            latest = self._answers_before(previous, first_read)
            start = first_read
        for results, calls in self._parts[start:]:
            for call in calls:
                latest[call.call_id] = call
            self.tool_calls.extend(calls)
            for result in results:
                k = len(self.results)
                self.results.append(result)
                self.by_position[result.position] = k
                answered = latest.get(result.call_id)
                self.calls.append(answered)
                if answered is not None:
                    self.by_signature.setdefault(answered.signature, []).append(k)
        self._signatures = sorted(self.by_signature)

    def _answers_before(self, previous: RequestView, first: int) -> dict[str, ToolCall]:
        """Take from ``previous`` the results and calls of the messages before ``first`` (the
        same in both views); the latest call of each id among them."""
        r = bisect_left(previous.results, first, key=_message_of)
        c = bisect_left(previous.tool_calls, first, key=_message_of)
        self.results = previous.results[:r]
        self.calls = previous.calls[:r]
        self.tool_calls = previous.tool_calls[:c]
        self.by_position = {result.position: k for k, result in enumerate(self.results)}
        for k, answered in enumerate(self.calls):
            if answered is not None:
                self.by_signature.setdefault(answered.signature, []).append(k)
        return {call.call_id: call for call in self.tool_calls}

    def signature(self, k: int) -> str | None:
        """The signature of the call result ``k`` answers; ``None`` when none."""
        call = self.calls[k]
        return None if call is None else call.signature

    def answering(self, name: str) -> list[int]:
        """The results answering a call whose signature the pointer name ``name`` stands for
        (:func:`named_by`), in order."""
        found = [k for s in named_signatures(name, self._signatures) for k in self.by_signature[s]]
        return sorted(found)


def _message_of(part: ToolResult | ToolCall) -> int:
    """The message a tool result or call stands in (what the view's lists are ordered by)."""
    return part.message


def holds(text: str, part: str) -> bool:
    """``part in text``, a long ``part`` looked for by :func:`.documents.find_text`."""
    if type(text) is str and type(part) is str:
        return find_text(text, part) >= 0
    return part in text


def pointer_results(view: RequestView, placement: ResultPlacement) -> tuple[int, int] | None:
    """The indexes in ``view.results`` of the result holding ``placement``'s pointer and of the
    result it names; ``None`` when either is not in ``view`` or the named one does not stand
    before it."""
    if placement.target_message is None:
        return None
    here = (placement.message, -1 if placement.block is None else placement.block)
    there = (
        placement.target_message,
        -1 if placement.target_block is None else placement.target_block,
    )
    k_here, k_there = view.by_position.get(here), view.by_position.get(there)
    if k_here is None or k_there is None or not there < here:
        return None
    return k_here, k_there


def check_pointer(view: RequestView, placement: ResultPlacement) -> bool:
    """Whether ``placement`` (a pointer to a whole result or a document) holds on the messages
    ``view`` was made of; a run of lines (reason ``"same lines"``) is checked by
    :func:`.repeated_lines.check_run_placement`."""
    if (
        placement.pointer is None
        or placement.original is None
        or placement.offset is None
        or placement.target_message is None
    ):
        return False
    found = pointer_results(view, placement)
    if found is None:
        return False
    k_here, k_there = found
    text, target = view.results[k_here].text, view.results[k_there].text
    if text is None or target is None:
        return False
    call, signature = placement.target_call, view.signature(k_there)
    if call is None or signature is None or not named_by(call, signature):
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
        if not holds(target, placement.original):
            return False
        if placement.target_label is not None and placement.target_label not in target:
            return False
    earlier = [view.results[k].text for k in view.answering(call) if k < k_here and k != k_there]
    return names_one_result(call, target, earlier)
