"""experiments/table_aquakv.py through run.py on stories260k, with 2-bit AQUA-KV predictors calibrated for it."""

import json

import pandas as pd
from conftest import run_experiment

from experiments.cells import fmt_ci
from experiments.table_aquakv import PUBLISHED_NOTE, render
from kvquant import get_method, load_model
from kvquant.fsutil import sha256_file
from kvquant.methods.aquakv import model_identity

GRID = [
    "experiment=table_aquakv",
    "~experiment.methods",
    "+experiment.methods={fp16:{},higgs2:{name:higgs,bits:2},higgs4:{name:higgs,bits:4},aquakv2:{name:aquakv,bits:2},"
    "aquakv_k_only2:{name:aquakv_k_only,bits:2},kivi2:{group_size:8,residual:32}}",
    "experiment.tasks.wikitext.window=200",
    "experiment.tasks.wikitext.limit=2",
    "experiment.tasks.longbench.tasks=[trec]",
    "experiment.tasks.longbench.max_length=300",
]


def test_aquakv_table_equals_its_cells_with_the_ablation_skipped(tmp_path, monkeypatch):
    model, tok = load_model("stories260k", device="cpu")
    method = get_method("aquakv", bits=2)
    path = method.default_path(model_identity(model.config), method.quantizers(model.config))
    predictor_file = method.calibrate(model, tok, n_seqs=4, seq_len=256, seed=0, progress=False, log=None).save(
        tmp_path / "pred" / path.relative_to(path.parents[1])
    )
    monkeypatch.setenv("KVQUANT_PREDICTOR_DIR", str(tmp_path / "pred"))

    fig = run_experiment(tmp_path, *GRID)
    table = pd.read_csv(fig / "table_aquakv.csv")
    assert len(table) == 6 * 2 and set(table.source) == {"ours"}
    by = table.set_index(["method", "task"])
    for row in table[table.status == "computed"].itertuples():
        data = json.loads((tmp_path / row.results).read_text())  # relative to where run.py ran
        assert float(row.value) == data["metrics"][row.metric] and row.n == data["task"]["n"]
        assert row.bits_stored == data["bits"]["stored"] and row.bits_analytic == data["bits"]["analytic_stored"]
        assert data["n"][f"metrics/{row.metric}"] == row.n == (2 if row.task == "wikitext" else 1)
        if row.method == "aquakv2":  # the file the cell read, by digest
            assert data["method"]["files"]["predictors"]["sha256"] == sha256_file(predictor_file)
        if row.task == "wikitext":  # two windows: the perplexity's interval, and its paired difference to fp16
            assert [row.value_lo, row.value_hi] == data["ci95"][
                "metrics/ppl"
            ] and row.value_lo <= row.value <= row.value_hi
            if row.method != "fp16":
                assert row.paired_lo <= row.paired <= row.paired_hi and row.kl_lo <= row.kl <= row.kl_hi
    assert list(table[table.status == "skipped"].method) == ["aquakv_k_only2"] * 2
    assert "calibrate first: python run.py experiment=calibrate method=aquakv_k_only" in by.reason.dropna().iloc[0]

    ppl = {m: by.loc[(m, "wikitext")] for m in ("fp16", "higgs2", "higgs4", "aquakv2", "kivi2")}
    assert ppl["higgs2"].bits_analytic == 2.5 and ppl["higgs4"].bits_analytic == 4.5  # 16-bit scale per 32 values
    assert ppl["aquakv2"].bits_analytic == (4.5 + 4 * 2.5) / 5  # layer 0 at 4 bits
    assert ppl["higgs2"].bits_stored < ppl["higgs4"].bits_stored < 16 and ppl["kivi2"].bits_stored < 16
    # Perplexity on a few hundred tokens of a 260K model is noise-level; the KL to fp16 is not.
    assert ppl["higgs2"].kl > 10 * ppl["aquakv2"].kl and ppl["higgs2"].kl > 10 * ppl["higgs4"].kl > 0

    text = (fig / "table_aquakv.md").read_text()
    change = 100 * (ppl["higgs2"].value / ppl["fp16"].value - 1)
    row = ppl["higgs2"]
    value = fmt_ci(row.value, row.value_lo, row.value_hi, 3)
    paired = fmt_ci(row.paired, row.paired_lo, row.paired_hi, 3, sign=True)
    kl = fmt_ci(row.kl, row.kl_lo, row.kl_hi, 4)
    assert f"| higgs2 | {row.bits_stored:.3f} | 2.500 | {value} | {change:+.2f}% | {paired}" in text
    assert f" | {kl} |" in text and "[" in value and "[" in paired and "[" in kl
    assert "| aquakv_k_only2 | skipped [1] | – | – | – | – | – | skipped [1] |" in text and PUBLISHED_NOTE in text
    for suffix in (".png", ".pdf", ".md", ".csv"):
        assert (fig / f"table_aquakv{suffix}").stat().st_size > 0
    again = render(table, tmp_path / "again" / "table_aquakv")
    assert [p.suffix for p in again] == [".md", ".png", ".pdf"] and again[0].read_text() == text

    [run] = list((tmp_path / "out" / "runs").glob("*/*/results.json"))
    records = json.loads(run.read_text())["table"]
    assert len(records) == len(table)
    for rec, row in zip(records, table.itertuples(), strict=True):
        assert rec["method"] == row.method and rec["status"] == row.status
        assert rec.get("value") == row.value if row.status == "computed" else "value" not in rec
