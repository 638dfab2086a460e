"""AQUA-KV and HIGGS: cross-layer predictors plus HIGGS codes of what they miss (``method.py``).

``method.py`` holds the methods and registers them; ``cache.py`` the layers and the cache that links
them, ``sliding.py`` what a sliding-window layer forgets; ``predictors.py`` the predictor file format
and the rule that applies predictors; ``calibration.py`` the calibration data and ridge fit
(imported when a method calibrates). The names below are the package's public face.
"""

from kvquant.methods.aquakv.cache import AquaKVCache, AquaKVLayer
from kvquant.methods.aquakv.method import (
    GROUP,
    METHOD_FOR_PREDICT,
    SINK,
    WINDOW,
    AquaKVMethod,
    HiggsMethod,
    HiggsPostRopeMethod,
)
from kvquant.methods.aquakv.predictors import PredictorFileError, Predictors, model_identity, predictor_dir

__all__ = [
    "GROUP",
    "METHOD_FOR_PREDICT",
    "SINK",
    "WINDOW",
    "AquaKVCache",
    "AquaKVLayer",
    "AquaKVMethod",
    "HiggsMethod",
    "HiggsPostRopeMethod",
    "PredictorFileError",
    "Predictors",
    "model_identity",
    "predictor_dir",
]
