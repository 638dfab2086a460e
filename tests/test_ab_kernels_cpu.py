"""``scripts/ab_kernels_cpu.py``: two kernel builds in one process (timing itself is never asserted)."""

import torch
from conftest import ROOT, load_script

from kernels_cpu import loader


def test_the_working_tree_against_itself_gives_every_case_the_same_outputs(built, capsys):
    """A build compared with itself: one row per case, each bit for bit the same, both times measured; the
    child process that builds A imports the kernels from the folder given, and the wrappers are left on B."""
    ab = load_script("ab_kernels_cpu")
    args = ["--base-dir", str(ROOT), "--contexts", "300", "--repeats", "1", "--warm", "--shapes", "9q/3kv x 64"]
    args += ["--cases", ",".join(ab.CASES)]  # 300 tokens: KIVI's and GEAR's codes are read too (128-token window)
    assert ab.main(args) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("9q")]
    assert [row[4] for row in rows] == list(ab.CASES)
    for row in rows:
        assert int(row[3]) == 300 and row[8] == "same"
        assert float(row[5]) > 0 and float(row[6]) > 0
    assert loader._module is loader.module()
    assert f"({loader.build_key()}); B: working tree ({loader.build_key()})" in out


def test_differences_are_reported_not_hidden():
    ab = load_script("ab_kernels_cpu")
    a = [torch.tensor([1.0, 2.0]), torch.tensor([8], dtype=torch.uint8)]
    assert ab.difference(a, [x.clone() for x in a]) == "same"
    assert ab.difference(a, [a[0] + 0.5, a[1]]) == "max |B-A| 5.00e-01"
    assert ab.difference(a, [a[0], a[1] + 4]) == "max |B-A| 4.00e+00"
    assert ab.difference(a, [a[0][:1], a[1]]) == "shapes or dtypes differ"
    nan = [torch.tensor([float("nan"), 1.0])]
    assert ab.difference(nan, [nan[0].clone()]) == "same"  # bit for bit, NaN included
    assert ab.difference(nan, [torch.tensor([0.0, 1.0])]) == "max |B-A| nan"
    assert ab.difference(a, [a[0].half(), a[1]]) == "shapes or dtypes differ"


def test_a_base_that_cannot_be_read_or_built_is_one_error_line(built, capsys, tmp_path):
    ab = load_script("ab_kernels_cpu")
    assert ab.main(["--base", "no-such-revision-xyz"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot read kernels_cpu/ at 'no-such-revision-xyz'")
    assert ab.main(["--base-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path} holds no kernels_cpu package (kernels_cpu/loader.py)"]
    assert ab.main(["--base-dir", str(tmp_path), "--shapes", "7q x 3"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert ab.main(["--base-dir", str(tmp_path), "--cases", "fp16,kivi3"]) == 2
    assert "unknown case 'kivi3'" in capsys.readouterr().err


def test_the_base_is_built_from_its_own_folder(built, tmp_path):
    """A copy of the kernel sources elsewhere: the child imports that copy (not the working tree's, which a
    child started in it would find first), and as its sources are the same, finds the same build."""
    import shutil

    ab = load_script("ab_kernels_cpu")
    shutil.copytree(ROOT / "kernels_cpu", tmp_path / "kernels_cpu", ignore=shutil.ignore_patterns("__pycache__"))
    assert ab.build_at(tmp_path) == loader.build_dir() / f"{loader.module_name(loader.build_key())}.so"
