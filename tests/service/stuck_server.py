"""``contextpilot-server`` whose evictions never return: a stand-in for a call stuck in the
engine link (such as a mirror walk looping for ever under the mirror lock).
Run by ``test_event_loop.py`` through ``server_factory(..., launcher=...)``."""

from __future__ import annotations

import sys
import threading

from contextpilot_integrations.service.index_service import IndexService
from contextpilot_integrations.service.server import main

_NEVER = threading.Event()


def _stuck_evict(self: IndexService, rid: str, *, caller: str | None = None) -> bool:
    _NEVER.wait()
    return False


IndexService.evict = _stuck_evict  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
