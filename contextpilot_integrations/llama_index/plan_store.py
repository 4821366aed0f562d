"""Recent plans, found again by the prompt templates from the context text LlamaIndex builds.

A LlamaIndex response synthesizer hands its prompt template only the joined node texts
(``context_str``) and the question, never the nodes. The ContextPilot templates therefore find
the plan the post-processor made for those nodes by the joined text itself: each plan is filed
under a 128-bit digest of exactly the ``context_str`` LlamaIndex builds from the nodes the
post-processor returns, which come in ``plan.output_order()`` (``PromptHelper.repack``: each
node's LLM text stripped, empty ones left out, joined with a blank line). When several live
plans have the same context (identical concurrent requests), the one armed in the caller's
context wins (:mod:`.request_ids`).

Bounded (docs/DESIGN.md, "Bounded"): at most ``max_plans`` plans, the least recently filed dropped
first (:class:`~contextpilot_integrations.core.lru.LRU`). Thread-safe (one lock).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

from contextpilot_integrations.core.lru import LRU
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.llama_index.request_ids import pending_request

__all__ = ["PlanStore", "StoredPlan", "context_digest", "context_text"]


def context_digest(text: str) -> bytes:
    """128-bit digest of a context string after ``strip()`` (LlamaIndex strips it too)."""
    return hashlib.blake2b(text.strip().encode("utf-8"), digest_size=16).digest()


def context_text(plan: Plan) -> str:
    """The ``context_str`` LlamaIndex builds from the nodes returned for ``plan`` (in
    ``plan.output_order()``): their LLM texts, stripped, the empty ones left out, joined with a
    blank line (``PromptHelper.repack``)."""
    texts = (p.text.strip() for p in plan.output_order())
    return "\n\n".join(text for text in texts if text)


@dataclass(frozen=True, slots=True)
class StoredPlan:
    """A plan as filed by the post-processor.

    Attributes:
        plan: the core :class:`~contextpilot_integrations.core.plan.Plan`.
        earlier_sections: ``(turn, section text)`` of the earlier turns of its conversation
            that its prompt shows before its own section, oldest first (empty without a
            conversation; :mod:`.conversation_sections`).
    """

    plan: Plan
    earlier_sections: tuple[tuple[int, str], ...] = ()


class PlanStore:
    """Plans by request id and by the digest of their context text.

    Args:
        max_plans: plans kept (least recently filed dropped first); an int ``>= 1``.

    Raises:
        ValueError: ``max_plans`` is not an int ``>= 1``.
    """

    def __init__(self, *, max_plans: int = 4096) -> None:
        if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
            raise ValueError(f"max_plans must be an int >= 1, got {max_plans!r}")
        self.max_plans = max_plans
        self._lock = threading.Lock()
        self._by_rid: LRU[str, tuple[bytes, StoredPlan]] = LRU(max_plans)
        self._by_context: dict[bytes, list[str]] = {}  # digest -> rids, oldest first

    # ------------------------------------------------------------------ Public API
    def put(self, stored: StoredPlan) -> None:
        """File ``stored`` under its rid and under the digest of :func:`context_text`;
        drops the least recently filed plan past ``max_plans``."""
        digest = context_digest(context_text(stored.plan))
        rid = stored.plan.rid
        with self._lock:
            previous = self._by_rid.pop(rid)
            if previous is not None:
                self._unfile(rid, previous[0])
            evicted = self._by_rid.put(rid, (digest, stored))
            self._by_context.setdefault(digest, []).append(rid)
            for old_rid, (old_digest, _) in evicted:
                self._unfile(old_rid, old_digest)

    def get(self, rid: str) -> StoredPlan | None:
        """The plan filed under ``rid``, or ``None`` (does not change what is dropped next)."""
        with self._lock:
            entry = self._by_rid.peek(rid)
            return entry[1] if entry is not None else None

    def find(self, context: str) -> StoredPlan | None:
        """The plan whose nodes join to ``context`` (after ``strip()``), or ``None``.

        Among several, the one armed in the caller's context, else the most recently filed.
        """
        digest = context_digest(context)
        pending = pending_request()
        with self._lock:
            rids = self._by_context.get(digest)
            if not rids:
                return None
            rid = pending.rid if pending is not None and pending.rid in rids else rids[-1]
            entry = self._by_rid.peek(rid)
            return entry[1] if entry is not None else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_rid)

    # ------------------------------------------------------------------ internals
    def _unfile(self, rid: str, digest: bytes) -> None:
        rids = self._by_context.get(digest)
        if rids is not None:
            rids.remove(rid)
            if not rids:
                del self._by_context[digest]
