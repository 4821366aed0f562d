"""The parts of :mod:`~contextpilot_integrations.service.proxy.document_placement` the proxy's
end-to-end tests cannot reach: the lossless check on a rendered context, the memory's bounds."""

from __future__ import annotations

import dataclasses

from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.service.proxy.document_placement import (
    DocumentMemory,
    _context_keeps_everything,
    _in_full,
    _Sent,
)

DOCS = ["alpha " * 40, "bravo " * 40, "alpha " * 40]


def test_the_check_finds_a_document_the_context_lacks() -> None:
    plan = ContextPilot().plan("q", DOCS)
    assert _context_keeps_everything(plan, plan.context, "")
    segments = list(plan.segments)
    segments[2] = segments[2].replace(DOCS[1], "")
    lacking = dataclasses.replace(plan, segments=tuple(segments))
    assert not _context_keeps_everything(lacking, lacking.context, "")
    # The fallback shows every distinct document in full, in the client's order.
    full = _in_full(plan)
    assert full.index(DOCS[0]) < full.index(DOCS[1]) and full.count(DOCS[0]) == 1


def _sent(size: int) -> _Sent:
    return _Sent({"role": "user", "content": "x"}, size, 1)


def test_the_memory_is_bounded_by_conversations_messages_and_bytes() -> None:
    memory = DocumentMemory(max_conversations=2, max_messages=2, max_bytes=100)
    for chain in (b"1", b"2", b"3"):
        memory.put("a", chain, _sent(10))
    assert memory.lookup("a", b"1") is None and memory.lookup("a", b"3") is not None
    memory.put("b", b"1", _sent(10))
    memory.put("c", b"1", _sent(10))
    assert len(memory) == 2 and not memory.holds("a")
    memory.put("d", b"1", _sent(95))  # over the bytes with "c": the older one goes
    assert memory.holds("d") and not memory.holds("c")
