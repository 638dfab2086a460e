"""docs/adding_a_method.md is the one recipe for a new method, and it works exactly as written.

The recipe's numbered steps name their file in the heading and give its whole content in the next
code block. This test copies the repository to a temporary folder, writes there exactly those files,
runs the page's ``run.py`` command, its test file and the shared layout tests on the new method in the
copy, and checks the recipe touches one module, one YAML and one test file — so the page cannot drift
from the code or grow a fourth step.
"""

from __future__ import annotations

import json
import re

from conftest import ROOT
from recipes import follow, recipe

DOC = ROOT / "docs" / "adding_a_method.md"


def kind(path: str) -> str:
    """What a recipe file is, by where it lives (anything else is named by its path, and fails)."""
    patterns = {"module": r"kvquant/methods/\w+\.py", "yaml": r"conf/method/\w+\.yaml", "test": r"tests/test_\w+\.py"}
    return next((k for k, pattern in patterns.items() if re.fullmatch(pattern, path)), path)


def test_the_recipe_names_one_module_one_yaml_one_test():
    files, commands = recipe(DOC.read_text(encoding="utf-8"))
    kinds = sorted(kind(p) for p in files)
    assert kinds == ["module", "test", "yaml"], sorted(files)
    assert [c.split()[0] for c in commands] == ["python", "pytest"]
    assert not any((ROOT / p).exists() for p in files), "the worked example must not already be in the repository"


def test_a_toy_method_added_by_the_recipe_runs_end_to_end(tmp_path):
    # The recipe's test, and the shared layout tests (seven architectures, sliding windows) on the new method.
    done = follow(DOC, tmp_path, ["tests/test_architectures.py", "-k", "halfkeys"])
    assert done.tests_rc == 0, done.tests_out[-3000:]
    passed = re.search(r"(\d+) passed", done.tests_out)
    assert passed and int(passed.group(1)) > 4, done.tests_out[-1000:]  # the recipe's 4, and the layouts ran too

    assert done.run_rc == 0, done.run_err[-3000:]
    (results_path,) = done.results_dir.rglob("results.json")
    results = json.loads(results_path.read_text(encoding="utf-8"))
    assert results["method"] == {"name": "halfkeys", "rounding": "nearest"}
    assert results["config"]["method"] == results["method"]  # the YAML's keys and defaults are the dataclass's
    assert results["bits"]["stored"] == results["bits"]["read"] == 12.0 < 16
    assert results["bits"]["analytic_stored"] == 12.0
    assert 0 < results["fidelity"]["greedy_match"] <= 1 and results["metrics"]["ppl"] > 1
