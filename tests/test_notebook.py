"""notebooks/reproduce_figures.ipynb runs top to bottom on the committed results (so it cannot rot)."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import NATIVE_KERNEL_NAME, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "reproduce_figures.ipynb"


def this_interpreters_kernel() -> AsyncKernelManager:
    """A kernel manager for ipykernel on this interpreter (the venv's), found without any kernelspec
    folder: no kernel directories are searched (so no user-installed "python3" is picked up), which
    leaves ipykernel's own spec, whose command is ``sys.executable -m ipykernel_launcher``. (A spec
    installed into a temporary prefix and named by ``JUPYTER_PATH`` was once not found there.)"""
    specs = KernelSpecManager(kernel_dirs=[], ensure_native_kernel=True)
    km = AsyncKernelManager(kernel_name=NATIVE_KERNEL_NAME, kernel_spec_manager=specs)
    assert km.kernel_spec.argv[0] == sys.executable
    return km


def test_notebook_executes_and_draws_every_figure(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_FIGURES_DIR", str(tmp_path / "figures"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, timeout=300, km=this_interpreters_kernel(), resources={"metadata": {"path": str(ROOT / "notebooks")}}
    )
    client.execute()
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) >= 3  # fig_bitwidth, fig_latency, frontier_alignedkv
    assert (tmp_path / "figures" / "frontier_alignedkv.png").is_file()
    assert not list((ROOT / "notebooks").glob("*.png"))
