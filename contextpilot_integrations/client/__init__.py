"""The index service's HTTP client: the ``Planner`` contract over HTTP, sync and async twins.

Needs ``httpx`` and ``pydantic`` only (``pip install contextpilot-integrations[client]``):
nothing of the server. Modules: :mod:`.client` (``ContextPilotClient``), :mod:`.calls` (each
call once, as a generator of HTTP requests), :mod:`.transports` (how they are sent),
:mod:`.errors` (what each answer raises), :mod:`.fallback` (the local plans while the service
is down), :mod:`.conversations` (turn numbers across service restarts, calls that failed
after they were sent), :mod:`.schemas` (the wire format, shared with the server).
"""

from contextpilot_integrations.client.client import ContextPilotClient
from contextpilot_integrations.client.errors import ServiceError, ServiceUnavailableError

__all__ = ["ContextPilotClient", "ServiceError", "ServiceUnavailableError"]
