"""``scripts/bench_kernels_cpu.py --higgs`` runs on a tiny context and prints one row of ratios per shape
(timing itself is never asserted: benchmarks report ratios measured in the same run)."""

import pytest
from conftest import load_script


@pytest.mark.parametrize("length", [100, 300])
def test_higgs_rows_compare_pre_and_post_rope_with_fused_fp16(built, capsys, length):
    """At 100 tokens nothing is coded (sinks and window only); at 300 the codes are read."""
    bench = load_script("bench_kernels_cpu")
    args = ["--higgs", "--contexts", str(length), "--repeats", "1", "--warm", "--shapes", "9q/3kv x 64,32q/8kv x 128"]
    assert bench.main(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("9q", "32q"))]
    assert len(rows) == 2
    for row in rows:
        assert int(row[3]) == length and len(row) == 9
        assert all(float(x) > 0 for x in row[4:])
