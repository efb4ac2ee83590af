# Set-up for a fresh machine: `make demo` and `make test` each create .venv if missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel these machines carry; an open range would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.r3data-installed

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,megatron,hf,s3]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/r3data demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest --cov=r3data --cov-report=term-missing:skip-covered
	@echo "Coverage of the foundation (target >= 95%):"
	$(PY) -m coverage report --include='r3data/packed.py,r3data/batch.py' --fail-under=95

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(VENV)/bin/r3data bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .coverage build *.egg-info
