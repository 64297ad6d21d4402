# Two commands do everything on a fresh machine with Python 3.11+:
#   make demo   the main job: a two-stage chain on a local moto server, checked end to end
#   make test   lint, types and the test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_ARGS ?=

.PHONY: demo test test-fast lint types docs docs-settings pytest bench clean

# One venv in two layers. `make demo` installs the runtime and the lean local stand-in
# (.[local], about 410 MB); `make test` adds the dev tools (.[dev]) on top. One venv, so
# that the commands the demo prints (.venv/bin/sqsinfer ...) work whichever ran first.
$(BIN)/.installed-local: pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[local]'
	touch $@

$(BIN)/.installed: $(BIN)/.installed-local
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# make demo DEMO_ARGS=--keep leaves the stand-in up afterwards, to explore.
demo: $(BIN)/.installed-local
	$(BIN)/sqsinfer demo $(DEMO_ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check app tests examples
	$(BIN)/ruff format --check app tests examples
	$(BIN)/lint-imports

types: $(BIN)/.installed
	$(BIN)/mypy

pytest: $(BIN)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The documentation site, built strictly: a broken link or anchor fails the build.
docs: $(BIN)/.installed
	$(BIN)/mkdocs build --strict --site-dir $(VENV)/site

# docs/settings.md is generated from the Settings dataclass (a test checks it is current).
docs-settings: $(BIN)/.installed
	$(BIN)/python -c 'from sqsinfer import config; print(config.reference_markdown(), end="")' > docs/settings.md

test: lint types docs pytest

# The inner loop: unit tests and the worker against moto, without ops, deploy and lab.
test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit tests/worker

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
