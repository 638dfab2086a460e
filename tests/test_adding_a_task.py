"""docs/adding_a_task.md is the one recipe for a new task, and it works exactly as written.

As ``tests/test_adding_a_method.py`` does for methods (and with its page reader): the recipe's
numbered steps name their file in the heading and give its whole content in the next code block.
This test copies the repository to a temporary folder, writes there exactly those files, runs the
page's ``run.py`` command, its test file and the shared task tests on the new task in the copy, and
checks the recipe touches one module, one YAML and one test file — so the page cannot drift from
the code or grow a fourth step.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys

from conftest import ROOT
from test_adding_a_method import COPIED, recipe, start

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
    files, commands = recipe(DOC.read_text(encoding="utf-8"))
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, repo / name)
    for path, content in files.items():
        (repo / path).write_text(content, encoding="utf-8")

    run_line, test_line = commands
    out = tmp_path / "out"
    run_py = start([sys.executable, *shlex.split(run_line)[1:], f"results_dir={out}", "progress=false"], repo)
    # The recipe's test, and the shared task tests (its YAML, its bounds) on the new task.
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shlex.split(test_line)[1:]]
    tests = start([*pytest, "tests/test_registry.py", "-k", "lastword"], repo)
    try:
        stdout, _ = tests.communicate(timeout=300)
        _, stderr = run_py.communicate(timeout=300)
    finally:
        for proc in (tests, run_py):
            if proc.poll() is None:
                proc.kill()

    assert tests.returncode == 0, stdout[-3000:]
    passed = re.search(r"(\d+) passed", stdout)
    assert passed and int(passed.group(1)) == 5, stdout[-1000:]  # the recipe's 3, and the 2 shared ones

    assert run_py.returncode == 0, stderr[-3000:]
    (results_path,) = out.rglob("results.json")
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
