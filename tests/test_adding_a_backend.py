"""docs/adding_a_backend.md is the one recipe for a new backend, and it works exactly as written.

The page's numbered steps name their file in the heading and give its whole content in the next code
block. This test copies the repository to a temporary folder, writes there exactly those files, runs
the page's ``run.py`` command and its test file in the copy (``recipes.follow``), and checks the recipe
touches one package (its ``__init__`` and ``backend`` modules) and one test file.
"""

from __future__ import annotations

import json
import re

from conftest import ROOT
from recipes import follow, recipe

DOC = ROOT / "docs" / "adding_a_backend.md"


def kind(path: str) -> str:
    """What a recipe file is, by where it lives (anything else is named by its path, and fails)."""
    patterns = {
        "package": r"kernels_\w+/__init__\.py",
        "backend": r"kernels_\w+/backend\.py",
        "test": r"tests/test_kernels_\w+\.py",
    }
    return next((k for k, pattern in patterns.items() if re.fullmatch(pattern, path)), path)


def test_the_recipe_names_one_package_and_one_test():
    files, commands = recipe(DOC.read_text(encoding="utf-8"))
    assert sorted(kind(p) for p in files) == ["backend", "package", "test"], sorted(files)
    assert len({p.split("/")[0] for p in files if not p.startswith("tests/")}) == 1  # one package
    assert [c.split()[0] for c in commands] == ["python", "pytest"]
    assert not any((ROOT / p).exists() for p in files), "the worked example must not already be in the repository"


def test_a_toy_backend_added_by_the_recipe_runs_end_to_end(tmp_path):
    done = follow(DOC, tmp_path, [])
    assert done.tests_rc == 0, done.tests_out[-3000:]
    ran = re.search(r"\b2 passed", done.tests_out) or done.tests_out.split()[:1] == [".."]  # however quiet
    assert ran, done.tests_out[-1000:]
    assert done.run_rc == 0, done.run_err[-3000:]
    (results_path,) = done.results_dir.rglob("results.json")
    results = json.loads(results_path.read_text(encoding="utf-8"))
    assert results["method"]["backend"] == results["method"]["backend_used"] == "toy"
    assert results["bits"]["stored"] == results["bits"]["read"] == 16.0
    assert results["metrics"]["ppl"] > 1  # fp16 is the reference: no fidelity block (its test compares with torch)
