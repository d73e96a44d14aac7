# trtkv: two commands from a fresh clone.
#   make demo   set up, fetch SmolLM2, build engines, generate (the main job)
#   make test   set up and run the test suite (what CI runs)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# CPU machines here have a local CPU wheel of torch 2.13.0; on a GPU machine plain `torch` (CUDA) is used.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
EXTRAS  ?= gguf,test,serve,onnx
ENGINES ?= engines
PROMPT  ?= Write a long, detailed essay about the history of mathematics, from ancient Babylon to modern computers. Cover many eras and people.
# SmolLM2-135M loops under greedy decoding even with the full cache; the demo samples (seeded, reproducible)
SAMPLING ?= --temperature 0.7 --top-p 0.9 --repetition-penalty 1.1 --seed 0 --ignore-eos

.PHONY: setup demo test test-fast test-kernels lint bench-cpu wheel clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, then trtkv without pip's build isolation: setup.py compiles the C++ CPU kernels against this
# torch, -march=native (a few minutes on 2 cores, once; again when their sources change). No trtkv process compiles.
KERNEL_SRC := setup.py plugins/cpu_kernels/variants.py $(wildcard plugins/cpu_kernels/csrc/*)
$(VENV)/.installed: pyproject.toml $(KERNEL_SRC) | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)" "setuptools>=68" ninja==1.13.2
	@echo "building trtkv's C++ CPU kernels for this CPU (setup.py)"
	$(BIN)/pip install -q --no-build-isolation -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/trtkv models fetch smollm2-135m
	$(BIN)/trtkv build --model smollm2-135m --policy full --set kv_format=fp16 --out $(ENGINES)/smollm2-full
	$(BIN)/trtkv build --model smollm2-135m --policy thinkv --budget 256 --out $(ENGINES)/smollm2-thinkv
	@echo "--- full cache (fp16) ---"
	$(BIN)/trtkv generate $(ENGINES)/smollm2-full --prompt "$(PROMPT)" --max-tokens 1024 $(SAMPLING)
	@echo "--- ThinKV, budget 256 ---"
	$(BIN)/trtkv generate $(ENGINES)/smollm2-thinkv --prompt "$(PROMPT)" --max-tokens 1024 $(SAMPLING)

test: setup lint
	$(BIN)/python -m pytest -q -m "not slow or serve or claim" tests --ignore=tests/kernels
	$(MAKE) test-kernels

lint: setup
	$(BIN)/ruff check trtkv plugins tests build_scripts
	$(BIN)/lint-imports --no-cache  # the layering in .importlinter

test-kernels: setup
	$(BIN)/python -m pytest -q tests/kernels
	TRITON_INTERPRET=1 TRTKV_KERNELS=triton $(BIN)/python -m pytest -q tests/kernels

bench-cpu: setup
	PATH=$(BIN):$$PATH build_scripts/bench_cpu.sh results/bench-cpu-thinkv

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not model and not serve" tests --ignore=tests/kernels

# a wheel for other x86-64 machines (no compiler needed there): x86-64-v4+VBMI, v4 and v3 builds of the CPU
# kernels, the import picks the one the CPU runs (setup.py); it needs the torch version it was built with
wheel: setup
	TRTKV_CPU_ARCH=portable $(BIN)/pip wheel -q --no-build-isolation --no-deps -w dist .

clean:
	rm -rf $(VENV) $(ENGINES) .pytest_cache build plugins/cpu_kernels/_C_*.so plugins/cpu_kernels/_C_build.json
