"""A fair admission gate in front of one upstream's connection pool (docs/DESIGN.md, "The
proxy").

The pool holds ``capacity`` connections; a call holds one slot of the gate from before its
request goes out until its answer is over (streamed, broken off, cancelled), so the pool
never queues a call itself. The gate shares the slots between tenants:

- a tenant holds at most ``tenant_cap`` slots, so one tenant never takes the last slots
  another tenant's call needs; a call without a tenant (``None``: a service without tenant
  keys, or with one) may take the whole pool;
- a slot freed while calls wait goes to the waiting tenant holding the fewest slots (among
  those under their cap), first come first served within a tenant;
- a call waits ``timeout_s`` at most: then :class:`PoolBusy` and nothing was sent.

Per call the gate does constant work, plus a pass over the tenants that wait (a few) when a
slot is freed while calls wait; a call that stops waiting (timed out, cancelled) stays in its
queue and is skipped when its turn comes, so leaving costs nothing either. It serves one
event loop (the proxy's).
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["ConnectionGate", "PoolBusy"]


class PoolBusy(Exception):
    """No slot of the pool was free for the call within the gate's timeout."""


class ConnectionGate:
    """The slots of one upstream pool, shared fairly between tenants (module docstring).

    Args:
        capacity: the pool's connections (>= 1).
        tenant_cap: the most slots one tenant holds (1 to ``capacity``).
        timeout_s: the longest wait for a slot, in seconds (> 0).
    """

    def __init__(self, capacity: int, tenant_cap: int, timeout_s: float) -> None:
        if not 1 <= tenant_cap <= capacity:
            raise ValueError(f"tenant_cap must be from 1 to {capacity}, got {tenant_cap!r}")
        self.capacity = capacity
        self.tenant_cap = tenant_cap
        self.timeout_s = timeout_s
        self._free = capacity
        self._held: dict[str | None, int] = {}
        self._waiting: dict[str | None, deque[asyncio.Future[None]]] = {}

    # ------------------------------------------------------------------ Public API
    async def acquire(self, tenant: str | None) -> None:
        """Take a slot for ``tenant``'s call; waits for one ``timeout_s`` at most.

        Raises:
            PoolBusy: no slot within ``timeout_s`` (the call holds none).
            asyncio.CancelledError: cancelled while waiting (the call holds none).
        """
        if self._free > 0 and tenant not in self._waiting and self._under_cap(tenant):
            self._take(tenant)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(waiter)
        if self._free > 0:  # free, but others of this tenant queued first
            self._hand_on()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.timeout_s)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.release(tenant)  # granted as the wait ended: give the slot on
            else:
                waiter.cancel()  # left in its queue, skipped when its turn comes
            if isinstance(exc, asyncio.TimeoutError):
                if not self._under_cap(tenant):  # its own share was what ran out
                    raise PoolBusy(
                        f"this key's calls hold their share of the upstream connections "
                        f"({self.tenant_cap} of {self.capacity}) and none came free within "
                        f"{self.timeout_s:g} s"
                    ) from None
                raise PoolBusy(
                    f"no upstream connection free within {self.timeout_s:g} s "
                    f"({self.capacity} in the pool)"
                ) from None
            raise

    def release(self, tenant: str | None) -> None:
        """Give back a slot ``tenant``'s call held; it goes to the waiting tenant that holds
        the fewest."""
        held = self._held[tenant] - 1
        if held:
            self._held[tenant] = held
        else:
            del self._held[tenant]
        self._free += 1
        if self._waiting:
            self._hand_on()

    def held(self, tenant: str | None) -> int:
        """Slots ``tenant`` holds now."""
        return self._held.get(tenant, 0)

    @property
    def free(self) -> int:
        """Slots free now."""
        return self._free

    # ------------------------------------------------------------------ internals
    def _under_cap(self, tenant: str | None) -> bool:
        return tenant is None or self._held.get(tenant, 0) < self.tenant_cap

    def _take(self, tenant: str | None) -> None:
        self._free -= 1
        self._held[tenant] = self._held.get(tenant, 0) + 1

    def _hand_on(self) -> None:
        """Free slots to waiting calls: each to the eligible tenant holding the fewest."""
        while self._free > 0:
            eligible = [t for t in self._waiting if self._under_cap(t)]
            if not eligible:
                return
            tenant = min(eligible, key=self.held)
            queue = self._waiting[tenant]
            waiter = queue.popleft()
            if not queue:
                del self._waiting[tenant]
            if waiter.done():  # its call timed out or was cancelled
                continue
            self._take(tenant)
            waiter.set_result(None)
