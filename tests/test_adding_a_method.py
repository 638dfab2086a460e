"""docs/adding_a_method.md is the one recipe for a new method, and it works exactly as written.

The recipe's numbered steps name their file in the heading and give its whole content in the next
code block. This test copies the repository to a temporary folder, writes there exactly those files,
runs the page's ``run.py`` command, its test file and the shared layout tests on the new method in the
copy, and checks the recipe touches one module, one YAML and one test file — so the page cannot drift
from the code or grow a fourth step.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

DOC = ROOT / "docs" / "adding_a_method.md"
COPIED = ("run.py", "pyproject.toml", "conf", "experiments", "kvquant", "kernels_cpu", "kernels_cupy", "tests")
STEP = re.compile(r"^### \d+\. .*?(?:`([^`]+)`)?$")


def recipe(text: str) -> tuple[dict[str, str], list[str]]:
    """``{path: content}`` of every step that names a file, and the shell lines of the steps that do not."""
    files: dict[str, str] = {}
    commands: list[str] = []
    target, block, in_block, in_step = None, [], False, False
    for line in text.splitlines():
        if in_block:
            if line.startswith("```"):
                if target:
                    files[target] = "\n".join(block) + "\n"
                else:
                    commands += [c for c in block if c.strip()]
                in_block, target, in_step = False, None, False
            else:
                block.append(line)
        elif line.startswith("#"):
            match = STEP.match(line)
            in_step, target = bool(match), match.group(1) if match else None
        elif line.startswith("```") and in_step:
            in_block, block = True, []
    return files, commands


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    """A subprocess in the copy, offline, one torch thread (the two run side by side)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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
    # The recipe's test, and the shared layout tests (seven architectures, sliding windows) on the new method.
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shlex.split(test_line)[1:]]
    tests = start([*pytest, "tests/test_architectures.py", "-k", "halfkeys"], repo)
    try:
        stdout, _ = tests.communicate(timeout=300)
        _, stderr = run_py.communicate(timeout=300)
    finally:
        for proc in (tests, run_py):
            if proc.poll() is None:
                proc.kill()

    assert tests.returncode == 0, stdout[-3000:]
    passed = re.search(r"(\d+) passed", stdout)
    assert passed and int(passed.group(1)) > 4, stdout[-1000:]  # the recipe's 4, and the layouts ran too

    assert run_py.returncode == 0, stderr[-3000:]
    (results_path,) = out.rglob("results.json")
    results = json.loads(results_path.read_text(encoding="utf-8"))
    assert results["method"] == {"name": "halfkeys", "rounding": "nearest"}
    assert results["config"]["method"] == results["method"]  # the YAML's keys and defaults are the dataclass's
    assert results["bits"]["stored"] == results["bits"]["read"] == 12.0 < 16
    assert results["bits"]["analytic_stored"] == 12.0
    assert 0 < results["fidelity"]["greedy_match"] <= 1 and results["metrics"]["ppl"] > 1
