"""Finding the documents of a multi-document tool result without changing a byte of it."""

from __future__ import annotations

import json

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from contextpilot_integrations.core.messages.documents import (
    _unique_literal,
    find_documents,
    span_text,
)
from contextpilot_integrations.core.rendering import PromptLayout


def test_numbered_blocks() -> None:
    text = "Top results:\n\n[1] first doc\nsecond line\n\n[2]  second doc  \n\nShowing 2 of 9"
    documents = find_documents(text)
    assert [(d.label, text[d.start : d.end]) for d in documents] == [
        ("[1]", "first doc\nsecond line"),
        ("[2]", "second doc"),
    ]
    dotted = find_documents("1. one\n\n2. two\n\n3. three")
    assert [d.label for d in dotted] == ["1.", "2.", "3."]


def test_numbered_blocks_need_two_consecutive_markers_of_one_style() -> None:
    assert find_documents("[1] only one") == ()
    assert find_documents("[1] a\n\n[3] b") == ()
    assert find_documents("[1] a\n\n2. b") == ()
    assert find_documents("1. a\n2. b") == ()  # not separated by blank lines


def test_a_numbered_label_written_twice_names_nothing() -> None:
    documents = find_documents("[1] a\n\n[2] b\n[1] again")
    assert [d.label for d in documents] == [None, "[2]"]


def test_tagged_documents() -> None:
    text = '<document index="1" source="a">\n  alpha  \n</document>\n<document>beta</document>'
    documents = find_documents(text)
    assert [(d.label, d.key) for d in documents] == [('index="1"', "alpha"), (None, "beta")]
    assert text[documents[0].start : documents[0].end] == "alpha"


def test_json_documents() -> None:
    items = [{"id": "a", "text": "alpha é"}, {"title": "B", "page_content": "beta"}, {"x": 1}]
    for text in (json.dumps(items), json.dumps({"hits": items}, indent=2, ensure_ascii=False)):
        documents = find_documents(text)
        assert [(d.key, d.label) for d in documents] == [
            ("alpha é", '"id": "a"'),
            ("beta", '"title": "B"'),
        ]
        assert json.loads('"' + text[documents[0].start : documents[0].end] + '"') == "alpha é"
    compact = json.dumps(items, separators=(",", ":"))
    assert find_documents(compact)[0].label == '"id":"a"'


def test_json_text_written_twice_is_not_a_document() -> None:
    text = json.dumps([{"text": "same", "title": "same"}, {"text": "other"}])
    assert [d.key for d in find_documents(text)] == ["other"]


def test_rendered_blocks() -> None:
    layout = PromptLayout()
    texts = ["alpha one", "  beta\n-----\nstill beta \n", "", "gamma"]
    hint = "Also relevant: [Doc 3] of turn 2, shown above."
    text = "".join(layout.render_block(i, t) for i, t in enumerate(texts)) + layout.context_tail(
        annotation_labels=["[Doc 4]", "[Doc 1]"], hints=[hint]
    )
    documents = find_documents(text)
    assert [(d.layout, d.label, d.key) for d in documents] == [
        ("rendered", "[Doc 1]", "alpha one"),
        ("rendered", "[Doc 2]", "beta\n-----\nstill beta"),  # a middle text may hold the line
        ("rendered", "[Doc 4]", "gamma"),  # an empty text is no document
    ]
    assert all(text[d.start : d.end] == d.key for d in documents)
    assert find_documents("\n" + layout.render_block(0, "one")) != ()


def test_rendered_blocks_in_doubt() -> None:
    layout = PromptLayout()
    two = layout.render_block(0, "one") + layout.render_block(1, "two")
    # A separator line after the last label: where the last text ends is in doubt.
    assert [d.key for d in find_documents(two + "-----\nfooter\n")] == ["one"]
    assert [d.key for d in find_documents(two.replace("two", "two\n-----\nthree"))] == ["one"]
    # Labels out of turn, twice, or not at the start: not the renderer's layout.
    assert find_documents(layout.render_block(0, "one") + layout.render_block(2, "three")) == ()
    assert find_documents(layout.render_block(0, "one\n[Doc 1]\nagain")) == ()
    assert find_documents("Results:\n" + two) == ()
    assert find_documents("[Doc 1]\n-----\n[Doc 2]\ntwo\n-----\n") == ()
    assert find_documents("[Doc 01]\none\n-----\n") == ()


def test_not_documents() -> None:
    for text in ("", "plain output", "[1, 2, 3]", '{"a": 1}', "{not json", "<document>"):
        assert find_documents(text) == ()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=5), st.text(max_size=20))
def test_spans_replace_cleanly(bodies: list[str], pointer: str) -> None:
    # Replacing every span keeps the rest byte-identical and, for JSON, valid JSON; a rendered
    # document's span is its text, whitespace around it left out.
    layout = PromptLayout()
    layouts = {
        "json": json.dumps([{"id": n, "text": b} for n, b in enumerate(bodies)]),
        "numbered": "\n\n".join(f"[{n}] {b}" for n, b in enumerate(bodies, 1)),
        "rendered": "".join(layout.render_block(n, b) for n, b in enumerate(bodies))
        + layout.context_tail(annotation_labels=[layout.label(n) for n in range(len(bodies))]),
    }
    for layout, text in layouts.items():
        documents = find_documents(text)
        rebuilt, position = [], 0
        for d in documents:
            assert d.layout == layout
            rebuilt += [text[position : d.start], span_text(layout, pointer)]
            position = d.end
        rebuilt.append(text[position:])
        if layout == "json":
            json.loads("".join(rebuilt))
        if layout == "rendered":
            assert {text[d.start : d.end] for d in documents} <= {b.strip() for b in bodies}
        assert all(text[d.start : d.end].strip() or layout == "json" for d in documents)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=5), st.booleans())
def test_a_json_text_without_a_backslash_finds_the_same_literals_unencoded(
    bodies: list[str], ascii_only: bool
) -> None:
    # Repeated bodies included: a literal standing twice is no document either way.
    items = [{"id": n, "text": b} for n, b in enumerate(bodies + bodies[:1])]
    text = json.dumps(items, ensure_ascii=ascii_only)
    assume("\\" not in text)
    for body in bodies:
        assert _unique_literal(text, body, True) == _unique_literal(text, body)
