"""Many clients of two tenants at once through the proxy while the upstream fails, stalls and
is hung up on: every request is answered, each with its own answer, and no tenant sees
another's conversation (docs/DESIGN.md, "The proxy", "Callers independent", "Isolation")."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
from proxy_testing import serve_proxy

from contextpilot_integrations.service.tenants import TenantKeys

TENANTS = {"alice": TenantKeys(("alice-key",)), "bob": TenantKeys(("bob-key",))}


async def _one(client: httpx.AsyncClient, proxy: str, i: int, kind: str) -> tuple[int, str, object]:
    tenant = "alice" if i % 2 else "bob"
    headers = {
        "authorization": f"Bearer {tenant}-key",
        "x-contextpilot-session": f"conversation-{i % 5}",
    }
    text = f"request {i} of {tenant}"
    body: dict[str, object] = {"messages": [{"role": "user", "content": text}]}
    if kind in ("hang", "break"):
        body |= {"model": kind, "stream": True}
        async with client.stream(
            "POST", f"{proxy}/v1/chat/completions", json=body, headers=headers
        ) as response:
            lines = response.aiter_lines()
            await lines.__anext__()  # the first event
            if kind == "break":  # the upstream breaks off: the client's answer is cut short
                try:
                    async for _ in lines:
                        pass
                except httpx.RemoteProtocolError:
                    return i, kind, "cut short"
        return i, kind, response.status_code
    body["model"] = {"ok": "echo", "error": "error-500", "stall": "stall"}[kind]
    response = await client.post(f"{proxy}/v1/chat/completions", json=body, headers=headers)
    if kind != "ok":
        return i, kind, response.status_code
    content, rid = json.loads(response.json()["choices"][0]["message"]["content"])
    assert rid == response.headers["x-contextpilot-rid"]
    return i, kind, (content, tenant, rid)


def test_concurrent_requests_with_a_failing_upstream(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    kinds = ["ok"] * 40 + ["error"] * 8 + ["stall"] * 4 + ["hang"] * 8 + ["break"] * 4
    random.Random(3).shuffle(kinds)

    async def run(proxy: str) -> list[tuple[int, str, object]]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(_one(client, proxy, i, k) for i, k in enumerate(kinds)))

    with serve_proxy(url, {"read_timeout_s": 3.0}, tenants=TENANTS) as proxy:
        answers = asyncio.run(run(proxy))
        usage = {
            tenant: httpx.get(
                f"{proxy}/v1/usage", headers={"authorization": f"Bearer {tenant}-key"}
            ).json()
            for tenant in TENANTS
        }
    assert len(answers) == len(kinds)
    tags = {}
    for i, kind, answer in answers:
        if kind == "ok":
            content, tenant, rid = answer  # type: ignore[misc]
            assert content == f"request {i} of {tenant}"  # its own answer, nobody else's
            tags.setdefault(tenant, set()).add(rid.split(".")[0])
        else:
            expected = {"error": 500, "stall": 504, "hang": 200, "break": "cut short"}[kind]
            assert answer == expected, (i, kind, answer)
    assert len(tags["alice"]) == len(tags["bob"]) == 1 and tags["alice"] != tags["bob"]
    for tenant, figures in usage.items():
        assert set(figures["conversations"]) == {tenant}
        planned = sum(c["plans"] for c in figures["conversations"][tenant].values())
        assert planned == sum(1 for i, _ in enumerate(kinds) if (i % 2 == 1) == (tenant == "alice"))
    # Each stand-in request came with its tenant's own salt.
    salts = {json.loads(r.raw)["messages"][0]["content"].split()[-1]: set() for r in state.received}
    for received in state.received:
        body = json.loads(received.raw)
        salts[body["messages"][0]["content"].split()[-1]].add(body["cache_salt"])
    assert all(len(s) == 1 for s in salts.values()) and salts["alice"] != salts["bob"]
