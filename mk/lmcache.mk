# LMCache (the plugin in connectors/lmcache, its tests and its benchmark) lives in an environment of
# its own: LMCache 0.5.6 pins protobuf<7, numpy<=2.2.6 and prometheus_client<=0.24.1, and grpcio
# 1.78 through grpcio-observability, while our generated stubs are for protobuf 7 and grpcio 1.85
# (the plugin loads them there anyway: connectors/lmcache/stubs.py). Include it from the Makefile;
# it uses PYTHON, TORCH, STAMP and PY from there, with these defaults when run alone.

PYTHON        ?= python3
TORCH         ?= torch==2.13.0
LMCACHE       ?= lmcache==0.5.6
LMCACHE_VENV  ?= .venv-lmcache
LMCACHE_PY    := $(LMCACHE_VENV)/bin/python
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed

.PHONY: lmcache-venv lmcache-bench

lmcache-venv: $(LMCACHE_STAMP)

# torch first, pinned (an unpinned one would pull a CUDA build); then LMCache with its own pins;
# then this project without its dependencies, plus the two the sidecar client needs beyond
# LMCache's (grpcio, protobuf and numpy come with LMCache). The import at the end is the check
# that the client loads under LMCache's protobuf and grpcio.
$(LMCACHE_STAMP): pyproject.toml mk/lmcache.mk
	test -x $(LMCACHE_PY) || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_PY) -m pip install -q --upgrade pip
	$(LMCACHE_PY) -m pip install -q "$(TORCH)"
	$(LMCACHE_PY) -m pip install -q "$(LMCACHE)"
	$(LMCACHE_PY) -m pip install -q "xxhash>=3.4" "rocksdict>=0.3.23"
	$(LMCACHE_PY) -m pip install -q --no-deps -e .
	$(LMCACHE_PY) -c "import connectors.lmcache.adapter"
	touch $@

# our plugin against LMCache's Redis connector (needs the Debian redis-server package)
lmcache-bench: $(STAMP) $(LMCACHE_STAMP)
	$(PY) benchmarks/lmcache_bench.py
