import json

import pytest

from kvquant import results


def cfg(**over):
    base = {
        "model": {"name": "stories260k"},
        "method": {"name": "fp16"},
        "task": {"name": "tinystories", "limit": 5},
        "results_dir": "outputs",
        "rerun": False,
        "logger": {"name": "none"},
        "progress": True,
    }
    base.update(over)
    return base


def test_hash_ignores_outputs_rerun_logger_and_tracks_the_rest():
    h = results.config_hash(cfg())
    assert h == results.config_hash(cfg(results_dir="elsewhere", rerun=True, logger={"name": "wandb"}, progress=False))
    assert h != results.config_hash(cfg(task={"name": "tinystories", "limit": 6}))
    assert h != results.config_hash(cfg(method={"name": "kivi", "bits": 2}))


def test_write_is_atomic_and_omits_missing_values(tmp_path):
    data = {
        "config": {"model": {"path": None}},
        "config_hash": "abc",
        "metrics": {"ppl": 4.2, "bad": float("nan")},
        "fidelity": None,
        "bits": {"stored": None},
    }
    path = results.write_results(tmp_path, data)
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    loaded = json.loads(path.read_text())
    assert loaded == {"config": {"model": {"path": None}}, "config_hash": "abc", "metrics": {"ppl": 4.2}}


def test_find_and_collect(tmp_path):
    for i, name in enumerate(["fp16", "kivi"]):
        results.write_results(
            tmp_path / f"run{i}", {"config_hash": f"h{i}", "method": {"name": name}, "metrics": {"ppl": 4.0 + i}}
        )
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results.json").write_text("{not json")
    assert results.find_results(tmp_path, "h1") == tmp_path / "run1" / "results.json"
    assert results.find_results(tmp_path, "missing") is None
    assert results.find_results(tmp_path / "nowhere", "h1") is None
    table = results.collect(tmp_path)
    assert list(table["method/name"]) == ["fp16", "kivi"] and list(table["metrics/ppl"]) == [4.0, 5.0]


def test_collect_splits_intervals_and_tolerates_runs_without_them(tmp_path):
    results.write_results(
        tmp_path / "new",
        {
            "config_hash": "h1",
            "metrics": {"ppl": 5.0},
            "paired": {"ppl": 0.5},
            "ci95": {"metrics/ppl": [4.5, 5.5], "paired/ppl": [0.1, 0.9]},
            "n": {"metrics/ppl": 8, "paired/ppl": 8},
        },
    )
    results.write_results(tmp_path / "old", {"config_hash": "h0", "metrics": {"ppl": 4.0}})  # before intervals
    table = results.collect(tmp_path).set_index("config_hash")
    assert table.loc["h1", "ci95/metrics/ppl/lo"] == 4.5 and table.loc["h1", "ci95/paired/ppl/hi"] == 0.9
    assert table.loc["h1", "n/metrics/ppl"] == 8 and table.loc["h1", "paired/ppl"] == 0.5
    assert table[["ci95/metrics/ppl/lo", "n/metrics/ppl"]].loc["h0"].isna().all()


def test_collect_cli_writes_csv(tmp_path, capsys):
    results.write_results(
        tmp_path / "r",
        {
            "config_hash": "h",
            "model": {"name": "m"},
            "method": {"name": "fp16"},
            "task": {"name": "t"},
            "metrics": {"ppl": 3.5},
        },
    )
    assert results._main([str(tmp_path), "--csv", str(tmp_path / "all.csv")]) == 0
    assert "3.5" in capsys.readouterr().out
    assert (tmp_path / "all.csv").read_text().startswith("path,")
    assert results._main([str(tmp_path / "empty")]) == 1


def test_env_records_versions():
    env = results.env_info("cpu")
    assert env["torch"] and env["transformers"] and env["python"] and env["device"] == "cpu"


def test_env_records_the_commit_the_process_started_at(monkeypatch):
    """A run spanning a commit must name the code it ran, not the HEAD it finished at."""
    results.code_commit.cache_clear()
    monkeypatch.setattr(results, "git_commit", lambda: "a" * 40)
    assert results.env_info()["git_commit"] == "a" * 40
    monkeypatch.setattr(results, "git_commit", lambda: "b" * 40)  # HEAD moved during the run
    assert results.env_info()["git_commit"] == "a" * 40
    results.code_commit.cache_clear()


@pytest.mark.parametrize("obj,flat", [({"a": {"b": 1, "c": {"d": 2}}}, {"a/b": 1, "a/c/d": 2}), ({}, {})])
def test_flatten(obj, flat):
    assert results.flatten(obj) == flat


def aquakv_result(sha: str | None, commit: str = "c" * 40, digest: str = "h1", folder: str = "m-1") -> dict:
    """An AQUA-KV run's results.json: its config names a predictor file; ``sha``: the digest it recorded."""
    files = {"predictors": {"path": f"/home/x/{folder}/aquakv-kv-b2.safetensors", "sha256": sha}} if sha else {}
    return {
        "config": {"method": {"name": "aquakv", "predictors": None}},
        "config_hash": digest,
        "method": {"name": "aquakv", **({"files": files} if files else {})},
        "env": {"git_commit": commit},
    }


def test_identity_adds_the_digests_of_the_files_a_run_reads():
    assert results.identity("h1") == results.identity("h1", {}) == "h1"  # runs that read no file keep their hash
    one, other = results.identity("h1", {"predictors": "a" * 64}), results.identity("h1", {"predictors": "b" * 64})
    assert len({one, other, "h1"}) == 3 and one == results.identity("h1", {"predictors": "a" * 64})
    assert results.result_identity(aquakv_result("a" * 64)) == one
    assert results.result_identity({"config": {"method": {"name": "fp16"}}, "config_hash": "h2"}) == "h2"
    unnamed = {"config": {"method": {"name": "x"}}, "config_hash": "h3", "method": {"files": {"w": {"sha256": "a"}}}}
    assert results.result_identity(unnamed) == "h3"  # only files its config names (FILE_PARAMS) are identity


def test_a_result_that_read_a_file_without_recording_it_is_unverifiable_and_never_found(tmp_path):
    legacy, recorded = aquakv_result(None), aquakv_result("a" * 64, digest="h2")
    assert results.unverifiable(legacy) == ["predictors"] and results.unverifiable(recorded) == []
    assert results.result_identity(legacy) is None
    results.write_results(tmp_path / "legacy", legacy)
    results.write_results(tmp_path / "recorded", recorded)
    assert results.find_results(tmp_path, "h1") is None
    assert results.find_results(tmp_path, "h2") is None  # its identity holds the digest
    found = results.find_results(tmp_path, results.identity("h2", {"predictors": "a" * 64}))
    assert found == tmp_path / "recorded" / "results.json"


def test_mix_warning_names_the_commits_and_the_digests_of_one_file():
    assert results.mix_warning([aquakv_result("a" * 64), aquakv_result("a" * 64)]) is None
    assert results.mix_warning([aquakv_result("a" * 64), aquakv_result("b" * 64, folder="m-2")]) is None  # two files
    line = results.mix_warning([aquakv_result("a" * 64), aquakv_result("b" * 64, commit="d" * 40 + "+dirty")])
    assert line == (
        "warning: 2 results mix 2 code commits (ccccccc, ddddddd+dirty); 2 digests of m-1/aquakv-kv-b2.safetensors "
        "(aaaaaaaaaaaa, bbbbbbbbbbbb): the numbers may not be comparable"
    )


def test_collect_cli_lists_unverifiable_results_and_warns_once(tmp_path, capsys):
    results.write_results(tmp_path / "old", aquakv_result(None))
    results.write_results(tmp_path / "new", aquakv_result("a" * 64, commit="d" * 40))
    assert results._main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "unverifiable: 1 results" in out and f"  {tmp_path / 'old'} (predictors)" in out.splitlines()
    assert str(tmp_path / "new") not in out.split("unverifiable:")[1]
    warning = "warning: 2 results mix 2 code commits (ccccccc, ddddddd): the numbers may not be comparable"
    assert err.splitlines() == [warning]


def test_env_records_the_kernels_build_key_when_asked():
    from kernels_cpu.loader import build_key

    assert results.env_info("cpu", kernels=True)["kernels_cpu_build_key"] == build_key()
    assert "kernels_cpu_build_key" not in results.env_info("cpu")
