# Entry points for a fresh machine (see README.md):
#   make docs   install into .venv, then serve the site with `mkdocs serve`
#   make test   install into .venv, build the engine environments, check format, lint and
#               types (ruff, mypy), then run the whole test suite with `pytest`
#   make wheel  build dist/torchlens-<version>-py3-none-any.whl, the wheel Getting started installs
#               (`pip install dist/torchlens-*.whl`); older wheels in dist/ are removed first

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DOCS_ADDR ?= 127.0.0.1:8000
PYTEST_ARGS ?=

# The torch pin comes from constraints.txt. It is installed on its own, before the
# project: if pip resolved the project's bare `torch>=2.4` first, it could pull a
# multi-GB CUDA build.
TORCH_PIN := $(shell grep -E '^torch==' constraints.txt)

# Silence Material's banner about MkDocs 2 on every build.
export NO_MKDOCS_2_WARNING := 1

STAMP := $(VENV)/.torchlens-installed

# Peer engines whose pins conflict with the main environment get one virtual environment
# each: envs/NAME.txt pins it, envs/build.sh builds it into $(ENGINE_DIR)/NAME, and the docs
# harness runs a block with tool=NAME in that interpreter (the rows: tests/fixtures/engines.py). An
# environment is rebuilt when its file changes. They build one after another, after .venv:
# build.sh hard-links the files they share (torch above all) to finished trees, which keeps
# four environments near 4 GB on disk instead of 7.
ENGINE_ENVS := $(patsubst envs/%.txt,%,$(wildcard envs/*.txt))
ENGINE_DIR ?= .venv-engines
ENGINE_STAMPS := $(foreach e,$(ENGINE_ENVS),$(ENGINE_DIR)/$(e)/.built)
export TORCHLENS_ENGINE_ENVS := $(abspath $(ENGINE_DIR))

.PHONY: docs test install engines wheel

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH_PIN)
	$(BIN)/python -m pip install -c constraints.txt -e ".[test,docs,draw]"
	touch $@

engines: $(STAMP)
	@$(MAKE) --no-print-directory -j1 $(ENGINE_STAMPS)

$(ENGINE_DIR)/%/.built: envs/%.txt envs/build.sh
	bash envs/build.sh $*
	touch $@

wheel:
	rm -f dist/torchlens-*.whl
	$(PYTHON) -m pip wheel --no-deps --wheel-dir dist .

docs: $(STAMP)
	$(BIN)/mkdocs serve --dev-addr $(DOCS_ADDR)

# The source is checked first: `ruff format --check` and `ruff check` over the Python of the
# repository, `mypy` over src/torchlens (settings in pyproject.toml, versions in constraints.txt).
# pytest runs whatever they found, and make test fails if any of the four failed. pytest exits 5
# when it collected no tests; that is a failure here, like any other.
LINT_PATHS := src scripts tests
test: $(STAMP) engines
	@status=0; \
	$(BIN)/ruff format --check $(LINT_PATHS) || status=1; \
	$(BIN)/ruff check $(LINT_PATHS) || status=1; \
	$(BIN)/mypy || status=1; \
	pstatus=0; $(BIN)/pytest $(PYTEST_ARGS) || pstatus=$$?; \
	if [ $$pstatus -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)" >&2; fi; \
	if [ $$pstatus -ne 0 ]; then status=$$pstatus; fi; \
	exit $$status
