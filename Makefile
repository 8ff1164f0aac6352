# `make up` serves the built-in tiny model; `make test` runs the whole suite. Both build .venv from nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test venv protos clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first: a bare `torch` requirement would pull a multi-GB CUDA build; 2.13.0 is the local CPU wheel.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/kimiserve up

test: $(STAMP)
	$(PY) -m pytest -q -ra tests

protos: $(STAMP)
	$(PY) -m kimiserve.protogen

clean:
	rm -rf $(VENV)
