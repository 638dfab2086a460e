"""Following a recipe page (docs/adding_a_*.md) literally, in a copy of the repository.

A recipe's numbered steps name their file in the heading and give its whole content in the next code
block; the steps that name no file give shell lines (a ``python run.py …`` line and a ``pytest …``
line). ``follow`` writes the files into a copy, runs both lines there side by side, and returns
what they printed, so a page cannot drift from the code.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT

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


def copy_repo(repo: Path, files: dict[str, str]) -> Path:
    """A copy of the repository at ``repo`` with the recipe's ``files`` written into it."""
    repo.mkdir(parents=True)
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, repo / name)
    for path, content in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)  # a recipe may add a package
        (repo / path).write_text(content, encoding="utf-8")
    return repo


def finish(procs: list[subprocess.Popen], timeout: int = 300) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it ends; any still running after ``timeout`` is killed."""
    try:
        return [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


@dataclass
class Followed:
    """What following a recipe printed: its tests' output and exit code, run.py's stderr and exit code."""

    tests_out: str
    tests_rc: int
    run_err: str
    run_rc: int
    results_dir: Path


def follow(doc: Path, tmp_path: Path, shared: list[str]) -> Followed:
    """Write ``doc``'s files into a copy of the repository, then run its ``run.py`` line (results under
    ``tmp_path/out``) beside its ``pytest`` line plus ``shared`` (more pytest arguments)."""
    files, (run_line, test_line) = recipe(doc.read_text(encoding="utf-8"))
    repo = copy_repo(tmp_path / "repo", files)
    out = tmp_path / "out"
    run_py = start([sys.executable, *shlex.split(run_line)[1:], f"results_dir={out}", "progress=false"], repo)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shlex.split(test_line)[1:], *shared]
    tests = start(pytest, repo)
    (tests_out, _), (_, run_err) = finish([tests, run_py])
    return Followed(tests_out, tests.returncode, run_err, run_py.returncode, out)
