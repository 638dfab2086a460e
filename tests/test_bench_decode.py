from conftest import load_script


def test_prints_table_with_ratios_to_fp16(capsys):
    bench = load_script("bench_decode")
    assert (
        bench.main(
            [
                "--models",
                "stories260k",
                "--contexts",
                "64,1000",
                "--new-tokens",
                "8",
                "--repeats",
                "1",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [(r[1], r[2]) for r in rows] == [
        ("64", "fp16"),
        ("64", "hf_dynamic"),
        ("504", "fp16"),
        ("504", "hf_dynamic"),
    ]
    assert all(r[5] == "1.00" for r in rows if r[2] == "fp16")
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)


def test_unknown_model_is_an_error(capsys):
    bench = load_script("bench_decode")
    assert bench.main(["--models", "nope", "--repeats", "1"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
