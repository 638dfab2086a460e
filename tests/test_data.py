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


def test_truthfulqa_mc_in_hub_layout():
    rows = data.truthfulqa_mc()
    assert len(rows) == 817 and rows[0]["question"] == "What happens if you eat a pomegranate?"
    mc2 = rows[0]["mc2_targets"]
    assert mc2["labels"] == [1, 1, 1, 0, 0, 0] and mc2["choices"][0].startswith("Nothing in particular")


def test_longbench_loaders():
    prompts, maxgen = data.longbench_config()
    assert maxgen["trec"] == 64 and "{context}" in prompts["trec"]
    rows = data.longbench("trec")
    assert len(rows) == 20 and {"input", "context", "answers", "all_classes"} <= set(rows[0])


def test_missing_bundled_file_names_path_and_hub(monkeypatch, tmp_path):
    monkeypatch.setattr(data, "DATASETS", tmp_path)
    with pytest.raises(KvquantError, match=r"longbench/trec.jsonl.*task.source=hub .*THUDM/LongBench"):
        data.longbench("trec")


def test_corpus_ids_are_the_tokenizers_ids_and_are_kept_per_tokenizer(stories, monkeypatch):
    """The kept ids equal a fresh call (WikiText-2 plain, TinyStories with special tokens); a second request
    tokenizes nothing; a tokenizer changed since (an added token) gets its own ids, not the kept ones."""
    import copy

    _, tok = stories
    monkeypatch.setattr(data, "_CORPUS_IDS", {})
    wikitext = tok(data.wikitext2_test(), add_special_tokens=False).input_ids
    stories_text = "\n\n".join(data.tinystories_pieces())
    tinystories = tok(stories_text, add_special_tokens=True).input_ids
    assert tinystories[0] == tok.bos_token_id != wikitext[0]
    assert data.corpus_ids(tok, "wikitext") == wikitext and data.corpus_ids(tok, "tinystories", True) == tinystories
    with monkeypatch.context() as patched:
        patched.setattr(type(tok), "__call__", lambda *a, **k: pytest.fail("tokenized again"))
        assert data.corpus_ids(tok, "wikitext") == wikitext and data.corpus_ids(tok, "tinystories", True) == tinystories

    changed = copy.deepcopy(tok)
    assert data.tokenizer_fingerprint(changed) == data.tokenizer_fingerprint(tok)  # kept for this object now
    changed.add_tokens([stories_text.split()[3]])
    assert data.tokenizer_fingerprint(changed) != data.tokenizer_fingerprint(tok)
    ids = data.corpus_ids(changed, "tinystories", True)
    assert ids == changed(stories_text, add_special_tokens=True).input_ids and len(tok) in ids


def test_unknown_corpus_is_one_line(stories):
    with pytest.raises(KvquantError, match="unknown corpus .nope.; valid corpora: wikitext, tinystories$"):
        data.corpus_ids(stories[1], "nope")
