# The two commands a newcomer needs: `make run` and `make test`.
# Both create .venv and install everything on first use (torch first, pinned to the CPU build
# where no GPU exists: an unpinned torch would pull a multi-gigabyte CUDA build).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: run test bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

run: $(STAMP)
	$(VENV)/bin/kvstore run

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(VENV)/bin/kvstore bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
