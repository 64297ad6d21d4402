"""Model handlers: the contract a model plugs in by, and the registry of short names.

A setting names a handler either by a short name from `REGISTRY` (`xgboost`) or as
`package.module:Class`. The class is imported and instantiated in each spawned
inference process, never in the worker's own process, so a handler must load its
model in `load()`, not at import time.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from sqsinfer.compute.errors import ModelLoadError

if TYPE_CHECKING:
    import numpy as np

# Short names, in the manner of uvicorn's protocol registries: a name maps to an
# import path, so a handler's dependencies are imported only when it is chosen.
REGISTRY: dict[str, str] = {
    "xgboost": "sqsinfer.compute.handlers.xgboost_impl:XGBoostHandler",
    "onnx": "sqsinfer.compute.handlers.onnx_impl:OnnxHandler",
}
DEFAULT = "xgboost"


@runtime_checkable
class Handler(Protocol):
    """What a model plugs in as. One instance per process, loaded once.

    `load` receives the model file and the thread count; `predict` takes a 2-D float
    array and returns a numeric array with one row per input row. Raise `InputError`
    from `predict` for inputs the model cannot take (e.g. the wrong number of features).

    Optional: `load_bytes(data: bytearray, threads: int)`, the model from the file's
    bytes, in a buffer the handler owns (it may hand it to a library in place, keep it,
    or empty it). When the model's sha256 is pinned, the process reads the file once,
    checks the hash of those bytes and hands them to `load_bytes`, so what is loaded is
    what was checked. A handler without it is given the path after the check, and reads
    the file a second time (a file replaced in between would be loaded unchecked).

    Optional: `version`, a string written in every output's metadata (`handler-version`)
    once the model is loaded. Without it, the version of the installed distribution the
    handler's module comes from (`handler_version`).

    Optional, for a model of several outputs: `choose_output(name: str)`, called before
    `load` when the model output setting names one, and `output_name`, the output served
    once loaded (written in every output's metadata as `model-output`). A handler without
    `choose_output` serves one output, and the setting is refused for it.

    Optional: `rows_independent = True`, the handler's word that each output row depends
    on its input row alone, bit for bit, whatever other rows share the call. The worker
    may then score the rows of several small tasks in one `predict` call and split the
    result back per task (`rows_independent`). Without it, each task is its own call.
    """

    def load(self, model_path: str, threads: int) -> None: ...

    def predict(self, array: np.ndarray) -> np.ndarray: ...


# The setting that names the output (config.Settings.model_output), for messages written
# here, where the settings are not imported (a test holds the two to one name).
MODEL_OUTPUT_SETTING = "SQSINFER_MODEL_OUTPUT"


def choose_output(handler: Handler, name: str, handler_path: str) -> None:
    """Tell a handler which model output to serve (`name`; "" leaves its default)."""
    if not name:
        return
    choose = getattr(handler, "choose_output", None)
    if not callable(choose):
        raise ModelLoadError(
            f"{MODEL_OUTPUT_SETTING}={name!r}, but handler {handler_path!r} serves a model's "
            "one output and cannot choose another: unset it"
        )
    choose(name)


def output_served(handler: Handler) -> str:
    """The model output a loaded handler serves, by name ("" when it has one only)."""
    name = getattr(handler, "output_name", "")
    return name if isinstance(name, str) else ""


def resolve(name: str) -> str:
    """The import path `module:Class` of a handler given by short name or by path."""
    return REGISTRY.get(name, name)


def import_handler(name: str) -> Handler:
    """Import and instantiate a handler (in the process that will run it)."""
    path = resolve(name)
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"handler {name!r} cannot be imported: {exc}") from exc
    handler = factory()
    if not isinstance(handler, Handler):
        raise ModelLoadError(f"handler {name!r} has no load()/predict()")
    return handler


def rows_independent(handler: Handler) -> bool:
    """Whether the handler lets several tasks' rows share one predict call: only when it
    says so (`rows_independent = True`), never by default."""
    return getattr(handler, "rows_independent", False) is True


def handler_version(handler: Handler) -> str:
    """What a loaded handler says its version is (`version`), or the version of the
    distribution its top-level package was installed from, or "unknown"."""
    own = getattr(handler, "version", None)
    if isinstance(own, str) and own:
        return own
    package = type(handler).__module__.split(".", 1)[0]
    for dist in importlib.metadata.packages_distributions().get(package, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"
