"""Documents a RAG app marks in the body (``contextpilot.documents``), planned by the tenant's
context index and put in front of the newest user message: a common prefix across
conversations, the order annotation, the with-documents message put back byte-identically on
later calls, de-duplication within a conversation with hints to text the request holds, bad
input refused naming the field, tenants apart (docs/DESIGN.md, "The proxy")."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from proxy_testing import dumped, serve_proxy

from contextpilot_integrations.service.tenants import TenantKeys

SYSTEM = "You answer from the documents."


def _doc(name: str) -> str:
    """A document long enough that a hint to it saves more than the hint costs."""
    return " ".join(
        f"{name} sentence {i} says the cache keeps key and value tensors." for i in range(8)
    )


D1, D2, D3, D4, D5 = (_doc(n) for n in ("alpha", "bravo", "charlie", "delta", "echo"))


def _client(proxy: str, key: str = "none", session: str | None = None) -> openai.OpenAI:
    headers = {"x-contextpilot-session": session} if session else None
    return openai.OpenAI(
        base_url=f"{proxy}/v1", api_key=key, max_retries=0, default_headers=headers
    )


def _ask(client: openai.OpenAI, messages: list[dict[str, Any]], documents: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model="plain",
        messages=messages,  # type: ignore[arg-type]
        extra_body={"contextpilot": {"documents": documents}},
    )


def _opening(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_shared_documents_form_a_common_prefix_with_the_order_annotation(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        first = _ask(_client(proxy, session="a"), _opening("What is kept?"), [D1, D2, D3])
        second = _ask(_client(proxy, session="b"), _opening("Where is it kept?"), [D2, D1, D4])
        bodies = state.bodies("/v1/chat/completions")
        a, b = (body["messages"][1]["content"] for body in bodies)
        shared = "[Doc 1]\n" + D1 + "\n-----\n[Doc 2]\n" + D2 + "\n-----\n"
        assert a.startswith(shared) and b.startswith(shared)
        assert bodies[0]["messages"][0] == bodies[1]["messages"][0]
        # The question stays where the app put it, after the context.
        assert a.endswith("\n\nWhat is kept?") and b.endswith("\n\nWhere is it kept?")
        # The second call was reordered: the annotation gives the client's relevance order.
        assert "Read the documents in this priority order: [Doc 2] > [Doc 1] > [Doc 3]." in b
        assert "priority order" not in a
        assert first.headers["x-contextpilot-documents"] == "3"
        assert first.headers["x-contextpilot-documents-reordered"] == "false"
        assert second.headers["x-contextpilot-documents-reordered"] == "true"
        assert int(second.headers["x-contextpilot-documents-prefix-tokens"]) > 0
        # The rid the index planned under is the one the engine got.
        assert second.headers["x-contextpilot-rid"] == bodies[1]["rid"]
        # The extension never goes upstream.
        for received in state.received:
            assert "contextpilot" not in received.body
            assert b'"documents"' not in received.raw


def test_a_later_turn_gets_the_with_documents_message_back_and_hints_at_it(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        client = _client(proxy, session="conversation-1")
        messages = _opening("What is kept?")
        _ask(client, messages, [D1, D2])
        # The app's history holds its own message, without the documents.
        messages += [
            {"role": "assistant", "content": "Tensors."},
            {"role": "user", "content": "And where?"},
        ]
        raw = _ask(client, messages, [D2, D5])
        # A third call without documents still gets both earlier messages back.
        messages += [
            {"role": "assistant", "content": "In the cache."},
            {"role": "user", "content": "Thanks."},
        ]
        third = client.chat.completions.with_raw_response.create(
            model="plain",
            messages=messages,  # type: ignore[arg-type]
        )
        bodies = state.bodies("/v1/chat/completions")
        assert dumped(bodies[1]["messages"][:2]) == dumped(bodies[0]["messages"])
        assert dumped(bodies[2]["messages"][:4]) == dumped(bodies[1]["messages"])
        assert raw.headers["x-contextpilot-restored"] == "1"
        assert third.headers["x-contextpilot-restored"] == "2"
        assert int(raw.headers["x-contextpilot-replayed"]) == 2
        assert "x-contextpilot-documents" not in third.headers
        # D2 stood in turn 1 as [Doc 2]; turn 2 points at it instead of sending it again.
        newest = bodies[1]["messages"][3]["content"]
        assert D2 not in newest and D5 in newest
        assert "Also relevant: [Doc 2] of turn 1, shown above." in newest
        assert "[Doc 2]\n" + D2 in bodies[1]["messages"][1]["content"]
        assert raw.headers["x-contextpilot-documents-replaced"] == "1"
        assert int(raw.headers["x-contextpilot-tokens-removed"]) > 0
        # The totals count each call's plan once, with what the hint removed.
        totals = httpx.get(f"{proxy}/v1/usage").json()
        conversation = totals["conversations"][""]["conversation-1"]
        assert conversation["plans"] == 3
        assert conversation["tokens_removed"] == int(raw.headers["x-contextpilot-tokens-removed"])
        assert conversation["blocks_replaced"] == 1


def test_an_app_that_dropped_the_earlier_turn_gets_no_hint_to_it(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        client = _client(proxy, session="trimmed")
        _ask(client, _opening("What is kept?"), [D1, D2])
        # The app trimmed its history to the new question alone: D2 must go in full.
        raw = _ask(client, _opening("And where?"), [D2, D5])
        newest = state.bodies("/v1/chat/completions")[1]["messages"][1]["content"]
        assert D2 in newest and "Also relevant" not in newest
        assert raw.headers["x-contextpilot-documents-replaced"] == "0"


def test_a_conversation_without_an_id_places_documents_but_remembers_none(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        client = _client(proxy)
        messages = _opening("What is kept?")
        _ask(client, messages, [D1])
        messages += [
            {"role": "assistant", "content": "Tensors."},
            {"role": "user", "content": "And where?"},
        ]
        raw = _ask(client, messages, [D1, D3])
        bodies = state.bodies("/v1/chat/completions")
        assert raw.headers["x-contextpilot-conversation-source"] == "opening"
        assert bodies[1]["messages"][1] == {"role": "user", "content": "What is kept?"}
        assert "x-contextpilot-restored" not in raw.headers
        assert D1 in bodies[1]["messages"][3]["content"]  # no hint to a message not sent


def test_list_content_gets_a_text_part_first(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        content = [{"type": "text", "text": "What is kept?"}]
        _ask(_client(proxy), [{"role": "user", "content": content}], [D1])
        sent = state.bodies("/v1/chat/completions")[0]["messages"][0]["content"]
        assert sent[1:] == content
        assert sent[0]["type"] == "text" and sent[0]["text"].startswith("[Doc 1]\n" + D1)


def test_anthropic_documents_go_after_the_tool_results(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url, {"kind": "openai-compatible"}) as proxy:
        client = anthropic.Anthropic(base_url=proxy, api_key="none", max_retries=0)
        result = {"type": "tool_result", "tool_use_id": "t1", "content": "done"}
        question = {"type": "text", "text": "Now answer."}
        messages = [
            {"role": "user", "content": "Look it up."},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "search", "input": {}}],
            },
            {"role": "user", "content": [result, question]},
        ]
        client.messages.create(
            model="plain",
            max_tokens=8,
            messages=messages,  # type: ignore[arg-type]
            extra_body={"contextpilot": {"documents": [D1, D2], "query": "kept?"}},
        )
        sent = state.bodies("/v1/messages")[0]["messages"]
        assert sent[:2] == messages[:2]
        last = sent[2]["content"]
        assert last[0]["type"] == "tool_result" and last[2]["text"] == "Now answer."
        assert last[1]["text"].startswith("[Doc 1]\n" + D1)
        # A user message of tool results alone is not a turn to put documents in.
        with pytest.raises(anthropic.UnprocessableEntityError, match="contextpilot.documents"):
            client.messages.create(
                model="plain",
                max_tokens=8,
                messages=[{"role": "user", "content": [result]}],
                extra_body={"contextpilot": {"documents": [D1]}},
            )


@pytest.mark.parametrize(
    ("documents", "field", "words"),
    [
        ("one document", "contextpilot.documents", "must be a list of str"),
        ([D1, 3], "contextpilot.documents[1]", "must be a str, got int"),
        ([], "contextpilot.documents", "at least one document"),
        ([D1, ""], "contextpilot.documents[1]", "must hold text"),
        (["x"] * 257, "contextpilot.documents", "at most 256"),
    ],
)
def test_bad_documents_are_refused_naming_the_field(standin, documents, field, words) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            _ask(_client(proxy), _opening("q"), documents)
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == field
        assert words in error["message"]
        assert state.received == []


def test_documents_need_a_new_user_message(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        client = _client(proxy, session="s")
        system_only = [{"role": "system", "content": SYSTEM}]
        replayed = [*_opening("q"), {"role": "assistant", "content": "a"}]
        for messages, words in ((system_only, "has none"), (replayed, "messages[2] (assistant)")):
            with pytest.raises(openai.UnprocessableEntityError) as caught:
                _ask(client, messages, [D1])
            error = caught.value.body
            assert isinstance(error, dict) and error["param"] == "contextpilot.documents"
            assert words in error["message"]
        with pytest.raises(openai.UnprocessableEntityError, match="contextpilot.query"):
            client.chat.completions.create(
                model="plain",
                messages=_opening("q"),  # type: ignore[arg-type]
                extra_body={"contextpilot": {"documents": [D1], "query": 7}},
            )
        assert state.received == []


def test_a_body_the_planner_refuses_indexes_no_documents(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        body = {
            "model": "plain",
            "messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": 5}],
            "contextpilot": {"documents": [D1]},
        }
        answer = httpx.post(f"{proxy}/v1/chat/completions", json=body)
        assert answer.status_code == 422 and "messages[1]" in answer.text
        assert httpx.get(f"{proxy}/v1/usage").json()["plans"] == 0
        assert state.received == []


def test_tenants_never_share_what_was_sent(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    tenants = {"alice": TenantKeys(("alice-key",)), "bob": TenantKeys(("bob-key",))}
    with serve_proxy(url, {"api_key": "upstream"}, tenants=tenants) as proxy:
        alice = _client(proxy, "alice-key", session="same-id")
        bob = _client(proxy, "bob-key", session="same-id")
        _ask(alice, _opening("What is kept?"), [D1, D2])
        history = [
            *_opening("What is kept?"),
            {"role": "assistant", "content": "Tensors."},
            {"role": "user", "content": "And where?"},
        ]
        raw = _ask(bob, history, [D2])
        bodies = state.bodies("/v1/chat/completions")
        assert bodies[1]["messages"][1] == {"role": "user", "content": "What is kept?"}
        assert "x-contextpilot-restored" not in raw.headers
        newest = bodies[1]["messages"][3]["content"]
        assert D2 in newest and "Also relevant" not in newest
        assert json.dumps(bodies[1]).count(D1) == 0


def test_a_newest_message_sent_again_without_documents_gets_none(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        client = _client(proxy, session="retry")
        _ask(client, _opening("What is kept?"), [D1])
        client.chat.completions.create(model="plain", messages=_opening("What is kept?"))  # type: ignore[arg-type]
        bodies = state.bodies("/v1/chat/completions")
        assert bodies[1]["messages"][1] == {"role": "user", "content": "What is kept?"}


def test_a_hint_names_the_block_of_the_branch_the_request_holds(standin) -> None:  # type: ignore[no-untyped-def]
    # Two branches of turn 2 (a regenerated or concurrent call): the conversation store's
    # turn 2 is the later branch (D3 as [Doc 1]); the app continues the earlier one, which
    # holds D2 as [Doc 1] and D3 as [Doc 2]. A hint "[Doc 1] of turn 2" would name D2.
    url, state = standin
    with serve_proxy(url) as proxy:
        client = _client(proxy, session="branches")
        opening = _opening("What is kept?")
        _ask(client, opening, [D1])
        answer = {"role": "assistant", "content": "Tensors."}
        first = [*opening, answer, {"role": "user", "content": "And where?"}]
        _ask(client, first, [D2, D3])
        _ask(client, [*opening, answer, {"role": "user", "content": "And when?"}], [D3])
        raw = _ask(client, [*first, answer, {"role": "user", "content": "Thanks."}], [D3])
        bodies = state.bodies("/v1/chat/completions")
        assert "[Doc 2]\n" + D3 in bodies[1]["messages"][3]["content"]
        assert dumped(bodies[3]["messages"][:4]) == dumped(bodies[1]["messages"])
        newest = bodies[3]["messages"][5]["content"]
        assert "[Doc 1] of turn 2" not in newest
        assert D3 in newest or "Also relevant: [Doc 2] of turn 2, shown above." in newest
        assert raw.headers["x-contextpilot-documents"] == "1"


def test_a_pointer_names_the_block_of_the_branch_the_request_holds(standin) -> None:  # type: ignore[no-untyped-def]
    # As above, for the sub-block pointers of a document that repeats part of one shown before.
    def paragraphs(name: str) -> str:
        return "\n\n".join(
            " ".join(
                f"{name} paragraph {k} sentence {i} says the cache keeps keys." for i in range(6)
            )
            for k in range(4)
        )

    bravo, charlie, tail = paragraphs("bravo"), paragraphs("charlie"), paragraphs("tail")
    url, state = standin
    with serve_proxy(url) as proxy:
        client = _client(proxy, session="pointer-branches")
        opening = _opening("What is kept?")
        _ask(client, opening, [D1])
        answer = {"role": "assistant", "content": "Tensors."}
        first = [*opening, answer, {"role": "user", "content": "And where?"}]
        _ask(client, first, [bravo, charlie])
        _ask(client, [*opening, answer, {"role": "user", "content": "And when?"}], [charlie])
        _ask(
            client,
            [*first, answer, {"role": "user", "content": "Thanks."}],
            [charlie + "\n\n" + tail],
        )
        bodies = state.bodies("/v1/chat/completions")
        assert "[Doc 2]\n" + charlie in bodies[1]["messages"][3]["content"]
        newest = bodies[3]["messages"][5]["content"]
        assert "[Doc 1] of turn 2" not in newest
        assert charlie in newest or "[Doc 2] of turn 2" in newest


def test_one_conversation_never_holds_more_than_the_tenants_bound() -> None:
    from contextpilot_integrations.service.proxy.document_placement import (
        DocumentMemory,
        _Sent,
    )

    memory = DocumentMemory(max_bytes=1000)
    for turn in range(1, 101):
        memory.put("c", bytes([turn]) * 16, _Sent({"content": "x" * 490}, 500, turn))
    assert memory.lookup("c", bytes([100]) * 16) is not None
    assert memory.lookup("c", bytes([99]) * 16) is not None
    assert memory.lookup("c", bytes([1]) * 16) is None
    held = memory._conversations.get("c")
    assert held is not None and held.size <= 1000 and len(held.entries) == 2


def test_two_chats_under_one_id_that_open_alike_never_get_each_others_documents(standin) -> None:  # type: ignore[no-untyped-def]
    # A client with a fixed session header (or one `user` for many people) runs two chats that
    # open with the same question: chat A's next call must not carry chat B's documents.
    url, state = standin
    with serve_proxy(url) as proxy:
        client = _client(proxy, session="shared-id")
        opening = _opening("What do these documents say?")
        _ask(client, opening, [D1, D2])  # chat A
        _ask(client, opening, [D3, D4])  # chat B
        answer = {"role": "assistant", "content": "Tensors."}
        raw = _ask(client, [*opening, answer, {"role": "user", "content": "More?"}], [D5])
        sent = state.bodies("/v1/chat/completions")[2]["messages"]
        assert D3 not in sent[1]["content"] and D4 not in sent[1]["content"]
        # Neither chat's message is put back (the proxy cannot tell which one this continues),
        # so no hint names an earlier turn either.
        assert sent[1]["content"] == "What do these documents say?"
        assert "x-contextpilot-restored" not in raw.headers
        assert "of turn 1" not in sent[3]["content"]


def test_a_chain_sent_twice_alike_is_kept_and_twice_differently_is_not() -> None:
    from contextpilot_integrations.service.proxy.document_placement import (
        DocumentMemory,
        _Sent,
    )

    memory = DocumentMemory()
    same = _Sent({"role": "user", "content": "a"}, 10, 1)
    memory.put("c", b"chain", same)
    memory.put("c", b"chain", _Sent({"role": "user", "content": "a"}, 10, 1))
    assert memory.lookup("c", b"chain") == same
    memory.put("c", b"chain", _Sent({"role": "user", "content": "b"}, 10, 1))
    assert memory.lookup("c", b"chain") is None
    memory.put("c", b"chain", same)  # ambiguous for good
    assert memory.lookup("c", b"chain") is None
    held = memory._conversations.get("c")
    assert held is not None and held.size == 0
