"""Bundled datasets (real, licensed copies under ``kvquant/assets/datasets``; see PROVENANCE.md there)."""

from __future__ import annotations

from pathlib import Path

from kvquant.errors import KvquantError

DATASETS = Path(__file__).resolve().parent / "assets" / "datasets"


def dataset_file(relative: str) -> Path:
    """Path of a bundled data file, or a one-line error naming it."""
    path = DATASETS / relative
    if not path.is_file():
        raise KvquantError(f"data file not found: {path}; it ships with the repository (restore it with git checkout)")
    return path


def tinystories_pieces() -> list[str]:
    """TinyStories validation stories, split on blank lines (4,300 pieces)."""
    text = dataset_file("tinystories/tinystories_val.txt").read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def wikitext2_test() -> str:
    """WikiText-2 (raw) test split as the usual perplexity string ``"\\n\\n".join(rows)`` (LF line ends)."""
    return dataset_file("wikitext-2/wikitext-test.txt").read_text(encoding="utf-8").replace("\r\n", "\n")
