"""experiments/table_backends.py through run.py on stories260k: kernels vs torch, greedy tokens and bits."""

import json

from conftest import require_kernels_cpu, run_experiment

from experiments.figures import check_agrees, read_table


def test_kernels_give_the_torch_paths_tokens_and_bits(tmp_path, stories, predictor_root):
    require_kernels_cpu()
    fig = run_experiment(
        tmp_path,
        "experiment=table_backends",
        "experiment.prompts=2",
        "experiment.prompt_tokens=160",
        "experiment.new_tokens=12",
        "experiment.methods=[fp16,truncation,kivi2,higgs,aquakv]",
        env={"OMP_NUM_THREADS": "1", "KVQUANT_PREDICTOR_DIR": str(predictor_root(*stories))},
    )
    table = read_table(fig / "table_backends.csv")
    assert list(table.method) == ["fp16", "truncation", "kivi2", "higgs", "aquakv"]
    ran = table.set_index("method")
    assert (ran.prompts == 2).all() and (ran.bits_read_torch == ran.bits_read_kernel).all()
    assert (
        (ran.decode_ratio > 0).all()
        and ran.bits_read_torch["fp16"] == 16.0
        and ran.bits_read_kernel["truncation"] == 13.0
    )
    # methods that keep fp16 values differ, if at all, only at near-ties; KIVI's codes may flip (module docstring)
    assert ran.all_first_differences_near_ties["fp16"] and ran.all_first_differences_near_ties["truncation"]
    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    check_agrees(table, results["table"], "table_backends")
    assert results["experiment"]["backend"] == "cpu"
    assert "| kivi2 |" in (fig / "table_backends.md").read_text()
