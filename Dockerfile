# syntax=docker/dockerfile:1
# sqsinfer worker image.
#
#   docker build -t sqsinfer .
#   docker build -t sqsinfer:stage1 --build-arg MODEL_FILE=models/stage1.ubj .
#   docker build -t sqsinfer:onnx --build-arg EXTRAS=onnx,parquet .
#
# EXTRAS (optional) are the package's extras to install: `onnx` (SQSINFER_HANDLER=onnx)
# and `parquet` (.parquet inputs and outputs).
#
# Offline (air-gapped builds, or a host whose builds cannot reach the package index):
#   python scripts/wheelhouse.py --extras parquet wheelhouse      (where the index is)
#   docker build -t sqsinfer --build-arg WHEELHOUSE=wheelhouse --build-arg EXTRAS=parquet .
# WHEELHOUSE (optional) is a folder of wheels in the build context; pip then installs
# from it alone (--no-index). PYTHON_IMAGE is the base (a Debian with python3 and
# python3-venv, e.g. one made with mmdebstrap: see docs/deployment.md). With podman,
# build with `--format docker`: the OCI format drops SHELL, and with it pipefail.
#
# `python scripts/release.py` writes the release's build command (with VERSION).
#
# MODEL_FILE (optional) is a model file in the build context; it is baked in at
# /models/$MODEL_NAME and SQSINFER_MODEL_PATH points at it. Without it, mount the model
# (the Helm chart's `model.volume`) and set SQSINFER_MODEL_PATH.
#
# The image runs as UID 10001 and needs no writable root filesystem: give it /tmp and a
# memory-backed /dev/shm large enough for processes x prefetch x max input size, e.g.
#   docker run --read-only --tmpfs /tmp --shm-size 512m -e SQSINFER_... sqsinfer

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The package's version (sqsinfer.__version__; a test keeps this default equal to it).
ARG VERSION=0.2.0

# ---- builder: the project and its dependencies in a virtual environment --------------
FROM ${PYTHON_IMAGE} AS builder

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv

WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app

# The project depends on xgboost-cpu: the CPU-only wheel, without the CUDA libraries
# that the plain xgboost wheel pulls in. Fail the build if anything brought those in.
# (DL3013 asks to pin what pip installs: this is the project itself, pinned by its tree.)
# pip and setuptools (the build backend) leave the environment once it is built: the
# worker runs neither, and the runtime image has no use for an installer.
ARG EXTRAS=""
ARG WHEELHOUSE=""
# hadolint ignore=DL3013
RUN --mount=type=bind,target=/context \
    pip install --no-cache-dir \
        ${WHEELHOUSE:+--no-index --find-links "/context/${WHEELHOUSE}"} \
        ".${EXTRAS:+[${EXTRAS}]}" \
    && pip show xgboost-cpu > /dev/null \
    && if pip show xgboost > /dev/null 2>&1; then echo "xgboost (CUDA) installed" >&2; exit 1; fi \
    && if pip freeze | grep -i '^nvidia-'; then echo "CUDA libraries installed" >&2; exit 1; fi \
    && sqsinfer --help > /dev/null \
    && pip uninstall --yes --quiet pip setuptools

# The optional baked-in model, staged so the runtime stage can copy it unconditionally.
ARG MODEL_FILE=""
ARG MODEL_NAME=model.ubj
RUN --mount=type=bind,target=/context \
    mkdir -p /out/models \
    && if [ -n "${MODEL_FILE}" ]; then \
         cp "/context/${MODEL_FILE}" "/out/models/${MODEL_NAME}" \
         && chmod 0444 "/out/models/${MODEL_NAME}"; \
       fi

# ---- runtime ------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG VERSION
LABEL org.opencontainers.image.title="sqsinfer" \
      org.opencontainers.image.description="Batch ML inference worker: SQS in, S3 out" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/sqsinfer/sqsinfer" \
      org.opencontainers.image.licenses="Apache-2.0"

# tini is PID 1: it hands SIGTERM to the worker (which drains and releases its messages)
# and reaps the inference processes the worker spawns.
# apt-get clean: a base without the Docker images' apt hook would otherwise keep apt's
# package caches (about 77 MB) in this layer.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 sqsinfer \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
         --home-dir /nonexistent --shell /usr/sbin/nologin sqsinfer

COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /out/models /models

# The base image ships the standard library without .pyc files and the pod's root is
# read-only, so every process (the worker and each inference process) would compile it
# again at start, about 0.6 s each. Compile it and the virtual environment once, here.
# unchecked-hash: the .pyc files are used without a look at their sources, which never
# change in an image (and whose timestamps a copy between stages may not keep).
RUN python -m compileall -q -j 0 --invalidation-mode unchecked-hash \
        "$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')" /opt/venv/lib

ARG MODEL_FILE=""
ARG MODEL_NAME=model.ubj
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SQSINFER_MODEL_PATH=${MODEL_FILE:+/models/${MODEL_NAME}}

USER 10001:10001
WORKDIR /tmp

# /livez, /readyz and /metrics (SQSINFER_HEALTH_PORT).
EXPOSE 8080

ENTRYPOINT ["tini", "--", "sqsinfer"]
CMD ["worker"]
