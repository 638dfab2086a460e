"""Tasks run by lm-eval from our own YAMLs (``kvquant/assets/lm_tasks``): gsm8k, truthfulqa_mc2, truthfulqa_gen.

Only our folder is indexed (``include_defaults=False``; lm-eval's 14k built-in YAMLs cost ~10 s).
``source=bundled`` points the YAML's ``data_files`` at the bundled copies; ``source=hub`` swaps in the
hub dataset named in the YAML's ``metadata.hub``. The model is ``KVMethodLM``, so every request goes
through the method's cache; answers per example feed answer agreement with fp16.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvquant.data import DATASETS, HUB, bundled, truthfulqa_mc
from kvquant.eval import scorers
from kvquant.eval.engine import Engine
from kvquant.eval.suite import Evaluation, SuiteTask
from kvquant.eval.tasks import NonNegative, Positive, register_task

LM_TASKS = Path(__file__).resolve().parents[1] / "assets" / "lm_tasks"
TAIL = 400  # characters of each prompt kept in the per-example rows


# --------------------------------------------------------------------------- hooks named by the YAMLs
def gsm8k_results(doc: dict, results: list[str]) -> dict[str, float]:
    return scorers.gsm8k_scores(results[0], doc["answer"])


def truthfulqa_mc_bundled(**_: Any):
    """The bundled TruthfulQA v1 multiple-choice set as a ``DatasetDict`` with one ``validation`` split."""
    import datasets

    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(truthfulqa_mc())})


def truthfulqa_mc2_results(doc: dict, results: list[tuple[float, bool]]) -> dict[str, float]:
    return {"mc2": scorers.truthfulqa_mc2([r[0] for r in results], doc["mc2_targets"]["labels"])}


def truthfulqa_gen_docs(dataset):
    """Hub rows or rows of the original CSV → question, true answers (+ "I have no comment."), false answers."""

    def convert(doc: dict) -> dict:
        if "Question" in doc:  # the original CSV: answers joined with ";"
            correct = (doc.get("Correct Answers") or "").split(";")
            incorrect = (doc.get("Incorrect Answers") or "").split(";")
            question = doc["Question"]
        else:
            correct, incorrect, question = doc["correct_answers"], doc["incorrect_answers"], doc["question"]
        return {
            "question": question.strip(),
            "correct_answers": scorers.truthfulqa_answers(correct, add_no_comment=True),
            "incorrect_answers": scorers.truthfulqa_answers(incorrect),
        }

    return dataset.map(convert, remove_columns=list(dataset.column_names))


def truthfulqa_gen_results(doc: dict, results: list[str]) -> dict[str, float]:
    return scorers.truthfulqa_gen_scores(results[0], doc["correct_answers"], doc["incorrect_answers"])


# --------------------------------------------------------------------------- the task
@dataclass(frozen=True)
class LmEvalTask(SuiteTask):
    """One of our lm-eval YAML tasks (``kvquant/assets/lm_tasks/<name>.yaml``), run with ``KVMethodLM``
    on the first ``limit`` documents; a subclass per YAML names it and sets its default ``limit``."""

    limit: Positive[int | None] = None
    chunk_size: Positive[int] = 32
    source: Literal["bundled", "hub"] = "bundled"
    num_fewshot: NonNegative[int | None] = None  # None: the YAML's
    max_gen_toks: Positive[int | None] = None  # None: the YAML's
    batch_size: Positive[int] = 8

    def lm_config(self) -> dict[str, Any]:
        """Our YAML with the data source filled in (bundled files checked first, with a one-line error)."""
        from lm_eval.tasks._yaml_loader import load_yaml

        cfg = load_yaml(LM_TASKS / f"{self.name}.yaml", resolve_func=True)
        meta = dict(cfg.get("metadata") or {})
        hub = meta.pop("hub", {})
        files = meta.pop("bundled", [])
        cfg["metadata"] = meta
        if self.source == "bundled":
            for rel in files:
                bundled(rel, self.name, HUB.get(self.name.split("_")[0], hub.get("dataset_path", "")))
            data_files = (cfg.get("dataset_kwargs") or {}).get("data_files")
            if data_files:
                cfg["dataset_kwargs"] = {"data_files": {k: str(DATASETS / v) for k, v in data_files.items()}}
        else:
            cfg.pop("custom_dataset", None)
            cfg.pop("dataset_kwargs", None)
            cfg.update(hub)
        if self.num_fewshot is not None:
            cfg["num_fewshot"] = self.num_fewshot
        if self.max_gen_toks is not None and "generation_kwargs" in cfg:
            cfg["generation_kwargs"] = {**cfg["generation_kwargs"], "max_gen_toks": self.max_gen_toks}
        return cfg

    def answer(self, sample: dict) -> str:
        """What answer agreement compares: the generated text by default."""
        return str(sample["resps"][0][0]).strip()

    def evaluate(self, engine: Engine, progress: bool) -> Evaluation:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        from kvquant.eval.lm_eval_model import KVMethodLM

        logging.getLogger("lm_eval").setLevel(logging.WARNING)
        cfg = self.lm_config()
        lm = KVMethodLM(engine, progress=progress)
        manager = TaskManager(include_path=str(LM_TASKS), include_defaults=False)
        out = simple_evaluate(
            model=lm,
            tasks=[cfg],
            limit=self.limit,
            task_manager=manager,
            log_samples=True,
            bootstrap_iters=0,
        )
        name = cfg["task"]
        metric_names = [m["metric"] for m in cfg["metric_list"]]
        metrics = {}
        for key, value in out["results"][name].items():
            metric = key.split(",")[0]
            if metric in metric_names and isinstance(value, (int, float)):
                metrics[metric] = float(value)
        examples = []
        for sample in sorted(out["samples"][name], key=lambda s: s["doc_id"]):
            examples.append(
                {
                    "id": f"{name}/{sample['doc_id']}",
                    "doc_id": sample["doc_id"],
                    "prompt_tail": str(sample["arguments"][0][0])[-TAIL:],
                    "target": str(sample["target"]),
                    "output": [r[0] for r in sample["resps"]] if len(sample["resps"]) > 1 else sample["resps"][0][0],
                    "answer": self.answer(sample),
                    **{m: float(sample[m]) for m in metric_names if m in sample},
                }
            )
        # Every metric of our YAMLs aggregates by mean, so the per-sample values give the intervals
        # (kvquant.eval.intervals, paired with fp16); lm-eval's own stderr stays off (bootstrap_iters=0).
        return Evaluation(metrics, examples, {"num_fewshot": cfg.get("num_fewshot", 0)}, tuple(metric_names))


@dataclass(frozen=True)
class Gsm8kTask(LmEvalTask):
    """GSM8K: answer agreement compares the number extracted from each answer."""

    limit: Positive[int | None] = 5

    def answer(self, sample: dict) -> str:
        return scorers.gsm8k_extract(str(sample["resps"][0][0]), "flexible")


@dataclass(frozen=True)
class TruthfulQAMC2Task(LmEvalTask):
    """TruthfulQA MC2: answer agreement compares the choice each method ranks first."""

    limit: Positive[int | None] = 10

    def answer(self, sample: dict) -> str:
        """The choice with the highest log-likelihood."""
        lls = [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in sample["resps"]]
        return str(max(range(len(lls)), key=lls.__getitem__))


@dataclass(frozen=True)
class TruthfulQAGenTask(LmEvalTask):
    """TruthfulQA generation: answer agreement compares the generated text."""

    limit: Positive[int | None] = 10


register_task("gsm8k", Gsm8kTask)
register_task("truthfulqa_mc2", TruthfulQAMC2Task)
register_task("truthfulqa_gen", TruthfulQAGenTask)
