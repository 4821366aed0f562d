"""The quick-start notebook executes headless (nbclient, a kernel on this interpreter) and shows
the reuse gain as a plot."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "llamaindex_quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs_and_plots_the_gain(documents) -> None:  # type: ignore[no-untyped-def]
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from jupyter_client.kernelspec import NATIVE_KERNEL_NAME

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")
    # Which interpreter runs the kernel (this test's, the .venv): checked, not assumed.
    notebook.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = nbclient.NotebookClient(
        notebook,
        timeout=240,
        kernel_name=NATIVE_KERNEL_NAME,  # ipykernel of this interpreter (the .venv)
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    start = time.monotonic()
    client.execute()
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
