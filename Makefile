# paralab: `make demo` sets up and runs the main job; `make test` sets up and runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0

.PHONY: setup data demo test test-slow mutants bench gpu-check clean

# A virtual environment with torch installed first, pinned (a bare `torch`
# requirement can pull gigabytes of CUDA wheels). If the Python that creates
# the venv already has torch (say, a CUDA build), the venv sees it through
# --system-site-packages and it is never replaced.
setup: $(VENV)/.paralab-setup
$(VENV)/.paralab-setup: pyproject.toml
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "setup: using the torch already installed for $(PY)"; \
	  $(PY) -m venv --system-site-packages $(VENV); \
	else \
	  $(PY) -m venv $(VENV) && $(BIN)/pip install -q $(TORCH_PIN); \
	fi
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python -m compileall -q src  # bytecode now, as a wheel install has: a shell may forbid writing it later
	@touch $@

# Real data offline: Debian's dataset-fashion-mnist and jargon-text (the text for --model gpt),
# where root and apt allow.
data:
	@if [ -d /usr/share/datasets/fashion-mnist ]; then \
	  echo "data: Fashion-MNIST present in /usr/share/datasets/fashion-mnist"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get install -y -q dataset-fashion-mnist || (apt-get update -q && apt-get install -y -q dataset-fashion-mnist)) \
	  || echo "data: could not install dataset-fashion-mnist; the demo uses synthetic data"; \
	else \
	  echo "data: not root or no apt-get; the demo uses synthetic data (see README for real data)"; \
	fi
	@if [ -f /usr/share/doc/jargon-text/jargon.txt.gz ]; then \
	  echo "data: the Jargon File (text) present in /usr/share/doc/jargon-text"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get install -y -q jargon-text || (apt-get update -q && apt-get install -y -q jargon-text)) \
	  || echo "data: could not install jargon-text; --model gpt uses synthetic-text"; \
	else \
	  echo "data: not root or no apt-get; --model gpt uses synthetic-text (apt-get install jargon-text)"; \
	fi

# The main job: single at 1 worker, every other strategy at 2, checked against the
# single-process reference, into reports/compare-<time>/report.html.
demo: setup data
	$(BIN)/paralab compare

test: setup
	$(BIN)/python -m pytest -q -m "not slow"

# The long matrices (every strategy in float64 at real hyper-parameters, 20 steps): CI runs them too.
test-slow: setup
	$(BIN)/python -m pytest -q -m slow

# Seeded bugs --check must catch (tests/test_mutants.py: a copy of the package per bug; part of test-slow).
mutants: setup
	$(BIN)/python -m pytest -q tests/test_mutants.py

bench: setup
	$(BIN)/python bench/run.py

# The GPU path, proven on a machine with a CUDA device: the CUDA-marked tests, every strategy's --check on
# the GPU(s), samples/s and MFU at 1 GPU -> bench/results/gpu-*.json. Needs no setup (it runs paralab from
# src/ with the first Python whose torch sees a GPU); without one it says so and exits 2, having run nothing.
gpu-check:
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) runs reports .pytest_cache
