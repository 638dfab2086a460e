"""The Hydra entry point, end to end, as a user runs it."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_py

FAST = ["model=stories260k", "logger=none", "progress=false", "task.ppl_pieces=20", "task.max_new_tokens=8"]


def run_cli(tmp_path, *args, **env):
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    return run_py(tmp_path, *flags, f"results_dir={tmp_path}", *overrides, env=env, timeout=300)


def results_files(tmp_path):
    return sorted(tmp_path.rglob("results.json"))


def test_run_writes_results_then_skips_then_reruns(tmp_path):
    from conftest import require_kernels_cpu

    require_kernels_cpu()
    first = run_cli(tmp_path, *FAST, "method=fp16", "task=tinystories", "task.limit=5")
    assert first.returncode == 0, first.stderr
    [path] = results_files(tmp_path)
    data = json.loads(path.read_text())
    assert data["model"]["name"] == "stories260k"
    assert data["method"] == {"name": "fp16", "backend": "auto", "backend_used": "cpu"}  # a newcomer gets the kernels
    assert data["task"]["limit"] == 5 and data["task"]["chunk_size"] == 32
    assert data["bits"]["stored"] == 16.0 and data["memory"]["kv_bytes"] == data["memory"]["kv_bytes_fp16"]
    assert 3.0 < data["metrics"]["ppl"] < 6.0
    assert {"wall_s", "prefill_tok_s", "decode_tok_s"} <= set(data["timing"])
    assert {"python", "torch", "transformers", "lm_eval", "git_commit", "host"} <= set(data["env"])
    assert "fidelity" not in data  # fp16 is the reference
    assert "metrics/ppl" in first.stdout

    again = run_cli(tmp_path, *FAST, "method=fp16", "task=tinystories", "task.limit=5")
    assert again.returncode == 0 and "skip:" in again.stdout
    assert len(results_files(tmp_path)) == 1
    # A new interpreter (a resumed sweep's job process) skips without importing torch or transformers.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    argv = [sys.executable, "-X", "importtime", str(ROOT / "run.py"), *FAST, "method=fp16", "task=tinystories"]
    fresh = subprocess.run(
        [*argv, "task.limit=5", f"results_dir={tmp_path}"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert fresh.returncode == 0 and "skip:" in fresh.stdout, fresh.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in fresh.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported and not {"torch", "transformers"} & imported
    assert len(results_files(tmp_path)) == 1

    forced = run_cli(tmp_path, *FAST, "method=fp16", "task=tinystories", "task.limit=5", "rerun=true")
    assert forced.returncode == 0 and len(results_files(tmp_path)) == 2


def test_unknown_choice_lists_valid_names(tmp_path):
    proc = run_cli(tmp_path, "method=nope")
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert line.startswith("error: unknown method 'nope'; valid methods: ") and line.endswith("(conf/method/*.yaml)")
    assert "fp16" in line
    proc = run_cli(tmp_path, "model=gpt5")
    assert proc.returncode == 2 and "valid models: llama2_7b" in proc.stderr


def test_bad_parameter_is_one_line(tmp_path):
    proc = run_cli(tmp_path, *FAST, "+method.bits=3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: method 'fp16': got an unexpected keyword")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["method=kivi2", "method.grup_size=8"],
            "error: method 'kivi2' has no parameter 'grup_size'; its parameters are: bits, group_size, residual, "
            "backend (conf/method/kivi2.yaml)",
        ),
        (["method=alignedkv", "method.margin=abc"], "error: method 'alignedkv': parameter 'margin' expects float"),
        (["+method.grup_size=8", "method=kivi2"], "error: method 'kivi2': got an unexpected keyword argument"),
        (["task.limitt=3"], "error: task 'tinystories' has no parameter 'limitt'; its parameters are: limit,"),
        (["task=passkey", "task.lengths=[1024,x]"], "error: task 'passkey': parameter 'lengths' expects a list of int"),
    ],
)
def test_parameter_errors_are_one_line_whatever_the_route(tmp_path, args, line):
    proc = run_cli(tmp_path, "model=stories260k", "logger=none", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), proc.stderr[-2000:]


@pytest.mark.slow
def test_failed_sweep_job_is_reported_and_the_sweep_resumes(tmp_path):
    # The middle job asks for more context than stories260k has; the jobs around it still run.
    broken = run_cli(tmp_path, "-m", *FAST, "task.limit=1", "task.max_tokens=64,1024,96")
    assert broken.returncode == 1 and "context is 512" in broken.stderr
    assert (
        broken.stderr.strip()
        .splitlines()[-1]
        .startswith("sweep: 3 jobs, 2 done, 0 skipped, 1 failed (task.max_tokens=1024)")
    )
    assert sorted(json.loads(p.read_text())["task"]["max_tokens"] for p in results_files(tmp_path)) == [64, 96]

    resumed = run_cli(tmp_path, "-m", *FAST, "task.limit=1", "task.max_tokens=64,128,96")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("skip:") == 2 and "sweep: 3 jobs, 1 done, 2 skipped, 0 failed" in resumed.stdout
    assert sorted(json.loads(p.read_text())["task"]["max_tokens"] for p in results_files(tmp_path)) == [64, 96, 128]


def test_single_run_failure_keeps_exit_code_2(tmp_path):
    proc = run_cli(tmp_path, *FAST, "method=aquakv", KVQUANT_PREDICTOR_DIR=str(tmp_path / "no-predictors"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: no AQUA-KV predictors at ")
    assert "sweep:" not in proc.stdout + proc.stderr and not results_files(tmp_path)


def test_suite_task_writes_examples_fidelity_and_reuses_the_fp16_reference(tmp_path):
    args = ["model=stories260k", "logger=none", "progress=false", "task=truthfulqa_mc2", "task.limit=2"]
    fp16 = run_cli(
        tmp_path, *args, "method=fp16", "method.backend=torch"
    )  # the reference: fp16 as transformers runs it
    assert fp16.returncode == 0, fp16.stderr
    [ref] = list((tmp_path / "references").rglob("*.pt"))
    lossy = run_cli(tmp_path, *args, "method=truncation", "method.keep_bits=9")
    assert lossy.returncode == 0, lossy.stderr
    assert list((tmp_path / "references").rglob("*.pt")) == [ref]
    data = {
        json.loads(p.read_text())["method"]["name"]: (p, json.loads(p.read_text())) for p in results_files(tmp_path)
    }
    path, res = data["truncation"]
    assert (
        res["task"]["n"] == 2
        and res["task"]["truncated"] == 0
        and res["examples"] == {"file": "examples.jsonl", "n": 2}
    )
    assert {"kl", "top1_agreement", "answer_agreement"} <= set(res["fidelity"]) and "mc2" in res["metrics"]
    rows = [json.loads(line) for line in (path.parent / "examples.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["truthfulqa_mc2/0", "truthfulqa_mc2/1"] and "fp16_answer" in rows[0]
    assert "fidelity" not in data["fp16"][1]


def test_missing_coqa_data_offline_is_one_line(tmp_path):
    proc = run_cli(tmp_path, "model=stories260k", "logger=none", "progress=false", "task=coqa")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: task coqa needs the hub")


def test_an_aquakv_run_is_reused_until_its_predictors_are_recalibrated(tmp_path):
    import shutil

    from kvquant.fsutil import sha256_file

    folder = shutil.copytree(ROOT / "tests" / "data" / "predictors", tmp_path / "predictors")
    env = {"KVQUANT_PREDICTOR_DIR": str(folder), "OMP_NUM_THREADS": "1"}
    plain = ["model=stories260k", "logger=none", "progress=false", "method=aquakv"]
    args = [*plain, "task=wikitext", "task.limit=1", "task.window=128"]
    first = run_cli(tmp_path, *args, **env)
    assert first.returncode == 0, first.stderr[-2000:]
    [path] = results_files(tmp_path)
    files = json.loads(path.read_text())["method"]["files"]["predictors"]
    assert files["sha256"] == sha256_file(files["path"])
    again = run_cli(tmp_path, *args, **env)
    assert again.returncode == 0 and again.stdout.startswith(f"skip: results for this config already exist at {path}")

    calibrate = ["experiment=calibrate", "experiment.n_seqs=2", "experiment.seq_len=64", "seed=1"]
    recalibrated = run_cli(tmp_path, *plain, *calibrate, **env)
    assert recalibrated.returncode == 0, recalibrated.stderr[-2000:]
    assert sha256_file(files["path"]) != files["sha256"]  # the same file, refitted
    after = run_cli(tmp_path, *args, **env)
    assert after.returncode == 0 and "skip:" not in after.stdout, after.stderr[-2000:]
    runs = [json.loads(p.read_text()) for p in results_files(tmp_path) if p != path]
    [new] = [r for r in runs if r["config"]["experiment"]["runner"] == "evaluate"]
    assert new["config_hash"] == json.loads(path.read_text())["config_hash"]
    assert new["method"]["files"]["predictors"]["sha256"] == sha256_file(files["path"])


def test_a_benchmark_is_measured_again_on_every_run_with_the_kernels_build_key(tmp_path):
    from kernels_cpu.loader import build_key

    args = ["model=stories260k", "logger=none", "progress=false", "experiment=bench_kv_methods"]
    args += ["experiment.methods=[truncation]", "experiment.contexts=[64]", "experiment.new_tokens=3"]
    args += ["experiment.repeats=1", "experiment.profile_steps=0", f"experiment.figures_dir={tmp_path / 'fig'}"]
    for run in (1, 2):
        proc = run_cli(tmp_path, *args, OMP_NUM_THREADS="1")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "skip:" not in proc.stdout and "bench_kv_methods measures time: never reused" in proc.stdout
        assert len(results_files(tmp_path)) == run
    for path in results_files(tmp_path):
        assert json.loads(path.read_text())["env"]["kernels_cpu_build_key"] == build_key()


def test_how_a_runner_resumes_is_read_from_its_source_as_importing_it_would_say():
    """``run.resume_of`` reads ``RESUME`` without importing the runner; for every runner it says what the
    imported module says, and a ``RESUME`` bound any other way than a string literal is left to the import."""
    import importlib

    import run

    names = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if p.stem != "__init__")
    assert {run.resume_of(n) for n in names} == {"run", "cells", "never"}
    for name in names:
        assert run.resume_of(name) == getattr(importlib.import_module(f"experiments.{name}"), "RESUME", "run"), name
    assert run.declared_resume('X = 1\nRESUME = "never"  # timings\n') == "never"
    assert run.declared_resume("import os\n") == "run"
    for other in ("RESUME = pick()", "from x import RESUME", "RESUME: str = 'cells'", "RESUME, X = 'a', 1"):
        assert run.declared_resume(other) is None, other
