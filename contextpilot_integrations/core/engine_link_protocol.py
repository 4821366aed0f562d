"""What the pilot and the router call on an engine link (:class:`EngineLinkProtocol`).

An engine link follows one engine's prefix cache and reports what the engine dropped. The core
never builds one: the application gives it (``ContextPilot(engine=EngineLink({...}))``, or a
router's ``link_factory``), so the core imports nothing of the link's own package
(:class:`~contextpilot_integrations.sync.engine_link.EngineLink`, the ``sync`` extra;
docs/DESIGN.md, "Layers" and "The engine link").

Ownership is decided by binding: whoever binds a link's callbacks (:meth:`~EngineLinkProtocol.
bind`) owns it, starts it and stops it. A pilot given an unbound link binds the evictions to its
own index and starts and stops the link; a link its owner bound already (the index service's
one link for every tenant's pilot, a router's link per replica) is only recorded with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from contextpilot_integrations.core.plan import Plan

__all__ = ["EngineLinkProtocol"]


@runtime_checkable
class EngineLinkProtocol(Protocol):
    """An engine link as the core uses it. Implementations never raise from these calls on
    the planning path (docs/DESIGN.md, "Never break a request"): they count and log."""

    @property
    def bound(self) -> bool:
        """Whether :meth:`bind` was called (the link has an owner)."""
        ...

    def bind(
        self,
        on_evict: Callable[[str], bool],
        *,
        on_session: Callable[[str], object] | None = None,
        on_health: Callable[[bool], object] | None = None,
    ) -> object:
        """Route the engine's news to the owner, once, before :meth:`start`: ``on_evict(rid)``
        when the engine dropped ``rid``'s prefix (True when it was indexed), ``on_session(rid)``
        when the engine echoed ``rid`` on a block it stored (the request reached this engine),
        ``on_health(up)`` when its cache feed has been unreachable for its grace period
        (``False``) or is connected again (``True``).

        Raises:
            ValueError: the link is bound already.
        """
        ...

    def start(self) -> object:
        """Start following the engine (idempotent)."""
        ...

    def stop(self) -> None:
        """Stop following the engine (idempotent)."""
        ...

    def record(self, plans: Iterable[Plan]) -> None:
        """The plans' requests were sent to the engine."""
        ...

    def touch(self, rid: str) -> None:
        """The engine served ``rid`` from its cache."""
        ...

    def forget(self, rid: str) -> None:
        """Stop following ``rid`` without an eviction callback (the index dropped it)."""
        ...

    def reset(self) -> list[str]:
        """Forget what the engine is believed to cache (it went down); the rids it held."""
        ...

    def stats(self) -> dict[str, Any]:
        """The link's figures, for monitoring (``stats()["sync"]`` of a pilot)."""
        ...
