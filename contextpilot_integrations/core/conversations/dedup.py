"""Multi-turn de-duplication: replace context already shown in a conversation by a location hint.

ContextPilot (MLSys 2026, "multi-turn de-duplication"): a block that an earlier turn's prompt
already shows is replaced by a short hint naming where it stands; a sub-block
(:mod:`~contextpilot_integrations.core.conversations.chunking`) already shown is replaced by a
pointer to its first occurrence, and a run of consecutive ones standing in the same order in one
earlier block gets a single pointer. :meth:`Deduplicator.plan` takes one request's blocks in
prompt order and returns, per block, the text to render (with pointers spliced in) or a hint,
plus the request's figures. Rules:

- Lossless (docs/DESIGN.md, "Lossless"): a block or sub-block is replaced only when its exact
  text (same 64-bit id, :func:`~contextpilot_integrations.core.blocks.block_id`) stands in full
  at the named place, in a turn the prompt still holds (:class:`TurnVisibility`) or earlier in
  this prompt. Places are recorded only where text was rendered literally.
- Isolation (docs/DESIGN.md, "Isolation"): history is per ``(tenant, conversation_id)``; a
  request with ``conversation_id=None`` is never de-duplicated and never recorded.
- Deterministic (docs/DESIGN.md, "Deterministic"): the output depends only on the inputs and
  the store's records.
- A replacement is made only if it saves at least ``min_tokens_saved`` tokens.

Hints (:class:`HintWording`, configurable) read ``Also relevant: [Doc 3] of turn 2, shown
above.`` for a block and ``[Repeated passage: see [Doc 3] of turn 2, from "first words" to
"last words".]`` for a sub-block (the quoted ends let the model find a passage whose boundaries
it cannot see); a place earlier in the same prompt reads ``[Doc 3] in this message``.

Labels: a kept block's label is ``label_template`` with its 1-based position among the *kept*
blocks (the renderer lists the hints after the blocks, docs/DESIGN.md, "Prompt layout"); with
``number_replaced_blocks=True`` its position among all blocks. The store records those labels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from contextpilot_integrations.core.blocks import ApproxTokenCounter, TokenCounter, block_id
from contextpilot_integrations.core.conversations.chunking import ContentChunker, SubBlock
from contextpilot_integrations.core.conversations.conversation import ConversationStore
from contextpilot_integrations.core.conversations.conversation_turn import ConversationTurn
from contextpilot_integrations.core.conversations.turns import Location, TurnVisibility
from contextpilot_integrations.core.hint_wording import HintWording, line_ending, quote_ends
from contextpilot_integrations.core.lru import LRU

__all__ = ["DedupBlock", "DedupPlan", "Deduplicator", "SubBlockPointer"]


@dataclass(frozen=True, slots=True)
class SubBlockPointer:
    """A run of consecutive sub-blocks of a kept block replaced by one pointer.

    The run stands, whole and in the same order, as consecutive literal sub-blocks of one block
    at ``source``.

    Attributes:
        part: 0-based index of the run's first sub-block in this block.
        count: number of sub-blocks in the run (``>= 1``).
        start, end: character span of the run in the block's original text.
        source: where the run stands: ``source.part`` is the index of its first sub-block
            within the block at ``source.label`` of turn ``source.turn``.
        text: the pointer as spliced into the rendered text.
    """

    part: int
    count: int
    start: int
    end: int
    source: Location
    text: str


@dataclass(frozen=True, slots=True)
class DedupBlock:
    """The decision for one block. Exactly one of ``text`` and ``hint`` is set.

    Attributes:
        index: position in the request's blocks (0-based prompt order).
        block_id: id of the original text.
        label: the label it is rendered under when kept (also when replaced, with
            ``number_replaced_blocks=True``); ``None`` for a replaced block otherwise.
        text: the text to render when kept: the original, or with repeated sub-blocks replaced
            by pointers; ``None`` when replaced.
        hint: the location hint when the whole block is replaced; else ``None``.
        source: where the identical block stands when replaced; else ``None``.
        reference: how the prompt refers to the block: ``label`` when kept, else the hint's
            place (``"[Doc 3] of turn 2"``); for the order annotation's labels.
        pointers: the runs of sub-blocks replaced in a kept block, in text order.
        tokens: token count of the original text.
        tokens_saved: tokens saved: original minus hint, or the sum over replaced runs of
            run minus pointer (by the token counter of the :meth:`Deduplicator.plan` call).
    """

    index: int
    block_id: int
    label: str | None
    text: str | None
    hint: str | None
    source: Location | None
    reference: str
    pointers: tuple[SubBlockPointer, ...]
    tokens: int
    tokens_saved: int

    @property
    def kept(self) -> bool:
        """Whether the block is rendered (possibly with sub-block pointers)."""
        return self.text is not None


@dataclass(frozen=True, slots=True)
class DedupPlan:
    """One request's de-duplication.

    Attributes:
        tenant, conversation_id: the conversation (``conversation_id`` ``None``: nothing was
            looked up or recorded).
        turn: the turn number planned and recorded (``None`` without a conversation).
        blocks: one decision per input block, in input (prompt) order.
        blocks_kept, blocks_replaced, sub_blocks_replaced: counts.
        tokens_in: tokens of the original blocks; tokens_saved: sum over ``blocks``.
        pending: the turn's records in the conversation store, pending until
            ``pending.commit()`` (call it once the plan is handed out; ``abort()`` otherwise);
            ``None`` without a conversation.
    """

    tenant: str
    conversation_id: str | None
    turn: int | None
    blocks: tuple[DedupBlock, ...]
    blocks_kept: int
    blocks_replaced: int
    sub_blocks_replaced: int
    tokens_in: int
    tokens_saved: int
    pending: ConversationTurn | None = field(default=None, repr=False, compare=False)

    @property
    def kept_texts(self) -> list[str]:
        """Texts of the kept blocks, in prompt order (what the renderer lists as blocks)."""
        return [b.text for b in self.blocks if b.text is not None]

    @property
    def hints(self) -> list[str]:
        """Hints of the replaced blocks, in prompt order (what the renderer adds after them)."""
        return [b.hint for b in self.blocks if b.hint is not None]


_DEFAULT_CHUNKER = ContentChunker()


class Deduplicator:
    """Plans the de-duplication of each request against its conversation's history.

    Args:
        store: the conversation store (a new default one when ``None``).
        chunker: cuts kept blocks into sub-blocks for partial-overlap replacement; ``None``
            for whole-block de-duplication only.
        token_counter: counts tokens for ``tokens_saved`` and the ``min_tokens_saved`` test
            where a :meth:`plan` call passes none (default
            :class:`~contextpilot_integrations.core.blocks.ApproxTokenCounter`).
        wording: hint templates.
        label_template: a kept block's label, ``str.format`` template with field
            ``{position}`` (1-based), the same as ``PromptLayout.label_template``.
        number_replaced_blocks: number labels over all blocks instead of the kept ones.
        min_tokens_saved: replace a block or sub-block only if that saves at least this many
            tokens (``>= 1``).
        chunk_cache_size: blocks whose sub-blocks are cached (LRU; the cache holds only a pure
            function of the text, shared by all conversations; ``0`` disables it).

    Raises:
        TypeError / ValueError: a bad argument (the message names it).

    Thread-safe: :meth:`plan` validates, hashes and counts outside the store's lock, then holds
    it while it looks up, chunks the kept blocks (cached), and records (the median request of
    ``benchmarks/bench_dedup.py`` holds it well under a millisecond).
    """

    def __init__(
        self,
        store: ConversationStore | None = None,
        *,
        chunker: ContentChunker | None = _DEFAULT_CHUNKER,
        token_counter: TokenCounter | None = None,
        wording: HintWording | None = None,
        label_template: str = "[Doc {position}]",
        number_replaced_blocks: bool = False,
        min_tokens_saved: int = 16,
        chunk_cache_size: int = 4096,
    ) -> None:
        if store is not None and not isinstance(store, ConversationStore):
            raise TypeError(f"store must be a ConversationStore, got {type(store).__name__}")
        if chunker is not None and not isinstance(chunker, ContentChunker):
            raise TypeError(f"chunker must be a ContentChunker or None, got {chunker!r}")
        if token_counter is not None and not callable(getattr(token_counter, "count", None)):
            raise TypeError(f"token_counter must have a count(text) method, got {token_counter!r}")
        if wording is not None and not isinstance(wording, HintWording):
            raise TypeError(f"wording must be a HintWording, got {type(wording).__name__}")
        if not isinstance(label_template, str):
            raise TypeError(f"label_template must be a str, got {label_template!r}")
        try:
            label = label_template.format(position=1)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"label_template must be a format string with field {{position}}, got "
                f"{label_template!r}: {exc!r}"
            ) from exc
        if label == label_template.format(position=2):
            raise ValueError(f"label_template must use {{position}}, got {label_template!r}")
        for name, value, low in (
            ("min_tokens_saved", min_tokens_saved, 1),
            ("chunk_cache_size", chunk_cache_size, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        self.store = store if store is not None else ConversationStore()
        self.chunker = chunker
        self.token_counter: TokenCounter = token_counter or ApproxTokenCounter()
        self.wording = wording or HintWording()
        self.label_template = label_template
        self.number_replaced_blocks = bool(number_replaced_blocks)
        self.min_tokens_saved = min_tokens_saved
        self._chunk_cache = _ChunkCache(chunk_cache_size)

    def plan(
        self,
        tenant: str,
        conversation_id: str | None,
        blocks: Sequence[str],
        *,
        turn: int | None = None,
        visibility: TurnVisibility | None = None,
        block_ids: Sequence[int] | None = None,
        block_tokens: Sequence[int] | None = None,
        token_counter: TokenCounter | None = None,
    ) -> DedupPlan:
        """De-duplicate one request's blocks; this turn's records wait in the store, pending
        until the caller commits them (:attr:`DedupPlan.pending`).

        Args:
            tenant: the tenant (``""`` for a single-tenant app).
            conversation_id: the conversation, or ``None`` (no de-duplication, nothing stored).
            blocks: the block texts in prompt order (after alignment).
            turn: this turn's number; ``None`` for one after the conversation's latest. Planning
                an earlier or the same number again drops the records of that turn and later
                ones first (a retry or an edited history).
            visibility: the earlier turns the app's prompt still holds (default: all).
            block_ids: :func:`~contextpilot_integrations.core.blocks.block_id` of each block,
                when the caller has them (saves hashing); must match ``blocks``.
            block_tokens: token count of each block, when the caller has them.
            token_counter: counts this call's tokens (the blocks without ``block_tokens``, the
                hints, pointers and runs: ``tokens_saved`` and the ``min_tokens_saved`` test);
                default the deduplicator's. A pilot passes its own, the counter its
                ``block_tokens`` come from, so every figure of one plan has one counter.

        Returns:
            The :class:`DedupPlan`; its blocks are in the order of ``blocks``.

        Raises:
            TypeError: ``blocks`` is not a sequence of ``str``, or another argument has the
                wrong type (the message names it).
            ValueError: ``block_ids``/``block_tokens`` do not match ``blocks`` in length, a
                text cannot be encoded as UTF-8, a bad ``turn`` or ``conversation_id``.
        """
        if token_counter is not None and not callable(getattr(token_counter, "count", None)):
            raise TypeError(f"token_counter must have a count(text) method, got {token_counter!r}")
        count = (token_counter or self.token_counter).count
        texts = _check_blocks(blocks)
        ids = self._ids(texts, block_ids)
        tokens = self._tokens(texts, block_tokens, count)
        if conversation_id is None:
            if not isinstance(tenant, str):
                raise TypeError(f"tenant must be a str, got {type(tenant).__name__}: {tenant!r}")
            return self._keep_all(tenant, texts, ids, tokens)
        with self.store.open_turn(tenant, conversation_id, turn, visibility) as history:
            decided: list[DedupBlock] = []
            kept = 0
            for i, text in enumerate(texts):
                block = self._decide(history, i, kept + 1, text, ids[i], tokens[i], count)
                kept += block.kept
                decided.append(block)
            return DedupPlan(
                tenant=history.tenant,
                conversation_id=history.conversation_id,
                turn=history.turn,
                blocks=tuple(decided),
                blocks_kept=kept,
                blocks_replaced=len(decided) - kept,
                sub_blocks_replaced=sum(p.count for b in decided for p in b.pointers),
                tokens_in=sum(tokens),
                tokens_saved=sum(b.tokens_saved for b in decided),
                pending=history,
            )

    # --- one block -------------------------------------------------------------------------

    def _decide(
        self,
        history: ConversationTurn,
        index: int,
        kept_number: int,
        text: str,
        bid: int,
        tokens: int,
        count: Callable[[str], int],
    ) -> DedupBlock:
        """Replace, or keep (with sub-block pointers), the block at ``index``; record it.

        ``kept_number`` is the 1-based number the block gets among the kept ones if kept;
        ``count`` counts tokens.
        """
        source = history.find_block(bid)
        if source is not None:
            where = self.wording.where(source, history.number)
            hint = self.wording.block_hint.format(where=where, label=source.label, turn=source.turn)
            saved = tokens - count(hint)
            if saved >= self.min_tokens_saved:
                label = self._label(index + 1) if self.number_replaced_blocks else None
                return DedupBlock(index, bid, label, None, hint, source, where, (), tokens, saved)
        label = self._label(index + 1 if self.number_replaced_blocks else kept_number)
        pointers: list[SubBlockPointer] = []
        saved = 0
        pieces: list[str] = []
        literal: list[tuple[int, int]] = []
        parts = self._sub_blocks(bid, text)
        sources = [history.find_sub_block(sub.sub_block_id) for sub in parts]
        first = 0
        while first < len(parts):
            end = _run_end(sources, first)
            found = self._pointer(history, text, parts, first, end, sources[first], count)
            if found is None:
                for part in range(first, max(end, first + 1)):
                    pieces.append(parts[part].text)
                    literal.append((part, parts[part].sub_block_id))
                first = max(end, first + 1)
                continue
            pointer, run_saved = found
            pointers.append(pointer)
            pieces.append(pointer.text)
            saved += run_saved
            first = end
        # Recorded after the loop: a block never points into itself, so a block whose text
        # repeats internally stays whole and can later be replaced by one hint.
        for part, sub_id in literal:
            history.record_sub_block(sub_id, label, part)
        if pointers:
            rendered = "".join(pieces)
        else:
            rendered = text
            history.record_block(bid, label)
        return DedupBlock(
            index, bid, label, rendered, None, None, label, tuple(pointers), tokens, saved
        )

    def _pointer(
        self,
        history: ConversationTurn,
        text: str,
        parts: tuple[SubBlock, ...],
        first: int,
        end: int,
        source: Location | None,
        count: Callable[[str], int],
    ) -> tuple[SubBlockPointer, int] | None:
        """The pointer replacing ``parts[first:end]`` (a run found at ``source``) and the
        tokens it saves, or ``None`` when there is no run or it saves under
        ``min_tokens_saved``."""
        if source is None or end <= first:
            return None
        start, stop = parts[first].start, parts[end - 1].end
        run_tokens = count(text[start:stop])
        if run_tokens < self.min_tokens_saved:
            return None
        head, _ = quote_ends(parts[first].text, self.wording.quote_words)
        _, tail = quote_ends(parts[end - 1].text, self.wording.quote_words)
        pointer_text = self.wording.sub_block_pointer.format(
            where=self.wording.where(source, history.number),
            label=source.label,
            turn=source.turn,
            part=(source.part or 0) + 1,
            head=head,
            tail=tail,
        ) + line_ending(parts[end - 1].text)
        run_saved = run_tokens - count(pointer_text)
        if run_saved < self.min_tokens_saved:
            return None
        return SubBlockPointer(first, end - first, start, stop, source, pointer_text), run_saved

    def _sub_blocks(self, bid: int, text: str) -> tuple[SubBlock, ...]:
        """Sub-blocks of a block (cached by id, checked by text); ``()`` without a chunker."""
        if self.chunker is None:
            return ()
        cached = self._chunk_cache.get(bid, text)
        if cached is None:
            cached = self.chunker.split(text)
            self._chunk_cache.put(bid, text, cached)
        return cached

    def _label(self, position: int) -> str:
        return self.label_template.format(position=position)

    # --- whole request ---------------------------------------------------------------------

    def _keep_all(
        self, tenant: str, texts: list[str], ids: list[int], tokens: list[int]
    ) -> DedupPlan:
        labels = [self._label(i + 1) for i in range(len(texts))]
        decided = tuple(
            DedupBlock(i, ids[i], labels[i], text, None, None, labels[i], (), tokens[i], 0)
            for i, text in enumerate(texts)
        )
        return DedupPlan(tenant, None, None, decided, len(decided), 0, 0, sum(tokens), 0)

    def _ids(self, texts: list[str], block_ids: Sequence[int] | None) -> list[int]:
        if block_ids is None:
            try:
                return [block_id(text) for text in texts]
            except UnicodeEncodeError as exc:
                raise ValueError(f"a block cannot be encoded as UTF-8: {exc}") from exc
        ids = list(block_ids)
        if len(ids) != len(texts):
            raise ValueError(f"block_ids has {len(ids)} ids for {len(texts)} blocks")
        for i, value in enumerate(ids):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
                raise TypeError(f"block_ids[{i}] must be an unsigned 64-bit int, got {value!r}")
        return ids

    def _tokens(
        self, texts: list[str], block_tokens: Sequence[int] | None, count: Callable[[str], int]
    ) -> list[int]:
        if block_tokens is None:
            return [count(text) for text in texts]
        counts = list(block_tokens)
        if len(counts) != len(texts):
            raise ValueError(f"block_tokens has {len(counts)} counts for {len(texts)} blocks")
        for i, value in enumerate(counts):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TypeError(f"block_tokens[{i}] must be an int >= 0, got {value!r}")
        return counts


class _ChunkCache:
    """Bounded LRU of ``block id -> (text, sub-blocks)``, thread-safe (0: disabled)."""

    def __init__(self, capacity: int) -> None:
        self._lock = threading.Lock()
        self._entries: LRU[int, tuple[str, tuple[SubBlock, ...]]] | None = (
            LRU(capacity) if capacity else None
        )

    def get(self, bid: int, text: str) -> tuple[SubBlock, ...] | None:
        if self._entries is None:
            return None
        with self._lock:
            entry = self._entries.get(bid)
        if entry is None or entry[0] != text:  # the text check rules out an id collision
            return None
        return entry[1]

    def put(self, bid: int, text: str, parts: tuple[SubBlock, ...]) -> None:
        if self._entries is None:
            return
        with self._lock:
            self._entries.put(bid, (text, parts))


def _check_blocks(blocks: object) -> list[str]:
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):
        raise TypeError(f"blocks must be a sequence of str, got {type(blocks).__name__}")
    texts = list(blocks)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"blocks[{i}] must be a str, got {type(text).__name__}: {text!r:.80}")
    return texts


def _run_end(sources: Sequence[Location | None], first: int) -> int:
    """End (exclusive) of the run of sub-blocks from ``first`` whose places are consecutive
    parts of one block at one place; ``first`` itself when ``sources[first]`` is ``None``."""
    start = sources[first]
    if start is None:
        return first
    end = first + 1
    while end < len(sources):
        place = sources[end]
        if (
            place is None
            or place.turn != start.turn
            or place.label != start.label
            or place.part != (start.part or 0) + (end - first)
        ):
            break
        end += 1
    return end
