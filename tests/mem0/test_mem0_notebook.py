"""notebooks/mem0_memory.ipynb executes headless (nbclient, a kernel on this interpreter:
``support.notebooks``) on real LoCoMo data and plots."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.notebooks import execute_notebook, read_notebook


@pytest.mark.slow
def test_notebook_executes_and_plots(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    notebook = read_notebook("mem0_memory.ipynb")
    execute_notebook(
        notebook,
        kernel_dir=tmp_path / "jupyter",
        cwd=tmp_path,
        timeout_s=300,
        env={
            "CONTEXTPILOT_DATA_DIR": str(data_dir),
            "CONTEXTPILOT_MEM0_STORE": str(tmp_path / "store"),
            "CONTEXTPILOT_NOTEBOOK_QUESTIONS": "30",
        },
        monkeypatch=monkeypatch,
    )
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "30 questions about conv-26: 419 memories of the pair" in text
    for run in ("top-20 online", "top-20 offline", "top-100 online", "top-100 offline"):
        assert f"{run}: hit ratio" in text
