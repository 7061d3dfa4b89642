# The two commands a newcomer needs: `make run` and `make test`.
# Both create .venv and install everything on first use (torch first, pinned: an unpinned torch
# would pull the newest multi-gigabyte CUDA build; TORCH=... picks another, see the README).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# Debian packages the tests and benchmarks use: chromium (dashboard browser tests), redis-server
# (the sidecar benchmark's peer), prometheus (promtool checks deploy/), openssl (TLS test certs),
# gcc and libxxhash-dev (the C loop of the prefix hash chain, kvstore/_chain.c; gcc alone for
# HitDensity's sampling loop, kvstore/policies/_sampling.c; both optional at build),
# g++, pkg-config and libgrpc++-dev (the sidecar's native data plane, kvstore/service/dataplane_native/;
# optional at build: without it other hosts get blocks through the slower Python Get).
SYSTEM_PACKAGES ?= chromium redis-server prometheus openssl gcc libxxhash-dev g++ pkg-config libgrpc++-dev
SYSTEM_TOOLS    := /usr/bin/chromium /usr/bin/redis-server /usr/bin/promtool /usr/bin/openssl /usr/bin/gcc \
                   /usr/include/xxhash.h /usr/bin/g++ /usr/bin/pkg-config /usr/include/grpcpp/grpcpp.h

.PHONY: run test bench venv clean system-packages

# LMCache's own environment (.venv-lmcache) for the plugin's tests and benchmark
include mk/lmcache.mk

venv: $(STAMP)

# apt-get runs only when a tool is missing; without root (and no sudo) it says what to install.
system-packages:
	@missing=0; for tool in $(SYSTEM_TOOLS); do test -e $$tool || missing=1; done; \
	if [ $$missing = 1 ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO=sudo; else \
	    echo "warning: install these Debian packages as root: $(SYSTEM_PACKAGES) (tests needing them skip)"; exit 0; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	fi

$(STAMP): pyproject.toml setup.py kvstore/_chain.c kvstore/policies/_sampling.c $(wildcard kvstore/service/dataplane_native/*) Makefile
	@$(MAKE) --no-print-directory system-packages
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

run: $(STAMP)
	$(VENV)/bin/kvstore run

test: $(STAMP) $(LMCACHE_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(VENV)/bin/kvstore bench

clean:
	rm -rf $(VENV) $(LMCACHE_VENV) .pytest_cache .hypothesis
