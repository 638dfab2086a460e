"""Figures: one colour per method across every plot, PNG + PDF, data saved beside each figure as CSV.

Every artefact draws through :func:`method_color` and :func:`save_figure`, so a method looks the same in
every figure and every figure exists as PNG (for the README) and PDF (for papers).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

METHOD_COLORS = {
    "fp16": "#000000",
    "truncation": "#7f7f7f",
    "alignedkv": "#1f77b4",
    "alignedkv_release": "#17becf",
    "alignedkv_plus": "#2ca02c",
    "kivi2": "#d62728",
    "kivi4": "#ff9896",
    "gear2": "#9467bd",
    "gear4": "#c5b0d5",
    "gear_l2": "#6a3d9a",
    "gear_l4": "#b294c7",
    "higgs": "#8c564b",
    "higgs_post_rope": "#c49c94",
    "aquakv": "#e377c2",
    "aquakv_k_only": "#f7b6d2",
    "aquakv_v_only": "#c51b7d",
}


def method_color(name: str) -> str:
    """The colour of ``name`` (a registry name, or ``"<name> <detail>"``); unknown names get grey."""
    return METHOD_COLORS.get(name.split()[0], "#bcbd22")


def pyplot():
    """matplotlib's pyplot on the non-interactive backend (figures are files, never windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, stem: Path, copies: Iterable[Path] = ()) -> list[Path]:
    """Save ``fig`` as ``stem.png`` and ``stem.pdf``, plus copies of those and ``stem.csv`` (if written)
    into each folder of ``copies``; returns the paths written in ``stem``'s folder."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix in (".png", ".pdf"):
        fig.savefig(stem.with_suffix(suffix), dpi=150, bbox_inches="tight")
        written.append(stem.with_suffix(suffix))
    pyplot().close(fig)
    csv = stem.with_suffix(".csv")
    for folder in copies:
        folder.mkdir(parents=True, exist_ok=True)
        for path in [*written, csv] if csv.exists() else written:
            shutil.copyfile(path, folder / path.name)
    return written
