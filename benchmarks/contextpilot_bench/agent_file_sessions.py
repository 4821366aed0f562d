"""File-editing agent sessions over this package's own source files (``agentic-file-edits``).

The files are :data:`SOURCE_FILES`, modules of the installed ``contextpilot_integrations``
package read at run time: Python source of the kind a coding agent reads and edits, under this
repository's own licence, offline, and the same for a given commit, so the workload is
deterministic without any dataset. (The shared datasets are prose a search tool retrieves in
pieces; an agent reads and edits source files whole.) None of them is under ``core/messages``:
those modules spell out the pointer wording, which the accounting's pointer check
(:mod:`~contextpilot_bench.agent_accounting`) would read as pointers in a file's text.

Session ``s`` works on a window of :data:`FILE_TURNS` + 1 consecutive files of
:data:`SOURCE_FILES` (starting at file ``s``, wrapping around). In turn ``t`` the target is
window file ``t``, the context window file ``t + 1``; the turn's tool calls, in order:

1. on every third turn from the third on, ``read_file`` of the file edited two turns before
   (its text as the re-read after that edit returned it);
2. ``read_file(target)``: from the second turn on, an exact repeat of the previous turn's read
   of its context file (unchanged since);
3. ``read_file(context)``;
4. on odd turns, ``search_files`` for the name of the function the turn edits;
5. ``edit_file(target, old, new)``: a comment line put above a function's ``def`` line (``old``
   is that line, unique in the file; the function is picked by ``s`` and ``t`` among the
   file's functions);
6. ``read_file(target)``: the whole file again, which differs from the read before by the edit
   only.

The answer is one line, except on odd turns where it quotes the edited function whole (a long
output of the model's own, which the library must send back unchanged). The calls are computed
here on a :class:`~contextpilot_bench.agent_workspace.Workspace`, so every ``old`` is checked
to occur once where the agent will send it; a replay runs the same calls on its own copy.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import contextpilot_integrations
from contextpilot_bench.agent_sessions import AgentSession, AgentTurn, ToolCall
from contextpilot_bench.agent_workspace import (
    EDIT_TOOL,
    READ_TOOL,
    SEARCH_FILES_TOOL,
    Workspace,
)

__all__ = ["FILE_TURNS", "FILE_WORKLOAD", "SOURCE_FILES", "file_sessions", "source_files"]

FILE_WORKLOAD = "agentic-file-edits"
"""The ``--workload`` name."""
FILE_TURNS = 5
"""User turns per session."""
SOURCE_FILES = (
    "contextpilot_integrations/core/blocks.py",
    "contextpilot_integrations/core/lru.py",
    "contextpilot_integrations/core/usage.py",
    "contextpilot_integrations/core/rendering.py",
    "contextpilot_integrations/core/plan.py",
    "contextpilot_integrations/core/placements.py",
    "contextpilot_integrations/core/request.py",
    "contextpilot_integrations/core/conversations/conversation_records.py",
    "contextpilot_integrations/core/ordering/popularity.py",
    "contextpilot_integrations/core/replicas/route_keys.py",
    "contextpilot_integrations/core/ordering/distance.py",
    "contextpilot_integrations/core/conversations/chunking.py",
    "contextpilot_integrations/core/index/index_tree.py",
    "contextpilot_integrations/core/window/window_policy.py",
)
"""The workspace's files, as the agent names them (paths from the repository root)."""


def source_files() -> dict[str, str]:
    """:data:`SOURCE_FILES` read from the installed package (path to text).

    Raises:
        FileNotFoundError: a listed module is not in the installed package.
    """
    root = Path(contextpilot_integrations.__file__).resolve().parent.parent
    out: dict[str, str] = {}
    for path in SOURCE_FILES:
        file = root / path
        if not file.is_file():
            raise FileNotFoundError(f"SOURCE_FILES names {path}, which {root} does not have")
        out[path] = file.read_text(encoding="utf-8")
    return out


def _functions(text: str, path: str) -> list[tuple[str, int, int]]:
    """``(name, def line, last line)`` (1-based) of each function whose ``def`` line is unique
    in ``text``, in line order."""
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text, filename=path)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
            line = lines[node.lineno - 1]
            if text.count(line) == 1:
                found.append((node.name, node.lineno, node.end_lineno))
    if not found:
        raise ValueError(f"SOURCE_FILES: {path} has no function with a unique def line")
    return sorted(found, key=lambda f: f[1])


def _turn(
    workspace: Workspace, session: int, turn: int, window: list[str], edited: list[str]
) -> AgentTurn:
    """Turn ``turn`` of session ``session`` (module docstring); runs its calls on
    ``workspace`` (mutates it) and appends the edited file to ``edited``."""
    target, context = window[turn], window[turn + 1]
    functions = _functions(workspace.files[target], target)
    name, line, _ = functions[(7 * session + 3 * turn) % len(functions)]
    def_line = workspace.files[target].splitlines()[line - 1]
    indent = def_line[: len(def_line) - len(def_line.lstrip())]
    note = f"{indent}# Checked against {context} (session {session + 1}, turn {turn + 1})."
    calls: list[ToolCall] = []
    question = f"In {target}, put a note above `{name}` saying it was checked against {context}."
    if turn >= 2 and turn % 3 == 2:
        calls.append(ToolCall(READ_TOOL, {"path": edited[turn - 2]}))
        question += f" Look at the note you put in {edited[turn - 2]} first and word it alike."
    calls += [ToolCall(READ_TOOL, {"path": target}), ToolCall(READ_TOOL, {"path": context})]
    long_answer = turn % 2 == 1
    if long_answer:
        calls.append(ToolCall(SEARCH_FILES_TOOL, {"pattern": name}))
        question += f" Find where `{name}` is used, and show me the function afterwards."
    edit = ToolCall(EDIT_TOOL, {"path": target, "old": def_line, "new": f"{note}\n{def_line}"})
    calls += [edit, ToolCall(READ_TOOL, {"path": target})]
    for call in calls:
        result = workspace.call(call)
        if result.startswith("Error:"):
            raise ValueError(f"session {session + 1}, turn {turn + 1}: {call}: {result}")
    edited.append(target)
    if long_answer:
        text = workspace.files[target]
        _, start, end = next(f for f in _functions(text, target) if f[0] == name and f[1] > line)
        source = "\n".join(text.splitlines()[start - 2 : end])  # the note, then the function
        answer = f"Done. `{name}` in {target} now reads:\n\n```python\n{source}\n```"
    else:
        answer = f"Done: the note is above `{name}` in {target}."
    return AgentTurn(question, tuple(calls), answer)


def file_sessions(
    sessions: int | None, files: Mapping[str, str] | None = None
) -> list[AgentSession]:
    """The first ``sessions`` file-editing sessions (all, one per file, when ``None``).

    Args:
        sessions: how many, ``int >= 1`` or ``None``; more than ``len(files)`` wraps around
            (session ``s`` starts at file ``s % len(files)``).
        files: the workspace (path to Python source, at least two files); default
            :func:`source_files`.

    Raises:
        ValueError: a bad ``sessions``, too few files, or a file without a function to edit.
    """
    if sessions is not None and (
        isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1
    ):
        raise ValueError(f"sessions must be an int >= 1 or None, got {sessions!r}")
    files = source_files() if files is None else dict(files)
    if len(files) < 2:
        raise ValueError(f"files must hold at least 2 files, got {len(files)}")
    paths = list(files)
    out: list[AgentSession] = []
    for number in range(len(paths) if sessions is None else sessions):
        window = [paths[(number + k) % len(paths)] for k in range(FILE_TURNS + 1)]
        workspace = Workspace(files)
        edited: list[str] = []
        turns = tuple(_turn(workspace, number, t, window, edited) for t in range(FILE_TURNS))
        out.append(AgentSession(f"{number + 1}:files", "", turns, files))
    return out
