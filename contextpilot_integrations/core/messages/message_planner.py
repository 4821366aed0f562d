"""Planning over chat messages: the messages to send for one LLM call of an agent conversation.

An agent's prompt is its whole history: system prompt, user turns, the model's tool calls and
the tools' results, sent again on every call. Two things make that cheap or expensive. The
engine's (or the hosted API's) prefix cache reuses the KV of the longest byte-identical prefix,
so every earlier message must go out exactly as it went out before. And tools repeat
themselves: the same search run twice, the same documents returned by two searches. The
planner sends repeated tool output once and a short pointer to it afterwards, under the rules
below (docs/DESIGN.md, "Byte-stable history", "Sure hints", "Lossless", "Isolation").

Shapes (:mod:`.message_shapes`): OpenAI chat messages (``api="openai"``) and Anthropic messages
(``api="anthropic"``, the system prompt passed separately as ``system``). A bad shape raises a
ValueError naming the field path and the value (``messages[3].content``); content the planner
does not read (images, unknown part and block types) passes through untouched.

Rules:

1. Byte-stable history. Earlier messages go out exactly as they went out before. Per
   ``(scope.tenant, scope.conversation_id)`` the planner remembers, for each message sent, a
   fingerprint of what the app gave and the exact message sent in its place
   (:mod:`.message_history`). A call whose messages extend what was sent replays the sent
   messages for that prefix. Where the app's history stops being an extension (an edited,
   summarised or trimmed message, a message removed), everything from the first divergence on
   is new and the records from there are dropped. A new message that is a message the
   conversation was sent with pointers (an app that keeps what was sent, then trims or edits
   it) is planned from the app's original, which the memory rebuilds from the placements
   (:meth:`.message_history.MessageHistory.restore`): its pointers may name text the request
   no longer holds. A conversation the memory does not hold (never seen, evicted, forgotten)
   replays nothing. Without a scope or a conversation id there is no memory at all: nothing
   crosses conversations or tenants, and a history given back as sent is the app's own text.
2. Only new messages change, and only their tool results (OpenAI ``"tool"`` messages,
   Anthropic ``tool_result`` blocks). The model's own messages (assistant text and tool
   calls), user and system messages are never rewritten.
3. Same result. A new tool result whose text equals, after stripping surrounding whitespace,
   an earlier tool result that stands verbatim in the messages being sent is replaced by a
   pointer naming the earlier call by its tool's name and arguments as that call states them
   (``[Same result as search({"query": "..."}) above.]``), where that saves at
   least ``min_tokens_saved``. Long arguments are cut short, ``search({"query": "Who
   founded…)`` (:func:`.pointers.short_name`): a verbatim prefix that no other signature of a
   call before the pointer starts with, used where it saves at least :data:`_NAME_SAVING`
   tokens over the whole arguments.
4. Same document. Inside a new multi-document tool result (:mod:`.documents`: the library's
   own ``[Doc 1]`` blocks, a JSON list of objects with a text field, ``<document>`` tags, or
   ``[1]``/``1.`` blocks), a document whose text stands verbatim in an earlier tool result of
   the messages being sent is replaced, in place, by a pointer naming that earlier call and the
   document's label in its result (``[Same as document [Doc 2] of
   search(...) above.]``; a JSON document's ``"id": "d7"`` shown as ``id "d7"``), or
   the whole earlier result when the document is all of it.
   Only where the label is written in the earlier result and names one document, and the
   replacement saves at least ``min_tokens_saved``; every other byte of the result stays as it
   is.
4a. Same lines. In a new result none of whose documents was replaced, and that is no JSON
   array or object, a run of whole lines standing verbatim in one earlier tool result of the
   messages being sent (a file read again after an edit, a plain retriever's passages read
   before) is replaced, in place, by a pointer naming that call and the run's first and last
   lines by their verbatim starts (``[Same 46 lines as in the result of
   read_file(...) above, from the line starting "import os" to the line starting "    return
   x".]``, then the run's line ending; :mod:`.repeated_lines`), where that saves at least
   ``min_tokens_saved``, the pointer's own tokens counted. Its placement counts as a document
   of the result (numbered after the documents found in it; reason ``"same lines"``).
5. Unsure means kept. A pointer is made only when the earlier call it names reads one way: if
   another earlier call the name stands for (the same name and arguments, or for a short name
   arguments starting with its prefix) returned something else, the result or document is
   kept in full. "Earlier" is an earlier position of the same request (an
   earlier message, or an earlier block of the same Anthropic message).
6. Sure hints. Every pointer is checked on the final messages before they are returned
   (:func:`.pointers.check_pointer`): the text it stands for is verbatim in the earlier result
   it names, in the same request, and the named call is there (for a run of lines: its quotes
   and count find exactly the replaced lines there, :func:`.repeated_lines.check_run`). A new
   pointer that fails is undone (the original text restored); a replayed one that fails is a
   divergence at its message, which is then planned anew from the app's original. The check
   reads the messages being returned, never memory.
7. Nothing is lost. The plan has a placement for every tool result and every detected document
   (:class:`.message_plan.ResultPlacement`): kept (and why), or replaced by a pointer to which
   earlier message, block and document, with the exact text replaced, the pointer's offset in
   the sent text and the tokens saved.
8. Deterministic, bounded, proportional. The same messages and the same memory give the same
   plan; memory is an LRU of ``max_conversations`` conversations of at most ``max_messages``
   messages each, ``max_chars`` characters of messages together; one call reads each message
   a bounded number of times (looking up earlier copies by exact text).

The input list and its dicts are never changed; the returned messages are new dicts. One lock
makes a planner safe to share between threads; calls are synchronous.
"""

from __future__ import annotations

import json
import threading
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from contextpilot_integrations.core.blocks import ApproxTokenCounter, TokenCounter
from contextpilot_integrations.core.messages.documents import (
    Document,
    DocumentLayout,
    DocumentRef,
    document_ref,
    find_documents,
    span_text,
)
from contextpilot_integrations.core.messages.message_history import (
    LATER,
    Later,
    MessageHistory,
    Proof,
    RecordedDocuments,
    SentMessage,
    fingerprint,
    is_plain,
    mentions,
    prove,
    sent_record,
)
from contextpilot_integrations.core.messages.message_plan import MessagePlan, ResultPlacement
from contextpilot_integrations.core.messages.message_shapes import (
    Api,
    check_api,
    check_message_list,
    copy_message,
    validate_message,
    validate_system,
    with_result_text,
)
from contextpilot_integrations.core.messages.pointers import (
    POINTER_MARK,
    RequestView,
    check_pointer,
    document_pointer,
    holds,
    named_signatures,
    names_one_result,
    result_pointer,
    short_name,
)
from contextpilot_integrations.core.messages.repeated_lines import (
    SAME_LINES,
    LineIndex,
    check_run_placement,
    run_pointer,
)
from contextpilot_integrations.core.request import Scope

__all__ = ["MessagePlanner"]

_MAX_CANDIDATES = 8
"""Earlier copies of one text tried as a pointer's target (bounds the work per result)."""
_NAME_SAVING = 4
"""Least tokens a short name (:func:`.pointers.short_name`) must save over the whole arguments
to be used: a cut that saves less reads worse for next to nothing."""


_FoundDocuments = tuple[str, tuple[Document, ...]]
"""A tool result's text and the documents found in it."""
_Indexed = Document | DocumentRef | None
"""Where a text stands in a result: as one of its documents, or (``None``) as all of it."""


@dataclass(frozen=True, slots=True)
class _Placed:
    """What placing one call's new tool results gave: their placements in order, the view of
    the final messages (every new pointer checked on it), and per result index the documents
    found in the text it was indexed with."""

    placements: list[ResultPlacement]
    view: RequestView
    documents: dict[int, _FoundDocuments]


@dataclass(frozen=True, slots=True)
class _Edit:
    """A document span of a result to replace by ``pointer`` (already encoded for its layout);
    ``placement`` is complete but for its offset."""

    start: int
    end: int
    layout: DocumentLayout | None  # None: a run of whole lines (.repeated_lines)
    pointer: str
    placement: ResultPlacement


class MessagePlanner:
    """Plans the messages of agent conversations (see the module docstring for the rules).

    Args:
        token_counter: counts the tokens a pointer saves; default
            :class:`~contextpilot_integrations.core.blocks.ApproxTokenCounter`.
        min_tokens_saved: least tokens a pointer must save to be made (``int >= 0``).
        max_conversations: most conversations remembered (``int >= 1``).
        max_messages: most messages remembered per conversation (``int >= 1``).
        max_chars: most characters of sent messages remembered, all conversations together
            (``int >= 1``; least recently used conversations dropped first).

    Raises:
        ValueError: a bound that is not an int of the allowed range, or a counter without a
            ``count`` method.
    """

    def __init__(
        self,
        token_counter: TokenCounter | None = None,
        min_tokens_saved: int = 16,
        max_conversations: int = 10_000,
        max_messages: int = 4_096,
        max_chars: int = 256 * 1024 * 1024,
    ) -> None:
        if token_counter is not None and not callable(getattr(token_counter, "count", None)):
            raise ValueError(
                f"token_counter must have a count(text) -> int method, got {token_counter!r:.80}"
            )
        if (
            isinstance(min_tokens_saved, bool)
            or not isinstance(min_tokens_saved, int)
            or min_tokens_saved < 0
        ):
            raise ValueError(f"min_tokens_saved must be an int >= 0, got {min_tokens_saved!r}")
        self.token_counter: TokenCounter = token_counter or ApproxTokenCounter()
        self.min_tokens_saved = min_tokens_saved
        self._history = MessageHistory(max_conversations, max_messages, max_chars)
        self._lock = threading.Lock()

    def plan(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        scope: Scope | None = None,
        api: Api = "openai",
        system: Any = None,
    ) -> MessagePlan:
        """The messages to send for ``messages`` of the conversation ``scope``.

        Args:
            messages: the conversation's messages as the app has them, or as they were sent
                (then perhaps trimmed or edited), shape ``api``.
            scope: the conversation (``scope.conversation_id``) and tenant; ``None`` or no
                conversation id: nothing is remembered or replayed.
            api: ``"openai"`` or ``"anthropic"``.
            system: Anthropic's system prompt (a str or a list of text blocks); returned as is.

        Raises:
            ValueError: a bad shape (the message names the field path and the value; a cycle
                or nesting deeper than :data:`.message_shapes.MAX_DEPTH` included), an unknown
                ``api``, or a ``scope`` that is not a Scope.
        """
        shape = check_api(api)
        check_message_list(messages)
        key = scope.conversation if isinstance(scope, Scope) else None
        with self._lock:
            held = self._history.records(key)
        # A message that is, node for node, one the conversation's memory holds (as sent, or
        # as the app gave it) has that record's fingerprint and a shape validated before
        # (message_history, prove); the others are validated here.
        proofs: list[Proof | None] = []
        for i, message in enumerate(messages):
            proof = prove(message, held[i], shape) if i < len(held) else None
            if proof is None:
                validate_message(i, message, shape)
            proofs.append(proof)
        validate_system(system, shape)
        if scope is not None and not isinstance(scope, Scope):
            raise ValueError(f"scope must be a Scope or None, got {type(scope).__name__}")
        given = _Given(messages, proofs)
        with self._lock:
            replay = self._history.replay(key, len(messages), given.matches)
            n, diverged_at = len(replay.sent), replay.diverged_at
            while True:
                out: list[dict[str, Any]] = [copy_message(r.sent) for r in replay.sent[:n]]
                fingerprints: list[bytes | None | Later] = [None] * n  # of the new ones only
                as_given: list[bytes | None] = [None] * len(messages)
                aliases = self._history.has_aliases(key)
                for i in range(n, len(messages)):
                    original = None
                    if aliases and given.may_be_sent(i):
                        original = self._history.restore(key, given.fingerprint(i))
                    if original is None:
                        out.append(copy_message(messages[i]))
                        fingerprints.append(given.for_record(i))
                    else:  # the app gave back what was sent: plan its original anew
                        out.append(original)
                        fingerprints.append(fingerprint(original))
                        as_given[i] = given.fingerprint(i)
                before_placing = list(out)
                placed = self._place(out, shape, n, replay.sent[:n])
                broken = _first_broken(placed.view, replay.sent[:n])
                if broken is None:
                    break
                n = diverged_at = broken  # a divergence: that message and the rest are new
            records = list(replay.sent[:n])
            records.extend(
                self._new_records(
                    given, before_placing, out, fingerprints, as_given, placed, n, shape
                )
            )
            self._history.record(key, records)
        placements = [p for r in replay.sent[:n] for p in r.placements]
        placements.extend(placed.placements)
        return MessagePlan(
            messages=out,
            system=copy_message(system),
            api=shape,
            replayed=n,
            diverged_at=diverged_at,
            placements=tuple(placements),
            tokens_removed=sum(p.tokens_saved for p in placements),
        )

    def forget(self, scope: Scope) -> bool:
        """Drop the memory of ``scope``'s conversation; False when none was held."""
        key = scope.conversation if isinstance(scope, Scope) else None
        if key is None:
            return False
        with self._lock:
            return self._history.forget(key)

    @property
    def conversations(self) -> int:
        """How many conversations are remembered."""
        with self._lock:
            return len(self._history)

    def _new_records(
        self,
        given: _Given,
        before_placing: list[dict[str, Any]],
        out: list[dict[str, Any]],
        fingerprints: list[bytes | None | Later],
        as_given: list[bytes | None],
        placed: _Placed,
        n: int,
        api: Api,
    ) -> list[SentMessage]:
        """The records of the messages ``n`` on, as sent in ``out``: their placements, the
        documents found in their results' final texts, and the app's message (``before_placing``,
        a copy) when it is a plain tree that later calls may recognise (a restored original
        is not: its fingerprint is not the app's)."""
        by_message: dict[int, list[ResultPlacement]] = {}
        for placement in placed.placements:
            by_message.setdefault(placement.message, []).append(placement)
        found: dict[int, list[RecordedDocuments | None]] = {}
        for k, result in enumerate(placed.view.results):
            if result.message >= n:
                entry = placed.documents.get(k)
                recorded: RecordedDocuments | None = None
                if entry is not None and entry[0] == result.text:  # else: a text not sent
                    refs = tuple(document_ref(d) for d in entry[1] if d.label is not None)
                    recorded = (entry[0], refs)
                found.setdefault(result.message, []).append(recorded)
        records = []
        for i in range(n, len(out)):
            plain_given = None
            if as_given[i] is None and given.plain[i]:
                plain_given = before_placing[i]
            records.append(
                sent_record(
                    fingerprints[i],
                    out[i],
                    tuple(by_message.get(i, ())),
                    as_given[i],
                    documents=tuple(found.get(i, ())),
                    plain_given=plain_given,
                    api=api,
                )
            )
        return records

    # ------------------------------------------------------------------ one call
    def _place(
        self, out: list[dict[str, Any]], api: Api, n: int, replayed: Sequence[SentMessage]
    ) -> _Placed:
        """Rewrite the new tool results of ``out`` (messages ``n`` on) in place; ``replayed``:
        the records of messages ``0..n-1`` (their results' documents are read from there)."""
        view = RequestView(out, api)
        texts: list[str | None] = [r.text for r in view.results]
        given = list(texts)
        whole: dict[str, list[int]] = {}  # stripped text -> results holding it whole
        # hash of a text -> where texts of that hash stand, in order (the text itself is read
        # back when a lookup needs it: _candidates)
        documents: dict[int, list[tuple[int, _Indexed]]] = {}
        by_signature: dict[str, list[int]] = {}  # call signature -> results of such calls
        slots: dict[int, list[ResultPlacement]] = {}
        edits: dict[int, list[_Edit]] = {}
        found: dict[int, _FoundDocuments] = {}  # result -> documents of the text indexed
        lines = LineIndex()  # the texts of the results so far, by signature, for runs
        line_sources: list[int] = []  # per text of `lines`, its result
        before = _Signatures(view)
        message, ordinal = -1, 0  # the result's message, and its place among that one's results
        for k, result in enumerate(view.results):
            ordinal = ordinal + 1 if result.message == message else 0
            message = result.message
            replaced_whole = False
            if result.message >= n:
                before.up_to(result.position)
                placement, edited, in_given = self._place_result(
                    k, view, texts, whole, documents, by_signature, before.sorted
                )
                if in_given is not None:
                    found[k] = in_given
                slots[k] = [placement]
                if placement.status == "pointer":
                    replaced_whole = True
                    pointer = placement.pointer
                    assert pointer is not None  # a pointer placement has its text
                    texts[k] = pointer
                    # not indexed now; read (a short text) for the record, as replays index it
                    found[k] = (pointer, find_documents(pointer))
                else:
                    # a text found to hold JSON documents is a JSON array or object, which
                    # _place_runs leaves alone: not parsed again to learn that
                    if not any(e.pointer for e in edited) and not _json_found(in_given):
                        edited = edited + self._place_runs(
                            k, view, texts[k], lines, line_sources, before.sorted, len(edited)
                        )
                    if edited:
                        edits[k] = edited
                        texts[k] = self._render(k, given, edits, slots)
                if texts[k] != given[k]:
                    out[result.message] = with_result_text(
                        out[result.message], result, texts[k] or ""
                    )
            signature = view.signature(k)
            if signature is None:
                continue
            by_signature.setdefault(signature, []).append(k)
            text = texts[k]
            if text:  # a whole-result pointer too: another reading of its call, or the same
                lines.add(signature, text)
                line_sources.append(k)
            if text is None or replaced_whole or not text.strip():
                continue
            stripped = text.strip()
            whole.setdefault(stripped, []).append(k)
            documents.setdefault(hash(stripped), []).append((k, None))
            if result.message < n:
                refs = _recorded(replayed[result.message], ordinal, text)
                if refs is not None:
                    for ref in refs:
                        documents.setdefault(ref.key_hash, []).append((k, ref))
                    continue
            entry = found.get(k)
            if entry is not None and entry[0] != text:
                entry = None  # found in the given text; this one has pointers in it
            if entry is None:
                entry = found[k] = (text, find_documents(text))
            for document in entry[1]:
                if document.label is not None:
                    documents.setdefault(hash(document.key), []).append((k, document))
        final = self._verify(out, api, view, given, texts, slots, edits)
        return _Placed([p for k in sorted(slots) for p in slots[k]], final, found)

    def _place_result(
        self,
        k: int,
        view: RequestView,
        texts: list[str | None],
        whole: dict[str, list[int]],
        documents: dict[int, list[tuple[int, _Indexed]]],
        by_signature: dict[str, list[int]],
        before: list[str],
    ) -> tuple[ResultPlacement, list[_Edit], _FoundDocuments | None]:
        """The whole-result placement of new result ``k`` and, when it is kept, the edits of
        its documents (their placements included) and the documents found in its text
        (``None``: not read); ``before``: the signatures of the calls standing before result
        ``k`` (sorted, distinct)."""
        result = view.results[k]
        text = texts[k]
        base = ResultPlacement(
            message=result.message,
            block=result.block,
            call_id=result.call_id,
            document=None,
            label=None,
            status="kept",
            replayed=False,
            reason="not plain text",
        )
        if text is None:
            return base, [], None
        reason = "no earlier copy"
        count = self.token_counter.count
        for t in whole.get(text.strip(), ())[:_MAX_CANDIDATES]:
            signature = view.signature(t)
            target = texts[t]
            assert signature is not None and target is not None  # only such results are indexed
            call = self._name(signature, before, result_pointer)
            if not names_one_result(call, target, _others(call, before, by_signature, t, texts)):
                reason = "ambiguous call"
                continue
            pointer = result_pointer(call)
            saved = count(text) - count(pointer)
            if saved < self.min_tokens_saved:
                reason = "saves too little"
                continue
            target_result = view.results[t]
            pointed = ResultPlacement(
                result.message,
                result.block,
                result.call_id,
                None,
                None,
                "pointer",
                False,
                "same result",
                target_message=target_result.message,
                target_block=target_result.block,
                target_call=call,
                original=text,
                pointer=pointer,
                offset=0,
                tokens_saved=saved,
            )
            return pointed, [], None
        in_text = find_documents(text)
        found = [
            self._place_document(base, document, text, view, texts, documents, by_signature, before)
            for document in in_text
        ]
        kept = ResultPlacement(
            result.message, result.block, result.call_id, None, None, "kept", False, reason
        )
        return kept, found, (text, in_text)

    def _place_document(
        self,
        base: ResultPlacement,
        document: Document,
        text: str,
        view: RequestView,
        texts: list[str | None],
        documents: dict[int, list[tuple[int, _Indexed]]],
        by_signature: dict[str, list[int]],
        before: list[str],
    ) -> _Edit:
        """The edit for one document of a new result (``pointer`` empty: kept); ``before`` as
        for :meth:`_place_result`."""
        reason = "no earlier copy"
        original = text[document.start : document.end]
        count = self.token_counter.count
        for t, earlier in _candidates(documents, document.key, texts):
            signature = view.signature(t)
            target = texts[t]
            assert signature is not None and target is not None  # only such results are indexed
            if not holds(target, original):
                reason = "not verbatim"
                continue
            label = None if earlier is None else earlier.label

            def pointer_for(name: str, label: str | None = label) -> str:
                return span_text(document.layout, document_pointer(name, label))

            call = self._name(signature, before, pointer_for)
            if not names_one_result(call, target, _others(call, before, by_signature, t, texts)):
                reason = "ambiguous call"
                continue
            pointer = pointer_for(call)
            saved = count(original) - count(pointer)
            if saved < self.min_tokens_saved:
                reason = "saves too little"
                continue
            target_result = view.results[t]
            placement = ResultPlacement(
                base.message,
                base.block,
                base.call_id,
                document.index,
                document.label,
                "pointer",
                False,
                "same document",
                target_message=target_result.message,
                target_block=target_result.block,
                target_document=None if earlier is None else earlier.index,
                target_label=label,
                target_call=call,
                original=original,
                pointer=pointer,
                tokens_saved=saved,
            )
            return _Edit(document.start, document.end, document.layout, pointer, placement)
        kept = ResultPlacement(
            base.message,
            base.block,
            base.call_id,
            document.index,
            document.label,
            "kept",
            False,
            reason,
        )
        return _Edit(document.start, document.end, document.layout, "", kept)

    def _place_runs(
        self,
        k: int,
        view: RequestView,
        text: str | None,
        lines: LineIndex,
        line_sources: list[int],
        before: list[str],
        first: int,
    ) -> list[_Edit]:
        """The run-of-lines edits of new result ``k`` of text ``text`` (:mod:`.repeated_lines`),
        pointing into the results standing before it (``lines`` holds their texts by their
        calls' signatures, ``line_sources`` which result each is), each placement numbered
        from ``first`` on, after the result's documents; none for a JSON text (a pointer
        between its lines would leave it no JSON)."""
        if text is None or _is_json(text):
            return []
        names: dict[str, str] = {}

        def name(signature: str) -> str:
            names[signature] = self._name(signature, before, _run_probe)
            return names[signature]

        result = view.results[k]
        edits = []
        runs = lines.find(text, self.token_counter.count, self.min_tokens_saved, name)
        for r, run in enumerate(runs):
            t = line_sources[run.source]
            target_result = view.results[t]
            signature = view.signature(t)
            assert signature is not None  # only answered results are in `lines`
            placement = ResultPlacement(
                result.message,
                result.block,
                result.call_id,
                first + r,
                None,
                "pointer",
                False,
                SAME_LINES,
                target_message=target_result.message,
                target_block=target_result.block,
                target_call=names[signature],
                original=text[run.start : run.end],
                pointer=run.pointer,
                tokens_saved=run.tokens_saved,
            )
            edits.append(_Edit(run.start, run.end, None, run.pointer, placement))
        return edits

    def _name(self, signature: str, before: list[str], pointer: Callable[[str], str]) -> str:
        """How a pointer made by ``pointer`` (a name -> the pointer's text) names a call of
        ``signature``: cut short (:func:`.pointers.short_name`, unique among ``before``) where
        that saves at least :data:`_NAME_SAVING` tokens, else whole."""
        short = short_name(signature, before)
        if short is None:
            return signature
        count = self.token_counter.count
        if count(pointer(short)) + _NAME_SAVING > count(pointer(signature)):
            return signature
        return short

    @staticmethod
    def _render(
        k: int,
        given: list[str | None],
        edits: dict[int, list[_Edit]],
        slots: dict[int, list[ResultPlacement]],
    ) -> str:
        """Result ``k``'s given text with its document pointers in place; sets the placements
        (whole result first, then each document with its pointer's offset) in ``slots[k]``."""
        text = given[k]
        assert text is not None  # only plain-text results have documents
        parts: list[str] = []
        placed = [slots[k][0]]
        position = 0  # in the given text
        length = 0  # of the sent text so far
        for edit in edits[k]:
            if not edit.pointer:
                placed.append(edit.placement)
                continue
            parts.append(text[position : edit.start])
            length += edit.start - position
            placed.append(_at_offset(edit.placement, length))
            parts.append(edit.pointer)
            length += len(edit.pointer)
            position = edit.end
        parts.append(text[position:])
        rendered = "".join(parts)
        if any(e.layout == "json" and e.pointer for e in edits[k]):
            try:
                json.loads(rendered)
            except ValueError:
                slots[k] = [slots[k][0]] + [_unverified(e.placement) for e in edits[k]]
                return text
        slots[k] = placed
        return rendered

    def _verify(
        self,
        out: list[dict[str, Any]],
        api: Api,
        view: RequestView,
        given: list[str | None],
        texts: list[str | None],
        slots: dict[int, list[ResultPlacement]],
        edits: dict[int, list[_Edit]],
    ) -> RequestView:
        """Check every new pointer on ``out`` and undo those that fail, until all hold
        (undoing only restores given text, so this ends after at most one round per
        pointer); the view of ``out`` as it then is."""
        final = view
        while True:
            final = RequestView(out, api, final)  # reads only the messages rewritten since
            failed: set[tuple[int, int | None]] = set()  # (result, document)
            for k, placed in slots.items():
                for placement in placed:
                    if placement.status == "pointer" and not _pointer_holds(final, placement):
                        failed.add((k, placement.document))
            if not failed:
                return final
            for k, document in sorted(failed, key=lambda f: (f[0], -1 if f[1] is None else f[1])):
                result = view.results[k]
                if document is None:
                    slots[k] = [_unverified(slots[k][0])]
                    texts[k] = given[k]
                else:
                    edits[k] = [
                        replace(e, pointer="", placement=_unverified(e.placement))
                        if e.placement.document == document
                        else e
                        for e in edits[k]
                    ]
                    texts[k] = self._render(k, given, edits, slots)
                out[result.message] = with_result_text(out[result.message], result, texts[k] or "")


def _run_probe(name: str) -> str:
    """A run pointer naming ``name``, to weigh a short name against the whole one
    (:meth:`MessagePlanner._name`): the quotes and count cost the same either way."""
    return run_pointer(2, name, "", "", "\n")


def _is_json(text: str) -> bool:
    """Whether ``text`` is a JSON array or object (surrounding whitespace aside)."""
    stripped = text.strip()
    if stripped[:1] not in ("[", "{"):
        return False
    try:
        json.loads(stripped)
    except ValueError:
        return False
    return True


def _json_found(found: _FoundDocuments | None) -> bool:
    """Whether the documents found in a text were JSON ones: the text then parsed as a JSON
    array or object (:func:`.documents.find_documents`), so :func:`_is_json` holds for it."""
    return found is not None and any(d.layout == "json" for d in found[1])


def _first_broken(view: RequestView, replayed: Sequence[SentMessage]) -> int | None:
    """The first replayed message one of whose pointers fails the check on ``view`` (of the
    messages to send, as they are); ``None`` when all hold."""
    if not any(p.status == "pointer" for r in replayed for p in r.placements):
        return None
    for i, record in enumerate(replayed):
        for placement in record.placements:
            if placement.status == "pointer" and not _pointer_holds(view, placement):
                return i
    return None


def _others(
    call: str,
    before: list[str],
    by_signature: dict[str, list[int]],
    target: int,
    texts: list[str | None],
) -> list[str | None]:
    """The texts of the results so far, other than ``target``, answering calls whose signature
    the name ``call`` stands for (their signatures are among ``before``)."""
    return [
        texts[u]
        for s in named_signatures(call, before)
        for u in by_signature.get(s, ())
        if u != target
    ]


class _Given:
    """The fingerprints of one call's messages, each computed only when something asks for
    it: a proven message's is its record's (:class:`.message_history.Proof`); a plain
    message's (:func:`.message_history.is_plain`) is left :data:`.message_history.LATER` for
    the record made of it to compute if ever needed; any other message's is computed here.

    Attributes:
        plain: per message, whether it is a plain tree (a proven one is).
    """

    __slots__ = ("_entries", "_messages", "plain")

    def __init__(self, messages: Sequence[dict[str, Any]], proofs: list[Proof | None]) -> None:
        self._messages = messages
        self._entries: list[Proof | bytes | None | Later] = []
        self.plain: list[bool] = []
        for message, proof in zip(messages, proofs):
            plain = proof is not None or is_plain(message)
            self.plain.append(plain)
            if proof is not None:
                self._entries.append(proof)
            else:
                self._entries.append(LATER if plain else fingerprint(message))

    def fingerprint(self, i: int) -> bytes | None:
        """Message ``i``'s fingerprint (computed now if it was not)."""
        entry = self._entries[i]
        if isinstance(entry, Proof):
            entry = entry.fingerprint()
        elif isinstance(entry, Later):
            entry = fingerprint(self._messages[i])
        self._entries[i] = entry
        return entry

    def matches(self, i: int, record: SentMessage) -> bool:
        """Whether message ``i`` stands for ``record`` (its fingerprint is one of the record's:
        :meth:`.message_history.SentMessage.answers`)."""
        entry = self._entries[i]
        if isinstance(entry, Proof) and entry.record is record:
            return True
        return record.answers(self.fingerprint(i))

    def for_record(self, i: int) -> bytes | None | Later:
        """Message ``i``'s fingerprint for the record made of it: :data:`LATER` while not
        computed (a plain message)."""
        entry = self._entries[i]
        return entry if isinstance(entry, Later) else self.fingerprint(i)

    def may_be_sent(self, i: int) -> bool:
        """Whether message ``i`` may be one the conversation was sent with pointers: every
        pointer starts with :data:`.pointers.POINTER_MARK`, so a plain message with no key or
        str holding it has a canonical JSON (so a fingerprint) no such message has."""
        return not isinstance(self._entries[i], Later) or mentions(self._messages[i], POINTER_MARK)


class _Signatures:
    """The signatures of a request's tool calls standing before a position, sorted and distinct,
    gathered as the position moves on (each call read once)."""

    __slots__ = ("_calls", "_next", "sorted")

    def __init__(self, view: RequestView) -> None:
        self._calls = view.tool_calls
        self._next = 0
        self.sorted: list[str] = []

    def up_to(self, position: tuple[int, int]) -> None:
        """Take in the calls standing before ``position`` (``(message, block or -1)``)."""
        while self._next < len(self._calls):
            call = self._calls[self._next]
            if (call.message, call.slot) >= position:
                return
            at = bisect_left(self.sorted, call.signature)
            if at == len(self.sorted) or self.sorted[at] != call.signature:
                self.sorted.insert(at, call.signature)
            self._next += 1


def _recorded(record: SentMessage, ordinal: int, text: str) -> tuple[DocumentRef, ...] | None:
    """The labelled documents ``record`` keeps for its tool result number ``ordinal`` (in
    order of position), when they were found in ``text``; ``None`` when it keeps none for that
    text."""
    if ordinal >= len(record.documents):
        return None
    entry = record.documents[ordinal]
    if entry is None or entry[0] != text:
        return None
    return entry[1]


def _candidates(
    documents: dict[int, list[tuple[int, _Indexed]]], key: str, texts: list[str | None]
) -> list[tuple[int, _Indexed]]:
    """The first :data:`_MAX_CANDIDATES` places, in order, where the text ``key`` stands (whole
    result stripped, or a document's key); the entries of ``key``'s hash are read back and
    compared, so another text of that hash is no candidate."""
    found: list[tuple[int, _Indexed]] = []
    for t, where in documents.get(hash(key), ()):
        text = texts[t]
        assert text is not None  # only plain-text results are indexed
        if where is None:
            same = text.strip() == key
        elif isinstance(where, DocumentRef):
            same = where.key_in(text) == key
        else:
            same = where.key == key
        if same:
            found.append((t, where))
            if len(found) == _MAX_CANDIDATES:
                break
    return found


def _at_offset(p: ResultPlacement, offset: int) -> ResultPlacement:
    """``p`` with its pointer at ``offset`` (``dataclasses.replace(p, offset=offset)``)."""
    return ResultPlacement(
        p.message,
        p.block,
        p.call_id,
        p.document,
        p.label,
        p.status,
        p.replayed,
        p.reason,
        p.target_message,
        p.target_block,
        p.target_document,
        p.target_label,
        p.target_call,
        p.original,
        p.pointer,
        offset,
        p.tokens_saved,
    )


def _unverified(placement: ResultPlacement) -> ResultPlacement:
    """``placement`` undone: kept, because its pointer failed the check."""
    return ResultPlacement(
        placement.message,
        placement.block,
        placement.call_id,
        placement.document,
        placement.label,
        "kept",
        placement.replayed,
        "not verified",
    )


def _pointer_holds(view: RequestView, placement: ResultPlacement) -> bool:
    """Whether the pointer ``placement`` holds on the messages of ``view``, by its kind's check."""
    if placement.reason == SAME_LINES:
        return check_run_placement(view, placement)
    return check_pointer(view, placement)
