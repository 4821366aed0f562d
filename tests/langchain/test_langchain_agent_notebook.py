"""notebooks/langchain_agent.ipynb executes headless (nbclient, a kernel on this interpreter:
``support.notebooks``) and shows the middleware's gain in a ``create_agent`` agent."""

from __future__ import annotations

import re

import pytest
from support.notebooks import NOTEBOOKS, execute_notebook, read_notebook

_RATIO = re.compile(
    r"prefill tokens with vs without ContextPilotMiddleware: ([\d,]+) / ([\d,]+) = [\d.]+"
)
_POINTERS = re.compile(r"pointers placed: (\d+), dangling pointers: (\d+)")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_agent_notebook_executes_and_shows_the_middleware_gain(data_dir, tmp_path, monkeypatch):
    notebook = read_notebook("langchain_agent.ipynb")
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
    ratio = _RATIO.search(text)
    assert ratio is not None, "no prefill ratio line"
    with_middleware, without = (int(g.replace(",", "")) for g in ratio.groups())
    assert 0 < with_middleware < without
    pointers = _POINTERS.search(text)
    assert pointers is not None, "no pointer count line"
    assert int(pointers.group(1)) > 0 and int(pointers.group(2)) == 0
    # The tool message shown as the model got it: a document replaced by a pointer that names
    # the earlier call (its arguments whole, or cut short to a prefix and an ellipsis).
    assert re.search(
        r"^\[Same as document \[Doc \d\] of "
        r"search\(\{.+(?:\}|\u2026)\) above\.\]$",
        text,
        flags=re.MULTILINE,
    )
    assert "'new_pointers'" in text  # middleware.stats()
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1
