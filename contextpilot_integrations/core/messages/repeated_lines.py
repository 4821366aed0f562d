"""Stretches of whole lines of a new tool result that an earlier tool result already holds.

A file read again after a one-line edit, or a plain retriever tool's passages (texts joined by
blank lines, no labels) that an earlier search returned, repeat long stretches of an earlier
result without any label a document pointer could name. Such a stretch, a *run* of
consecutive whole lines (a line ends after ``"\\n"``; bytes kept exactly, ``"\\r\\n"``
included), is replaced in place by a pointer naming the earlier call and the stretch's first
and last lines by how they start::

    [Same 46 lines as in the result of read_file({"path": "a.py"}) above,
    from the line starting "import os" to the line starting "    return x".]

(one line in the result), followed by the line ending the run's last line had, so the lines
around it stay lines. A run of one line (a plain retriever's passage is one line, which an
earlier search may have returned beside other passages) names that line alone::

    [Same line as in the result of search({"query": "kv cache"}) above, the
    line starting "The prefix cache keeps…".]

The pointer starts with :data:`.pointers.POINTER_MARK` like every other.

How the model (and :func:`check_run`) finds the stretch in the named call's result: the first
line is the first line of that result starting with the first quote, the last line the first
line at or after it starting with the second quote (for one line: the first line itself), and
the stretch is the stated number of lines. A quote is a line's verbatim start, without its line
ending, cut short with :data:`.pointers.ELLIPSIS` where the line goes on; it keeps at least
:data:`MIN_QUOTE` characters (or the whole line) and is lengthened along :data:`_QUOTE_LENGTHS`
until it identifies its line so. A run whose lines cannot be quoted so (a first line that
stands earlier in the result too, a last line repeated inside the run) is trimmed by a few
lines at that end (at its end, further to a line no line of the run repeats: a web page whose
menu lines every page of the site repeats), or refused.

Lines are the same when their bytes are, but for one case: a line that ends its text without
a line ending is the same as that line with one (the last passage of one search, a passage
in the middle of the next; :func:`_same_lines`). Such a line can only end a run, and the run
replaces it without its ending: the pointer then has no line ending of its own, and the new
text's line ending, if any, stays after it. So the text a pointer replaced is verbatim in the
earlier result in every case.

Finding (:func:`find_runs`; :meth:`LineIndex.find` on an index one planning call keeps, so
each earlier result is split and indexed once however many new results follow) is greedy from
the first line on: at each line the runs starting there, each in one earlier result, from the
first :data:`MAX_POSITIONS` places (over all the earlier results, in order) holding that line;
the :data:`_TRIES` longest are tried, and of those that can be quoted and pay the one saving
the most tokens is kept, one starting at that line before one trimmed at its start (the
longest may not be quotable where a shorter one, from another earlier result, is: a passage
standing first in one and among other passages in another). A run pays when its pointer saves
at least ``min_tokens_saved`` tokens (the pointer's own tokens counted), the rule of the other
pointers; one whose text holds fewer tokens than the shortest pointer plus
``min_tokens_saved`` is refused before any quote is looked for (so short repeated lines, a
blank line or a ``}``, cost one count). After a kept run the search goes on after the match it
was cut from (lines trimmed off stay as they are); where none is kept, after the longest
match.

Work bound: per line of the new text at most :data:`MAX_POSITIONS` candidate places, each
extended line by line, and each match extended once whatever line it is met from again (the
reach of each diagonal, earlier result and offset, is kept), so the extensions cost
``O(MAX_POSITIONS * lines)`` line comparisons in all, whatever the text (a result of many
identical lines included). Add building the line index of the earlier results (one pass), at
most ``MIN_QUOTE + len(_QUOTE_LENGTHS)`` prefix indexes per earlier result (one pass each,
built when first needed) and, per line, at most :data:`_TRIES` runs tried, each with at most
``(_TRIM + 1) * (2 * _TRIM + 1)`` quotes and ``(_TRIM + 1) * _SCAN`` look-ups of a line's last
earlier copy, each quote tried at ``len(_QUOTE_LENGTHS) + 1`` lengths, each length a bisection
and at most :data:`MAX_POSITIONS` line comparisons (a quote whose line is not found within them
is not used), so a result of many short runs (many repeated passages, in another order) stays
linear too.

docs/DESIGN.md, "Sure hints": a pointer is checked on the request that carries it
(:func:`check_run`; on a request's messages, :func:`check_run_placement`): the call it names
has results in the request before it, and in each of them that is not itself a whole-result
pointer to that call, the quotes and the count find exactly the text the pointer replaced. The
finder makes only pointers that pass that check.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from contextpilot_integrations.core.messages.message_plan import ResultPlacement
from contextpilot_integrations.core.messages.pointers import (
    ELLIPSIS,
    POINTER_MARK,
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
MIN_LINES = 1
"""Fewest lines a run has: one line, when it is long enough to pay for its pointer (a plain
retriever's passage is one line)."""
MIN_QUOTE = 24
"""Least characters a quote keeps of a line longer than that: enough for the model to find
the line by eye."""
SAME_LINES = "same lines"
"""The ``reason`` of a run pointer's placement (:class:`.message_plan.ResultPlacement`)."""
_QUOTE_LENGTHS = (MIN_QUOTE, 32, 48, 64, 96, 128, 192, 256)
"""The prefix lengths a quote is tried at, shortest first; past the last, the whole line."""
_TRIM = 8
"""Most lines a run is trimmed by at its start, one after the other, to find a first line its
quote identifies; at its end, the lines tried one after the other, and how many more are tried
further in (:data:`_SCAN`)."""
_SCAN = 256
"""Most lines a run is trimmed by at its end: past the first :data:`_TRIM`, only to a line whose
text does not stand between the run's first line and it (:func:`_tail_trims`)."""
_MEMO = "repeated_lines"
"""This module's key in a :attr:`.pointers.RequestView.memo`: result index -> its lines."""
_TRIES = 4
"""Most places (the longest matches first) a run starting at one line is tried from: when the
longest cannot be quoted (its first line stands earlier in its result), a shorter one from
another result may be."""

_RUN = "[Same {lines} lines as in the result of {call} above, from the line "
_QUOTES = 'starting "{first}" to the line starting "{last}".]'
_ONE_LINE = '[Same line as in the result of {call} above, the line starting "{first}".]'
_PARSE = re.compile(
    r"\[Same (?P<lines>[1-9][0-9]*) lines as in the result of (?P<call>.+?)"
    r' above, from the line starting "(?P<first>[^\n]*?)" to the line starting'
    r' "(?P<last>[^\n]*?)"\.\]'
)
"""A run pointer, each part read up to the first place the template's next words stand (as a
reader scanning the text from the left reads it); no part spans a line break."""
_PARSE_ONE_LINE = re.compile(
    r"\[Same line as in the result of (?P<call>.+?) above, the line starting"
    r' "(?P<first>[^\n]*?)"\.\]'
)
"""A one-line run pointer, read as :data:`_PARSE` reads a longer one's."""


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
        start, end: the run's span in the new text (character offsets; whole lines, but for
            the last one's ending where the earlier copy of that line ends its text without
            one).
        source: index of the earlier result (in the ``earlier`` given to :func:`find_runs`, or
            the number :meth:`LineIndex.add` gave it).
        source_start, source_end: the span of the same lines in that result (its last line's
            ending included where it has one).
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


def _same_lines(a: str, b: str) -> bool:
    """Whether the lines ``a`` and ``b`` are the same: equal, or equal but for the ending one
    of them lacks (it ends its text, as the last passage a retriever tool returns does)."""
    if a == b:
        return True
    return _bare(a) == _bare(b) and not (_ending(a) and _ending(b))


def _stands_for(stretch: str, original: str) -> bool:
    """Whether a pointer to ``stretch`` (whole lines of an earlier result) stands for
    ``original``: the same text, or the stretch without its last line's ending where
    ``original`` has none (so ``original`` is verbatim in the earlier result either way)."""
    return stretch == original or (not _ending(original) and _bare(stretch) == original)


def run_pointer(lines: int, call: str, first: str, last: str, ending: str) -> str:
    """The pointer for a run of ``lines`` lines of ``call``'s result whose first and last
    lines start with the quotes ``first`` and ``last`` (as written), then ``ending``; for one
    line only ``first`` is shown (its last line is its first)."""
    if lines == 1:
        return _ONE_LINE.format(call=call, first=first) + ending
    return _RUN.format(lines=lines, call=call) + _QUOTES.format(first=first, last=last) + ending


def parse_run_pointer(text: str) -> RunPointer | None:
    """What the run pointer ``text`` (the whole of it, its line ending included) states;
    ``None`` when ``text`` is no run pointer. The call is read up to the first ``" above, from
    the line starting "`` (one line: ``" above, the line starting "``), each quote up to the
    first ``"`` the template's next words follow; a one-line pointer's ``last`` is its
    ``first``. :func:`find_runs` makes only pointers that read back as made."""
    match = _PARSE.match(text)
    if match is not None:
        lines, last = int(match.group("lines")), match.group("last")
    else:
        match = _PARSE_ONE_LINE.match(text)
        if match is None:
            return None
        lines, last = 1, match.group("first")
    if text[match.end() :] not in ("", "\n", "\r\n"):
        return None
    return RunPointer(lines, match.group("call"), match.group("first"), last, text[match.end() :])


def _prefix(quote: str) -> str:
    """The line start a quote stands for: without the ellipsis that marks a cut."""
    return quote[: -len(ELLIPSIS)] if quote.endswith(ELLIPSIS) else quote


def _resolve(source: _Source, pointer: RunPointer) -> str | None:
    """The stretch of ``source``'s text the pointer's quotes and count identify (see the module
    docstring); ``None`` when they identify none (or not within the look-up's bound:
    :meth:`_Source.first_line`)."""
    start = source.first_line(_prefix(pointer.first), 0)
    if start is None:
        return None
    end = source.first_line(_prefix(pointer.last), start)
    if end is None or end - start + 1 != pointer.lines:
        return None
    return source.text[source.offsets[start] : source.offsets[end + 1]]


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
    quotes and the count identify exactly ``original`` (or ``original`` and the line ending
    after it, where ``original`` has none: :func:`_stands_for`); a result without text fails.
    """
    sources = {
        signature: [None if text is None else _Source(signature, text) for text in texts]
        for signature, texts in results.items()
        if named_by(_named(pointer), signature)
    }
    return _check_sources(sources, pointer, original)


def _named(pointer: str) -> str:
    """The call a run pointer names (``""`` when ``pointer`` is none: it names nothing)."""
    stated = parse_run_pointer(pointer)
    return "" if stated is None else stated.call


def _check_sources(
    results: Mapping[str, Sequence[_Source | None]], pointer: str, original: str
) -> bool:
    """:func:`check_run` on the results as :class:`_Source` (each split and indexed once,
    however many pointers into it are checked)."""
    stated = parse_run_pointer(pointer)
    if stated is None or not original or stated.ending != _ending(original):
        return False
    if len(split_lines(original)) != stated.lines:
        return False
    same = result_pointer(stated.call)
    read = 0
    for signature, sources in results.items():
        if not named_by(stated.call, signature):
            continue
        for source in sources:
            if source is None:
                return False
            if source.text == same:
                continue
            stretch = _resolve(source, stated)
            if stretch is None or not _stands_for(stretch, original):
                return False
            read += 1
    return read > 0


def check_run_placement(view: RequestView, placement: ResultPlacement) -> bool:
    """Whether the run pointer of ``placement`` holds on the messages ``view`` was made of.

    The pointer stands at ``placement.offset`` in its result, at the start of a line and, when
    it ends without a line ending, at the end of the text or before a line ending (one the
    replaced text left out: its earlier copy ends its result); the result it names
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
    after = offset + len(pointer)
    ended = after == len(text) or text.startswith(("\n", "\r\n"), after)
    if not pointer.endswith("\n") and not ended:
        return False
    signature = view.signature(k_there)
    if signature is None or not named_by(call, signature):
        return False
    # the results' lines, split and indexed once per view however many pointers are checked
    memo: dict[int, _Source | None] = view.memo.setdefault(_MEMO, {})
    results: dict[str, list[_Source | None]] = {}
    for k in view.answering(call):
        named = view.signature(k)
        if k < k_here and named is not None:
            if k not in memo:
                earlier = view.results[k].text
                memo[k] = None if earlier is None else _Source(named, earlier)
            results.setdefault(named, []).append(memo[k])
    return _check_sources(results, pointer, original)


class _Source:
    """One earlier result's lines, where each starts, per line the last line before it of the
    same text (``previous``, -1 for none: a line with such a one at or after line ``after``
    has no quote from ``after`` on), and per prefix length (built when first needed) the
    lines starting with each prefix of that length."""

    __slots__ = ("_by_prefix", "key", "lines", "offsets", "previous", "text")

    def __init__(self, key: str, text: str) -> None:
        self.key = key
        self.text = text
        self.lines = split_lines(text)
        self.offsets = [0]
        self.previous: list[int] = []
        last: dict[str, int] = {}
        for i, line in enumerate(self.lines):
            self.offsets.append(self.offsets[-1] + len(line))
            bare = _bare(line)
            self.previous.append(last.get(bare, -1))
            last[bare] = i
        self._by_prefix: dict[int, dict[str, list[int]]] = {}

    def _starting(self, prefix: str) -> tuple[list[int], bool]:
        """The lines (ascending) whose text starts with ``prefix``'s first ``size`` characters,
        and whether that is all of ``prefix``. Indexed by the prefix's length when shorter
        than :data:`MIN_QUOTE`, else by the longest length of :data:`_QUOTE_LENGTHS` it
        reaches, so at most ``MIN_QUOTE + len(_QUOTE_LENGTHS)`` indexes are ever built, each
        in one pass over the lines."""
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
        return index.get(prefix[:size], []), size == len(prefix)

    def quote(self, line: int, after: int) -> str | None:
        """The shortest quote (of the lengths tried) of line ``line`` whose first matching
        line at or after line ``after`` is ``line``, read as :func:`check_run` reads it (an
        ending ellipsis marks a cut); ``None`` when none identifies it. A quote never holds
        :data:`.pointers.POINTER_MARK` (a line that is, or holds, a pointer: a pointer quoting
        a pointer would read as two)."""
        bare = _bare(self.lines[line])
        mark = bare.find(POINTER_MARK)
        for length in _QUOTE_LENGTHS:
            if length >= len(bare) or (mark >= 0 and length > mark):
                break
            quote = bare[:length] + ELLIPSIS
            if self.first_line(_prefix(quote), after) == line:
                return quote
        if mark < 0 and self.first_line(_prefix(bare), after) == line:
            return bare
        return None

    def first_line(self, prefix: str, after: int) -> int | None:
        """The first line at or after line ``after`` whose text starts with ``prefix``;
        ``None`` when there is none, or when :data:`MAX_POSITIONS` lines sharing the indexed
        part of ``prefix`` go by without one (the quote is then not used: a bound on the
        work, never a wrong answer)."""
        found, whole = self._starting(prefix)
        at = bisect_left(found, after)
        if whole:
            return found[at] if at < len(found) else None
        for i in found[at : at + MAX_POSITIONS]:
            if _bare(self.lines[i]).startswith(prefix):
                return i
        return None


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
        # a line's text without its ending -> (source, line): its first MAX_POSITIONS places,
        # in order
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
                found = self._places.setdefault(_bare(line), [])
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
        # (source, source line - new line) -> the new line the match along it reaches: a
        # match found from an earlier line is not extended again from a later one
        reach: dict[tuple[int, int], int] = {}
        i = 0
        while i < len(lines):
            found: list[tuple[int, int, int]] = []  # (length, source, line)
            for s, j in self._places.get(_bare(lines[i]), ()):
                source_lines = self._sources[s].lines
                if len(readings.get(self._sources[s].key, ())) != 1:
                    continue  # the pointer would name two readings
                end = reach.get((s, j - i), i)
                if end <= i:
                    end, shift = i, j - i
                    stop = min(len(lines), len(source_lines) - shift)
                    while end < stop and lines[end] == source_lines[end + shift]:
                        end += 1
                    # a line the same but for the ending one of them lacks ends its text
                    if end < stop and _same_lines(lines[end], source_lines[end + shift]):
                        end += 1
                    reach[(s, j - i)] = end
                if end - i >= MIN_LINES:
                    found.append((end - i, s, j))
            if not found:
                i += 1
                continue
            found.sort(key=lambda f: -f[0])  # longest first; stable: earlier places first
            step = found[0][0]
            chosen: LineRun | None = None
            for length, s, j in found[:_TRIES]:
                source = self._sources[s]
                run = _quoted(
                    text, i, j, length, source, s, names[source.key], offsets, count,
                    min_tokens_saved,
                )  # fmt: skip
                # a run cut at its start leaves the lines before it out: one that starts here
                # goes first
                if run is not None and (chosen is None or _better(run, chosen, offsets[i])):
                    chosen, step = run, length
            if chosen is not None:
                runs.append(chosen)
            i += step
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
    index ``s``, its call named ``call``), trimmed by at most :data:`_TRIM` lines at its start
    and as :func:`_tail_trims` says at its end until its first and last lines can be quoted,
    with its pointer; ``None`` when none pays or reads back. A
    run whose text cannot pay even for the shortest pointer (one line, empty quotes) is
    refused before any quote is looked for."""
    if count(text[offsets[i] : offsets[i + length]]) - count(_shortest(call)) < min_tokens_saved:
        return None
    previous = source.previous
    last_line = j + length - 1
    for head in range(min(_TRIM, length - MIN_LINES) + 1):
        first = source.quote(j + head, 0)
        if first is None:
            continue

        def may_end(t: int, after: int = j + head) -> bool:
            # a last line with a line of its text between the first line and it has no quote
            return previous[last_line - t] < after

        for tail in _tail_trims(length - head - MIN_LINES, may_end):
            n = length - head - tail
            # one line: its quote from the result's start names it from itself on too
            last = first if n == 1 else source.quote(j + head + n - 1, j + head)
            if last is None:
                continue
            start, end = offsets[i + head], offsets[i + head + n]
            original = text[start:end]
            ending = _ending(original)
            if ending and not _ending(source.lines[j + head + n - 1]):
                # the earlier copy of the last line ends its text: the ending stays as text
                end -= len(ending)
                original, ending = original[: -len(ending)], ""
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


def _tail_trims(most: int, may_end: Callable[[int], bool]) -> Iterator[int]:
    """How many lines a run is tried trimmed by at its end, in order, at most ``most``: each of
    ``0 .. _TRIM``, then up to :data:`_TRIM` more of the next ones up to :data:`_SCAN` for which
    ``may_end`` holds (the line the run would then end at has no line of its text between the
    run's first line and it, where a quote would find that one first: a web page's menu lines
    repeated through the run)."""
    yield from range(min(_TRIM, most) + 1)
    more = 0
    for k in range(_TRIM + 1, min(_SCAN, most) + 1):
        if more == _TRIM:
            return
        if may_end(k):
            more += 1
            yield k


def _better(run: LineRun, than: LineRun, here: int) -> bool:
    """Whether ``run`` is kept rather than ``than``, both found from the line at offset
    ``here``: one starting there before one trimmed at its start, then the more tokens saved."""
    return (run.start == here, run.tokens_saved) > (than.start == here, than.tokens_saved)


def _shortest(call: str) -> str:
    """The shortest pointer naming ``call``: one line, an empty quote, no line ending."""
    return run_pointer(1, call, "", "", "")


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
