"""Rules the whole repository keeps, checked over the files git knows.

- Every citation of the design document names one of its headings (code cites it as the path,
  a comma and the heading in double quotes), and the document has every heading the code is
  written against.
- The repository stands on its own: no file points at the notes or data kept outside it.
- Invariants are cited by name, never by number; library and benchmark code carry no issue
  numbers (the reasons belong in the text, not in a tracker reference).
- One import path per name: no module but a package's ``__init__.py`` re-exports a name it
  imported from another module of the project (docs/DESIGN.md, "Layers").

The files are those ``git ls-files`` lists, tracked or new and not ignored, so the rules hold
for work not yet committed too. Fast: text scans and one ``ast`` parse per Python file.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"

# The packages whose modules are checked for re-exports: import name -> directory that holds it.
PACKAGE_ROOTS = {
    "contextpilot_integrations": ROOT,
    "contextpilot_bench": ROOT / "benchmarks",
}

# The headings the code and the tests are written against (the brief's list); the document may
# have more.
REQUIRED_HEADINGS = (
    "Layers",
    "The flow of one request",
    "Prompt layout",
    "Block identity",
    "The context index",
    "Ordering",
    "Conversations and de-duplication",
    "Planning windows",
    "Replicas and routing",
    "The engine link",
    "Engine request fields and hosted prompt caches",
    "The service",
    "The client",
    "Faces",
    "LangChain",
    "LlamaIndex",
    "Mem0",
    "Snapshot formats",
    "Engine facts",
    "SGLang KV events",
    "vLLM KV events",
    "vLLM on a CPU",
    "The smg gateway",
    "SmolLM2-135M-Instruct",
    "Hosted prompt caches",
    "Datasets",
    "Invariants",
    "Lossless",
    "Isolation",
    "Deterministic",
    "Engine hashes are read",
    "Never break a request",
    "Bounded",
    "Hot path",
    "Tenants from credentials",
    "Sure hints",
    "Callers independent",
)

CITING_SUFFIXES = {".py", ".md", ".ipynb", ".sh"}

# A citation: the path, a comma, then one quoted heading, or several ("A", "B" and "C"). The
# path is built here so that this file holds no citation itself.
_QUOTED = r'"([^"]+)"'
CITATION = re.compile(
    r"docs/DESIGN\.md,\s*" + _QUOTED + r"((?:\s*(?:,|and|,\s*and)\s*" + _QUOTED + r")*)"
)
_MORE_QUOTED = re.compile(_QUOTED)

# Paths outside the repository (the workspace's shared notes and data). Split so that this file
# does not mention them.
OUTSIDE_PATHS = ("../" + "shared", "shared" + "/notes", "shared" + "/data")
# .ci/ belongs to whoever runs CI on the workspace: its runner may set up paths of the machine
# it runs on, which are not the repository's.
OUTSIDE_PATHS_EXEMPT = (".ci/",)

NUMBERED_INVARIANT = re.compile(r"\binvariants?\s+(?:no\.?\s*)?#?\d+", re.IGNORECASE)
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
CODE_FOLDERS = ("contextpilot_integrations/", "benchmarks/")


# ---------------------------------------------------------------------------------- the files
@cache
def repository_files() -> tuple[str, ...]:
    """Paths relative to the root: tracked, plus new files git does not ignore, that exist."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode("utf-8")
    names = sorted({name for name in listed.split("\0") if name})
    return tuple(name for name in names if (ROOT / name).is_file())


@cache
def text_of(name: str) -> str | None:
    """The file's text (a notebook: its cells' sources joined), or None for a binary file."""
    raw = (ROOT / name).read_bytes()
    if b"\0" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if name.endswith(".ipynb"):
        cells = json.loads(text).get("cells", [])
        return "\n".join(
            "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            for cell in cells
        )
    return text


def text_files(*, suffixes: set[str] | None = None, under: tuple[str, ...] = ()) -> Iterator[str]:
    for name in repository_files():
        if suffixes is not None and Path(name).suffix not in suffixes:
            continue
        if under and not name.startswith(under):
            continue
        if text_of(name) is not None:
            yield name


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# ---------------------------------------------------------------------------------- headings
def design_headings() -> set[str]:
    """The ``##``-``######`` headings of the design document, outside code fences."""
    headings: set[str] = set()
    fenced = False
    for line in DESIGN.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = re.match(r"#{2,6}\s+(.+?)\s*#*\s*$", line)
        if match and not fenced:
            headings.add(match.group(1))
    return headings


def cited_headings(text: str) -> Iterator[tuple[int, str]]:
    """(offset, heading) of every citation in ``text``; a heading wrapped over lines is read
    with its whitespace collapsed (and so fails unless it fits the heading)."""
    for match in CITATION.finditer(text):
        yield match.start(), match.group(1)
        for more in _MORE_QUOTED.finditer(match.group(2) or ""):
            yield match.start(), more.group(1)


def test_design_document_has_the_required_headings() -> None:
    assert DESIGN.is_file(), "docs/DESIGN.md is missing"
    missing = [heading for heading in REQUIRED_HEADINGS if heading not in design_headings()]
    assert not missing, f"docs/DESIGN.md lacks the headings {missing}"


def test_every_design_citation_names_a_heading() -> None:
    headings = design_headings()
    unresolved = []
    for name in text_files(suffixes=CITING_SUFFIXES):
        text = text_of(name)
        assert text is not None
        for offset, heading in cited_headings(text):
            if " ".join(heading.split()) not in headings:
                unresolved.append(f"{name}:{line_of(text, offset)}: {heading!r}")
    assert not unresolved, "citations of docs/DESIGN.md that name no heading:\n" + "\n".join(
        unresolved
    )


# ---------------------------------------------------------------------------------- text rules
def offending_lines(pattern: re.Pattern[str], names: Iterator[str]) -> list[str]:
    found = []
    for name in names:
        text = text_of(name)
        assert text is not None
        for match in pattern.finditer(text):
            found.append(f"{name}:{line_of(text, match.start())}: {match.group(0)!r}")
    return found


def test_no_file_points_outside_the_repository() -> None:
    pattern = re.compile("|".join(re.escape(path) for path in OUTSIDE_PATHS))
    names = (name for name in text_files() if not name.startswith(OUTSIDE_PATHS_EXEMPT))
    found = offending_lines(pattern, names)
    assert not found, "paths outside the repository:\n" + "\n".join(found)


def test_invariants_are_cited_by_name() -> None:
    found = offending_lines(NUMBERED_INVARIANT, text_files(suffixes=CITING_SUFFIXES))
    assert not found, (
        'cite an invariant by its heading (docs/DESIGN.md, "Invariants"), not its number:\n'
        + "\n".join(found)
    )


def test_code_carries_no_issue_numbers() -> None:
    found = offending_lines(ISSUE_NUMBER, text_files(under=CODE_FOLDERS))
    assert not found, "issue numbers in library or benchmark code:\n" + "\n".join(found)


# ---------------------------------------------------------------------------------- re-exports
@dataclass(frozen=True)
class Module:
    name: str
    path: str
    is_package: bool
    tree: ast.Module

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def module_name(path: str) -> str | None:
    """The import name of a repository file of one of :data:`PACKAGE_ROOTS`, else None."""
    full = ROOT / path
    for top, base in PACKAGE_ROOTS.items():
        try:
            relative = full.relative_to(base)
        except ValueError:
            continue
        if relative.parts[0] != top:
            continue
        parts = list(relative.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join(parts)
    return None


@cache
def project_modules() -> dict[str, Module]:
    modules = {}
    for path in text_files(suffixes={".py"}):
        name = module_name(path)
        if name is None:
            continue
        text = text_of(path)
        assert text is not None
        tree = ast.parse(text, filename=path)
        modules[name] = Module(name, path, path.endswith("__init__.py"), tree)
    return modules


def resolve(module: str | None, level: int, package: str) -> str | None:
    """The absolute module a ``from ... import`` names, seen from ``package``."""
    if level == 0:
        return module
    parts = package.split(".") if package else []
    if level - 1 > len(parts):
        return None
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, module] if module else base)


def top_level_statements(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, looking into ``if`` / ``try`` blocks (``TYPE_CHECKING``,
    optional imports), not into functions or classes."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        yield node
        if isinstance(node, ast.If):
            pending[:0] = [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            pending[:0] = [
                *node.body,
                *(s for h in node.handlers for s in h.body),
                *node.orelse,
                *node.finalbody,
            ]


def defined_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in top_level_statements(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def project_imports(module: Module) -> dict[str, str]:
    """Names ``module`` binds at module level from another project module: name -> source."""
    modules = project_modules()
    bound: dict[str, str] = {}
    for node in top_level_statements(module.tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = resolve(node.module, node.level, module.package)
        if source is None or source.split(".")[0] not in PACKAGE_ROOTS or source not in modules:
            continue
        for alias in node.names:
            if alias.name != "*":
                bound[alias.asname or alias.name] = source
    return bound


def exported_names(tree: ast.Module) -> set[str]:
    """The strings of a literal module-level ``__all__`` (list or tuple; ``+=`` included)."""
    names: set[str] = set()
    for node in top_level_statements(tree):
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets, value = [node.target], node.value
        if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        if isinstance(value, (ast.List, ast.Tuple)):
            names.update(
                e.value
                for e in value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            )
    return names


def imports_from(path: str, package: str) -> Iterator[tuple[str, str, int]]:
    """(module, name, line) of every ``from module import name`` in the file, at any depth."""
    text = text_of(path)
    assert text is not None
    for node in ast.walk(ast.parse(text, filename=path)):
        if isinstance(node, ast.ImportFrom):
            source = resolve(node.module, node.level, package)
            if source is not None:
                for alias in node.names:
                    yield source, alias.name, node.lineno


def test_no_module_but_a_package_reexports() -> None:
    modules = project_modules()
    reexported: dict[str, set[str]] = {}  # module -> the names it passes on
    candidates: dict[str, set[str]] = {}  # module -> names imported from the project, not defined
    for name, module in modules.items():
        if module.is_package:
            continue
        imported = set(project_imports(module)) - defined_names(module.tree)
        candidates[name] = imported
        listed = imported & exported_names(module.tree)
        if listed:
            reexported.setdefault(name, set()).update(listed)
    # Imported elsewhere from a module that did not define the name: a second import path.
    uses: list[str] = []
    for path in text_files(suffixes={".py"}):
        own = module_name(path) or ""
        package = own if path.endswith("__init__.py") else own.rpartition(".")[0]
        for source, imported_name, line in imports_from(path, package):
            if imported_name in candidates.get(source, ()):
                reexported.setdefault(source, set()).add(imported_name)
                uses.append(f"{path}:{line}: from {source} import {imported_name}")
    lines = [
        f"{modules[name].path}: {', '.join(sorted(names))}"
        for name, names in sorted(reexported.items())
    ]
    assert not reexported, (
        "modules that pass on names they import (import each name from the module that defines "
        "it; only a package's __init__.py gathers names):\n"
        + "\n".join(lines)
        + ("\nimported through them:\n" + "\n".join(uses) if uses else "")
    )


# The path of a citation, split so that the examples below are no citations of this file.
_CITE = "docs/DESIGN" + ".md, "


@pytest.mark.parametrize(
    ("text", "headings"),
    [
        (_CITE + '"Lossless"', ["Lossless"]),
        (_CITE + '"Sure hints" and "Bounded"', ["Sure hints", "Bounded"]),
        (_CITE + '"A", "B" and "C".', ["A", "B", "C"]),
        (_CITE + '"Engine-facing\n    request fields"', ["Engine-facing\n    request fields"]),
        ("docs/DESIGN.md: the design", []),
    ],
)
def test_citation_pattern(text: str, headings: list[str]) -> None:
    assert [heading for _, heading in cited_headings(text)] == headings
