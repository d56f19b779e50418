"""The notebooks run top to bottom in a real Jupyter kernel (nbclient + ipykernel on this interpreter, importing
this checkout) and draw their pictures: no cell errors, and every cell tagged "figure" shows one PNG.

``python tests/test_notebook.py`` executes them the same way and writes the outputs back into notebooks/ (the
committed notebooks keep their outputs, so GitHub shows the pictures).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_BYTES = 400_000  # a committed notebook with its PNGs; larger means oversized figures


def execute(path: Path, kernels: Path) -> nbformat.NotebookNode:
    """``path`` executed in its own folder by a kernel of this interpreter (not whatever "python3" a Jupyter
    install on the machine points to), with this checkout first on the kernel's import path."""
    spec = kernels / "lightning-spatial"
    spec.mkdir(parents=True, exist_ok=True)
    path_entries = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    spec_json = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lightning_spatial (test)",
        "language": "python",
        "env": {"PYTHONPATH": os.pathsep.join(path_entries)},
    }
    (spec / "kernel.json").write_text(json.dumps(spec_json))
    manager = KernelManager(kernel_name=spec.name, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, km=manager, timeout=300, record_timing=False, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError with the cell and its traceback
    return notebook


def figures(notebook: nbformat.NotebookNode) -> list[tuple[str, int]]:
    """(first source line, number of PNG outputs) of every cell tagged "figure"."""
    tagged = [c for c in notebook.cells if "figure" in c.metadata.get("tags", [])]
    return [(c.source.splitlines()[0], sum("image/png" in o.get("data", {}) for o in c.outputs)) for c in tagged]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_a_kernel_and_draws_its_figures(path, tmp_path):
    notebook = execute(path, tmp_path)
    drawn = figures(notebook)
    assert drawn and all(count == 1 for _, count in drawn), drawn


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_shows_its_figures_and_stays_small(path):
    drawn = figures(nbformat.read(path, as_version=4))
    assert drawn and all(count == 1 for _, count in drawn), f"{path.name}: run `python tests/test_notebook.py`"
    assert path.stat().st_size < MAX_BYTES, f"{path.name} is {path.stat().st_size} bytes: make its figures smaller"


def test_the_tour_and_the_bev_notebook_exist():
    assert [p.name for p in NOTEBOOKS] == ["bev.ipynb", "tour.ipynb"]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as kernels:
        for path in [Path(p).resolve() for p in sys.argv[1:]] or NOTEBOOKS:
            nbformat.write(execute(path, Path(kernels)), path)
            print(f"{path.relative_to(ROOT)}: {path.stat().st_size} bytes, figures {figures(nbformat.read(path, 4))}")
