"""Stretches of whole lines of a new tool result that an earlier tool result already holds.

A file read again after a one-line edit, or a plain retriever tool's passages (texts joined by
blank lines, no labels) that an earlier search returned, repeat long stretches of an earlier
result without any label a document pointer could name. Such a stretch, a *run* of
consecutive whole lines (a line ends after ``"\\n"``; bytes kept exactly, ``"\\r\\n"``
included), is replaced in place by a pointer naming the earlier call and the stretch's first
and last lines by how they start::

    [Same 46 lines as in the result of the earlier call read_file({"path": "a.py"}) above,
    from the line starting "import os" to the line starting "    return x".]

(one line in the result), followed by the line ending the run's last line had, so the lines
around it stay lines. The pointer starts with :data:`.pointers.POINTER_MARK` like every other.

How the model (and :func:`check_run`) finds the stretch in the named call's result: the first
line is the first line of that result starting with the first quote, the last line the first
line at or after it starting with the second quote, and the stretch is the stated number of
lines. A quote is a line's verbatim start, without its line ending, cut short with
:data:`.pointers.ELLIPSIS` where the line goes on; it keeps at least :data:`MIN_QUOTE`
characters (or the whole line) and is lengthened along :data:`_QUOTE_LENGTHS` until it
identifies its line so. A run whose lines cannot be quoted so (a first line that stands earlier
in the result too, a last line repeated inside the run) is trimmed by a few lines at that end,
or refused.

Finding (:func:`find_runs`; :meth:`LineIndex.find` on an index one planning call keeps, so
each earlier result is split and indexed once however many new results follow) is greedy from
the first line on: at each line the longest run starting there, in one earlier result, from
one of the first :data:`MAX_POSITIONS` places (over all the earlier results, in order) holding
that line; kept only when the pointer saves at least ``min_tokens_saved`` tokens (the
pointer's own tokens counted), the rule of the other pointers.

Work bound: per line of the new text at most :data:`MAX_POSITIONS` candidate places, each
extended line by line; after a run, kept or refused, the search goes on after it, so the
extensions cost ``O(MAX_POSITIONS * lines)`` line comparisons in all, whatever the text (a
result of many identical lines included). Add building the line index of the earlier results
(one pass), at most ``MIN_QUOTE + len(_QUOTE_LENGTHS)`` prefix indexes per earlier result (one
pass each, built when first needed) and, per run, at most ``(_TRIM + 1) ** 2`` quote lookups.

docs/DESIGN.md, "Sure hints": a pointer is checked on the request that carries it
(:func:`check_run`; on a request's messages, :func:`check_run_placement`): the call it names
has results in the request before it, and in each of them that is not itself a whole-result
pointer to that call, the quotes and the count find exactly the text the pointer replaced. The
finder makes only pointers that pass that check.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from contextpilot_integrations.core.messages.message_plan import ResultPlacement
from contextpilot_integrations.core.messages.pointers import (
    ELLIPSIS,
    RequestView,
    named_by,
    pointer_results,
    result_pointer,
)

__all__ = [
    "MAX_POSITIONS",
    "MIN_LINES",
    "MIN_QUOTE",
    "EarlierResult",
    "LineIndex",
    "LineRun",
    "SAME_LINES",
    "RunPointer",
    "check_run",
    "check_run_placement",
    "find_runs",
    "parse_run_pointer",
    "replace_runs",
    "run_pointer",
    "split_lines",
]

MAX_POSITIONS = 64
"""Most places of one line's text, over all earlier results, a run may start from (the first
ones, in order): what bounds the search on a result of many identical lines."""
MIN_LINES = 2
"""Fewest lines a run has: a single repeated line is left to the whole-result and document
pointers."""
MIN_QUOTE = 24
"""Least characters a quote keeps of a line longer than that: enough for the model to find
the line by eye."""
SAME_LINES = "same lines"
"""The ``reason`` of a run pointer's placement (:class:`.message_plan.ResultPlacement`)."""
_QUOTE_LENGTHS = (MIN_QUOTE, 32, 48, 64, 96, 128, 192, 256)
"""The prefix lengths a quote is tried at, shortest first; past the last, the whole line."""
_TRIM = 8
"""Most lines a run is trimmed by at each end to find lines its quotes identify."""

_RUN = "[Same {lines} lines as in the result of the earlier call {call} above, from the line "
_QUOTES = 'starting "{first}" to the line starting "{last}".]'
_PARSE = re.compile(
    r"\[Same (?P<lines>[1-9][0-9]*) lines as in the result of the earlier call (?P<call>.+?)"
    r' above, from the line starting "(?P<first>[^\n]*?)" to the line starting'
    r' "(?P<last>[^\n]*?)"\.\]'
)
"""A run pointer, each part read up to the first place the template's next words stand (as a
reader scanning the text from the left reads it); no part spans a line break."""


class EarlierResult(NamedTuple):
    """An earlier tool result a run may point into: the name a pointer gives its call
    (``name(arguments)``, perhaps cut short: :func:`.pointers.short_name`) and its text."""

    call: str
    text: str


class RunPointer(NamedTuple):
    """What a run pointer states: the line count, the call's name, the two quotes as written
    (an ellipsis included) and the line ending after the pointer (``""``, ``"\\n"`` or
    ``"\\r\\n"``)."""

    lines: int
    call: str
    first: str
    last: str
    ending: str


@dataclass(frozen=True, slots=True)
class LineRun:
    """One run of a new result's lines found verbatim in an earlier result.

    Attributes:
        start, end: the run's span in the new text (character offsets; whole lines).
        source: index of the earlier result (in the ``earlier`` given to :func:`find_runs`, or
            the number :meth:`LineIndex.add` gave it).
        source_start, source_end: the same text's span in that result.
        lines: how many lines the run has.
        pointer: the text replacing ``text[start:end]``, line ending included.
        tokens_saved: tokens of the run minus tokens of the pointer.
    """

    start: int
    end: int
    source: int
    source_start: int
    source_end: int
    lines: int
    pointer: str
    tokens_saved: int


def split_lines(text: str) -> list[str]:
    """``text``'s lines, each with its ``"\\n"`` (the last one without, when ``text`` does not
    end with one; none for an empty text): ``"".join(split_lines(t)) == t``. Only ``"\\n"``
    ends a line (unlike ``str.splitlines``)."""
    lines = text.split("\n")
    last = lines.pop()
    out = [line + "\n" for line in lines]
    if last:
        out.append(last)
    return out


def _bare(line: str) -> str:
    """A line without its ending (``"\\n"`` or ``"\\r\\n"``): what a quote is a prefix of."""
    if line.endswith("\n"):
        line = line[:-1]
        if line.endswith("\r"):
            line = line[:-1]
    return line


def _ending(line: str) -> str:
    return line[len(_bare(line)) :]


def run_pointer(lines: int, call: str, first: str, last: str, ending: str) -> str:
    """The pointer for a run of ``lines`` lines of ``call``'s result whose first and last
    lines start with the quotes ``first`` and ``last`` (as written), then ``ending``."""
    return _RUN.format(lines=lines, call=call) + _QUOTES.format(first=first, last=last) + ending


def parse_run_pointer(text: str) -> RunPointer | None:
    """What the run pointer ``text`` (the whole of it, its line ending included) states;
    ``None`` when ``text`` is no run pointer. The call is read up to the first ``" above, from
    the line starting "``, each quote up to the first ``"`` the template's next words follow;
    :func:`find_runs` makes only pointers that read back as made."""
    match = _PARSE.match(text)
    if match is None or text[match.end() :] not in ("", "\n", "\r\n"):
        return None
    return RunPointer(
        int(match.group("lines")),
        match.group("call"),
        match.group("first"),
        match.group("last"),
        text[match.end() :],
    )


def _prefix(quote: str) -> str:
    """The line start a quote stands for: without the ellipsis that marks a cut."""
    return quote[: -len(ELLIPSIS)] if quote.endswith(ELLIPSIS) else quote


def _line_starting(text: str, prefix: str, at: int) -> int | None:
    """Where the first line of ``text`` starting at or after offset ``at`` (a line start)
    whose text starts with ``prefix`` begins; ``None`` when none does. Searched with
    ``str.find``, each hit confirmed on the line without its ending."""
    pos = at
    while pos < len(text):
        if text.startswith(prefix, pos):
            newline = text.find("\n", pos)
            line = text[pos:] if newline < 0 else text[pos : newline + 1]
            if _bare(line).startswith(prefix):
                return pos
        hit = text.find("\n" + prefix, pos)
        if hit < 0:
            return None
        pos = hit + 1
    return None


def _resolve(text: str, pointer: RunPointer) -> str | None:
    """The stretch of ``text`` the pointer's quotes and count identify (see the module
    docstring); ``None`` when they identify none."""
    start = _line_starting(text, _prefix(pointer.first), 0)
    if start is None:
        return None
    end = _line_starting(text, _prefix(pointer.last), start)
    if end is None or text.count("\n", start, end) + 1 != pointer.lines:
        return None
    newline = text.find("\n", end)
    return text[start:] if newline < 0 else text[start : newline + 1]


def check_run(results: Mapping[str, Sequence[str | None]], pointer: str, original: str) -> bool:
    """Whether the run pointer ``pointer`` (line ending included) stands for ``original``.

    Args:
        results: per call signature, the texts of the results of the calls of that signature
            standing before the pointer in the request (``None``: a result without text).
        pointer: the pointer as it stands in the sent result.
        original: the text it replaced.

    True only when ``pointer`` parses, ends with ``original``'s line ending, names at least
    one signature of ``results`` (:func:`.pointers.named_by`), and in every result of those
    signatures (a whole-result pointer to the same call aside, which reads as that call) the
    quotes and the count identify exactly ``original``; a result without text fails.
    """
    stated = parse_run_pointer(pointer)
    if stated is None or not original or stated.ending != _ending(original):
        return False
    if len(split_lines(original)) != stated.lines:
        return False
    same = result_pointer(stated.call)
    read = 0
    for signature, texts in results.items():
        if not named_by(stated.call, signature):
            continue
        for text in texts:
            if text is None:
                return False
            if text == same:
                continue
            if _resolve(text, stated) != original:
                return False
            read += 1
    return read > 0


def check_run_placement(view: RequestView, placement: ResultPlacement) -> bool:
    """Whether the run pointer of ``placement`` holds on the messages ``view`` was made of.

    The pointer stands at ``placement.offset`` in its result, at the start of a line and, when
    it ends without a line ending, at the end of the text; the result it names
    (``target_message``, ``target_block``) stands before it and answers a call the name
    stands for; and :func:`check_run` holds on the results before the pointer answering calls
    the name stands for.
    """
    pointer, original, offset = placement.pointer, placement.original, placement.offset
    call = placement.target_call
    if pointer is None or original is None or offset is None or call is None:
        return False
    found = pointer_results(view, placement)
    if found is None:
        return False
    k_here, k_there = found
    text = view.results[k_here].text
    if text is None or not text.startswith(pointer, offset):
        return False
    if offset > 0 and text[offset - 1] != "\n":
        return False
    if not pointer.endswith("\n") and offset + len(pointer) != len(text):
        return False
    signature = view.signature(k_there)
    if signature is None or not named_by(call, signature):
        return False
    results: dict[str, list[str | None]] = {}
    for k in view.answering(call):
        named = view.signature(k)
        if k < k_here and named is not None:
            results.setdefault(named, []).append(view.results[k].text)
    return check_run(results, pointer, original)


class _Source:
    """One earlier result's lines, where each starts, and per prefix length (built when first
    needed) the lines starting with each prefix of that length."""

    __slots__ = ("_by_prefix", "key", "lines", "offsets", "text")

    def __init__(self, key: str, text: str) -> None:
        self.key = key
        self.text = text
        self.lines = split_lines(text)
        self.offsets = [0]
        for line in self.lines:
            self.offsets.append(self.offsets[-1] + len(line))
        self._by_prefix: dict[int, dict[str, list[int]]] = {}

    def starting(self, prefix: str) -> list[int]:
        """The lines (ascending) whose text starts with ``prefix``. Indexed by the prefix's
        length when shorter than :data:`MIN_QUOTE`, else by the longest length of
        :data:`_QUOTE_LENGTHS` it reaches and filtered, so at most ``MIN_QUOTE +
        len(_QUOTE_LENGTHS)`` indexes are ever built, each in one pass over the lines."""
        size = len(prefix)
        if size >= MIN_QUOTE:
            size = max(n for n in _QUOTE_LENGTHS if n <= size)
        index = self._by_prefix.get(size)
        if index is None:
            index = {}
            for i, line in enumerate(self.lines):
                bare = _bare(line)
                if len(bare) >= size:
                    index.setdefault(bare[:size], []).append(i)
            self._by_prefix[size] = index
        found = index.get(prefix[:size], [])
        if size == len(prefix):
            return found
        return [i for i in found if _bare(self.lines[i]).startswith(prefix)]

    def quote(self, line: int, after: int) -> str | None:
        """The shortest quote (of the lengths tried) of line ``line`` whose first matching
        line at or after line ``after`` is ``line``, read as :func:`check_run` reads it (an
        ending ellipsis marks a cut); ``None`` when none identifies it."""
        bare = _bare(self.lines[line])
        for length in _QUOTE_LENGTHS:
            if length >= len(bare):
                break
            quote = bare[:length] + ELLIPSIS
            if self._first(_prefix(quote), after) == line:
                return quote
        if self._first(_prefix(bare), after) == line:
            return bare
        return None

    def _first(self, prefix: str, after: int) -> int | None:
        found = self.starting(prefix)
        at = bisect_left(found, after)
        return found[at] if at < len(found) else None


class LineIndex:
    """The lines of earlier results, taken in one result at a time, to find runs of new
    results in (:meth:`find`); what one planning call keeps, so each result's lines are split
    and indexed once however many new results follow it.

    A result is added under a key (its call's signature, or the name a pointer gives its call)
    and read only when a :meth:`find` needs it.
    """

    __slots__ = ("_pending", "_places", "_sources")

    def __init__(self) -> None:
        self._pending: list[tuple[str, str]] = []
        self._sources: list[_Source] = []
        # line text -> (source, line): its first MAX_POSITIONS places, in order
        self._places: dict[str, list[tuple[int, int]]] = {}

    def __len__(self) -> int:
        return len(self._sources) + len(self._pending)

    def add(self, key: str, text: str) -> int:
        """Take in an earlier result ``text`` under ``key``; its source number (from 0, in
        order of adding: :attr:`LineRun.source`)."""
        self._pending.append((key, text))
        return len(self) - 1

    def _take_in(self) -> None:
        for key, text in self._pending:
            s = len(self._sources)
            source = _Source(key, text)
            self._sources.append(source)
            for i, line in enumerate(source.lines):
                found = self._places.setdefault(line, [])
                if len(found) < MAX_POSITIONS:
                    found.append((s, i))
        self._pending.clear()

    def find(
        self,
        text: str,
        count: Callable[[str], int],
        min_tokens_saved: int,
        name: Callable[[str], str] | None = None,
    ) -> list[LineRun]:
        """The runs of ``text`` to replace by pointers into the results added so far, in
        order, not overlapping.

        Args:
            text: the new result's text.
            count: the token counter (``text -> int``).
            min_tokens_saved: least tokens a pointer must save, its own tokens counted.
            name: the name a pointer gives the call of a key (called once per key);
                default: the key itself.

        A call whose results added read two ways (whole-result pointers to it aside) is
        pointed into by no run. Each run is maximal where it was found but for the lines
        trimmed to quote its ends, of at least :data:`MIN_LINES` lines, and its pointer passes
        :func:`check_run` against the results added under its key: the quotes are chosen on
        the same reading (the first matching lines) and the pointer reads back as made. See
        the module docstring for the bound on the work.
        """
        lines = split_lines(text)
        if len(lines) < MIN_LINES or not len(self):
            return []
        self._take_in()
        names: dict[str, str] = {}
        readings: dict[str, set[str]] = {}
        for source in self._sources:
            call = names.get(source.key)
            if call is None:
                call = names[source.key] = source.key if name is None else name(source.key)
            if source.text != result_pointer(call):
                readings.setdefault(source.key, set()).add(source.text)
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line))
        runs: list[LineRun] = []
        i = 0
        while i < len(lines):
            best: tuple[int, int, int] | None = None  # (length, source, line)
            for s, j in self._places.get(lines[i], ()):
                source_lines = self._sources[s].lines
                if len(readings.get(self._sources[s].key, ())) != 1:
                    continue  # "the earlier call" would name two readings
                length = 1
                while (
                    i + length < len(lines)
                    and j + length < len(source_lines)
                    and lines[i + length] == source_lines[j + length]
                ):
                    length += 1
                if best is None or length > best[0]:
                    best = (length, s, j)
            if best is None or best[0] < MIN_LINES:
                i += 1
                continue
            length, s, j = best
            source = self._sources[s]
            run = _quoted(
                text, i, j, length, source, s, names[source.key], offsets, count, min_tokens_saved
            )
            if run is not None:
                runs.append(run)
            i += length
        return runs


def find_runs(
    text: str,
    earlier: Sequence[EarlierResult],
    count: Callable[[str], int],
    min_tokens_saved: int,
) -> list[LineRun]:
    """The runs of ``text`` to replace by pointers into ``earlier`` (:meth:`LineIndex.find`
    of an index of ``earlier``, each under its call's name).

    ``earlier`` holds the earlier results it may point into; a pointer is checked against
    every result its name stands for, so ``earlier`` should hold them all.
    """
    index = LineIndex()
    for e in earlier:
        index.add(e.call, e.text)
    return index.find(text, count, min_tokens_saved)


def _quoted(
    text: str,
    i: int,
    j: int,
    length: int,
    source: _Source,
    s: int,
    call: str,
    offsets: list[int],
    count: Callable[[str], int],
    min_tokens_saved: int,
) -> LineRun | None:
    """The run of ``length`` lines at line ``i`` of ``text`` (line ``j`` of ``source``, its
    index ``s``, its call named ``call``), trimmed by at most :data:`_TRIM` lines at each end
    until its first and last lines can be quoted, with its pointer; ``None`` when none pays or
    reads back."""
    for head in range(min(_TRIM, length - MIN_LINES) + 1):
        first = source.quote(j + head, 0)
        if first is None:
            continue
        for tail in range(min(_TRIM, length - head - MIN_LINES) + 1):
            n = length - head - tail
            last = source.quote(j + head + n - 1, j + head)
            if last is None:
                continue
            start, end = offsets[i + head], offsets[i + head + n]
            original = text[start:end]
            ending = _ending(original)
            pointer = run_pointer(n, call, first, last, ending)
            saved = count(original) - count(pointer)
            if saved < min_tokens_saved:
                return None  # trimming more only saves less
            if parse_run_pointer(pointer) != RunPointer(n, call, first, last, ending):
                continue  # a quote or the call holds the template's words: unreadable
            return LineRun(
                start=start,
                end=end,
                source=s,
                source_start=source.offsets[j + head],
                source_end=source.offsets[j + head + n],
                lines=n,
                pointer=pointer,
                tokens_saved=saved,
            )
    return None


def replace_runs(text: str, runs: Sequence[LineRun]) -> str:
    """``text`` with each run (in order, not overlapping: :func:`find_runs`) replaced by its
    pointer; every other byte kept."""
    parts: list[str] = []
    position = 0
    for run in runs:
        parts.append(text[position : run.start])
        parts.append(run.pointer)
        position = run.end
    parts.append(text[position:])
    return "".join(parts)
