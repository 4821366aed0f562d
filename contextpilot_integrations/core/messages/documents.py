"""The documents inside one multi-document tool result, found without changing a byte of it.

Retrieval tools return several documents in one result, and an agent that searches twice gets
many of the same documents back. Four layouts are read, tried in this order (the first that
yields documents wins):

1. Rendered: the blocks the library's own renderer writes (the default
   :class:`~contextpilot_integrations.core.rendering.PromptLayout`, what
   ``langchain.retriever_tool`` returns): from the result's first byte (leading whitespace
   aside), ``[Doc 1]``, a newline, the text, a newline and the separator line ``-----``, then
   ``[Doc 2]`` the same way, and so on, then the context tail (location hints, the order
   annotation) with no separator line in it. The labels run ``[Doc 1]`` .. ``[Doc n]`` as whole
   lines, each once (a text holding a label line makes the result no rendered one), and each
   block but the last ends where the next label line starts; the last block ends at the one
   ``-----`` line after its label, and is no document when there are more (a text or a hint
   holding that line would leave its end in doubt). The span is the text between a label line
   and its separator, surrounding whitespace left out; the label is the label line's text
   (``[Doc 3]``), which the order annotation and hints may name again.
2. JSON: a list of objects, or an object with such a list under ``"results"``, ``"documents"``
   or ``"hits"``; each object with a str under ``"text"``, ``"content"``, ``"page_content"`` or
   ``"snippet"`` (the first present) is a document. Its span is the inside of that string's
   literal in the raw text (between the quotes, escapes as written), found only when the quoted
   literal occurs exactly once; its label is its id-like field as written, e.g. ``"id": "d7"``
   (the first of ``id``, ``doc_id``, ``document_id``, ``title``, ``source``, ``url``, ``name``
   whose literal, with ``": "`` or ``":"``, occurs exactly once).
3. Tagged: ``<document ...>text</document>``; the span is the text with its surrounding
   whitespace left out, the label the first ``id``/``index``/``source``/``title``/``name``
   attribute as written (``index="2"``), when it occurs exactly once in the result.
4. Numbered: blocks separated by blank lines, two or more of them starting with ``[n]`` or
   ``n.`` (one style, consecutive numbers); the span is the block after its marker, surrounding
   whitespace left out; the label is the marker (``[2]``, ``2.``) when no other line of the
   result starts with it. Blocks without a marker (a heading, a footer) are not documents.

A label is ``None`` when it cannot name the document without doubt; such a document can still
be replaced by a pointer elsewhere, but nothing can point at it (docs/DESIGN.md, "Sure hints").
Replacing a span by another text keeps every other byte; for JSON the replacement must be the
inside of a JSON string literal (:func:`span_text` encodes it), so the result stays valid JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring, encode_basestring_ascii
from typing import Any, Literal

from contextpilot_integrations.core.rendering import PromptLayout

__all__ = [
    "Document",
    "DocumentLayout",
    "DocumentRef",
    "document_ref",
    "find_documents",
    "find_text",
    "span_text",
]

DocumentLayout = Literal["rendered", "json", "tagged", "numbered"]

_LIST_KEYS = ("results", "documents", "hits")
_TEXT_KEYS = ("text", "content", "page_content", "snippet")
_LABEL_KEYS = ("id", "doc_id", "document_id", "title", "source", "url", "name")
_KEY_LITERALS = {key: json.dumps(key) for key in _LABEL_KEYS}
_PROBE = 32
"""Characters of a long needle :func:`find_text` looks for first."""
_PROBE_TRIES = 8
"""Places of the probe :func:`find_text` checks before it leaves the rest to ``str.find``."""
_TAGGED = re.compile(r"<document\b([^>]*)>(.*?)</document\s*>", re.S | re.I)
_ATTRIBUTE = re.compile(r"""\b(?:id|index|source|title|name)\s*=\s*(?:"[^"]*"|'[^']*')""", re.I)
_BLANK_LINES = re.compile(r"\r?\n(?:[ \t]*\r?\n)+")
_MARKER = re.compile(r"[ \t]*(?:\[(\d{1,9})\]|(\d{1,9})\.)[ \t]+")

# The rendered layout is the default PromptLayout's: labels and block template read from it.
_RENDERED = PromptLayout()
_LABEL_HEAD, _LABEL_TAIL = _RENDERED.label_template.split("{position}")  # "[Doc ", "]"
_BLOCK_HEAD, _BLOCK_TAIL = _RENDERED.block_template.split("{text}")  # "{label}\n", "\n-----\n"
_LABEL_LINE = re.compile(
    "(?m)^"
    + re.escape(_LABEL_HEAD)
    + r"(\d{1,9})"
    + re.escape(_LABEL_TAIL + _BLOCK_HEAD.removeprefix("{label}"))
)
_SEPARATOR_LINE = re.compile("(?m)^" + re.escape(_BLOCK_TAIL.strip("\n")) + "$")


@dataclass(frozen=True, slots=True)
class Document:
    """One document of a tool result.

    Attributes:
        index: its 0-based place among the result's documents.
        layout: the layout it was found in.
        start, end: its span in the result text (``text[start:end]``, the part a pointer
            replaces).
        key: the document's text with surrounding whitespace left out, for matching: JSON: the
            field's decoded value; otherwise the span itself.
        label: how the result names it, as written (``[Doc 2]``, ``[2]``, ``index="2"``,
            ``"id": "d7"``); ``None``: no unambiguous name.
    """

    index: int
    layout: DocumentLayout
    start: int
    end: int
    key: str
    label: str | None


@dataclass(frozen=True, slots=True)
class DocumentRef:
    """A labelled document of a result text, kept without its key: what a conversation's
    memory holds of each document a later pointer may name (the key, as long as the document,
    is read back from the text it was found in when a lookup needs it: :meth:`key_in`).

    Attributes:
        index, layout, start, end, label: as the :class:`Document`'s.
        key_hash: ``hash`` of the document's key (this process's str hash), to look it up.
    """

    index: int
    layout: DocumentLayout
    start: int
    end: int
    label: str
    key_hash: int

    def key_in(self, text: str) -> str:
        """The document's key, read from ``text`` (the text it was found in): its span, or
        for JSON the string its literal (the span and its quotes) stands for, stripped."""
        if self.layout == "json":
            value: str = json.loads(text[self.start - 1 : self.end + 1])
            return value.strip()
        return text[self.start : self.end]


def document_ref(document: Document) -> DocumentRef:
    """``document`` (one with a label) as its memory keeps it."""
    assert document.label is not None  # only a labelled document can be pointed at
    return DocumentRef(
        document.index,
        document.layout,
        document.start,
        document.end,
        document.label,
        hash(document.key),
    )


def span_text(layout: DocumentLayout, text: str) -> str:
    """``text`` as it must stand in a span of ``layout`` (JSON: escaped as a string's inside)."""
    if layout == "json":
        return encode_basestring(text)[1:-1]  # json.dumps(text, ensure_ascii=False)'s inside
    return text


def find_documents(text: str) -> tuple[Document, ...]:
    """The documents of ``text`` in order; ``()`` when none of the layouts fits."""
    stripped = text.strip()
    if stripped.startswith(_LABEL_HEAD):
        documents = _rendered_documents(text)
        if documents:
            return documents
    if stripped[:1] in ("[", "{"):
        documents = _json_documents(text)
        if documents:
            return documents
    if "<document" in text or "<DOCUMENT" in text:
        documents = _tagged_documents(text)
        if documents:
            return documents
    return _numbered_documents(text)


def _rendered_documents(text: str) -> tuple[Document, ...]:
    """The blocks of a rendered context (module docstring, layout 1); ``()`` when the labels
    leave a block's bounds in doubt."""
    labels = list(_LABEL_LINE.finditer(text))
    if not labels or labels[0].start() != len(text) - len(text.lstrip()):
        return ()
    if [m.group(1) for m in labels] != [str(n) for n in range(1, len(labels) + 1)]:
        return ()  # a label out of turn, twice, or with leading zeros
    bounds: list[tuple[int, int]] = []  # each block's text, between label line and separator
    for this, following in zip(labels, labels[1:]):
        end = following.start() - len(_BLOCK_TAIL)
        if end < this.end() or text[end : following.start()] != _BLOCK_TAIL:
            return ()
        bounds.append((this.end(), end))
    last = labels[-1].end()
    separators = list(_SEPARATOR_LINE.finditer(text, last))
    if len(separators) == 1:  # else: where the last text ends is in doubt, it is no document
        end = separators[0].start() - 1  # the newline that ends the text, before the separator
        if end >= last and text.startswith(_BLOCK_TAIL, end):
            bounds.append((last, end))
    documents: list[Document] = []
    for match, (body_start, body_end) in zip(labels, bounds):
        start, end = _strip_span(text, body_start, body_end)
        if start == end:
            continue
        label = f"{_LABEL_HEAD}{match.group(1)}{_LABEL_TAIL}"
        documents.append(Document(len(documents), "rendered", start, end, text[start:end], label))
    return tuple(documents)


def _json_documents(text: str) -> tuple[Document, ...]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return ()
    items: Any = value
    if type(value) is dict or isinstance(value, Mapping):
        items = next((value[k] for k in _LIST_KEYS if isinstance(value.get(k), list)), None)
    if not isinstance(items, list):
        return ()
    documents: list[Document] = []
    # A text without a backslash escapes nothing, and strict JSON holds no raw control
    # character in a string: each of its strings then stands as itself between quotes, which
    # is how json.dumps writes it, so its literal is made without encoding it again.
    unescaped = "\\" not in text
    for item in items:
        if type(item) is not dict and not isinstance(item, Mapping):
            continue
        body = next((item[k] for k in _TEXT_KEYS if isinstance(item.get(k), str)), None)
        if body is None or not body.strip():
            continue
        span = _unique_literal(text, body, unescaped)
        if span is None:
            continue
        label = _json_label(text, item)
        documents.append(Document(len(documents), "json", span[0], span[1], body.strip(), label))
    return tuple(documents)


def _unique_literal(text: str, value: str, unescaped: bool = False) -> tuple[int, int] | None:
    """Span of the inside of ``value``'s JSON string literal, when it occurs exactly once:
    the literal as ``json.dumps`` writes it with ``ensure_ascii=False``, else with
    ``ensure_ascii=True`` (the encoders ``json.dumps`` calls for a str; an ASCII form equal
    to the first is not looked for twice). ``unescaped``: ``value`` is a string of the strict
    JSON ``text``, which holds no backslash, so its literal is ``value`` between quotes."""
    literal = f'"{value}"' if unescaped else encode_basestring(value)
    first = find_text(text, literal, 0)
    if first < 0:
        ascii_literal = encode_basestring_ascii(value)
        if ascii_literal == literal:
            return None
        literal = ascii_literal
        first = find_text(text, literal, 0)
        if first < 0:
            return None
    if find_text(text, literal, first + 1) >= 0:
        return None
    return first + 1, first + len(literal) - 1


def find_text(text: str, needle: str, start: int = 0) -> int:
    """``text.find(needle, start)``, so ``needle in text`` is ``find_text(text, needle) >= 0``.

    A long needle (a document's literal) is looked for by its first :data:`_PROBE`
    characters, each place they stand checked for the whole needle: ``str.find`` prepares a
    needle that long, all of it, before it looks. After :data:`_PROBE_TRIES` places that do
    not hold it (a text that repeats the probe), the rest is left to ``str.find``, so the work
    stays linear in the text."""
    if len(needle) <= _PROBE or type(text) is not str or type(needle) is not str:
        return text.find(needle, start)
    probe = needle[:_PROBE]
    at = text.find(probe, start)
    for _ in range(_PROBE_TRIES):
        if at < 0 or text.startswith(needle, at):
            return at
        at = text.find(probe, at + 1)
    return -1 if at < 0 else text.find(needle, at)


def _json_label(text: str, item: Mapping[str, Any]) -> str | None:
    for key in _LABEL_KEYS:
        value = item.get(key)
        if isinstance(value, bool) or not isinstance(value, str | int):
            continue
        shown = _json_forms(value)
        for form in shown:
            for separator in (": ", ":"):
                label = f"{_KEY_LITERALS[key]}{separator}{form}"
                if text.count(label) == 1:
                    return label
    return None


def _json_forms(value: str | int) -> tuple[str, ...]:
    """How ``json.dumps`` writes ``value`` with ``ensure_ascii=False``, then with ``True``
    (one form when both are the same: an int, or a str the ASCII escapes leave alone)."""
    if isinstance(value, str):
        plain, escaped = encode_basestring(value), encode_basestring_ascii(value)
        return (plain,) if plain == escaped else (plain, escaped)
    return (int.__repr__(value),)


def _tagged_documents(text: str) -> tuple[Document, ...]:
    documents: list[Document] = []
    for match in _TAGGED.finditer(text):
        start, end = _strip_span(text, match.start(2), match.end(2))
        if start == end:
            continue
        attribute = _ATTRIBUTE.search(match.group(1))
        label = attribute.group(0) if attribute else None
        if label is not None and text.count(label) != 1:
            label = None
        documents.append(Document(len(documents), "tagged", start, end, text[start:end], label))
    return tuple(documents)


def _numbered_documents(text: str) -> tuple[Document, ...]:
    blocks: list[tuple[int, int]] = []
    position = 0
    for separator in _BLANK_LINES.finditer(text):
        blocks.append((position, separator.start()))
        position = separator.end()
    blocks.append((position, len(text)))
    found: list[tuple[str, int, int, int]] = []  # marker, number, body start, block end
    style = None
    for start, end in blocks:
        match = _MARKER.match(text, start, end)
        if match is None:
            continue
        bracketed = match.group(1) is not None
        if style is None:
            style = bracketed
        if bracketed != style:
            return ()
        number = int(match.group(1) if bracketed else match.group(2))
        if found and number != found[-1][1] + 1:
            return ()
        marker = f"[{number}]" if bracketed else f"{number}."
        if text[match.start() : match.end()].strip() != marker:
            return ()  # a marker written with leading zeros is not the label it reads as
        found.append((marker, number, match.end(), end))
    if len(found) < 2:
        return ()
    documents: list[Document] = []
    for marker, _number, body_start, block_end in found:
        start, end = _strip_span(text, body_start, block_end)
        if start == end:
            continue
        line_start = re.compile(r"(?m)^[ \t]*" + re.escape(marker) + r"[ \t]")
        label = marker if len(line_start.findall(text)) == 1 else None
        documents.append(Document(len(documents), "numbered", start, end, text[start:end], label))
    return tuple(documents)


def _strip_span(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end
