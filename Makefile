# Two commands do everything on a fresh machine with Python 3.11+:
#   make demo   the main job: a two-stage chain on a local moto server, checked end to end
#   make test   lint, types and the test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast test-localstack lint types docs docs-settings pytest bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/sqsinfer demo

lint: $(BIN)/.installed
	$(BIN)/ruff check app tests examples
	$(BIN)/ruff format --check app tests examples
	$(BIN)/lint-imports

types: $(BIN)/.installed
	$(BIN)/mypy

pytest: $(BIN)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider --ignore=tests/localstack

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

# The worker against LocalStack as well as moto: LocalStack's S3 and SQS, stricter where AWS
# is, in host mode (no Docker) from its own venv on Python 3.13, built here when missing.
LOCALSTACK_VENV ?= .venv-localstack

$(LOCALSTACK_VENV)/.installed: app/sqsinfer/lab/localstack.py | $(BIN)/.installed
	$(BIN)/python -m sqsinfer.lab.localstack install $(LOCALSTACK_VENV)
	touch $@

test-localstack: $(BIN)/.installed $(LOCALSTACK_VENV)/.installed
	SQSINFER_LOCALSTACK_PYTHON=$(LOCALSTACK_VENV)/bin/python SQSINFER_LOCALSTACK_REQUIRED=1 \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/localstack

clean:
	rm -rf $(VENV) $(LOCALSTACK_VENV) .mypy_cache .ruff_cache .pytest_cache
