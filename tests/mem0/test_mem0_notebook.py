"""notebooks/mem0_memory.ipynb executes headless (nbclient) on real LoCoMo data and plots."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import NATIVE_KERNEL_NAME
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "mem0_memory.ipynb"


@pytest.mark.slow
def test_notebook_executes_and_plots(data_dir: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    env = {
        "CONTEXTPILOT_DATA_DIR": str(data_dir),
        "CONTEXTPILOT_MEM0_STORE": str(tmp_path / "store"),
        "CONTEXTPILOT_NOTEBOOK_QUESTIONS": "30",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(
            notebook,
            timeout=300,
            kernel_name=NATIVE_KERNEL_NAME,  # ipykernel of this interpreter (the .venv)
            resources={"metadata": {"path": str(tmp_path)}},
        ).execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "30 questions about conv-26: 419 memories of the pair" in text
    for run in ("top-20 online", "top-20 offline", "top-100 online", "top-100 offline"):
        assert f"{run}: hit ratio" in text
