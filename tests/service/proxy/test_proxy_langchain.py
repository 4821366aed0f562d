"""Zero code changes: a LangChain agent (``create_agent`` with ``ChatOpenAI``) pointed at the
proxy gets the agent rules without the library's middleware (docs/DESIGN.md, "The proxy")."""

from __future__ import annotations

import httpx
from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from proxy_testing import assert_replayed, serve_proxy
from upstream_standin import SEARCH_RESULT


@tool
def search(query: str) -> str:
    """Search the corpus."""
    return SEARCH_RESULT


def test_a_langchain_agent_behind_the_proxy(standin) -> None:  # type: ignore[no-untyped-def]
    url, state = standin
    with serve_proxy(url) as proxy:
        model = ChatOpenAI(model="agent", base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        agent = create_agent(model, [search], system_prompt="Search, then answer.")
        result = agent.invoke({"messages": [("user", "What does the cache keep?")]})
        assert result["messages"][-1].content == "done"
        # The agent's own state keeps the tool results as the tool returned them.
        tool_messages = [m for m in result["messages"] if m.type == "tool"]
        assert [m.content for m in tool_messages] == [SEARCH_RESULT, SEARCH_RESULT]
        bodies = state.bodies("/v1/chat/completions")
        assert len(bodies) == 3
        assert_replayed(bodies[0]["messages"], bodies[1]["messages"])
        assert_replayed(bodies[1]["messages"], bodies[2]["messages"])
        sent = [m["content"] for m in bodies[2]["messages"] if m["role"] == "tool"]
        assert sent[0] == SEARCH_RESULT
        assert sent[1].startswith('[Same result as search({"query": "alpha"})')
        # No header, no user field: the conversation is named by its opening.
        conversations = httpx.get(f"{proxy}/v1/usage").json()["conversations"][""]
        [(key, figures)] = conversations.items()
        assert key.startswith("opening:") and figures["plans"] == 3
