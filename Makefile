# trtkv: two commands from a fresh clone.
#   make demo   set up, fetch SmolLM2, build engines, generate (the main job)
#   make test   set up and run the test suite (what CI runs)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# CPU machines here have a local CPU wheel of torch 2.13.0; on a GPU machine plain `torch` (CUDA) is used.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
EXTRAS  ?= gguf,test,serve
ENGINES ?= engines
PROMPT  ?= A train leaves at 3 pm and travels 60 miles per hour. How far has it gone by 5:30 pm? Think step by step.

.PHONY: setup demo test test-fast test-kernels bench-cpu clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/trtkv models fetch smollm2-135m
	$(BIN)/trtkv build --model smollm2-135m --policy full --out $(ENGINES)/smollm2-full
	$(BIN)/trtkv build --model smollm2-135m --policy thinkv --budget 256 --out $(ENGINES)/smollm2-thinkv
	@echo "--- full cache ---"
	$(BIN)/trtkv generate $(ENGINES)/smollm2-full --prompt "$(PROMPT)" --max-tokens 1024
	@echo "--- ThinKV, budget 256 ---"
	$(BIN)/trtkv generate $(ENGINES)/smollm2-thinkv --prompt "$(PROMPT)" --max-tokens 1024

test: setup
	$(BIN)/python -m pytest -q -m "not slow or serve" tests --ignore=tests/kernels
	$(MAKE) test-kernels

test-kernels: setup
	$(BIN)/python -m pytest -q tests/kernels
	TRITON_INTERPRET=1 TRTKV_KERNELS=triton $(BIN)/python -m pytest -q tests/kernels

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not model and not serve" tests --ignore=tests/kernels

clean:
	rm -rf $(VENV) $(ENGINES) .pytest_cache
