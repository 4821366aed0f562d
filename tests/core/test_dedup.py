"""Multi-turn de-duplication: lossless hints, isolation, visibility, odd texts, threads."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.core.blocks import block_id
from contextpilot_integrations.core.conversations.chunking import ContentChunker
from contextpilot_integrations.core.conversations.conversation import ConversationStore
from contextpilot_integrations.core.conversations.dedup import Deduplicator, DedupPlan
from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.hint_wording import HintWording
from contextpilot_integrations.core.rendering import PromptLayout


class SentDeduplicator(Deduplicator):
    """Commits each turn as the planner does once its plan is handed out."""

    def plan(self, *args, **kwargs) -> DedupPlan:  # type: ignore[no-untyped-def]
        plan = super().plan(*args, **kwargs)
        if plan.pending is not None:
            plan.pending.commit()
        return plan


SMALL_CHUNKS = ContentChunker(modulus=2, min_bytes=40, max_bytes=200)
SHORT_WORDING = HintWording(
    earlier_turn="{label}@{turn}",
    this_turn="{label}@here",
    block_hint="see {where}",
    sub_block_pointer="[{where}#{part}]",
)


def _paragraph(seed: int, lines: int = 12) -> str:
    rng = random.Random(seed)
    words = ["cache", "prefix", "token", "block", "engine", "query", "index", "turn", "model"]
    return "".join(
        " ".join(rng.choices(words, k=rng.randint(4, 14))) + f" {seed}-{i}\n" for i in range(lines)
    )


DOCS = [_paragraph(s) for s in range(6)]  # ~12 lines, ~700 bytes each


# --- a model of what each conversation's prompts showed, to check every hint against --------


@dataclass
class Shown:
    original: str
    rendered: str
    literal_parts: set[int]


@dataclass
class Transcript:
    turns: dict[int, dict[str, Shown]] = field(default_factory=dict)

    def latest(self) -> int:
        return max(self.turns, default=0)


def check_plan(
    plan: DedupPlan,
    texts: list[str],
    transcript: Transcript | None,
    visibility: TurnVisibility,
    chunker: ContentChunker | None,
) -> None:
    """Every block comes back, and every hint/pointer names identical literal text in a
    visible turn of the same conversation (or earlier in this prompt)."""
    assert [b.index for b in plan.blocks] == list(range(len(texts)))
    assert [b.block_id for b in plan.blocks] == [block_id(t) for t in texts]
    if transcript is None:
        assert plan.turn is None and plan.blocks_replaced == 0 and plan.sub_blocks_replaced == 0
        assert [b.text for b in plan.blocks] == texts
        return
    turn = plan.turn
    assert turn is not None
    for old in [t for t in transcript.turns if t >= turn]:
        del transcript.turns[old]
    current: dict[str, Shown] = {}
    transcript.turns[turn] = current

    def place(turn_number: int, label: str) -> Shown:
        if turn_number == turn:
            return current[label]  # KeyError: points below itself or to nothing
        assert turn_number < turn and visibility.includes(turn_number, turn)
        return transcript.turns[turn_number][label]

    for block, text in zip(plan.blocks, texts, strict=True):
        assert (block.text is None) != (block.hint is None)
        if not block.kept:
            assert block.source is not None and block.source.part is None
            shown = place(block.source.turn, block.source.label)
            assert shown.original == text and shown.rendered == text
            assert block.source.label in block.reference and block.source.label in block.hint
            continue
        assert block.label is not None and block.label not in current
        assert block.reference == block.label
        label = block.label
        parts = chunker.split(text) if chunker else ()
        replaced = {i for p in block.pointers for i in range(p.part, p.part + p.count)}
        rebuilt, cursor = [], 0
        for pointer in block.pointers:
            piece = text[pointer.start : pointer.end]
            assert chunker is not None and pointer.source.part is not None and pointer.count >= 1
            run = parts[pointer.part : pointer.part + pointer.count]
            assert piece == "".join(sub.text for sub in run) and len(run) == pointer.count
            shown = place(pointer.source.turn, pointer.source.label)  # never this block
            at_source = range(pointer.source.part, pointer.source.part + pointer.count)
            assert set(at_source) <= shown.literal_parts
            source_parts = chunker.split(shown.original)
            assert "".join(source_parts[i].text for i in at_source) == piece
            rebuilt += [text[cursor : pointer.start], pointer.text]
            cursor = pointer.end
        assert block.text == "".join(rebuilt) + text[cursor:]
        current[label] = Shown(text, block.text, set(range(len(parts))) - replaced)
    assert plan.blocks_kept + plan.blocks_replaced == len(texts)
    assert plan.tokens_saved == sum(b.tokens_saved for b in plan.blocks)
    assert all(b.tokens_saved >= (1 if not b.kept or b.pointers else 0) for b in plan.blocks)


# Texts share whole documents and stretches of lines (partial overlap), in LF and CRLF.
_texts = st.lists(
    st.tuples(
        st.integers(0, len(DOCS) - 1),
        st.integers(0, 11),
        st.integers(1, 12),
        st.booleans(),
        st.sampled_from(["", "intro line é ✓\n", "🙂 other intro\n"]),
    ),
    min_size=4,
    max_size=10,
).map(
    lambda specs: [
        (prefix + "".join(DOCS[d].splitlines(keepends=True)[a : a + n])).replace(
            "\n", "\r\n" if crlf else "\n"
        )
        for d, a, n, crlf, prefix in specs
    ]
)
_visibility = st.one_of(
    st.just(TurnVisibility.all()),
    st.integers(0, 3).map(TurnVisibility.last),
    st.sets(st.integers(1, 8)).map(TurnVisibility.only),
)
_request = st.tuples(
    st.integers(0, 3),  # conversation: (A, c1), (B, c1), (A, c2), (A, None)
    st.lists(st.integers(0, 9), min_size=1, max_size=6),
    _visibility,
    st.one_of(st.none(), st.integers(1, 6)),  # None: next turn; else re-plan that turn
)
CONVERSATIONS = [("A", "c1"), ("B", "c1"), ("A", "c2"), ("A", None)]


@settings(max_examples=150, deadline=None)
@given(
    pool=_texts,
    requests=st.lists(_request, min_size=1, max_size=14),
    number_replaced=st.booleans(),
    chunked=st.booleans(),
)
def test_every_hint_resolves_to_identical_visible_text(
    pool: list[str], requests: list, number_replaced: bool, chunked: bool
) -> None:
    chunker = SMALL_CHUNKS if chunked else None
    dedup = SentDeduplicator(
        chunker=chunker,
        wording=SHORT_WORDING,
        min_tokens_saved=1,
        number_replaced_blocks=number_replaced,
    )
    transcripts = {key: Transcript() for key in CONVERSATIONS if key[1] is not None}
    for conv, picks, visibility, replan in requests:
        tenant, conv_id = CONVERSATIONS[conv]
        texts = [pool[i % len(pool)] for i in picks]
        transcript = transcripts.get((tenant, conv_id))
        turn = None
        if transcript is not None and replan is not None and replan <= transcript.latest():
            turn = replan
        plan = dedup.plan(tenant, conv_id, texts, turn=turn, visibility=visibility)
        check_plan(plan, texts, transcript, visibility, chunker)


# --- specific behaviour ------------------------------------------------------------------------


def test_repeated_block_is_replaced_by_a_hint_naming_its_place() -> None:
    dedup = SentDeduplicator(chunker=None)
    first = dedup.plan("t", "c", [DOCS[0], DOCS[1]])
    assert first.turn == 1 and first.blocks_replaced == 0
    second = dedup.plan("t", "c", [DOCS[2], DOCS[1], DOCS[3]])
    assert second.turn == 2
    assert [b.label for b in second.blocks] == ["[Doc 1]", None, "[Doc 2]"]
    assert second.hints == ["Also relevant: [Doc 2] of turn 1, shown above."]
    assert [b.reference for b in second.blocks] == ["[Doc 1]", "[Doc 2] of turn 1", "[Doc 2]"]
    assert second.kept_texts == [DOCS[2], DOCS[3]]
    replaced = second.blocks[1]
    assert replaced.tokens_saved == replaced.tokens - dedup.token_counter.count(replaced.hint)
    assert (second.blocks_kept, second.blocks_replaced, second.sub_blocks_replaced) == (2, 1, 0)
    assert second.tokens_in == sum(b.tokens for b in second.blocks)
    assert second.tokens_saved == replaced.tokens_saved


def test_hint_points_into_the_real_rendered_prompt() -> None:
    layout = PromptLayout()
    dedup = SentDeduplicator(label_template=layout.label_template)
    prompts = {}
    for turn_blocks in ([DOCS[0], DOCS[1], DOCS[2]], [DOCS[3], DOCS[2]], [DOCS[2], DOCS[4]]):
        plan = dedup.plan("t", "c", turn_blocks)
        prompts[plan.turn] = layout.render(plan.kept_texts, "q?", hints=plan.hints)
        for block in plan.blocks:
            if not block.kept:
                assert block.source is not None
                shown = prompts[block.source.turn]
                assert f"{block.source.label}\n{turn_blocks[block.index]}\n-----\n" in shown
                assert block.hint in prompts[plan.turn]
    assert "[Doc 3] of turn 1" in prompts[3]


def test_partial_overlap_is_replaced_by_a_pointer_quoting_its_ends() -> None:
    dedup = SentDeduplicator(chunker=ContentChunker(modulus=2, min_bytes=128, max_bytes=512))
    shared = DOCS[1] + DOCS[2] + DOCS[3]
    dedup.plan("t", "c", [DOCS[0] + shared])
    original = "A new opening line.\n" + shared + DOCS[4]
    plan = dedup.plan("t", "c", [original])
    (block,) = plan.blocks
    assert block.kept and block.pointers
    assert plan.sub_blocks_replaced == sum(p.count for p in block.pointers)
    assert block.text is not None and DOCS[4] in block.text and block.text.startswith("A new")
    for pointer in block.pointers:
        assert pointer.source.turn == 1 and pointer.source.label == "[Doc 1]"
        assert pointer.text.startswith('[Repeated passage: see [Doc 1] of turn 1, from "')
        assert pointer.text.endswith('".]\n')
        words = original[pointer.start : pointer.end].split()
        assert f'from "{" ".join(words[:2])} ' in pointer.text
        assert f' {" ".join(words[-2:])}".]' in pointer.text
    assert block.tokens_saved > 0 and len(block.text) < len(original)
    # a block shown with pointers is not recorded whole: its repeat is kept, not hinted
    again = dedup.plan("t", "c", [original])
    assert again.blocks[0].kept


def test_no_conversation_id_means_no_replacement_and_nothing_stored() -> None:
    store = ConversationStore()
    dedup = SentDeduplicator(store)
    for _ in range(3):
        plan = dedup.plan("t", None, [DOCS[0], DOCS[0] + DOCS[1], DOCS[0]])
        assert plan.turn is None and plan.blocks_replaced == plan.sub_blocks_replaced == 0
        assert plan.kept_texts == [DOCS[0], DOCS[0] + DOCS[1], DOCS[0]]
        assert [b.label for b in plan.blocks] == ["[Doc 1]", "[Doc 2]", "[Doc 3]"]
    assert len(store) == 0


def test_identical_blocks_in_other_tenants_or_conversations_are_never_referenced() -> None:
    dedup = SentDeduplicator(chunker=SMALL_CHUNKS, min_tokens_saved=1)
    dedup.plan("tenant-a", "c1", [DOCS[0], DOCS[1]])
    for tenant, conv in (("tenant-b", "c1"), ("tenant-a", "c2")):
        plan = dedup.plan(tenant, conv, [DOCS[1], DOCS[0] + DOCS[1]])
        assert plan.blocks_replaced == 0
        # only pointers inside this very prompt ([Doc 1] here), never into the other chat
        for block in plan.blocks:
            assert all(p.source.turn == plan.turn for p in block.pointers)


def test_hints_only_point_to_turns_the_app_still_sends() -> None:
    dedup = SentDeduplicator(chunker=None)
    dedup.plan("t", "c", [DOCS[0]])  # turn 1
    dedup.plan("t", "c", [DOCS[1]])  # turn 2
    window = dedup.plan("t", "c", [DOCS[0], DOCS[1]], visibility=TurnVisibility.last(1))
    assert [b.kept for b in window.blocks] == [True, False]  # turn 1 is outside the window
    assert window.blocks[1].source.turn == 2  # type: ignore[union-attr]
    # turn 3 re-showed DOCS[0] in full but DOCS[1] only as a hint: with only turn 3 left in
    # the prompt, DOCS[0] points there and DOCS[1] (shown in full only in turn 2) is kept
    only = dedup.plan("t", "c", [DOCS[0], DOCS[1]], visibility=TurnVisibility.only([3]))
    assert only.blocks[0].source is not None and only.blocks[0].source.turn == 3
    assert only.blocks[1].kept
    none_left = dedup.plan("t", "c", [DOCS[0], DOCS[1]], visibility=TurnVisibility.last(0))
    assert none_left.blocks_replaced == 0


def test_replacement_must_save_tokens() -> None:
    dedup = SentDeduplicator(chunker=None, min_tokens_saved=16)
    dedup.plan("t", "c", ["tiny block", DOCS[0]])
    plan = dedup.plan("t", "c", ["tiny block", DOCS[0]])
    assert [b.kept for b in plan.blocks] == [True, False]


@pytest.mark.parametrize(
    "text",
    [
        "Unicode: naïve café — 日本語 — 🙂🙂 — עברית\n" * 40,
        "CRLF line one\r\nCRLF line two\r\n" * 60,
        "no newline at all, one very long line " * 300,
        "a single line block that is long enough to be worth a hint, " * 3,
        "\n\n\n" + "line after empty lines\n\n" * 50,
        "".join(chr(c) for c in range(1, 0x250) if c != 0x0A) * 4,
    ],
    ids=["unicode", "crlf", "long-line", "one-line", "empty-lines", "binary-looking"],
)
def test_odd_texts_round_trip_and_repeat_exactly(text: str) -> None:
    chunker = ContentChunker(modulus=2, min_bytes=64, max_bytes=256)
    dedup = SentDeduplicator(chunker=chunker, min_tokens_saved=1)
    transcript = Transcript()
    for texts in ([text], ["intro\n" + text], [text]):
        plan = dedup.plan("t", "c", texts)
        check_plan(plan, texts, transcript, TurnVisibility.all(), chunker)
    assert plan.blocks_replaced == 1


def test_crlf_and_lf_forms_are_not_taken_for_each_other() -> None:
    dedup = SentDeduplicator(chunker=SMALL_CHUNKS, min_tokens_saved=1)
    dedup.plan("t", "c", [DOCS[0]])
    plan = dedup.plan("t", "c", [DOCS[0].replace("\n", "\r\n")])
    assert plan.blocks_replaced == 0 and plan.sub_blocks_replaced == 0


def test_same_inputs_give_the_same_plans() -> None:
    def run() -> list[DedupPlan]:
        dedup = SentDeduplicator(chunker=SMALL_CHUNKS, min_tokens_saved=1)
        return [
            dedup.plan("t", "c", [DOCS[i % 6], DOCS[(i + 1) % 6] + DOCS[(i + 3) % 6]])
            for i in range(8)
        ]

    assert run() == run()


def test_chunk_cache_does_not_change_results() -> None:
    def run(cache_size: int) -> list[DedupPlan]:
        dedup = SentDeduplicator(
            chunker=SMALL_CHUNKS, min_tokens_saved=1, chunk_cache_size=cache_size
        )
        return [dedup.plan("t", "c", [DOCS[i % 3] + DOCS[i % 5]]) for i in range(10)]

    assert run(0) == run(1) == run(4096)


def test_caller_ids_and_token_counts_are_used_and_checked() -> None:
    dedup = SentDeduplicator(chunker=None)
    plan = dedup.plan("t", "c", [DOCS[0]], block_ids=[block_id(DOCS[0])], block_tokens=[7])
    assert plan.tokens_in == 7
    with pytest.raises(ValueError, match="block_ids has 2 ids for 1 blocks"):
        dedup.plan("t", "c", [DOCS[0]], block_ids=[1, 2])
    with pytest.raises(ValueError, match="block_tokens"):
        dedup.plan("t", "c", [DOCS[0]], block_tokens=[])
    with pytest.raises(TypeError, match=r"block_ids\[0\]"):
        dedup.plan("t", "c", [DOCS[0]], block_ids=[-1])
    with pytest.raises(TypeError, match=r"block_tokens\[0\]"):
        dedup.plan("t", "c", [DOCS[0]], block_tokens=[1.5])  # type: ignore[list-item]


def test_bad_input_names_the_field() -> None:
    dedup = SentDeduplicator()
    with pytest.raises(TypeError, match="blocks must be a sequence"):
        dedup.plan("t", "c", "one string")
    with pytest.raises(TypeError, match=r"blocks\[1\]"):
        dedup.plan("t", "c", ["ok", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="UTF-8"):
        dedup.plan("t", "c", ["lone \udc80"])
    with pytest.raises(TypeError, match="tenant"):
        dedup.plan(None, None, ["x"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="conversation_id"):
        dedup.plan("t", "", ["x"])
    with pytest.raises(ValueError, match="label_template"):
        SentDeduplicator(label_template="[Doc]")
    with pytest.raises(ValueError, match="label_template"):
        SentDeduplicator(label_template="[Doc {n}]")
    with pytest.raises(ValueError, match="block_hint"):
        HintWording(block_hint="see {page}")
    with pytest.raises(ValueError, match="quote_words"):
        HintWording(quote_words=0)
    with pytest.raises(ValueError, match="min_tokens_saved"):
        SentDeduplicator(min_tokens_saved=0)
    with pytest.raises(TypeError, match="chunker"):
        SentDeduplicator(chunker="lines")  # type: ignore[arg-type]


def test_concurrent_turns_on_different_conversations_match_sequential_runs() -> None:
    rng = random.Random(11)
    scripts = {
        f"c{c}": [[DOCS[rng.randrange(6)] + DOCS[rng.randrange(6)][:300]] for _ in range(25)]
        for c in range(8)
    }

    def run(dedup: Deduplicator, conv: str, out: dict[str, list[DedupPlan]]) -> None:
        out[conv] = [dedup.plan("t", conv, blocks) for blocks in scripts[conv]]

    expected: dict[str, list[DedupPlan]] = {}
    for conv in scripts:
        run(SentDeduplicator(chunker=SMALL_CHUNKS, min_tokens_saved=1), conv, expected)
    shared = SentDeduplicator(chunker=SMALL_CHUNKS, min_tokens_saved=1)
    got: dict[str, list[DedupPlan]] = {}
    threads = [threading.Thread(target=run, args=(shared, conv, got)) for conv in scripts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == expected
    assert sum(p.blocks_replaced + p.sub_blocks_replaced for p in got["c0"]) > 0


def test_an_uncommitted_turn_is_never_pointed_to_and_an_aborted_one_frees_its_number() -> None:
    dedup = Deduplicator(chunker=None)
    first = dedup.plan("t", "c", [DOCS[0]])
    assert first.turn == 1 and first.pending is not None
    second = dedup.plan("t", "c", [DOCS[0]])  # turn 1 is not committed: nothing to point to
    assert second.turn == 2 and second.blocks_replaced == 0
    assert second.pending is not None
    second.pending.abort()
    first.pending.commit()
    third = dedup.plan("t", "c", [DOCS[0]])
    assert third.turn == 2 and third.blocks_replaced == 1  # turn 2's number was released
    assert third.hints == ["Also relevant: [Doc 1] of turn 1, shown above."]
