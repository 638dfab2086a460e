"""W&B logging, checked on the offline run files that ``wandb sync`` would upload."""

import pytest

from kvquant.tracking import (
    log_to_wandb,
    markdown_table,
    metric_names,
    read_offline_run,
    run_tags,
    wandb_config,
)

RESULTS = {
    "config": {
        "model": {"name": "stories260k"},
        "method": {"name": "kivi2", "bits": 2},
        "task": {"name": "gsm8k", "limit": 5},
        "experiment": {"runner": "evaluate"},
    },
    "config_hash": "abc123",
    "model": {"name": "stories260k", "params": 260032},
    "method": {"name": "kivi2", "bits": 2},
    "task": {"name": "gsm8k", "n": 5},
    "metrics": {"exact_match,strict-match": 0.4, "exact_match,flexible-extract": 0.6},
    "fidelity": {"greedy_match": 0.9, "kl": 0.01},
    "paired": {"exact_match,strict-match": -0.2},
    "ci95": {
        "metrics/exact_match,strict-match": [0.0, 0.8],
        "fidelity/kl": [0.005, 0.02],
        "paired/exact_match,strict-match": [-0.6, 0.2],
    },
    "n": {"metrics/exact_match,strict-match": 5, "fidelity/kl": 5, "paired/exact_match,strict-match": 5},
    "bits": {"stored": 3.41, "read": 3.41, "widths_k": {"2": 1.0}},
    "memory": {"kv_bytes": 1000.0, "kv_bytes_fp16": 4000.0},
    "timing": {"wall_s": 1.5},
    "env": {"host": "vm", "git_commit": "deadbeef"},
    "bits_by_position": {"position": [65, 66], "bits_read_k": [15.0, 14.5], "bits_read_v": [9.0, 9.5]},
}


def write_artefacts(run_dir):
    """A PNG, a CSV and a Markdown table, as the paper-artefact runners leave in their run folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    fig.savefig(run_dir / "fig_bitwidth.png")
    plt.close(fig)
    (run_dir / "fig_bitwidth.csv").write_text("context,bits_read\n256,12.5\n512,12.25\n")
    (run_dir / "table_relerr.md").write_text(
        "# t\n\n| method | =0 |\n|---|---:|\n| alignedkv | 0.9 |\n| kivi2 | 0.1 |\n"
    )
    hidden = run_dir / ".hydra"
    hidden.mkdir()
    (hidden / "ignored.csv").write_text("a\n1\n")


def test_names_follow_task_metric_and_block_prefixes():
    names = metric_names(RESULTS)
    assert names["gsm8k/exact_match,strict-match"] == 0.4
    assert names["fidelity/kl"] == 0.01 and names["bits/stored"] == 3.41 and names["bits/widths_k/2"] == 1.0
    assert names["memory/kv_bytes"] == 1000.0 and names["timing/wall_s"] == 1.5
    assert not any(k.startswith(("metrics/", "env/", "model/", "ci95/", "n/", "paired/")) for k in names)
    # intervals beside the numbers they qualify, under those numbers' names
    assert names["gsm8k/exact_match,strict-match/ci95_lo"] == 0.0 and names["gsm8k/exact_match,strict-match/n"] == 5
    assert names["fidelity/kl/ci95_hi"] == 0.02 and names["fidelity/kl/n"] == 5
    assert names["gsm8k/exact_match,strict-match/vs_fp16"] == -0.2
    assert names["gsm8k/exact_match,strict-match/vs_fp16/ci95_lo"] == -0.6
    old = {k: v for k, v in RESULTS.items() if k not in ("paired", "ci95", "n")}  # a results.json from before
    assert not any("ci95" in k or k.endswith("/n") for k in metric_names(old))
    assert run_tags(RESULTS, "evaluate") == ["model:stories260k", "method:kivi2", "task:gsm8k", "experiment:evaluate"]
    config = wandb_config(RESULTS)
    assert config["method.name"] == "kivi2" and config["task.limit"] == 5 and config["env.host"] == "vm"
    assert config["config_hash"] == "abc123"


def test_paper_artefact_is_not_tagged_with_unused_method_or_task():
    artefact = {"config": {**RESULTS["config"], "experiment": {"runner": "fig_bitwidth"}}, "model": {"name": "m"}}
    assert run_tags(artefact, "fig_bitwidth") == ["model:m", "experiment:fig_bitwidth"]
    assert metric_names({**artefact, "metrics": {"x": 1.0}}) == {"fig_bitwidth/x": 1.0}


def test_markdown_table_is_parsed():
    assert markdown_table("text\n\n| a | b |\n|---|:-:|\n| 1 | 2 |\n| 3 |\n\nafter") == (
        ["a", "b"],
        [["1", "2"], ["3", ""]],
    )
    assert markdown_table("no table here") is None


def test_offline_run_holds_names_tags_group_and_media(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    write_artefacts(tmp_path)
    examples = [{"id": 1, "output": "4", "target": {"answer": 4}}, {"id": 2, "output": "x"}]
    assert log_to_wandb(
        RESULTS, str(tmp_path), project="kvquant-test", name="stories260k-kivi2-gsm8k", examples=examples, tags=["mine"]
    )
    [path] = (tmp_path / "wandb").glob("offline-run-*")
    run = read_offline_run(path)
    assert run["name"] == "stories260k-kivi2-gsm8k" and run["group"] == "evaluate" and run["job_type"] == "gsm8k"
    assert run["tags"] == ["model:stories260k", "method:kivi2", "task:gsm8k", "experiment:evaluate", "mine"]
    assert run["config"]["method.name"] == "kivi2" and run["config"]["method.bits"] == 2
    summary = run["summary"]
    assert summary["gsm8k/exact_match,strict-match"] == pytest.approx(0.4)
    assert summary["gsm8k/exact_match,flexible-extract"] == pytest.approx(0.6)
    assert summary["fidelity/kl"] == pytest.approx(0.01) and summary["bits/read"] == pytest.approx(3.41)
    assert summary["memory/kv_bytes_fp16"] == 4000 and summary["model/params"] == 260032
    assert summary["fidelity/kl/ci95_lo"] == pytest.approx(0.005) and summary["fidelity/kl/n"] == 5
    assert summary["gsm8k/exact_match,strict-match/vs_fp16/ci95_hi"] == pytest.approx(0.2)
    assert not any(k.startswith(("ci95/", "n/")) for k in summary)
    [step] = run["history"]
    assert step["timing/wall_s"] == pytest.approx(1.5)
    assert step["figures/fig_bitwidth"]["_type"] == "image-file"
    assert step["tables/fig_bitwidth"]["_type"] == "table-file" and step["tables/fig_bitwidth"]["nrows"] == 2
    assert step["tables/table_relerr"]["nrows"] == 2 and step["tables/table_relerr"]["ncols"] == 2
    assert step["tables/examples"]["nrows"] == 2 and step["tables/bits_by_position"]["nrows"] == 2
    assert step["tables/results"]["nrows"] == 1
    assert "tables/ignored" not in step
    assert any(f.startswith("media/images/figures/fig_bitwidth") and f.endswith(".png") for f in run["files"])


def test_group_override(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert log_to_wandb(RESULTS, str(tmp_path), project="kvquant-test", group="ablation-1", mode="offline")
    [path] = (tmp_path / "wandb").glob("offline-run-*")
    run = read_offline_run(path)
    assert run["group"] == "ablation-1" and "experiment:ablation-1" in run["tags"]


def test_failure_warns_and_returns_false(tmp_path, capsys):
    assert not log_to_wandb(RESULTS, str(tmp_path), mode="not-a-mode")
    assert "W&B logging failed" in capsys.readouterr().err
