"""The prompts LlamaIndex actually sends, formatted by the real response synthesizer: the
prompt layout, byte-identical over shared nodes, exact plan text, and the fallbacks."""

from __future__ import annotations

import logging

import pytest
from llama_index.core import get_response_synthesizer
from llama_index.core.llms import MockLLM
from llama_index.core.response_synthesizers import ResponseMode
from llama_index.core.schema import MetadataMode

from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.llama_index import (
    ContextPilotNodePostprocessor,
    text_qa_template,
)
from contextpilot_integrations.llama_index.request_ids import pending_request


def _synthesizer(pp: ContextPilotNodePostprocessor, **kwargs: object):  # type: ignore[no-untyped-def]
    return get_response_synthesizer(
        llm=kwargs.pop("llm", MockLLM()), text_qa_template=text_qa_template(pp), **kwargs
    )


def test_completion_prompt_is_exactly_the_plan(retrieved, questions, recorder) -> None:
    pp = ContextPilotNodePostprocessor()
    synthesizer = _synthesizer(pp)
    for query, nodes in zip(questions[:6], retrieved[:6]):
        out = pp.postprocess_nodes(nodes, query_str=query)
        synthesizer.synthesize(query, out)
        assert recorder.prompts[-1] == pp.plan_for(out).prompt  # type: ignore[union-attr]
    prompt = recorder.prompts[-1]
    layout = PromptLayout()
    # [system][blocks][annotation][question]
    assert prompt.startswith(layout.system_segment() + "[Doc 1]\n")
    plan = pp.plan_for(out)
    # The annotation is left out when the prompt already shows relevance order.
    if plan.annotation_labels:  # type: ignore[union-attr]
        annotation = prompt.index("Read the documents in this priority order:")
        assert prompt.rindex("-----\n") < annotation < prompt.index(f"Question: {questions[5]}")
    else:
        assert prompt.rindex("-----\n") < prompt.index(f"Question: {questions[5]}")
    assert prompt.endswith("\nAnswer:")


def test_chat_model_gets_exactly_the_plan_messages(retrieved, questions, recorder) -> None:
    pp = ContextPilotNodePostprocessor()
    synthesizer = _synthesizer(pp, llm=MockLLM(is_chat_model=True))
    out = pp.postprocess_nodes(retrieved[0], query_str=questions[0])
    synthesizer.synthesize(questions[0], out)
    plan = pp.plan_for(out)
    expected = "".join(f"{m['role']}: {m['content']}\n" for m in plan.messages)  # type: ignore[union-attr]
    assert recorder.prompts[-1] == expected


def test_two_queries_sharing_nodes_share_a_byte_identical_prefix(
    retrieved, questions, recorder
) -> None:
    """Query 2 gets the nodes of query 1 in another order plus others: its prompt must start
    with the bytes of query 1's prompt over the nodes they share."""
    pp = ContextPilotNodePostprocessor()
    synthesizer = _synthesizer(pp)
    first = retrieved[0]
    out1 = pp.postprocess_nodes(first, query_str=questions[0])
    synthesizer.synthesize(questions[0], out1)
    # Query 2: two of query 1's nodes, reversed, around two nodes of another question.
    shared = [out1[1], out1[0]]
    others = [n for n in retrieved[20] if n.node.node_id not in {m.node.node_id for m in first}]
    second = [others[0], shared[0], others[1], shared[1]]
    out2 = pp.postprocess_nodes(second, query_str=questions[20])
    synthesizer.synthesize(questions[20], out2)
    p1, p2 = recorder.prompts
    layout = PromptLayout()
    texts = [n.node.get_content(metadata_mode=MetadataMode.LLM).strip() for n in out1[:2]]
    shared_prefix = layout.system_segment() + "".join(
        layout.render_block(i, t) for i, t in enumerate(texts)
    )
    assert p1.startswith(shared_prefix) and p2.startswith(shared_prefix)
    assert [n.node.node_id for n in out2[:2]] == [n.node.node_id for n in out1[:2]]
    assert pp.plan_for(out2).matched_prefix_blocks == 2  # type: ignore[union-attr]
    # And token-identical with a real BPE tokenizer (LlamaIndex's cl100k_base).
    from llama_index.core.utils import get_tokenizer

    encode = get_tokenizer()
    head = encode(shared_prefix)
    assert encode(p1)[: len(head)] == head == encode(p2)[: len(head)]


def test_every_matched_prefix_is_byte_identical_to_an_earlier_prompt(
    retrieved, questions, recorder
) -> None:
    """Forty real queries in a row: whenever the index matched a prefix, the prompt's bytes up
    to the end of those blocks equal the start of an earlier prompt."""
    pp = ContextPilotNodePostprocessor()
    synthesizer = _synthesizer(pp)
    layout = PromptLayout()
    matched = 0
    for query, nodes in zip(questions, retrieved):
        out = pp.postprocess_nodes(nodes, query_str=query)
        synthesizer.synthesize(query, out)
        plan = pp.plan_for(out)
        m = plan.matched_prefix_blocks  # type: ignore[union-attr]
        if m:
            matched += 1
            head = layout.system_segment() + "".join(plan.segments[1 : 1 + m])  # type: ignore[union-attr]
            assert any(p.startswith(head) for p in recorder.prompts[:-1])
    assert matched >= 10


def test_stock_template_still_gets_aligned_lossless_context(retrieved, questions, recorder) -> None:
    pp = ContextPilotNodePostprocessor()
    synthesizer = get_response_synthesizer(llm=MockLLM())  # LlamaIndex's default template
    out = pp.postprocess_nodes(retrieved[0], query_str=questions[0])
    synthesizer.synthesize(questions[0], out)
    prompt = recorder.prompts[-1]
    positions = [
        prompt.index(n.node.get_content(metadata_mode=MetadataMode.LLM).strip()) for n in out
    ]
    assert positions == sorted(positions)  # every node, in the aligned order
    assert "contextpilot" not in prompt and "[Doc 1]" not in prompt


def test_unmatched_context_falls_back_to_the_given_text_and_warns_once(
    retrieved, questions, recorder, caplog: pytest.LogCaptureFixture
) -> None:
    pp = ContextPilotNodePostprocessor()
    # Refine mode formats one node at a time: no plan matches a single node's text.
    synthesizer = _synthesizer(pp, response_mode=ResponseMode.REFINE)
    out = pp.postprocess_nodes(retrieved[0], query_str=questions[0])
    with caplog.at_level(logging.WARNING):
        synthesizer.synthesize(questions[0], out)
    first = out[0].node.get_content(metadata_mode=MetadataMode.LLM).strip()
    assert recorder.prompts[0] == (
        PromptLayout().system_segment()
        + first
        + "\n"
        + PromptLayout().question_template.format(question=questions[0])
    )
    warnings = [r for r in caplog.records if "no ContextPilot plan matches" in r.getMessage()]
    assert len(warnings) == 1


def test_rendering_arms_the_request_it_renders(retrieved, questions) -> None:
    pp = ContextPilotNodePostprocessor()
    out_a = pp.postprocess_nodes(retrieved[0], query_str=questions[0])
    out_b = pp.postprocess_nodes(retrieved[1], query_str=questions[1])
    assert pending_request().rid == pp.plan_for(out_b).rid  # type: ignore[union-attr]
    # Formatting A's context (another step, another order of events) arms A's rid.
    template = text_qa_template(pp)
    context = "\n\n".join(n.node.get_content(metadata_mode=MetadataMode.LLM) for n in out_a)
    prompt = template.format(context_str=context, query_str=questions[0])
    assert prompt == pp.plan_for(out_a).prompt  # type: ignore[union-attr]
    assert pending_request().rid == pp.plan_for(out_a).rid  # type: ignore[union-attr]


def test_templates_survive_deepcopy_and_reject_other_objects() -> None:
    import copy

    pp = ContextPilotNodePostprocessor()
    template = text_qa_template(pp)
    clone = copy.deepcopy(template)
    renderer = clone.default_template.function_mappings["context_str"].__self__  # type: ignore[union-attr]
    assert renderer.plans is pp.plans and renderer.sections is pp.sections
    with pytest.raises(TypeError, match="must be a ContextPilotNodePostprocessor"):
        text_qa_template(object())  # type: ignore[arg-type]
    # The turn header is the layout's field, checked where the layout is made.
    with pytest.raises(ValueError, match="turn_header must contain"):
        PromptLayout(turn_header="Turn:\n")


def test_custom_layout_is_used(retrieved, recorder) -> None:
    from contextpilot_integrations import ContextPilot

    layout = PromptLayout(system_prompt="", question_template="Q: {question}\nA:")
    pp = ContextPilotNodePostprocessor(ContextPilot(layout=layout))
    synthesizer = _synthesizer(pp)
    out = pp.postprocess_nodes(retrieved[2], query_str="who?")
    synthesizer.synthesize("who?", out)
    assert recorder.prompts[-1].startswith("[Doc 1]\n")
    assert recorder.prompts[-1].endswith("Q: who?\nA:")
    assert recorder.prompts[-1] == pp.plan_for(out).prompt  # type: ignore[union-attr]
    chat = _synthesizer(pp, llm=MockLLM(is_chat_model=True))
    out = pp.postprocess_nodes(retrieved[3], query_str="who?")
    chat.synthesize("who?", out)
    assert recorder.prompts[-1].startswith("user: [Doc 1]\n")  # no empty system message
