"""notebooks/reproduce_figures.ipynb runs top to bottom on the committed results (so it cannot rot)."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "reproduce_figures.ipynb"


def test_notebook_executes_and_draws_every_figure(tmp_path, monkeypatch):
    from ipykernel.kernelspec import install

    # A kernel spec for this interpreter (the venv's), so no user-installed "python3" kernel is picked up.
    install(kernel_name="kvquant-test", prefix=str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter" / "share" / "jupyter"))
    monkeypatch.setenv("KVQUANT_FIGURES_DIR", str(tmp_path / "figures"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="kvquant-test", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    )
    client.execute()
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) >= 3  # fig_bitwidth, fig_latency, frontier_alignedkv
    assert (tmp_path / "figures" / "frontier_alignedkv.png").is_file()
    assert not list((ROOT / "notebooks").glob("*.png"))
