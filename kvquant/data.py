"""Bundled datasets (real, licensed copies under ``kvquant/assets/datasets``; see PROVENANCE.md there)."""

from __future__ import annotations

import hashlib
import json
import weakref
from array import array
from pathlib import Path
from typing import Any

from kvquant.errors import InvalidParameterError, KvquantError

DATASETS = Path(__file__).resolve().parent / "assets" / "datasets"
# The whole-text corpora (``corpus_text``) and their files under DATASETS.
CORPORA = {"wikitext": "wikitext-2/wikitext-test.txt", "tinystories": "tinystories/tinystories_val.txt"}


def dataset_file(relative: str) -> Path:
    """Path of a bundled data file, or a one-line error naming it."""
    path = DATASETS / relative
    if not path.is_file():
        raise KvquantError(f"data file not found: {path}; it ships with the repository (restore it with git checkout)")
    return path


def tinystories_pieces() -> list[str]:
    """TinyStories validation stories, split on blank lines (4,300 pieces)."""
    text = dataset_file(CORPORA["tinystories"]).read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def wikitext2_test() -> str:
    """WikiText-2 (raw) test split as the usual perplexity string ``"\\n\\n".join(rows)`` (LF line ends)."""
    return dataset_file(CORPORA["wikitext"]).read_text(encoding="utf-8").replace("\r\n", "\n")


_CORPUS_IDS: dict[tuple[object, ...], array] = {}
_MAX_CORPUS_IDS = 8  # ~3 MB each: two corpora × a few tokenizers × with/without special tokens
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def corpus_text(corpus: str) -> str:
    """A bundled corpus as one string: WikiText-2 test, or the TinyStories pieces joined by blank lines."""
    if corpus == "wikitext":
        return wikitext2_test()
    if corpus == "tinystories":
        return "\n\n".join(tinystories_pieces())
    raise InvalidParameterError(f"unknown corpus '{corpus}'; valid corpora: {', '.join(CORPORA)}")


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """A digest of everything a fast tokenizer's encoding follows (vocabulary, merges, normalizer,
    pre-tokenizer, added tokens, whether special tokens are split), or None for a tokenizer without a
    serialisable backend. Truncation and padding are left out: each call sets them anew.

    Kept per tokenizer object (SmolLM2's takes ~0.4 s to serialise) and computed again once its size or
    special-token splitting changes (``add_tokens``, ``add_special_tokens``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    mark = (len(tokenizer), bool(getattr(tokenizer, "split_special_tokens", False)))
    kept = _FINGERPRINTS.get(tokenizer)
    if kept is not None and kept[0] == mark:
        return kept[1]
    state = json.loads(backend.to_str())
    state["truncation"] = state["padding"] = None
    state["kvquant"] = [type(tokenizer).__qualname__, mark[1]]
    digest = hashlib.sha256(json.dumps(state, sort_keys=True).encode("utf-8")).hexdigest()
    _FINGERPRINTS[tokenizer] = (mark, digest)
    return digest


def corpus_ids(tokenizer: Any, corpus: str, add_special_tokens: bool = False) -> list[int]:
    """``tokenizer(corpus_text(corpus), add_special_tokens=...).input_ids``, kept per process.

    Tasks, table cells and experiments slice windows, fillers and haystacks from the whole WikiText-2 or
    TinyStories text; tokenizing it takes ~1.4 s on a CPU, so every cell of a table in one process used
    to pay that again. The ids are kept under the tokenizer's fingerprint (and the corpus file's size and
    modification time), so another (or a changed) tokenizer never receives them; a tokenizer without a
    fingerprint is simply called."""
    if corpus not in CORPORA:
        corpus_text(corpus)  # raises the one-line error
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        return list(tokenizer(corpus_text(corpus), add_special_tokens=add_special_tokens).input_ids)
    stat = dataset_file(CORPORA[corpus]).stat()
    key = (fingerprint, corpus, add_special_tokens, stat.st_size, stat.st_mtime_ns)
    if key not in _CORPUS_IDS:
        ids = tokenizer(corpus_text(corpus), add_special_tokens=add_special_tokens).input_ids
        while len(_CORPUS_IDS) >= _MAX_CORPUS_IDS:
            del _CORPUS_IDS[next(iter(_CORPUS_IDS))]
        _CORPUS_IDS[key] = array("l", ids)
    return _CORPUS_IDS[key].tolist()


def bundled(relative: str, task: str, hub: str) -> Path:
    """Path of a task's bundled file, or a one-line error naming it and the ``source=hub`` alternative."""
    path = DATASETS / relative
    if not path.is_file():
        raise KvquantError(
            f"data file not found: {path}; restore it (git checkout kvquant/assets/datasets) "
            f"or run with task.source=hub to use the hub dataset {hub} (needs the network)"
        )
    return path


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def truthfulqa_mc() -> list[dict]:
    """TruthfulQA v1 multiple choice (817 questions) in the hub layout: ``mc{1,2}_targets`` = choices + labels.

    The bundled ``mc_task.json`` maps each answer to its label; the hub dataset (and lm-eval) list them.
    """
    raw = json.loads(bundled("truthfulqa/v1/mc_task.json", "truthfulqa_mc2", HUB["truthfulqa"]).read_text("utf-8"))
    rows = []
    for item in raw:
        row = {"question": item["question"]}
        for key in ("mc1_targets", "mc2_targets"):
            row[key] = {"choices": list(item[key]), "labels": [int(v) for v in item[key].values()]}
        rows.append(row)
    return rows


def longbench_tasks() -> list[str]:
    """LongBench tasks with a bundled .jsonl, in a fixed order."""
    return sorted(p.stem for p in (DATASETS / "longbench").glob("*.jsonl"))


def longbench(task: str) -> list[dict]:
    """The bundled examples of one LongBench task (LongBench's own fields: input, context, answers, all_classes…)."""
    return read_jsonl(bundled(f"longbench/{task}.jsonl", "longbench", HUB["longbench"]))


def longbench_config() -> tuple[dict[str, str], dict[str, int]]:
    """LongBench's own prompt templates and maximum generation lengths per task."""
    prompts = json.loads(bundled("longbench/dataset2prompt.json", "longbench", HUB["longbench"]).read_text("utf-8"))
    maxlen = json.loads(bundled("longbench/dataset2maxlen.json", "longbench", HUB["longbench"]).read_text("utf-8"))
    return prompts, maxlen


HUB = {
    "gsm8k": "openai/gsm8k (main)",
    "truthfulqa": "truthfulqa/truthful_qa",
    "longbench": "THUDM/LongBench",
    "coqa": "stanfordnlp/coqa",
}
