"""docs/adding_a_task.md is the one recipe for a new task, and it works exactly as written.

As for methods (``tests/test_adding_a_method.py``): the page's numbered steps name their file in the
heading and give its whole content in the next code block. This test writes exactly those files into
a copy of the repository (``recipes.follow``), runs there the page's ``run.py`` command, its test file
and the shared task tests on the new task, and checks the recipe touches one module, one YAML and
one test file — so the page cannot drift from the code or grow a fourth step.
"""

from __future__ import annotations

import json
import re

from conftest import ROOT
from recipes import follow, recipe

DOC = ROOT / "docs" / "adding_a_task.md"


def kind(path: str) -> str:
    """What a recipe file is, by where it lives (anything else is named by its path, and fails)."""
    patterns = {"module": r"kvquant/eval/\w+\.py", "yaml": r"conf/task/\w+\.yaml", "test": r"tests/test_\w+\.py"}
    return next((k for k, pattern in patterns.items() if re.fullmatch(pattern, path)), path)


def test_the_recipe_names_one_module_one_yaml_one_test():
    files, commands = recipe(DOC.read_text(encoding="utf-8"))
    assert sorted(kind(p) for p in files) == ["module", "test", "yaml"], sorted(files)
    assert [c.split()[0] for c in commands] == ["python", "pytest"]
    assert not any((ROOT / p).exists() for p in files), "the worked example must not already be in the repository"


def test_a_toy_task_added_by_the_recipe_runs_end_to_end(tmp_path):
    # The recipe's test, and the shared task tests (its YAML, its bounds) on the new task.
    done = follow(DOC, tmp_path, ["tests/test_registry.py", "-k", "lastword"])

    assert done.tests_rc == 0, done.tests_out[-3000:]
    passed = re.search(r"(\d+) passed", done.tests_out)
    assert passed and int(passed.group(1)) == 5, done.tests_out[-1000:]  # the recipe's 3, and the 2 shared ones

    assert done.run_rc == 0, done.run_err[-3000:]
    (results_path,) = done.results_dir.rglob("results.json")
    results = json.loads(results_path.read_text(encoding="utf-8"))
    config = results["config"]["task"]
    assert config == {"name": "lastword", "limit": 4, "chunk_size": 32, "batch_size": 8, "source": "bundled"}
    assert {k: results["task"][k] for k in config} == config and results["task"]["n"] == 4
    metrics, ci95 = results["metrics"], results["ci95"]
    assert set(metrics) == {"acc", "logprob"} and 0 <= metrics["acc"] <= 1 and metrics["logprob"] < 0
    lo, hi = ci95["metrics/logprob"]
    assert lo <= metrics["logprob"] <= hi and results["n"]["metrics/logprob"] == 4
    assert set(results["paired"]) == {"acc", "logprob"}  # against fp16's outputs, computed first
    assert results["fidelity"]["kl"] > 0 and results["fidelity"]["answer_agreement"] <= 1
    assert results["bits"]["read"] == 13.0 < results["bits"]["stored"] == 16.0  # truncation's default keep_bits
