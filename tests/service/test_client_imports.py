"""The client needs httpx and pydantic only: importing it, and planning through its local
fallback, loads nothing of the server or the engine link (the ``client`` extra)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from service_testing import free_port

SERVER_ONLY = ("fastapi", "starlette", "uvicorn", "prometheus_client", "zmq", "msgspec")

SCRIPT = textwrap.dedent(
    """
    import sys

    BLOCKED = {blocked!r}

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"the client imported {{name}}")
            return None

    sys.meta_path.insert(0, Refuse())

    from contextpilot_integrations.client import ContextPilotClient, ServiceError
    from contextpilot_integrations.client.client import ContextPilotClient as Same
    from contextpilot_integrations.client.errors import ServiceUnavailableError

    assert Same is ContextPilotClient
    assert issubclass(ServiceUnavailableError, ServiceError)
    with ContextPilotClient("http://127.0.0.1:{port}", retry_interval_s=60) as client:
        plan = client.plan("which blocks?", ["block one", "block two"])
    assert len(plan.placements) == 2, plan
    assert client.stats()["client"]["fallback_plans"] == 1
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("ok")
    """
)


def test_the_client_imports_and_falls_back_without_the_server_packages() -> None:
    script = SCRIPT.format(blocked=SERVER_ONLY, port=free_port())
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
