"""The formatter and the prompt template render exactly the plan's prompt; two prompts sharing
blocks share a byte-identical (and token-identical) prefix; the annotation comes after it."""

from __future__ import annotations

import logging
import pickle

import pytest
from contextpilot_bench.testbed.chat_template import render_chat, tokenize_prompt
from contextpilot_bench.testbed.model_dir import prepare_model_dir
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnablePassthrough
from langchain_support import Bm25sRetriever, ListRetriever, RecordingPilot
from tokenizers import Tokenizer

from contextpilot_integrations import ContextPilot, PromptLayout
from contextpilot_integrations.core.placement_metadata import METADATA_KEY
from contextpilot_integrations.langchain import (
    CONTEXTPILOT_PROMPT,
    ContextPilotPromptValue,
    ContextPilotRetriever,
    RenderedContext,
    contextpilot_prompt,
    document_formatter,
    format_documents,
    render_context,
)

ANNOTATION = "Read the documents in this priority order"


def chain_for(retriever, prompt=CONTEXTPILOT_PROMPT, formatter=format_documents):
    return {"context": retriever | formatter, "question": RunnablePassthrough()} | prompt


def as_dicts(prompt_value: ContextPilotPromptValue) -> list[dict[str, str]]:
    roles = {"system": "system", "human": "user", "ai": "assistant"}
    return [{"role": roles[m.type], "content": m.content} for m in prompt_value.to_messages()]


def long_article(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


@pytest.fixture
def article_lines(multihop_documents) -> list[str]:
    """Real sentences (MultiHop-RAG evidence facts), one per line."""
    lines = [line for doc in multihop_documents for line in doc.page_content.split("\n")[1:]]
    return [line for line in lines if len(line) > 60][:120]


def test_rendered_messages_equal_the_plan_messages(topic_documents):
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=topic_documents, k=4), pilot=pilot
    )
    chain = chain_for(retriever)
    for question in ("prefix cache eviction", "bm25 ranking of documents", "tokenizer merges"):
        value = chain.invoke(question)
        plan = pilot.plans[-1]
        assert isinstance(value, ContextPilotPromptValue) and value.rid == plan.rid
        assert as_dicts(value) == plan.messages
        assert value.schedule_position is None


def test_rendered_messages_equal_the_plan_with_hints_and_sub_block_pointers(article_lines):
    # Turn 1 shows article A; turn 2 retrieves A again (replaced by a hint) and B, which repeats
    # most of A's lines (replaced by sub-block pointers inside B).
    a = long_article(article_lines[:60])
    b = long_article(article_lines[:48] + article_lines[100:110])
    c = long_article(article_lines[60:80])
    docs = {
        name: Document(page_content=t, metadata={"name": name}) for name, t in zip("abc", (a, b, c))
    }
    pilot = RecordingPilot()
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(
            results={"one": [docs["a"], docs["c"]], "two": [docs["b"], docs["a"]]}
        ),
        pilot=pilot,
    )
    chain = chain_for(retriever)
    config = {
        "metadata": {"contextpilot_conversation_id": "conv", "contextpilot_visible_turns": "all"}
    }
    first = chain.invoke("one", config=config)
    assert as_dicts(first) == pilot.plans[-1].messages
    second = chain.invoke("two", config=config)
    plan = pilot.plans[-1]
    assert as_dicts(second) == plan.messages
    assert any(p.status == "replaced" for p in plan.placements) and plan.hints  # A: a hint
    assert any(block.rendered_text != block.text for block in plan.blocks)  # pointers inside B
    returned = retriever.invoke(
        "two",
        config={
            "metadata": {"contextpilot_conversation_id": "x", "contextpilot_visible_turns": "all"}
        },
    )
    assert all(
        d.metadata[METADATA_KEY]["status"] == "shown" for d in returned
    )  # other conversation

    # The documents say what happened, and keep the original text.
    retriever.invoke(
        "one",
        config={
            "metadata": {"contextpilot_conversation_id": "z", "contextpilot_visible_turns": "all"}
        },
    )
    result = retriever.invoke(
        "two",
        config={
            "metadata": {"contextpilot_conversation_id": "z", "contextpilot_visible_turns": "all"}
        },
    )
    by_name = {d.metadata["name"]: d for d in result}
    b_entry = by_name["b"].metadata[METADATA_KEY]
    assert b_entry["status"] == "shown" and b_entry["original_page_content"] == b
    assert by_name["b"].page_content != b  # sub-blocks replaced by pointers
    assert "[Repeated passage: see [Doc 1] of turn 1" in by_name["b"].page_content
    a_entry = by_name["a"].metadata[METADATA_KEY]
    assert a_entry["status"] == "replaced" and a_entry["original_page_content"] == a
    assert by_name["a"].page_content == a_entry["hint"]
    rendered = format_documents.invoke(result)
    plan = retriever.pilot.plan_for(a_entry["rid"])
    assert rendered == plan.context and rendered.endswith(plan.context_tail)
    assert a_entry["hint"] in plan.context_tail


def test_two_prompts_sharing_blocks_share_a_byte_identical_prefix(
    multihop_documents, multihop_questions
):
    base = Bm25sRetriever(documents=multihop_documents, k=6)
    # Two real questions whose top-6 share at least two articles.
    retrieved = [{d.page_content for d in base.invoke(q)} for q in multihop_questions[:80]]
    i, j = next(
        (i, j)
        for i in range(len(retrieved))
        for j in range(i + 1, len(retrieved))
        if len(retrieved[i] & retrieved[j]) >= 2
    )
    shared = retrieved[i] & retrieved[j]
    # Planned together (a batch), the shared articles lead both prompts.
    retriever = ContextPilotRetriever(base_retriever=base, pilot=ContextPilot())
    both = retriever.batch([multihop_questions[i], multihop_questions[j]])
    first, second = (
        CONTEXTPILOT_PROMPT.invoke({"context": format_documents.invoke(docs), "question": q})
        for docs, q in zip(both, (multihop_questions[i], multihop_questions[j]))
    )
    first, second = first.to_messages(), second.to_messages()
    assert first[0].content == second[0].content  # the system prompt
    one, two = first[1].content, second[1].content
    common = 0
    while common < min(len(one), len(two)) and one[common] == two[common]:
        common += 1
    layout = PromptLayout()
    covered = one[:common]
    lead = "".join(
        layout.render_block(p, d.page_content) for p, d in enumerate(both[0][: len(shared)])
    )
    assert {d.page_content for d in both[0][: len(shared)]} == shared
    assert {d.page_content for d in both[1][: len(shared)]} == shared
    assert covered.startswith(lead)
    assert all(text in covered for text in shared)
    # Everything request-specific comes after the shared prefix.
    assert one.index(ANNOTATION) >= common and two.index(ANNOTATION) >= common
    assert one.index("Question:") > one.index(ANNOTATION)


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory) -> Tokenizer:
    """A real byte-level BPE tokenizer with a ChatML template (the vLLM CPU test model's)."""
    directory = prepare_model_dir(
        tmp_path_factory.mktemp("model"), vocab=4096, corpus_bytes=1_000_000
    )
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def test_shared_prefix_is_token_identical_with_a_real_tokenizer(
    multihop_documents, multihop_questions, bpe_tokenizer
):
    retriever = ContextPilotRetriever(
        base_retriever=Bm25sRetriever(documents=multihop_documents, k=5), pilot=ContextPilot()
    )
    layout = PromptLayout()
    requests = []
    for question in multihop_questions[:60]:
        docs = retriever.invoke(question)
        value = CONTEXTPILOT_PROMPT.invoke(
            {"context": format_documents.invoke(docs), "question": question}
        )
        requests.append((as_dicts(value), [d.page_content for d in docs]))
    checked = 0
    for x in range(len(requests)):
        for y in range(x + 1, len(requests)):
            (messages_x, blocks_x), (messages_y, blocks_y) = requests[x], requests[y]
            n = 0
            while n < min(len(blocks_x), len(blocks_y)) and blocks_x[n] == blocks_y[n]:
                n += 1
            if n == 0:
                continue
            # The chat-templated text up to the end of the shared blocks, tokenized alone,
            # must be a token prefix of both prompts (no BPE merge across the block boundary).
            shared = "".join(layout.render_block(p, text) for p, text in enumerate(blocks_x[:n]))
            head = render_chat(
                [messages_x[0], {"role": "user", "content": shared}], add_generation_prompt=False
            )
            head = head[: -len("<|im_end|>\n")]
            head_tokens = bpe_tokenizer.encode(head, add_special_tokens=False).ids
            for messages in (messages_x, messages_y):
                assert tokenize_prompt(bpe_tokenizer, messages)[: len(head_tokens)] == head_tokens
            checked += 1
    assert checked >= 20, f"only {checked} pairs of MultiHop-RAG requests share leading blocks"


def test_formatter_without_a_plan_and_with_mixed_plans(topic_documents, caplog):
    plain = topic_documents[:3]
    rendered = format_documents.invoke(plain)
    assert rendered.rid is None and ANNOTATION not in rendered
    assert rendered == "".join(
        PromptLayout().render_block(i, d.page_content) for i, d in enumerate(plain)
    )

    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(results={"a": plain, "b": topic_documents[3:5]})
    )
    mixed = retriever.invoke("a") + retriever.invoke("b")
    with caplog.at_level(logging.WARNING):
        rendered = render_context(mixed)
    assert rendered.rid is None and "2 different plans" in caplog.text
    # Hints of documents from several plans come after all their blocks (the core's tail).
    meta = {"metadata": {"contextpilot_conversation_id": "m", "contextpilot_visible_turns": "all"}}
    retriever.invoke("a", config=meta)
    hinted = retriever.invoke("a", config=meta)
    hints = [d.page_content for d in hinted]
    other = retriever.invoke("b")
    rendered = render_context(other + hinted)
    blocks = "".join(PromptLayout().render_block(i, d.page_content) for i, d in enumerate(other))
    assert rendered == blocks + PromptLayout().context_tail(hints=hints)
    assert all(d.metadata[METADATA_KEY]["status"] == "replaced" for d in hinted)

    reordered = list(reversed(retriever.invoke("a")))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        render_context(reordered)
    assert "reordered after the retriever" in caplog.text
    with pytest.raises(TypeError, match="documents must be a list of Document"):
        render_context("text")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"documents\[1\] must be a Document"):
        render_context([plain[0], "x"])  # type: ignore[list-item]


def test_rendered_context_keeps_its_request_through_pickle_and_templates():
    context = RenderedContext("[Doc 1]\ntext\n-----\n", rid="cp-1", schedule_position=3)
    again = pickle.loads(pickle.dumps(context))
    assert again == context and again.rid == "cp-1" and again.schedule_position == 3
    value = CONTEXTPILOT_PROMPT.invoke({"context": context, "question": "why?"})
    assert value.rid == "cp-1" and value.schedule_position == 3
    assert value.to_messages()[-1].content == "[Doc 1]\ntext\n-----\nQuestion: why?\nAnswer:"
    plain = CONTEXTPILOT_PROMPT.invoke({"context": "x", "question": "y"})
    assert plain.rid is None


def test_custom_layout_with_braces_and_history():
    layout = PromptLayout(
        system_prompt='Answer in JSON like {"answer": ...}.',
        question_template="Q: {question}\nA:",
        label_template="<doc {position}>",
    )
    prompt = contextpilot_prompt(layout)
    retriever = ContextPilotRetriever(
        base_retriever=ListRetriever(
            results={"q": [Document(page_content="alpha"), Document(page_content="beta")]}
        ),
        pilot=RecordingPilot(ContextPilot(layout=layout)),
    )
    chain = chain_for(retriever, prompt=prompt, formatter=document_formatter(layout))
    value = chain.invoke("q")
    plan = retriever.pilot.plans[-1]
    assert as_dicts(value) == plan.messages
    assert value.to_messages()[0].content == layout.system_prompt
    history = [HumanMessage(content="earlier"), AIMessage(content="reply")]
    with_history = prompt.invoke({"context": "", "question": "q", "history": history})
    assert [m.type for m in with_history.to_messages()] == ["system", "human", "ai", "human"]
    no_system = contextpilot_prompt(PromptLayout(system_prompt=""), history_key=None)
    assert [m.type for m in no_system.invoke({"context": "", "question": "q"}).to_messages()] == [
        "human"
    ]
