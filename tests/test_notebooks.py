"""The tutorials in examples/ run top to bottom (nbclient), on SmolLM2-135M instead of the Qwen pair.

Like papermill, a cell after the one tagged "parameters" overrides its values. Notebooks are committed
without outputs.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
SMALL = {
    "TARGET": "smollm2-135m",
    "DRAFT": "smollm2-135m",
    "QUANTIZATION": "none",
    "DTYPE": "float32",
    "DRAFT_QUANTIZATION": "q4",
    "QUANTIZE_DRAFT_HEAD": False,
    "MAX_NEW_TOKENS": 24,
    "REPEATS": 2,
}
EXPECTED = {
    "quickstart.ipynb": ["tokens/s | mean accepted length", "k histogram", "speedup", "tokens by source"],
    "profiling.ipynb": ["t_draft =", "best k", "cached verify ms"],
    "batch_generation.ipynb": ["tokens/s | mean latency", "rows equal to plain", "mean k by batch size"],
}


def _with_parameters(nb, values: dict):
    """Insert an ``injected-parameters`` cell after the ``parameters`` cell (papermill's convention)."""
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    names = {line.split("=")[0].strip() for line in nb.cells[index].source.splitlines() if "=" in line}
    source = "\n".join(f"{k} = {v!r}" for k, v in values.items() if k in names)
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(index + 1, cell)
    return nb


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_tutorials_exist():
    assert {p.name for p in NOTEBOOKS} >= set(EXPECTED)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), f"clear the outputs of {path.name}"
    assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_on_a_small_model(path, tmp_path):
    nb = _with_parameters(nbformat.read(path, as_version=4), SMALL)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = _text(nb)
    for expected in EXPECTED[path.name]:
        assert expected in text, f"{path.name}: {expected!r} missing from the outputs"
