"""An in-memory file system for the file-editing agent sessions, and the tools an agent uses on it.

A :class:`Workspace` is one session's copy of the files (path to text); its methods are the
tools, each returning the text the model reads, as a coding agent's tools do:

``read_file(path)``
    The file's whole text as it stands, without line numbers. LangChain's file-management
    ``ReadFileTool`` returns a file this way; and an edit that adds a line would renumber every
    later line of a ``cat -n`` listing, so a re-read would differ from the first read far beyond
    the edit, which no agent's history gains from.
``edit_file(path, old, new)``
    Replaces the one occurrence of ``old`` by ``new`` and confirms in one line; an ``old`` that
    is absent or not unique is refused (nothing changes), as coding agents' edit tools do.
``search_files(pattern)``
    The lines holding ``pattern`` (plain text, case-sensitive) as ``path:line: text``, files in
    path order, at most :data:`MAX_SEARCH_LINES`.

A refused call returns a line starting with ``Error:`` (the tool result an agent framework
hands the model) instead of raising.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from contextpilot_bench.agent_sessions import ToolCall

__all__ = [
    "EDIT_TOOL",
    "FILE_SYSTEM_PROMPT",
    "FILE_TOOL_DESCRIPTIONS",
    "MAX_SEARCH_LINES",
    "READ_TOOL",
    "SEARCH_FILES_TOOL",
    "Workspace",
]

READ_TOOL = "read_file"
EDIT_TOOL = "edit_file"
SEARCH_FILES_TOOL = "search_files"
MAX_SEARCH_LINES = 50
"""Lines ``search_files`` returns at most (the first ones, in path and line order)."""
FILE_TOOL_DESCRIPTIONS = {
    READ_TOOL: "Read a file of the repository; returns its whole text.",
    EDIT_TOOL: "Replace the one occurrence of `old` in a file by `new`.",
    SEARCH_FILES_TOOL: "Find the lines of the repository's files that contain a text.",
}
"""The tools' descriptions, as the model sees them, by tool name."""
FILE_SYSTEM_PROMPT = (
    "You are a coding assistant working in a Python repository. Read the files a request "
    "names before you change them, make each change with the edit tool, read the file again "
    "to check the change, and answer briefly, quoting code where it helps."
)


class Workspace:
    """One session's files; the tool methods read and change this copy only."""

    def __init__(self, files: Mapping[str, str]) -> None:
        self._files = dict(files)

    @property
    def files(self) -> Mapping[str, str]:
        """The files as they stand (a read-only view)."""
        return dict(self._files)

    def read_file(self, path: str) -> str:
        """The file's text (module docstring)."""
        if path not in self._files:
            return f"Error: no file {path!r}."
        return self._files[path]

    def edit_file(self, path: str, old: str, new: str) -> str:
        """Replace the one occurrence of ``old`` by ``new`` in ``path`` (mutates the file)."""
        text = self._files.get(path)
        if text is None:
            return f"Error: no file {path!r}."
        count = text.count(old) if old else 0
        if count != 1:
            return f"Error: `old` occurs {count} times in {path}; it must occur once."
        self._files[path] = text.replace(old, new, 1)
        before, after = old.count("\n") + 1, new.count("\n") + 1
        return f"Edited {path}: {before} line(s) replaced by {after}."

    def search_files(self, pattern: str) -> str:
        """The lines holding ``pattern`` (module docstring); a line saying none when none."""
        if not pattern:
            return "Error: the pattern is empty."
        hits: list[str] = []
        for path in sorted(self._files):
            for number, line in enumerate(self._files[path].splitlines(), start=1):
                if pattern in line:
                    hits.append(f"{path}:{number}: {line}")
        if not hits:
            return f"No line contains {pattern!r}."
        shown = hits[:MAX_SEARCH_LINES]
        more = len(hits) - len(shown)
        return "\n".join(shown) + (f"\n({more} more lines)" if more else "")

    def call(self, call: ToolCall) -> str:
        """Run one scripted call (what a framework's tool node does with the model's call).

        Raises:
            ValueError: ``call.name`` is not one of the tools, or its arguments do not fit.
        """
        tools: dict[str, Callable[..., str]] = {
            READ_TOOL: self.read_file,
            EDIT_TOOL: self.edit_file,
            SEARCH_FILES_TOOL: self.search_files,
        }
        if call.name not in tools:
            raise ValueError(f"call.name must be one of {', '.join(tools)}, got {call.name!r}")
        try:
            return tools[call.name](**call.arguments)
        except TypeError as error:
            raise ValueError(f"call.arguments do not fit {call.name}: {error}") from error
