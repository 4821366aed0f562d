"""notebooks/langchain_quickstart.ipynb executes headless (nbclient) and shows the gain.

The kernel is this interpreter: a kernel spec written to a temporary ``JUPYTER_PATH`` entry (the
first place Jupyter looks) runs ``sys.executable -m ipykernel_launcher``, so a ``python3`` spec
elsewhere on the machine (a user-level one pointing at another Python) cannot be picked up.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "langchain_quickstart.ipynb"
KERNEL = "contextpilot-langchain-test"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_notebook_executes_and_plots_the_gain(data_dir, tmp_path, monkeypatch):
    spec_dir = tmp_path / "kernels" / KERNEL
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
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("CONTEXTPILOT_DATA_DIR", str(data_dir))
    monkeypatch.delenv("CONTEXTPILOT_LLM_BASE_URL", raising=False)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=180,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()

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
