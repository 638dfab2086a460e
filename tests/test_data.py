import pytest

from kvquant import data
from kvquant.errors import KvquantError


def test_tinystories_has_4300_pieces():
    pieces = data.tinystories_pieces()
    assert len(pieces) == 4300 and pieces[0].startswith("Spot. Spot saw the shiny car")


def test_wikitext_is_lf_joined_rows():
    text = data.wikitext2_test()
    assert "\r" not in text and text.startswith("\n\n = Robert Boulter = \n")
    assert len(text) > 1_200_000


def test_missing_file_names_its_path():
    with pytest.raises(KvquantError, match="data file not found: .*nope.txt"):
        data.dataset_file("nope.txt")
