"""Executing a notebook headless (nbclient) on a kernel that runs this interpreter.

The kernel spec is written to a temporary ``JUPYTER_PATH`` entry (the first place Jupyter looks)
and runs ``sys.executable -m ipykernel_launcher``, so a ``python3`` spec elsewhere on the
machine (a user-level one pointing at another Python) cannot be picked up. The kernel inherits
this process's environment: plots go to the inline backend (the tests count the images) and
``CONTEXTPILOT_LLM_BASE_URL`` is removed, so the notebooks use their local models.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

import nbclient
import nbformat
import pytest

KERNEL = "contextpilot-tests"
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def execute_notebook(
    notebook: nbformat.NotebookNode,
    *,
    kernel_dir: Path,
    cwd: Path,
    timeout_s: int,
    env: Mapping[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Execute ``notebook`` in place (its cells get their outputs), working directory ``cwd``.

    ``kernel_dir`` (an empty temporary directory) receives the kernel spec; ``env`` is set for
    the kernel through ``monkeypatch`` (undone after the test); ``timeout_s`` bounds each cell.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised.
        nbclient.exceptions.CellTimeoutError: a cell ran longer than ``timeout_s``.
    """
    spec_dir = kernel_dir / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "contextpilot tests",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.delenv("CONTEXTPILOT_LLM_BASE_URL", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nbclient.NotebookClient(
        notebook,
        timeout=timeout_s,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(cwd)}},
    ).execute()


def read_notebook(name: str) -> nbformat.NotebookNode:
    """``notebooks/<name>`` as an nbformat 4 notebook."""
    return nbformat.read(NOTEBOOKS / name, as_version=4)
