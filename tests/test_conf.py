"""Every config choice names something the library knows, so `run.py` can never dispatch to nothing."""

import pytest
from conftest import ROOT
from hydra import compose, initialize_config_dir

from kvquant import method_names, model_names, task_names


def stems(group):
    return sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))


# experiments spelled as tasks (`task=calibrate` selects `experiment=calibrate`)
TASK_ALIASES = {"calibrate"}


@pytest.mark.parametrize("group,known", [("model", model_names), ("method", method_names), ("task", task_names)])
def test_group_files_match_registries(group, known):
    assert stems(group) and set(stems(group)) <= set(known()) | (TASK_ALIASES if group == "task" else set())


def test_task_calibrate_selects_the_calibrate_experiment():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["task=calibrate", "method=aquakv"])
        plain = compose(config_name="config", overrides=["experiment=calibrate", "method=aquakv"])
    assert cfg.experiment == plain.experiment and cfg.experiment.runner == "calibrate"
    assert cfg.task.name == "calibrate" and TASK_ALIASES == {"calibrate"}


def test_default_config_composes_with_smollm2_and_wandb():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config")
    assert (cfg.model.name, cfg.method.name, cfg.task.name, cfg.logger.name) == (
        "smollm2_135m",
        "fp16",
        "tinystories",
        "wandb",
    )
    assert cfg.task.chunk_size == 32 and cfg.experiment.runner == "evaluate"
