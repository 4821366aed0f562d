"""notebooks/langchain_quickstart.ipynb executes headless (nbclient, a kernel on this
interpreter: ``support.notebooks``) and shows the gain."""

from __future__ import annotations

import pytest
from support.notebooks import NOTEBOOKS, execute_notebook, read_notebook


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_notebook_executes_and_plots_the_gain(data_dir, tmp_path, monkeypatch):
    notebook = read_notebook("langchain_quickstart.ipynb")
    execute_notebook(
        notebook,
        kernel_dir=tmp_path / "jupyter",
        cwd=NOTEBOOKS,
        timeout_s=180,
        env={"CONTEXTPILOT_DATA_DIR": str(data_dir)},
        monkeypatch=monkeypatch,
    )

    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "500 questions, 326 articles" in text
    assert (
        "ContextPilot (batch): hit ratio" in text and "request id sent to the engine: cp-" in text
    )
    assert "Also relevant: [Doc 1] of turn 1" in text
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1
