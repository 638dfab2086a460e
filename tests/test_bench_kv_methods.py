"""experiments/bench_kv_methods.py (formerly scripts/bench_kv_methods.py) through run.py on stories260k.

A benchmark: this checks its table is complete and self-consistent, never how fast anything is.
"""

import json

import pytest
from conftest import run_py

from experiments.figures import check_agrees, read_table


def test_every_cache_timed_against_fp16_in_the_same_run(tmp_path):
    proc = run_py(
        tmp_path,
        "model=stories260k",
        "logger=none",
        "progress=false",
        f"results_dir={tmp_path / 'out'}",
        f"experiment.figures_dir={tmp_path / 'fig'}",
        "experiment=bench_kv_methods",
        "experiment.methods=[truncation,kivi2@torch,nope]",
        "experiment.contexts=[64,128]",
        "experiment.new_tokens=4",
        "experiment.repeats=1",
        "experiment.profile_steps=8",
        "experiment.bucket=4",
        "experiment.threads=1",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = read_table(tmp_path / "fig" / "bench_kv_methods.csv")
    decode = table[table.part == "decode"]
    assert list(decode.cache) == ["fp16", "truncation", "kivi2@torch", "hf_dynamic"] * 2 and set(decode.context) == {
        64,
        128,
    }
    for _, rows in decode.groupby("context"):
        by = rows.set_index("cache")
        assert by.ratio_fp16["fp16"] == 1.0 and by.ratio_hf_dynamic["hf_dynamic"] == 1.0
        for _, row in by.iterrows():
            assert row.ms_per_step > 0
            assert row.ratio_fp16 == pytest.approx(row.ms_per_step / by.ms_per_step["fp16"])
    profile = table[table.part == "profile"]
    assert list(profile.steps) == ["65-68", "69-72"] * 4 and (profile.context == 64).all()
    assert (profile[profile.cache == "fp16"].ratio_fp16 == 1.0).all() and (profile.max_ratio_fp16 > 0).all()

    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    check_agrees(table, results["table"], "bench_kv_methods")
    assert results["experiment"]["threads"] == 1 and "unknown method 'nope'" in results["experiment"]["skipped"]["nope"]
    assert "| context | cache | ms/step | × fp16 | × hf_dynamic |" in proc.stdout  # printed, not only written
    assert "| 64 | fp16 |" in proc.stdout and "| – | nope | skipped: unknown method" in proc.stdout


def test_method_entries_name_their_parameters_and_backend():
    """``name(key=value, ...)@backend`` builds the method with those parameters (YAML scalars) on that backend;
    a malformed entry is refused in one line that shows the form."""
    from experiments.bench_kv_methods import method_spec
    from kvquant.errors import InvalidParameterError
    from kvquant.methods import get_method

    entry = "alignedkv_plus_block(v_block=8, margin=0.5)@torch"
    label, spec = method_spec(entry)
    assert label == entry and spec == {"name": "alignedkv_plus_block", "v_block": 8, "margin": 0.5, "backend": "torch"}
    method = get_method(spec.pop("name"), **spec)
    rule = method.rule()
    assert rule.v_block == 8 and rule.margin == 0.5 and rule.value_rule == "block" and rule.blockwise
    assert method_spec("kivi2@cpu") == ("kivi2@cpu", {"name": "kivi2", "backend": "cpu"})
    for bad in ("kivi2(group)@cpu", "kivi2(=4)", "kivi2@", "@cpu", "kivi2((group=4))"):
        with pytest.raises(InvalidParameterError, match="name\\(key=value,...\\)@backend"):
            method_spec(bad)


def test_aquakv_entries_get_their_floor(tmp_path, stories, predictor_root):
    """An AQUA-KV entry adds ``aquakv_floor`` (DynamicCache's step plus the predictor matmuls, timed in
    the same run) and a ``ratio_floor`` column: the AQUA-KV rows' time over that floor (none for others)."""
    root = predictor_root(*stories)
    proc = run_py(
        tmp_path,
        "model=stories260k",
        "logger=none",
        "progress=false",
        f"results_dir={tmp_path / 'out'}",
        f"experiment.figures_dir={tmp_path / 'fig'}",
        "experiment=bench_kv_methods",
        "experiment.methods=[aquakv@cpu]",
        "experiment.contexts=[200]",
        "experiment.new_tokens=4",
        "experiment.repeats=1",
        "experiment.profile_steps=0",
        "experiment.threads=1",
        env={"OMP_NUM_THREADS": "1", "KVQUANT_PREDICTOR_DIR": str(root)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = read_table(tmp_path / "fig" / "bench_kv_methods.csv")
    by = table[table.part == "decode"].set_index("cache")
    assert list(by.index) == ["fp16", "aquakv@cpu", "hf_dynamic", "aquakv_floor"]
    assert by.ms_per_step["aquakv_floor"] > by.ms_per_step["hf_dynamic"]
    for name in ("aquakv@cpu", "aquakv_floor"):
        assert by.ratio_floor[name] == pytest.approx(by.ms_per_step[name] / by.ms_per_step["aquakv_floor"])
    assert by.ratio_floor[["fp16", "hf_dynamic"]].isna().all()
    assert "| × floor |" in proc.stdout and "| 200 | aquakv_floor |" in proc.stdout
    results = json.loads(next((tmp_path / "out").rglob("results.json")).read_text())
    check_agrees(table, results["table"], "bench_kv_methods")
