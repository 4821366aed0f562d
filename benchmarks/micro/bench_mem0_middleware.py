"""Prefill of a tool-using LangChain agent with ``Mem0MemoryMiddleware``, against the same
agent without it.

A ``create_agent`` agent with one tool and a scripted chat model (each user turn: ``--tool-calls``
tool calls, then an answer; the script ignores the prompt, so every run sends the same
conversation) talks with the user for ``--turns`` turns, the application passing the returned
messages back each turn. Mem0 runs offline (local Qdrant, all-MiniLM-L6-v2). Every model call's
messages are serialized (type, content, tool calls, tool call id); a call's prefill is its
prompt tokens minus the tokens of the longest common prefix with the previous call (what an
engine's prefix cache reuses), counted with ``ApproxTokenCounter``. The memory tokens are those
of the memory context the middleware rendered for each turn's first call, once per turn: the
least any placement adds. The figure is the ratio of the agent's prefill with the middleware to
the prefill without it plus the memory tokens, for ``ContextPilotMemory`` and plain Mem0.

Target: ratio <= 1.05 for both memories (docs/DESIGN.md, "Mem0").

Usage: ``.venv/bin/python benchmarks/micro/bench_mem0_middleware.py [--turns 4 --tool-calls 2
--top-k 20]``
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.mem0.local_config import local_mem0_config, offline_environment

SYSTEM_PROMPT = "You are Alice's personal assistant. Use the notes tool, then answer briefly."
MEMORIES = [
    "Alice is vegetarian and does not eat fish.",
    "Alice drinks green tea in the morning and never coffee after noon.",
    "Alice lives in Montreal with her cat Miso.",
    "Alice works as a computational biologist at McGill University.",
    "Alice runs the Montreal half marathon every September.",
    "Alice's brother Tom lives in Shizuoka and sends her Japanese tea.",
    "Alice is allergic to peanuts.",
    "Alice plays the cello in a community orchestra on Wednesdays.",
    "Alice started learning Japanese to talk with her brother's family.",
    "Alice prefers trains to planes for trips under six hours.",
]
QUESTIONS = [
    "Can you suggest a dinner I could cook tonight?",
    "What should I pack for my trip to see my brother?",
    "Any ideas for a weekend plan that fits my routine?",
    "Suggest a snack for after my Wednesday rehearsal.",
    "Which train should I take to Quebec City on Saturday?",
    "What gift could I bring to my orchestra's party?",
]


def notes(query: str) -> str:
    """The tool's answer: a deterministic page of notes about ``query`` (about 200 tokens)."""
    return "\n".join(f"note {i}: what the notebook says about {query!r}" for i in range(16))


def serialize(messages: Sequence[Any]) -> str:
    """One model call's messages as the text an engine would prefill, in order."""
    parts = []
    for m in messages:
        calls = json.dumps(getattr(m, "tool_calls", None) or [], sort_keys=True)
        parts.append(f"<{m.type}>{m.content}|{calls}|{getattr(m, 'tool_call_id', '')}\n")
    return "".join(parts)


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings, in characters."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefill(prompts: Sequence[str]) -> dict[str, int]:
    """Prompt tokens, prefill tokens (not in the previous call's prefix) and the previous
    call's tokens not reused, summed over the calls."""
    counter = ApproxTokenCounter()
    total = new = dropped = 0
    previous = ""
    for text in prompts:
        shared = counter.count(text[: common_prefix(previous, text)])
        total += counter.count(text)
        new += counter.count(text) - shared
        dropped += counter.count(previous) - shared
        previous = text
    return {"prompt": total, "prefill": new, "dropped": dropped}


def scripted_model(tool_calls: int) -> Any:
    """A chat model that calls the ``notes`` tool ``tool_calls`` times per user turn, then
    answers: its reply depends only on the messages after the latest user message."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.outputs import ChatGeneration, ChatResult

    class Scripted(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            kwargs.pop("tool_choice", None)  # model settings come as keywords
            return self.bind(**kwargs)

        def _generate(
            self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any
        ) -> ChatResult:
            turn = sum(isinstance(m, HumanMessage) for m in messages)
            done = 0
            for m in reversed(messages):
                if isinstance(m, HumanMessage):
                    break
                done += isinstance(m, ToolMessage)
            if done < tool_calls:
                call = {
                    "name": "notes",
                    "args": {"query": f"turn {turn} step {done}"},
                    "id": f"call-{turn}-{done}",
                    "type": "tool_call",
                }
                reply = AIMessage(content="", tool_calls=[call])
            else:
                reply = AIMessage(content=f"Here is my suggestion for turn {turn}.")
            return ChatResult(generations=[ChatGeneration(message=reply)])

    return Scripted(messages=iter(()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--turns", type=int, default=4, help=f"user turns (<= {len(QUESTIONS)})")
    parser.add_argument("--tool-calls", type=int, default=2, help="tool calls per user turn")
    parser.add_argument("--top-k", type=int, default=20, help="memories per search")
    args = parser.parse_args()
    questions = QUESTIONS[: args.turns]

    with tempfile.TemporaryDirectory(prefix="bench-mem0-middleware-") as directory:
        os.environ.update(offline_environment(directory))  # before mem0 is imported
        from langchain.agents import create_agent
        from langchain_core.callbacks import BaseCallbackHandler
        from langchain_core.tools import tool
        from mem0 import Memory

        from contextpilot_integrations.mem0 import ContextPilotMemory
        from contextpilot_integrations.mem0 import langchain_middleware as middleware_module
        from contextpilot_integrations.mem0.langchain_middleware import Mem0MemoryMiddleware

        class Recorder(BaseCallbackHandler):
            def __init__(self) -> None:
                self.calls: list[str] = []

            def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
                self.calls.append(serialize(messages[0]))

        # The memory context of every search the middleware makes, with the user turn.
        searches: list[tuple[int, str]] = []
        current = [0]
        search = middleware_module.search_memory_context

        def recorded_search(*a: Any, **kw: Any) -> Any:
            found = search(*a, **kw)
            searches.append((current[0], found.text))
            return found

        middleware_module.search_memory_context = recorded_search  # type: ignore[assignment]

        memory = Memory.from_config(local_mem0_config(directory))
        for text in MEMORIES:
            memory.add(text, user_id="alice", infer=False)
        notes_tool = tool(notes)

        def run(middleware: list[Any]) -> tuple[list[str], list[int]]:
            agent = create_agent(
                scripted_model(args.tool_calls),
                tools=[notes_tool],
                system_prompt=SYSTEM_PROMPT,
                middleware=middleware,
            )
            recorder = Recorder()
            turns: list[int] = []
            history: list[Any] = []
            for turn, question in enumerate(questions):
                current[0] = turn
                before = len(recorder.calls)
                state = agent.invoke(
                    {"messages": [*history, {"role": "user", "content": question}]},
                    context={"user_id": "alice"},
                    config={"callbacks": [recorder]},
                )
                turns.extend([turn] * (len(recorder.calls) - before))
                history = state["messages"]
            return recorder.calls, turns

        without, _ = run([])
        base = prefill(without)
        print(
            f"{len(questions)} user turns, {args.tool_calls} tool calls each, top_k={args.top_k}, "
            f"{len(without)} model calls"
        )
        print(
            f"  without memory:       prompt {base['prompt']:7d}  prefill {base['prefill']:7d}  "
            f"previous call not reused {base['dropped']:6d} tokens"
        )
        counter = ApproxTokenCounter()
        for label, wrapped in (
            ("ContextPilotMemory", ContextPilotMemory(memory)),
            ("plain Mem0", memory),
        ):
            searches.clear()
            mw = Mem0MemoryMiddleware(wrapped, top_k=args.top_k, search_kwargs={"threshold": 0.0})
            prompts, _ = run([mw])
            first: dict[int, str] = {}
            for turn, text in searches:
                first.setdefault(turn, text)
            memory_tokens = sum(counter.count(text) for text in first.values())
            got = prefill(prompts)
            ratio = got["prefill"] / (base["prefill"] + memory_tokens)
            print(
                f"  {label + ':':21s} prompt {got['prompt']:7d}  prefill {got['prefill']:7d}  "
                f"previous call not reused {got['dropped']:6d} tokens; {len(searches)} "
                f"searches, memory {memory_tokens} tokens; prefill / (without + memory) = "
                f"{ratio:.3f}"
            )
        memory.close()


if __name__ == "__main__":
    main()
