"""The model file: on the local disk, or fetched once per pod from S3 and verified.

A model in S3 is downloaded by the worker's own process before the pool starts, into
`model_dir` (the chart mounts an emptyDir there, so it works with a read-only root and
survives a container restart within the pod), streamed through a sha256 as it arrives.
The pin is required for a remote model: only bytes with that hash are ever renamed
into place, and the spawned processes hash the bytes they load once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import aiohttp

from sqsinfer import config
from sqsinfer.compute.errors import ModelLoadError
from sqsinfer.compute.inference import file_sha256
from sqsinfer.logs import Event
from sqsinfer.messages import S3Uri, parse_s3_uri

log = logging.getLogger("sqsinfer.model")

_CHUNK_BYTES = 1 << 20
_BODY_ATTEMPTS = 3


@dataclass(frozen=True)
class ModelFile:
    path: str  # the local file the inference processes load
    sha256: str  # of its bytes, as verified here
    source: str  # where it came from: the local path or the s3:// URI


def is_remote(model_path: str) -> bool:
    return model_path.startswith("s3://")


def local(path: str, expected_sha256: str) -> ModelFile:
    """A model on the local disk: hash it, and refuse it when the pin disagrees."""
    actual = file_sha256(path)
    if expected_sha256 and actual != expected_sha256:
        raise ModelLoadError(
            f"{config.env_name('model_sha256')}: model {path} has sha256 {actual}, "
            f"expected {expected_sha256}"
        )
    return ModelFile(path, actual, path)


def cached_path(uri: S3Uri, expected_sha256: str, model_dir: str) -> str:
    """Where a verified download lives: named by its hash, so a changed pin never reuses it."""
    return os.path.join(model_dir, expected_sha256 + uri.suffix)


async def fetch(s3: Any, settings: config.Settings) -> ModelFile:
    """Download the model named by an s3:// `model_path`, or reuse a verified copy."""
    uri = parse_s3_uri(settings.model_path, config.env_name("model_path"))
    target = cached_path(uri, settings.model_sha256, settings.model_dir)
    if await asyncio.to_thread(_reusable, target, settings.model_sha256, settings.model_dir):
        log.info(Event.MODEL_ALREADY_FETCHED, extra={"model": str(uri), "path": target})
        return ModelFile(target, settings.model_sha256, str(uri))
    for attempt in range(1, _BODY_ATTEMPTS + 1):
        try:
            return await _download(s3, uri, target, settings)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, OSError) as exc:
            if attempt == _BODY_ATTEMPTS:
                raise
            log.warning(Event.MODEL_DOWNLOAD_BROKE_OFF, extra={"error": str(exc)})
    raise AssertionError("unreachable")  # pragma: no cover


def _reusable(target: str, expected_sha256: str, model_dir: str) -> bool:
    """True when an earlier container of this pod left a verified copy; prepares the dir."""
    os.makedirs(model_dir, exist_ok=True)
    if not os.path.exists(target):
        return False
    if file_sha256(target) == expected_sha256:
        return True
    os.unlink(target)  # not what its name promises: fetch it anew
    return False


async def _download(s3: Any, uri: S3Uri, target: str, s: config.Settings) -> ModelFile:
    response = await s3.get_object(Bucket=uri.bucket, Key=uri.key)
    size = int(response["ContentLength"])
    if size > s.max_model_bytes:
        response["Body"].close()
        raise ModelLoadError(
            f"{config.env_name('max_model_bytes')}: model {uri} is {size} bytes, "
            f"limit {s.max_model_bytes}"
        )
    digest = hashlib.sha256()
    written = 0
    fd, partial = tempfile.mkstemp(prefix=".fetching-", dir=s.model_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            body = response["Body"]
            async with body:  # the stream itself iterates; `as` would give the raw response
                async for chunk in body.iter_chunks(_CHUNK_BYTES):
                    written += len(chunk)
                    if written > size:
                        raise OSError("S3 sent more bytes than its Content-Length")
                    digest.update(chunk)
                    await asyncio.to_thread(out.write, chunk)
        if written != size:
            raise OSError(f"model body ended after {written} of {size} bytes")
        _check_pin(digest.hexdigest(), s.model_sha256, uri)
        os.chmod(partial, 0o444)
        os.replace(partial, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
    log.info(Event.MODEL_FETCHED, extra={"model": str(uri), "path": target, "bytes": size})
    return ModelFile(target, s.model_sha256, str(uri))


def _check_pin(actual: str, expected: str, uri: S3Uri) -> None:
    if actual != expected:
        raise ModelLoadError(
            f"{config.env_name('model_sha256')}: model {uri} has sha256 {actual}, "
            f"expected {expected}"
        )
