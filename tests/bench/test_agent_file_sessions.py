"""The file-editing agent workload: the workspace tools, the scripted sessions (a re-read differs
from the read before by the edit only), and one session replayed with and without the library
(no dangling pointers, no prefix breaks, the model's own messages sent unchanged)."""

from __future__ import annotations

import pytest
from contextpilot_bench.agent_accounting import (
    AgentPrompt,
    dangling_pointers,
    pointer_count,
    prefill_tokens,
    prefix_breaks,
)
from contextpilot_bench.agent_file_sessions import FILE_TURNS, SOURCE_FILES, file_sessions
from contextpilot_bench.agent_llamaindex import llamaindex_unavailable, replay_llamaindex
from contextpilot_bench.agent_replay import AgentRun, replay_langchain
from contextpilot_bench.agent_sessions import AgentSession, ToolCall
from contextpilot_bench.agent_workspace import EDIT_TOOL, READ_TOOL, Workspace
from contextpilot_bench.cli import main

from contextpilot_integrations.core.blocks import ApproxTokenCounter

COUNTER = ApproxTokenCounter()


@pytest.fixture(scope="module")
def session() -> AgentSession:
    (first,) = file_sessions(1)
    return first


def test_workspace_tools_edit_their_own_copy() -> None:
    files = {"a.py": "x = 1\ny = 2\n", "b.py": "y = 3\n"}
    workspace = Workspace(files)
    assert workspace.read_file("a.py") == "x = 1\ny = 2\n"
    assert workspace.edit_file("a.py", "y = 2", "y = 20\nz = 3") == (
        "Edited a.py: 1 line(s) replaced by 2."
    )
    assert workspace.read_file("a.py") == "x = 1\ny = 20\nz = 3\n"
    assert files["a.py"] == "x = 1\ny = 2\n"  # the caller's mapping is not changed
    assert workspace.search_files("y =") == "a.py:2: y = 20\nb.py:1: y = 3"
    # Refused calls change nothing and say why.
    assert workspace.edit_file("a.py", "missing", "x").startswith("Error:")
    assert workspace.edit_file("b.py", "", "x").startswith("Error:")
    assert workspace.read_file("c.py").startswith("Error:")
    assert workspace.read_file("a.py") == "x = 1\ny = 20\nz = 3\n"
    with pytest.raises(ValueError, match=r"call\.name"):
        workspace.call(ToolCall("delete_file", {"path": "a.py"}))
    with pytest.raises(ValueError, match=r"call\.arguments"):
        workspace.call(ToolCall(READ_TOOL, {"file": "a.py"}))


def test_sessions_are_built_from_the_package_sources(session: AgentSession) -> None:
    assert set(session.files) == set(SOURCE_FILES)
    assert len(session.turns) == FILE_TURNS
    assert file_sessions(1) == [session]  # deterministic
    with pytest.raises(ValueError, match="sessions"):
        file_sessions(0)
    with pytest.raises(ValueError, match="files"):
        file_sessions(1, {"a.py": "def f():\n    pass\n"})


def test_a_re_read_differs_from_the_read_before_by_the_edit_only(session: AgentSession) -> None:
    workspace = Workspace(session.files)
    last_read: dict[str, str] = {}
    repeats = 0
    for turn in session.turns:
        edit = next(c for c in turn.calls if c.name == EDIT_TOOL)
        path, old, new = (edit.arguments[k] for k in ("path", "old", "new"))
        assert old.count("\n") == 0 and new.count("\n") == 1  # a small edit: one line to two
        for call in turn.calls:
            result = workspace.call(call)
            if call.name != READ_TOOL:
                continue
            before = last_read.get(call.arguments["path"])
            if call is turn.calls[-1]:  # the re-read of the edited file
                assert call.arguments["path"] == path
                assert before is not None and result != before
                assert result == before.replace(old, new, 1)
            elif result == before:
                repeats += 1
            last_read[call.arguments["path"]] = result
    assert repeats >= FILE_TURNS - 1  # each later turn re-reads an unchanged file


def _assistant_messages(run: AgentRun) -> list[tuple[object, ...]]:
    last: dict[str, AgentPrompt] = {p.session: p for p in run.prompts}
    return [
        tuple(m for m in prompt.messages if m.get("role") == "assistant")
        for prompt in last.values()
    ]


def _check_pair(base: AgentRun, pilot: AgentRun, session: AgentSession) -> None:
    calls = sum(len(t.calls) + 1 for t in session.turns)
    assert len(base.prompts) == len(pilot.prompts) == calls
    for run in (base, pilot):
        assert prefix_breaks(run.prompts) == []
        assert all(dangling_pointers(p, run.originals[p.session]) == [] for p in run.prompts)
    assert sum(pointer_count(p) for p in base.prompts) == 0
    assert pointer_count(pilot.prompts[-1]) > 0
    # The model's own messages, the long answers quoting a function among them, go out as the
    # plain agent sends them.
    assert _assistant_messages(base) == _assistant_messages(pilot)
    sent = [m.get("content") for m in pilot.prompts[-1].messages]
    assert all(t.answer in sent for t in session.turns[:-1])
    assert any("```python" in t.answer for t in session.turns)
    base_prefill = sum(p for _, p in prefill_tokens(base.prompts, COUNTER, None))
    pilot_prefill = sum(p for _, p in prefill_tokens(pilot.prompts, COUNTER, None))
    assert pilot_prefill < base_prefill


def test_one_session_replays_through_create_agent(session: AgentSession) -> None:
    base = replay_langchain("baseline", [session], None)
    pilot = replay_langchain("contextpilot", [session], None)
    _check_pair(base, pilot, session)
    # The tools' outputs are what the workspace returns for the scripted calls.
    workspace = Workspace(session.files)
    for number, turn in enumerate(session.turns, start=1):
        for step, call in enumerate(turn.calls, start=1):
            assert base.originals[session.id][f"call_{number}_{step}"] == workspace.call(call)


@pytest.mark.skipif(llamaindex_unavailable() is not None, reason="LlamaIndex agent not importable")
def test_one_session_replays_through_function_agent(session: AgentSession) -> None:
    base = replay_llamaindex("llamaindex-baseline", [session], None)
    pilot = replay_llamaindex("llamaindex-contextpilot", [session], None)
    _check_pair(base, pilot, session)


def test_cli_runs_one_file_session(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "agentic-file-edits", "--agent-sessions", "1", "--agents", "langchain"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "contextpilot prefill tokens vs the plain agent's" in out
    assert "dangling pointers: 0 (target 0: ok)" in out
    assert "prefix breaks: 0 (target 0: ok)" in out
