"""The plain LangChain agent's prompts as the proxy mode sends them upstream, planned in process.

An unmodified agent pointed at ``contextpilot-server --upstream URL`` sends the plain agent's
own messages; the proxy plans each call's body before it forwards it (docs/DESIGN.md, "The
proxy"). :func:`plan_through_proxy` runs the baseline's recorded prompts, in call order,
through that planning itself
(:class:`~contextpilot_integrations.service.proxy.request_planning.ProxyPlanning`: a service
without tenant keys, an ``openai-compatible`` upstream, the conversation named by the
``x-contextpilot-session`` header as the engine replay names it), with no server and no
engine, and keeps the messages of each body it would forward. So the embedded report prints
the ``proxy`` row from the same code the engine replay's proxy runs, on the prefix-cache model.

With ``processes`` above one, the calls are spread round-robin over that many plannings that
know nothing of each other (each its own process's memory): what several proxy processes
without the peer rule would send (docs/DESIGN.md, "Proxy peers"), the contrast to
:mod:`~contextpilot_bench.proxy_processes`.

Only the messages are read back: the fields the proxy adds for the engine (rid, session id,
cache salt) are no prompt tokens, and the tool schemas are the baseline's.
"""

from __future__ import annotations

import dataclasses
import json

from contextpilot_bench.agent_engine import PROXY_METHOD
from contextpilot_bench.agent_replay import AgentRun
from contextpilot_integrations.service.proxy.request_planning import BadRequest, ProxyPlanning
from contextpilot_integrations.service.tenants import Tenancy

__all__ = ["plan_through_proxy"]

MODEL = "agent"
"""The ``model`` of each body (the proxy forwards it; planning does not read it)."""


def plan_through_proxy(run: AgentRun, processes: int = 1, method: str = PROXY_METHOD) -> AgentRun:
    """``run``'s prompts as one proxy process plans them, in order (``processes``: call ``i``
    planned by the ``i mod processes``-th of that many independent ones): the run named
    ``method``, with ``run``'s tool outputs (the tools ran once; the proxy only rewrites what is
    sent).

    Raises:
        ValueError: the proxy refused a prompt (:class:`~contextpilot_integrations.service.
            proxy.request_planning.BadRequest`, named with the call's position).
    """
    plannings = [ProxyPlanning(Tenancy({}), "openai-compatible") for _ in range(processes)]
    out = AgentRun(method, originals=dict(run.originals))
    for position, prompt in enumerate(run.prompts):
        planning = plannings[position % processes]
        body = {"model": MODEL, "messages": [dict(m) for m in prompt.messages]}
        raw = json.dumps(body, ensure_ascii=False).encode("utf-8")
        try:
            call = planning.prepare(raw, "openai", None, prompt.session)
        except BadRequest as exc:
            raise ValueError(
                f"{method} call {position}: the proxy refused it ({exc.status}: {exc.message})"
            ) from None
        sent = json.loads(call.body)["messages"]
        out.prompts.append(dataclasses.replace(prompt, messages=tuple(sent)))
    return out
