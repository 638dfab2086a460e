"""experiments/table_ppl_aquakv.py (formerly scripts/ppl_aquakv.py) through run.py on stories260k."""

import json

from conftest import run_py

from experiments.figures import check_agrees, read_table

SMALL = [
    "model=stories260k",
    "logger=none",
    "progress=false",
    "experiment=table_ppl_aquakv",
    "~experiment.methods",
    "+experiment.methods={fp16:{},higgs2:{name:higgs,bits:2},higgs2_l0b4:{name:higgs,bits:2,first_layer_bits:4},"
    "aquakv2:{name:aquakv,bits:2}}",
    "experiment.tasks.wikitext.window=192",
    "experiment.tasks.wikitext.chunk_size=64",
]


def test_perplexity_rows_with_aquakv_skipped(tmp_path):
    args = [f"results_dir={tmp_path / 'out'}", f"experiment.figures_dir={tmp_path / 'fig'}", *SMALL]
    env = {"OMP_NUM_THREADS": "1", "KVQUANT_PREDICTOR_DIR": str(tmp_path / "no_predictors")}
    proc = run_py(tmp_path, *args, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = read_table(tmp_path / "fig" / "table_ppl_aquakv.csv")
    rows = {r["method"]: r for r in table.to_dict(orient="records")}
    assert list(rows) == ["fp16", "higgs2", "higgs2_l0b4", "aquakv2"]
    fp16, higgs, l0b4 = rows["fp16"], rows["higgs2"], rows["higgs2_l0b4"]
    assert fp16["metric"] == "ppl" and fp16["value"] > 1 and fp16["bits_stored"] == 16.0
    assert higgs["value"] != fp16["value"] and higgs["kl"] > 0 and higgs["bits_stored"] < 16.0
    assert l0b4["bits_analytic"] > higgs["bits_analytic"]  # layer 0 at 4 bits costs bits
    assert rows["aquakv2"]["status"] == "skipped" and "predictors" in rows["aquakv2"]["reason"]
    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    check_agrees(table, results["table"], "table_ppl_aquakv")
    text = (tmp_path / "fig" / "table_ppl_aquakv.md").read_text()
    assert text.startswith("## wikitext: ppl through each cache, stories260k (n = 1 windows)")
    assert f"| fp16 | {fp16['value']:.3f} | – | – | 16.000 | 16.000 |" in text
    assert "| aquakv2 | skipped [1] |" in text and "\n[1] " in text
