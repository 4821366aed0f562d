"""notebooks/llamaindex_quickstart.ipynb executes headless (nbclient, a kernel on this
interpreter: ``support.notebooks``) and shows the reuse gain as a plot."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import nbformat
import pytest
from support.notebooks import NOTEBOOKS, execute_notebook, read_notebook


@pytest.mark.slow
def test_quickstart_notebook_runs_and_plots_the_gain(  # type: ignore[no-untyped-def]
    data_dir: Path, documents, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    notebook = read_notebook("llamaindex_quickstart.ipynb")
    # Which interpreter runs the kernel (this test's, the .venv): checked, not assumed.
    notebook.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    start = time.monotonic()
    execute_notebook(
        notebook,
        kernel_dir=tmp_path / "jupyter",
        cwd=NOTEBOOKS,
        timeout_s=240,
        env={"CONTEXTPILOT_DATA_DIR": str(data_dir)},
        monkeypatch=monkeypatch,
    )
    assert time.monotonic() - start < 180
    text = "".join(
        output.get("text", "")
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if output.get("output_type") == "stream" and output.get("name") == "stdout"
    )
    gains = re.findall(r"top-(\d+): hit ratio ([\d.]+) -> ([\d.]+)", text)
    assert [int(k) for k, _, _ in gains] == [3, 5, 8], text
    for _, baseline, contextpilot in gains:
        assert float(contextpilot) > float(baseline) + 0.05
    images = [
        output
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]
    assert len(images) == 1
    kernel_python = notebook.cells[-1].outputs[0]["text"].strip()
    assert Path(kernel_python).resolve() == Path(sys.executable).resolve()
