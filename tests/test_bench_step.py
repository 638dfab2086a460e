"""``scripts/bench_step.py``: whole decode steps on a random-weight model of a layout, a row per method
beside DynamicCache's (timing itself is never asserted: benchmarks report ratios measured in one run)."""

import pytest
from conftest import load_script


def test_rows_per_cell_with_ratios_to_dynamic_cache_and_fp16(capsys, tmp_path):
    out = tmp_path / "step.md"
    args = ["--layout", "stories260k", "--contexts", "64,200", "--batches", "2", "--layers", "2"]
    assert (
        load_script("bench_step").main(
            [*args, "--methods", "fp16,truncation,kivi2@torch", "--repeats", "1", "--out", str(out)]
        )
        == 0
    )
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()[4:]]
    assert [(r[2], r[3]) for r in rows] == [
        (c, m) for c in ("64", "200") for m in ("DynamicCache", "fp16", "truncation", "kivi2@torch")
    ]
    for row in rows:
        assert row[0] == "stories260k" and row[1] == "2" and float(row[5]) > 0
        if row[3] == "DynamicCache":
            assert float(row[6]) == 1.0 and row[7] == row[8] == ""
        else:
            assert float(row[6]) > 0 and float(row[7]) > 0
    bits = {(r[2], r[3]): float(r[8]) for r in rows if r[3] != "DynamicCache"}
    assert bits["64", "fp16"] == 16.0 and bits["200", "truncation"] == 13.0
    assert bits["200", "kivi2@torch"] < 16.0  # 200 tokens: beyond KIVI's fp16 window of 128
    assert {r[4] for r in rows if r[3] == "kivi2@torch"} == {"torch"}  # name@backend: that backend
    assert "device: CPU" in out.read_text().splitlines()[0] and "layout stories260k" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layout", "llama9"], "error: unknown layout 'llama9'; valid: stories260k, smollm2_135m"),
        (["--layout", "stories260k", "--methods", "fp16,kivi9"], "error: "),
    ],
)
def test_bad_names_exit_2_with_one_line(capsys, args, message):
    assert load_script("bench_step").main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_a_profiled_method_prints_one_steps_operators_and_rows_count_them(capsys):
    """``--profile``: one more step of the named methods under torch.profiler, printed after the cell; every
    row counts the torch operators a step dispatched per layer and those that would wait for a GPU
    (``kernels/layer`` blank: no CuPy here)."""
    args = ["--layout", "stories260k", "--contexts", "64", "--layers", "2", "--repeats", "1"]
    assert (
        load_script("bench_step").main([*args, "--methods", "fp16@torch", "--profile", "DynamicCache,fp16@torch"]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("one step's operators by host time") == 2 and "Self CPU" in out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if "| stories260k |" in line]
    ops = {r[3]: float(r[10]) for r in rows}
    assert set(ops) == {"DynamicCache", "fp16@torch"} and 0 < ops["DynamicCache"] < ops["fp16@torch"]
    syncs = {r[3]: float(r[11]) for r in rows}  # fp16's range check reads its verdict at once on a CPU, not on a GPU
    assert syncs == {"DynamicCache": 0.0, "fp16@torch": 4.0}
    assert all(r[12] == "" for r in rows)
