"""The service client's fallback: when to leave the service alone, and the local plans instead.

The service being down never fails a request (docs/DESIGN.md, "Never break a request").
:class:`Fallback` keeps the client's view of the service's availability (after a failure the
service is tried again no sooner than ``retry_interval_s`` later; the first failure is logged
at warning level, the others at debug level; every one is counted) and makes the plans the
service did not: a local in-process ``ContextPilot`` with the server's layout (or
``fallback_layout`` before it is known).

A local plan never de-duplicates (docs/DESIGN.md, "Sure hints"): it is made without the
conversation, so it shows every block in full; its ``scope`` is the request's: the
conversation id, and the turn only when the caller gave one, or the number the client gave it
(:class:`LocalPlans.turns`, :mod:`.conversations`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from contextpilot_integrations.client.errors import ServiceUnavailableError
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import BatchPlan, Plan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest, Scope

__all__ = ["Fallback", "LocalPlans"]

# Every message of the client logs under the client's module name, wherever it is written.
logger = logging.getLogger("contextpilot_integrations.client.client")


@dataclass(frozen=True)
class LocalPlans:
    """What a plan call leaves to the local pilot.

    Attributes:
        turns: index of each request to plan locally -> the turn number its plan carries
            (``None``: the caller's own ``scope.turn``).
        service: the service's plans, kept for the other requests; ``None``: the whole call is
            planned locally.
    """

    turns: Mapping[int, int | None]
    service: BatchPlan | None = None

    @staticmethod
    def every(count: int) -> LocalPlans:
        """All ``count`` requests of a call the service did not plan."""
        return LocalPlans(dict.fromkeys(range(count)))


class Fallback:
    """The service's availability as the client sees it, and the local plans.

    Args:
        base_url: the service (for messages).
        enabled: plan locally when the service is unavailable (else raise
            :class:`ServiceUnavailableError`).
        retry_interval_s: after a failure, seconds before the service is tried again.
        layout: the layout local plans are rendered with: a callable giving the server's
            layout once known (``None`` before).
        fallback_layout: the layout before the server's is known (``None``: the default).

    Thread-safe.
    """

    def __init__(
        self,
        base_url: str,
        *,
        enabled: bool,
        retry_interval_s: float,
        layout: Callable[[], PromptLayout | None],
        fallback_layout: PromptLayout | None,
    ) -> None:
        self.base_url = base_url
        self.enabled = enabled
        self.retry_interval_s = retry_interval_s
        self._server_layout = layout
        self._fallback_layout = fallback_layout
        self._lock = threading.Lock()
        self._local: ContextPilot | None = None
        self._down_until = 0.0
        self._warned = False
        self._counters = {"calls": 0, "service_failures": 0, "fallback_plans": 0}

    # ------------------------------------------------------------------ Public API: availability
    def holding_off(self) -> bool:
        """True while an earlier failure says not to try the service yet."""
        return time.monotonic() < self._down_until

    def skip_call(self) -> bool:
        """Count a call; True when it must not go to the service now (:meth:`holding_off`).

        Raises:
            ServiceUnavailableError: the service is held off and the fallback is off.
        """
        with self._lock:
            self._counters["calls"] += 1
        if not self.holding_off():
            return False
        if not self.enabled:
            raise ServiceUnavailableError(
                f"index service {self.base_url}: unavailable, tried again at most every "
                f"{self.retry_interval_s} s"
            )
        return True

    def failed(self, what: str, exc: BaseException, *, raise_without_fallback: bool = True) -> None:
        """Count a service failure, warn once, hold off the service for a while.

        Raises:
            ServiceUnavailableError: the fallback is off and ``raise_without_fallback``.
        """
        with self._lock:
            self._counters["service_failures"] += 1
            first = not self._warned
            self._warned = True
            self._down_until = time.monotonic() + self.retry_interval_s
        level = logging.WARNING if first else logging.DEBUG
        fallback = "planning locally" if self.enabled else "no fallback"
        logger.log(
            level,
            "index service %s: %s failed (%s); %s",
            self.base_url,
            what,
            _describe(exc),
            fallback,
        )
        if not self.enabled and raise_without_fallback:
            if isinstance(exc, ServiceUnavailableError):
                raise exc
            raise ServiceUnavailableError(f"index service {self.base_url}: {exc}") from exc

    def recovered(self) -> None:
        """The service answered: try it again at once next time."""
        self._down_until = 0.0

    def counts(self) -> dict[str, int]:
        """``calls``, ``service_failures`` and ``fallback_plans`` (calls planned locally)."""
        with self._lock:
            return dict(self._counters)

    # ------------------------------------------------------------------ Public API: local plans
    @property
    def local(self) -> ContextPilot | None:
        """The local pilot, if one was made."""
        return self._local

    def pilot(self) -> ContextPilot:
        """The local pilot (made on first use, with the server's layout if known)."""
        with self._lock:
            if self._local is None:
                layout = self._server_layout() or self._fallback_layout or PromptLayout()
                self._local = ContextPilot(layout=layout)
            return self._local

    def plan(self, outcome: Plan | LocalPlans, request: PlanRequest) -> Plan:
        """The plan of ``request``: the service's, or a local one (:meth:`local_plan`)."""
        if isinstance(outcome, Plan):
            return outcome
        self._count_local()
        return self.local_plan(request, outcome.turns[0])

    def plan_batch(self, outcome: BatchPlan | LocalPlans, batch: list[PlanRequest]) -> BatchPlan:
        """The plans of ``batch``: the service's, local ones where ``outcome`` says (the whole
        batch planned and scheduled locally when the service planned none of it)."""
        if isinstance(outcome, BatchPlan):
            return outcome
        self._count_local()
        if outcome.service is not None:
            plans = list(outcome.service.plans)
            for index, turn in outcome.turns.items():
                plans[index] = self.local_plan(batch[index], turn)
            return dataclasses.replace(outcome.service, plans=tuple(plans))
        local = self.pilot().plan_batch(
            [dataclasses.replace(r, scope=_without_conversation(r)) for r in batch]
        )
        rescoped = tuple(
            dataclasses.replace(plan, scope=_scope(request, outcome.turns.get(i)))
            for i, (plan, request) in enumerate(zip(local.plans, batch))
        )
        return dataclasses.replace(local, plans=rescoped)

    def local_plan(self, request: PlanRequest, turn: int | None = None) -> Plan:
        """A local plan of ``request``, made without its conversation (it never hints); its
        scope is the request's, with ``turn`` when given."""
        plan = self.pilot().plan(
            request.query, request.blocks, rid=request.rid, scope=_without_conversation(request)
        )
        return dataclasses.replace(plan, scope=_scope(request, turn))

    def _count_local(self) -> None:
        with self._lock:
            self._counters["fallback_plans"] += 1


def _without_conversation(request: PlanRequest) -> Scope:
    return Scope(tenant=request.scope.tenant)


def _scope(request: PlanRequest, turn: int | None) -> Scope:
    if turn is None:
        return request.scope
    return dataclasses.replace(request.scope, turn=turn)


def _describe(exc: BaseException) -> str:
    """``exc`` for a log line: its type, and its message where it has one (httpx's timeouts
    often have none)."""
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
