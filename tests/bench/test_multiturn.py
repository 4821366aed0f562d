"""The multi-turn replay on the real MTRAG-UN conversations: the workload, prefix-stable prompts,
hints that only name text the prompt holds, and de-duplication beating the baseline."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from contextpilot_bench.cli import main
from contextpilot_bench.engine import EmbeddedEngine
from contextpilot_bench.multiturn import MULTITURN_METHODS, ReplayedTurn, replay, run_multiturn
from contextpilot_bench.multiturn_report import summarize_multiturn
from contextpilot_bench.prepared_conversations import (
    PreparedConversations,
    ReplayTurn,
    interleave_turns,
    prepare_conversations,
)
from contextpilot_bench.workloads import (
    Document,
    Request,
    Workload,
    load_workload,
)

from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.core.plan import PlacementStatus

COUNTER = ApproxTokenCounter()
SLICE = 400  # requests: the first 85 conversations


@pytest.fixture(scope="module")
def prepared(data_dir: Path) -> PreparedConversations:
    workload = load_workload("mtrag-conversations", data_dir).head(SLICE)
    return prepare_conversations(workload, 10, counter=COUNTER)


def _by_conversation(turns: list[ReplayedTurn]) -> dict[str, list[ReplayedTurn]]:
    grouped: dict[str, list[ReplayedTurn]] = {}
    for sent in turns:
        grouped.setdefault(sent.turn.conversation_id, []).append(sent)
    return grouped


# --- the workload ----------------------------------------------------------------------------


def test_workload_is_the_real_mtrag_un_conversations(data_dir: Path) -> None:
    workload = load_workload("mtrag-conversations", data_dir)
    assert len(workload.requests) == 2_191
    assert len(workload.corpus) == 1_152
    assert sorted(workload.scopes) == ["clapnq", "fiqa", "govt", "ibmcloud"]
    conversations = Counter(r.conversation_id for r in workload.requests)
    assert len(conversations) == 507
    assert max(conversations.values()) == 11
    # Every user turn but a conversation's last is followed by a recorded agent answer.
    assert sum(r.answer is not None for r in workload.requests) == 2_191 - 507
    first = workload.requests[0]
    assert first.id == "18ef26058d321c5d96ca3ebf8117789e::1"
    assert first.query == "How to pay with cash when car shopping?"
    assert first.answer is not None and first.answer.startswith("When paying with cash for a")
    # Same requests as the single-turn mtrag workload, in the same order.
    single = load_workload("mtrag", data_dir)
    assert [(r.id, r.query, r.scope) for r in single.requests] == [
        (r.id, r.query, r.scope) for r in workload.requests
    ]

    prepared = prepare_conversations(workload, 10, counter=COUNTER)
    assert len(prepared.conversations) == 507 and prepared.turns == 2_191
    last_turns = [conv[-1] for conv in prepared.conversations]
    assert all(
        t.answer is None and t.number == len(c) for t, c in zip(last_turns, prepared.conversations)
    )
    assert all(len(t.blocks) == 10 for conv in prepared.conversations for t in conv)
    share = prepared.repeat_share
    assert share.blocks <= 21_910 and 0.1 < share.block_share < 0.5


def test_conversation_retrieval_query_repeats_more_blocks(data_dir: Path) -> None:
    workload = load_workload("mtrag-conversations", data_dir).head(SLICE)
    by_turn = prepare_conversations(workload, 10, counter=COUNTER).repeat_share
    by_conversation = prepare_conversations(
        workload, 10, counter=COUNTER, retrieval_query="conversation"
    ).repeat_share
    assert by_conversation.block_share > by_turn.block_share


# --- prompts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sessions", [1, 8])
@pytest.mark.parametrize("method", MULTITURN_METHODS)
def test_earlier_prompt_is_a_byte_identical_prefix_of_the_later(
    prepared: PreparedConversations, method: str, sessions: int
) -> None:
    turns = list(replay(prepared, method, sessions=sessions))
    assert len(turns) == SLICE
    system = prepared.layout.system_segment()
    checked = 0
    for conversation in _by_conversation(turns).values():
        assert [s.turn.number for s in conversation] == list(range(1, len(conversation) + 1))
        for before, after in zip(conversation, conversation[1:]):
            assert after.segments[: len(before.segments)] == before.segments
            prompt_before, prompt_after = "".join(before.segments), "".join(after.segments)
            assert prompt_after.startswith(prompt_before)
            # After the earlier prompt's "Answer:" comes the answer the data records.
            assert prompt_after[len(prompt_before) :].startswith(f" {before.turn.answer.strip()}\n")
            checked += 1
        for sent in conversation:
            assert sent.segments[0] == system
            assert sent.turns == tuple(range(1, sent.turn.number + 1))
            for number, start in zip(sent.turns, sent.starts):
                assert sent.segments[start] == prepared.layout.turn_header.format(turn=number)
            if method == "alignment+dedup":
                # The turn was planned as the number its header shows (the hints name it).
                assert sent.plan is not None and sent.plan.scope.turn == sent.turn.number
            assert sent.segments[-1].endswith(f"Question: {sent.turn.question}\nAnswer:")
    assert checked == SLICE - len(_by_conversation(turns))


def test_engine_reuses_the_whole_earlier_prompt(prepared: PreparedConversations) -> None:
    # Unlimited cache, conversations one after the other: each later turn finds at least its
    # previous turn's whole prompt cached.
    for method in MULTITURN_METHODS:
        result = run_multiturn(
            method, prepared, engine_factory=lambda: EmbeddedEngine(None, counter=COUNTER)
        )
        records = result.result.records
        turns = list(replay(prepared, method))
        for previous, record, sent, sent_before in zip(records, records[1:], turns[1:], turns):
            if sent.turn.number > 1:
                assert sent.turn.conversation_id == sent_before.turn.conversation_id
                assert record.cached_tokens >= previous.prompt_tokens


def test_prompts_are_prefix_stable_in_tokens(
    prepared: PreparedConversations, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # A byte-level BPE tokenizer (GPT-2 pre-tokenizer) trained by the engines package.
    from contextpilot_bench.testbed.model_dir import prepare_model_dir
    from tokenizers import Tokenizer

    model_dir = prepare_model_dir(tmp_path_factory.mktemp("model"), seed=0)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    turns = list(replay(prepared, "alignment+dedup"))
    conversations = list(_by_conversation(turns).values())[:15]
    checked = 0
    for conversation in conversations:
        for before, after in zip(conversation, conversation[1:]):
            ids_before = tokenizer.encode("".join(before.segments)).ids
            ids_after = tokenizer.encode("".join(after.segments)).ids
            assert ids_after[: len(ids_before)] == ids_before
            checked += 1
    assert checked > 30


# --- hints -----------------------------------------------------------------------------------

_REFERENCE = re.compile(r"(\[Doc (\d+)\]) (?:of turn (\d+)|in this message)")
_POINTER = re.compile(
    r"\[Repeated passage: see (\[Doc (\d+)\]) (?:of turn (\d+)|in this message), "
    r'from "(.*?)" to "(.*?)"\.\]'
)


def _turn_blocks(sent: ReplayedTurn, number: int) -> list[str]:
    """The rendered block segments of turn ``number`` in ``sent``'s prompt (fails if absent)."""
    assert number in sent.turns, f"turn {number} is not in the prompt of {sent.rid}"
    at = sent.turns.index(number)
    start = sent.starts[at] + 1
    end = sent.starts[at + 1] if at + 1 < len(sent.starts) else len(sent.segments)
    # header, blocks..., tail (, answer for an earlier turn)
    stop = end - (1 if number == sent.turn.number else 2)
    return sent.segments[start:stop]


def _squash(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("history_turns", [None, 2, 0])
def test_hints_name_only_text_the_prompt_holds(
    prepared: PreparedConversations, history_turns: int | None
) -> None:
    layout = prepared.layout
    hints = pointers = 0
    for sent in replay(prepared, "alignment+dedup", history_turns=history_turns):
        plan = sent.plan
        assert plan is not None
        if history_turns is not None:
            assert len(sent.turns) <= history_turns + 1
        # Nothing lost: every input block is kept, a duplicate in the request, or replaced.
        kept = (PlacementStatus.SHOWN, PlacementStatus.DUPLICATE, PlacementStatus.REPLACED)
        indices = sorted(p.index for p in plan.placements if p.status in kept)
        assert indices == list(range(len(sent.turn.blocks)))
        tail = sent.segments[-1]
        replaced = [p for p in plan.placements if p.status is PlacementStatus.REPLACED]
        for index, hint in ((p.index, p.hint) for p in replaced):
            assert hint is not None and hint in plan.hints and hint in tail
            match = _REFERENCE.search(hint)
            assert match is not None, hint
            label, position, turn = match.group(1), int(match.group(2)), match.group(3)
            number = int(turn) if turn else sent.turn.number
            assert number != sent.turn.number or turn is None
            blocks = _turn_blocks(sent, number)
            # The identical text stands in full under that label in that turn.
            assert blocks[position - 1] == layout.render_block(
                position - 1, sent.turn.blocks[index]
            ), (sent.rid, hint)
            assert blocks[position - 1].startswith(f"{label}\n")
            hints += 1
        for block in plan.blocks:
            assert block.rendered_text is not None
            for match in _POINTER.finditer(block.rendered_text):
                position, turn = int(match.group(2)), match.group(3)
                number = int(turn) if turn else sent.turn.number
                named = _turn_blocks(sent, number)[position - 1]
                head, end = match.group(4), match.group(5)
                assert head and end
                assert head in _squash(named) and end in _squash(named), (sent.rid, match[0])
                assert head in _squash(block.text) and end in _squash(block.text)
                pointers += 1
        if history_turns == 0:
            assert not any("of turn" in h for h in plan.hints)
    if history_turns is None:
        assert hints > 300 and pointers > 10, (hints, pointers)
    elif history_turns == 2:
        assert hints > 100


def test_no_conversation_id_means_no_hints(prepared: PreparedConversations) -> None:
    for sent in replay(prepared, "alignment"):
        assert sent.plan is not None
        assert not sent.plan.hints
        assert all(p.status is not PlacementStatus.REPLACED for p in sent.plan.placements)
        assert sent.plan.scope.conversation_id is None and sent.plan.scope.turn is None


# --- figures ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("sessions", "cache"), [(1, None), (8, 60_000)])
def test_alignment_and_dedup_beat_the_baseline(
    prepared: PreparedConversations, sessions: int, cache: int | None
) -> None:
    results = [
        run_multiturn(
            method,
            prepared,
            sessions=sessions,
            engine_factory=lambda: EmbeddedEngine(cache, counter=COUNTER),
        )
        for method in MULTITURN_METHODS
    ]
    rows = {row["method"]: row for row in summarize_multiturn(results)}
    base, aligned, dedup = rows["baseline"], rows["alignment"], rows["alignment+dedup"]
    assert base["requests"] == aligned["requests"] == dedup["requests"] == SLICE
    assert base["prefill_vs_baseline"] == 1.0
    assert aligned["prefill_tokens"] < base["prefill_tokens"]
    assert dedup["prefill_tokens"] < 0.85 * base["prefill_tokens"], (dedup, base)
    assert dedup["prompt_tokens"] < aligned["prompt_tokens"]
    assert dedup["blocks_replaced"] > 0 and dedup["tokens_saved"] > 0
    assert aligned["blocks_replaced"] == 0 and base["blocks_replaced"] is None
    assert dedup["plan_ms_median"] is not None and base["plan_ms_median"] is None
    if cache is not None:
        for r in results:
            assert r.result.cache is not None and r.result.cache.peak_used_tokens <= cache
            assert r.result.cache.evicted_tokens > 0


# --- interleaving and bad input ---------------------------------------------------------------


def _turns(conversation: str, count: int) -> list[ReplayTurn]:
    return [
        ReplayTurn(0, f"{conversation}{n}", conversation, n, "q", None, ())
        for n in range(1, count + 1)
    ]


def test_interleave_round_robin_refills_slots() -> None:
    a, b, c = _turns("a", 3), _turns("b", 1), _turns("c", 2)
    order = [t.request_id for t in interleave_turns([a, b, c], 2)]
    assert order == ["a1", "b1", "a2", "c1", "a3", "c2"]
    assert [t.request_id for t in interleave_turns([a, b, c], 1)] == [
        "a1",
        "a2",
        "a3",
        "b1",
        "c1",
        "c2",
    ]
    assert [t.request_id for t in interleave_turns([a, b, c], 32)] == [
        "a1",
        "b1",
        "c1",
        "a2",
        "c2",
        "a3",
    ]
    with pytest.raises(ValueError, match="sessions must be >= 1, got 0"):
        interleave_turns([a], 0)
    with pytest.raises(TypeError, match="sessions must be an int"):
        interleave_turns([a], 2.0)  # type: ignore[arg-type]


def test_bad_input_is_named() -> None:
    workload = Workload("w", (Document("d", "text"),), (Request("r1", "q"),))
    with pytest.raises(ValueError, match="request 'r1' has no conversation_id"):
        prepare_conversations(workload, 3, counter=COUNTER)
    with pytest.raises(ValueError, match="retrieval_query must be one of"):
        prepare_conversations(workload, 3, counter=COUNTER, retrieval_query="all")
    ok = Workload("w", (Document("d", "text"),), (Request("r1", "q", conversation_id="c"),))
    prepared = prepare_conversations(ok, 3, counter=COUNTER)
    with pytest.raises(ValueError, match="method must be one of"):
        next(replay(prepared, "contextpilot"))
    with pytest.raises(ValueError, match="history_turns must be None or an int >= 0, got -1"):
        next(replay(prepared, "baseline", history_turns=-1))


# --- the command ------------------------------------------------------------------------------


def test_cli_prints_figures_target_and_writes_json(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "multiturn.json"
    args = ["--data-dir", str(data_dir), "--workload", "mtrag-conversations", "--limit", "120"]
    assert main([*args, "--out", str(out), "--plot", str(tmp_path / "mt.png")]) == 0
    text = capsys.readouterr().out
    assert "workload mtrag-conversations: 25 conversations, 120 turns" in text
    assert "capacity unlimited" in text
    assert "also retrieved" in text
    assert re.search(
        r"sessions 1: alignment\+dedup prefill tokens = 0\.\d{3} of the baseline's "
        r"\(target <= 0\.6: (ok|MISSED)\)\n",
        text,
    )
    for header in ("prefill tokens", "hit ratio", "prefill vs baseline", "plan ms p50"):
        assert header in text
    document = json.loads(out.read_text())
    assert document["run"]["k"] == 10 and document["run"]["cache_tokens"] is None
    assert [(r["method"], r["sessions"]) for r in document["results"]] == [
        (m, 1) for m in MULTITURN_METHODS
    ]
    for result, row in zip(document["results"], document["summary"]):
        assert len(result["records"]) == 120
        assert sum(r["cached_tokens"] for r in result["records"]) == row["cached_tokens"]
    assert (tmp_path / "mt.png").read_bytes()[:4] == b"\x89PNG"

    mixed = [*args, "--sessions", "2,8", "--cache-tokens", "40000", "--no-plot"]
    assert main([*mixed, "--methods", "baseline,alignment+dedup"]) == 0
    text = capsys.readouterr().out
    assert "capacity 40,000 tokens" in text
    assert "sessions 2: alignment+dedup" in text and "sessions 8: alignment+dedup" in text
    assert "(the target <= 0.6 is for k=10 on an unlimited cache)" in text
    assert "MISSED" not in text and ": ok" not in text

    assert main([*args, "--sessions", "0"]) == 2
    assert "--sessions must be integers >= 1" in capsys.readouterr().err
    assert main([*args, "--methods", "contextpilot"]) == 2
    assert "--methods: unknown ['contextpilot']" in capsys.readouterr().err
    assert main([*args, "--retriever", "mem0"]) == 2
    assert "--retriever mem0 is not supported" in capsys.readouterr().err
