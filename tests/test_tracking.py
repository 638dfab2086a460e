from kvquant.tracking import log_to_wandb

RESULTS = {
    "config": {"method": {"name": "fp16"}},
    "metrics": {"ppl": 4.2},
    "bits": {"read": 16.0},
    "bits_by_position": {"position": [65, 66], "bits_read_k": [15.0, 14.5], "bits_read_v": [9.0, 9.5]},
}


def test_offline_run_is_written_for_wandb_sync(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    examples = [{"id": 1, "output": "4", "target": {"answer": 4}}, {"id": 2, "output": "x"}]
    assert log_to_wandb(RESULTS, str(tmp_path), project="kvquant-test", examples=examples)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_failure_warns_and_returns_false(tmp_path, capsys):
    assert not log_to_wandb(RESULTS, str(tmp_path), mode="not-a-mode")
    assert "W&B logging failed" in capsys.readouterr().err
