"""The ``!function`` hooks our task YAMLs name (lm-eval resolves them beside the YAML); the code lives in kvquant."""

from kvquant.eval.lm_tasks import (  # noqa: F401
    gsm8k_results,
    truthfulqa_gen_docs,
    truthfulqa_gen_results,
    truthfulqa_mc2_results,
    truthfulqa_mc_bundled,
)
