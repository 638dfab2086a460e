import torch
from conftest import load_script

from kvquant.models import STORIES260K_DIR, load_model


def test_script_output_loads_and_equals_bundled_conversion(tmp_path, stories, capsys):
    convert = load_script("convert_llama2c")
    out = tmp_path / "hf"
    assert (
        convert.main([str(STORIES260K_DIR / "stories260K.bin"), str(STORIES260K_DIR / "tok512.model"), str(out)]) == 0
    )
    model, tok = load_model(str(out), device="cpu")
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stories[0](ids).logits)


def test_script_reports_missing_input(tmp_path, capsys):
    convert = load_script("convert_llama2c")
    assert convert.main([str(tmp_path / "no.bin"), str(tmp_path / "no.model"), str(tmp_path / "out")]) == 2
    assert "no.bin" in capsys.readouterr().err and not (tmp_path / "out").exists()
