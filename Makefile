# Two commands do everything on a fresh machine with Python 3.11+:
#   make demo   the main job: a two-stage chain on a local moto server, checked end to end
#   make test   lint, types and the test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The suite mostly waits (on the moto server, on spawned processes, on timeouts), so four
# pytest workers on two cores cut its wall time; a test file stays on one worker.
# PARALLEL= (empty) runs it in one process.
PARALLEL ?= -n 4 --dist loadfile
DEMO_ARGS ?=

.PHONY: demo chaos fleet-sim test test-fast test-floors test-localstack test-upgrade test-image image image-base wheelhouse lint types docs docs-settings chart-readme release pytest bench clean

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

# The proving ground (proving/, not installed): a two-stage chain under fire, checked.
CHAOS_ARGS ?= --tasks 2000
chaos: $(BIN)/.installed-local
	$(BIN)/python -m proving.chaos $(CHAOS_ARGS)

# The fleet simulator (proving/fleetsim): a fleet of workers under KEDA, event by event,
# beside `sqsinfer plan`'s figures for the same job, e.g.
#   make fleet-sim ARGS="--tasks 15.8M --seconds-per-task 21 --deadline-h 72 --processes 2 --json"
fleet-sim: $(BIN)/.installed-local
	$(BIN)/python -m proving.fleetsim $(ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check app proving tests examples scripts
	$(BIN)/ruff format --check app proving tests examples scripts
	$(BIN)/lint-imports

types: $(BIN)/.installed
	$(BIN)/mypy
	$(BIN)/mypy --strict scripts

pytest: $(BIN)/.installed $(BIN)/promtool
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PARALLEL) --ignore=tests/localstack \
		--ignore=tests/upgrade --ignore=tests/image

# The documentation site, built strictly: a broken link or anchor fails the build.
docs: $(BIN)/.installed
	$(BIN)/mkdocs build --strict --site-dir $(VENV)/site

# docs/settings.md is generated from the Settings dataclass (a test checks it is current).
docs-settings: $(BIN)/.installed
	$(BIN)/python -c 'from sqsinfer import config; print(config.reference_markdown(), end="")' > docs/settings.md

# helm/sqsinfer/README.md is generated from the values' comments (a test checks it is current).
chart-readme: $(BIN)/.installed
	$(BIN)/python scripts/chart_readme.py

test: lint types docs pytest

# promtool, which unit-tests the chart's alerts (tests/deploy/test_alert_rules.py): the binary
# alone, unpacked from Debian's prometheus package. Installing the package would also start
# a Prometheus server listening on every address.
$(BIN)/promtool: | $(BIN)/.installed
	rm -rf $(VENV)/promtool-deb && mkdir $(VENV)/promtool-deb
	cd $(VENV)/promtool-deb && { apt-get download prometheus 2>/dev/null \
		|| { apt-get update -qq && apt-get download prometheus; }; }
	dpkg-deb -x $(VENV)/promtool-deb/prometheus_*.deb $(VENV)/promtool-deb/x
	install -m 0755 $(VENV)/promtool-deb/x/usr/bin/promtool $@
	rm -rf $(VENV)/promtool-deb

# The inner loop: unit tests and the worker against moto, without ops, deploy and lab.
test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PARALLEL) tests/unit tests/worker

# The declared dependency floors really work: a separate venv holding the lowest version of
# every direct dependency (uv's lowest-direct resolution), checked to be the declared
# floors, then the tests that exercise the dependencies (not ops and lab: slow, and they
# use nothing the worker does not).
FLOORS_VENV ?= .venv-floors
test-floors: $(BIN)/.installed $(BIN)/promtool
	rm -rf $(FLOORS_VENV)
	$(BIN)/uv venv --quiet --seed --python $(PYTHON) $(FLOORS_VENV)  # --seed: pip, which tests use
	$(BIN)/uv pip install --quiet --python $(FLOORS_VENV)/bin/python \
		--resolution lowest-direct -e '.[dev]'
	$(FLOORS_VENV)/bin/python scripts/check_floors.py --extras dev
	$(FLOORS_VENV)/bin/python -m pytest -q -p no:cacheprovider $(PARALLEL) tests/unit tests/worker tests/deploy

# The release artefacts of sqsinfer.__version__ into dist/: wheel, sdist, chart package,
# lint of each, an SBOM, SHA256SUMS, and the image's build and the chart's push commands:
#   make release IMAGE=registry.example.com/ml/sqsinfer BASE_IMAGE=python:3.11-slim-bookworm@sha256:...
release: $(BIN)/.installed
	$(BIN)/python scripts/release.py --image "$(IMAGE)" --base-image "$(BASE_IMAGE)" \
		--chart-repo "$(CHART_REPO)"

# The worker against LocalStack as well as moto: LocalStack's S3 and SQS, stricter where AWS
# is, in host mode (no Docker) from its own venv on Python 3.13, built here when missing.
LOCALSTACK_VENV ?= .venv-localstack

$(LOCALSTACK_VENV)/.installed: proving/localstack.py | $(BIN)/.installed
	$(BIN)/python -m proving.localstack install $(LOCALSTACK_VENV)
	touch $@

test-localstack: $(BIN)/.installed $(LOCALSTACK_VENV)/.installed
	SQSINFER_LOCALSTACK_PYTHON=$(LOCALSTACK_VENV)/bin/python SQSINFER_LOCALSTACK_REQUIRED=1 \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/localstack

# The previous release (tests/upgrade/previous-release, built from its commit into
# .venv-previous/ on first use, about 15 s) and this tree side by side on one chain.
test-upgrade: $(BIN)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/upgrade

# -- The image -----------------------------------------------------------------------------
# `make image` builds IMAGE:TAG (sqsinfer:<version> unless given) with podman (with
# --format docker, which keeps the Dockerfile's SHELL and so pipefail) or docker, whichever
# is installed: from the package index by default; offline with WHEELHOUSE=wheelhouse
# (filled by `make wheelhouse` where the index is reachable) and BASE_IMAGE naming a base
# the engine has (the PYTHON_IMAGE build argument; `make image-base` makes one from
# Debian's packages, without Docker Hub).
VERSION := $(shell sed -n 's/^__version__ = "\([^"]*\)".*/\1/p' app/sqsinfer/__init__.py)
ENGINE ?= $(notdir $(or $(shell command -v podman),$(shell command -v docker)))
EXTRAS ?=
WHEELHOUSE ?=
DEBIAN_BASE ?= localhost/sqsinfer-base:bookworm
DEBIAN_BASE_TAR ?= build/image/debian-bookworm-python3.tar

image:
	@test -n "$(ENGINE)" || { echo "make image: install podman or docker" >&2; exit 1; }
	$(ENGINE) build $(if $(filter podman,$(ENGINE)),--format docker) \
		--build-arg VERSION=$(VERSION) \
		$(if $(BASE_IMAGE),--build-arg PYTHON_IMAGE=$(BASE_IMAGE)) \
		$(if $(EXTRAS),--build-arg EXTRAS=$(EXTRAS)) \
		$(if $(WHEELHOUSE),--build-arg WHEELHOUSE=$(WHEELHOUSE)) \
		-t $(or $(IMAGE),sqsinfer):$(or $(TAG),$(VERSION)) .

# The wheels of an offline build: the dependencies (and EXTRAS') for the image's Python.
wheelhouse: $(BIN)/.installed
	$(BIN)/python scripts/wheelhouse.py --extras '$(EXTRAS)' wheelhouse

# A base image from Debian 12's own packages (its Python is 3.11), for hosts without
# Docker Hub, as DEBIAN_BASE; the tarball is kept and imported once.
$(DEBIAN_BASE_TAR):
	mkdir -p $(@D)
	mmdebstrap --quiet --variant=minbase \
		--include=python3,python3-venv,python-is-python3,ca-certificates \
		bookworm $(@:.tar=.partial.tar)
	mv $(@:.tar=.partial.tar) $@

image-base: $(DEBIAN_BASE_TAR)
	$(ENGINE) image inspect $(DEBIAN_BASE) > /dev/null 2>&1 \
		|| $(ENGINE) import $(DEBIAN_BASE_TAR) $(DEBIAN_BASE)

# The image and the chart's own pods under podman, against a stand-in on loopback
# (tests/image). podman keeps this lane's images and pods under build/image
# (scripts/podman_conf.py): the base tarball, the wheelhouse and the day's build cache
# are reused by the next local run; a fresh clone builds everything.
IMAGE_STATE := $(CURDIR)/build/image
TEST_IMAGE_EXTRAS ?= parquet
test-image: export CONTAINERS_CONF = $(IMAGE_STATE)/containers.conf
test-image: export CONTAINERS_STORAGE_CONF = $(IMAGE_STATE)/storage.conf
test-image: $(BIN)/.installed
	scripts/image_tools.sh
	$(BIN)/python scripts/podman_conf.py $(IMAGE_STATE) > /dev/null
	$(MAKE) --no-print-directory wheelhouse EXTRAS=$(TEST_IMAGE_EXTRAS)
	$(MAKE) --no-print-directory image-base ENGINE=podman
	podman image prune --force --filter until=24h > /dev/null  # keep today's build cache
	$(MAKE) --no-print-directory image ENGINE=podman IMAGE=localhost/sqsinfer TAG=test \
		BASE_IMAGE=$(DEBIAN_BASE) WHEELHOUSE=wheelhouse EXTRAS=$(TEST_IMAGE_EXTRAS)
	SQSINFER_TEST_IMAGE=localhost/sqsinfer:test SQSINFER_IMAGE_REQUIRED=1 \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/image

clean:
	rm -rf $(VENV) $(FLOORS_VENV) $(LOCALSTACK_VENV) .venv-previous .mypy_cache .ruff_cache \
		.pytest_cache
