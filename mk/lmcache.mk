# LMCache's environment: `pip install -e .[lmcache,codegen]`, the project with the extra a user
# installs for the plugin (connectors/lmcache), where the plugin's tests and benchmark run. The main
# environment (.venv) resolves the newest protobuf (7) and grpcio; this one protobuf 6 and grpcio
# 1.78 (LMCache's pins), so `make test` runs the project on both. Include it from the Makefile; it
# uses PYTHON, TORCH, STAMP and PY from there, with these defaults when run alone.

PYTHON        ?= python3
TORCH         ?= torch==2.13.0
LMCACHE_VENV  ?= .venv-lmcache
LMCACHE_PY    := $(LMCACHE_VENV)/bin/python
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed

.PHONY: lmcache-venv lmcache-bench

lmcache-venv: $(LMCACHE_STAMP)

# torch first, pinned (an unpinned one would pull a CUDA build); then this project with its lmcache
# extra (LMCache 0.5.6 and its pins: protobuf 6, grpcio 1.78) and its codegen extra (grpcio-tools
# 1.78.0, which needs protobuf 6 too: the stubs' staleness test runs here). The import at the end
# is the check that the sidecar client and the plugin load under those versions.
$(LMCACHE_STAMP): pyproject.toml mk/lmcache.mk
	test -x $(LMCACHE_PY) || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_PY) -m pip install -q --upgrade pip
	$(LMCACHE_PY) -m pip install -q "$(TORCH)"
	$(LMCACHE_PY) -m pip install -q -e ".[lmcache,codegen]"
	$(LMCACHE_PY) -c "import connectors.lmcache.adapter, kvstore.service.server"
	touch $@

# our plugin against LMCache's Redis connector (needs the Debian redis-server package)
lmcache-bench: $(STAMP) $(LMCACHE_STAMP)
	$(PY) benchmarks/lmcache_bench.py
