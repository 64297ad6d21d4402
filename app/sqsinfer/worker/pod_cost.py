"""This pod's deletion cost, kept current through the Kubernetes API (`pod_deletion_cost`).

When a Deployment scales in (KEDA's HPA lowering its replicas), its ReplicaSet deletes
the pods of lowest `controller.kubernetes.io/pod-deletion-cost` first (among pods equally
ready). A worker that holds messages sets its pod's cost high, an idle one low, so that
a scale-in takes idle pods and leaves the busy ones their tasks. Best effort, as
Kubernetes says of the annotation: a scale-in larger than the idle pods still takes
busy ones, which then drain as before.

Patches are few: one when the worker turns busy (at once: that is the protection) and
one when it has been idle for `pod_deletion_cost_idle_s` (a pod between two receives is
not idle), never the value last set; so at most two a pod per `pod_deletion_cost_idle_s`,
and none from a fleet working through a deep queue. A patch that fails touches no task:
it is counted (sqsinfer_pod_deletion_cost_errors_total), logged once until one succeeds
again, and tried again after a backoff. At shutdown the cost is set low, within a short
bound.

In-cluster configuration, as client libraries read it: the API server from
KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT, the token and CA bundle from
`kube_token_dir` (the token is read again before each patch: the kubelet rotates it),
the pod from POD_NAME and POD_NAMESPACE (the downward API; the namespace file beside the
token is the fallback).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

from sqsinfer import config
from sqsinfer.backoff import Backoff
from sqsinfer.config import ConfigError, ExternalConfigError
from sqsinfer.logs import Event
from sqsinfer.metrics import Metrics

log = logging.getLogger("sqsinfer.worker")

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
BUSY_COST = 1000  # room below for ranks of one's own, none above needed
IDLE_COST = 0  # what a pod without the annotation counts as
DRAIN_TIMEOUT_S = 2.0  # the shutdown's low patch: never holds the exit longer
_TIMEOUT_S = 5.0
_TICK_S = 1.0
_MOST_BACKOFF_S = 300.0


@dataclass(frozen=True)
class KubeTarget:
    """Where this pod's object is, and how to reach the API server."""

    pod_url: str
    token_path: str
    ca_path: str
    namespace: str
    pod_name: str


def target(s: config.Settings, environ: Mapping[str, str] | None = None) -> KubeTarget | None:
    """The pod's API object from the in-cluster configuration, or None when
    `pod_deletion_cost` is off. Reads variables and checks files; contacts nothing.
    Raises a ConfigError naming what is missing."""
    if not s.pod_deletion_cost:
        return None
    environ = os.environ if environ is None else environ
    host, port = (
        _required(environ, "KUBERNETES_SERVICE_HOST"),
        environ.get("KUBERNETES_SERVICE_PORT", "443"),
    )
    token, ca = (os.path.join(s.kube_token_dir, name) for name in ("token", "ca.crt"))
    for path in (token, ca):
        if not os.path.isfile(path):
            missing = os.path.basename(path)
            raise ConfigError("kube_token_dir", f"no {missing} in {s.kube_token_dir}")
    namespace = environ.get("POD_NAMESPACE", "").strip() or _namespace_file(s.kube_token_dir)
    name = _required(environ, "POD_NAME")
    server = f"[{host}]" if ":" in host else host  # an IPv6 address
    url = f"https://{server}:{port}/api/v1/namespaces/{namespace}/pods/{name}"
    return KubeTarget(url, token, ca, namespace, name)


def _required(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "").strip()
    if not value:
        raise ExternalConfigError(
            name, "is not set: pod_deletion_cost needs it (set in a pod by Kubernetes)"
        )
    return value


def _namespace_file(token_dir: str) -> str:
    try:
        with open(os.path.join(token_dir, "namespace")) as fh:
            namespace = fh.read().strip()
    except OSError:
        namespace = ""
    if not namespace:
        raise ExternalConfigError(
            "POD_NAMESPACE", f"is not set, and {token_dir} has no namespace file"
        )
    return namespace


class DeletionCost:
    """Keeps the pod's deletion cost at BUSY_COST while `busy()`, else IDLE_COST."""

    def __init__(
        self,
        kube: KubeTarget,
        metrics: Metrics,
        busy: Callable[[], bool],
        idle_s: float,
    ) -> None:
        self.kube = kube
        self.metrics = metrics
        self.busy = busy
        self.idle_s = idle_s
        # After a failure, the next patch waits (from idle_s up, doubling).
        self.backoff = Backoff(base_s=max(_TICK_S, idle_s), max_s=_MOST_BACKOFF_S)
        self.cost: int | None = None  # the value last set (None: none yet)
        self._idle_since: float | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._draining = False
        self._session: aiohttp.ClientSession | None = None

    async def run(self) -> None:
        """Patch as the worker turns busy or idle, until cancelled."""
        try:
            while True:
                wanted = self._wanted(time.monotonic())
                if wanted is not None:
                    await self.set(wanted)
                await asyncio.sleep(_TICK_S)
        finally:
            await self.close()

    def _wanted(self, now: float) -> int | None:
        """The cost to patch now (None: none), by the rules of the module's doc."""
        busy = self.busy()
        self._idle_since = None if busy else (self._idle_since or now)
        wanted = BUSY_COST if busy else IDLE_COST
        if self._draining or wanted == self.cost or now < self._retry_at:
            return None
        # Idle long enough to be idle, not between two tasks (the first patch goes at once).
        if not busy and self.cost is not None and now - (self._idle_since or now) < self.idle_s:
            return None
        return wanted

    async def set(self, cost: int) -> bool:
        """One patch of the annotation; True when the API server took it."""
        try:
            await self._patch(cost)
        except (aiohttp.ClientError, OSError, TimeoutError, PatchRefused) as exc:
            self._failed(exc)
            return False
        self.cost = cost
        self.metrics.pod_deletion_cost.labels(self.kube.pod_name).set(cost)
        if self._failures:
            log.info(Event.POD_COST_SET_AGAIN, extra={"cost": cost, "failures": self._failures})
        self._failures, self._retry_at = 0, 0.0
        return True

    async def lowest(self) -> None:
        """At shutdown: the cost low at once (the pod takes no more work), within a bound;
        the tasks it still finishes no longer raise it."""
        self._draining = True
        if self.cost == IDLE_COST:
            return
        try:
            await asyncio.wait_for(self.set(IDLE_COST), DRAIN_TIMEOUT_S)
        except TimeoutError as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.metrics.pod_deletion_cost_errors.inc()
        if not self._failures:  # once a streak: a fleet's API outage is not a log flood
            log.warning(
                Event.POD_COST_NOT_SET,
                extra={"pod": self.kube.pod_name, "error": str(exc) or type(exc).__name__},
            )
        self._retry_at = time.monotonic() + self.backoff.delay_s(self._failures)
        self._failures += 1

    async def _patch(self, cost: int) -> None:
        session = self._session or self._open()
        token = await asyncio.to_thread(_read, self.kube.token_path)
        body = json.dumps({"metadata": {"annotations": {ANNOTATION: str(cost)}}})
        headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/merge-patch+json",
            "Accept": "application/json",
        }
        async with session.patch(self.kube.pod_url, data=body, headers=headers) as response:
            if response.status != 200:
                detail = (await response.text())[:300]
                raise PatchRefused(f"HTTP {response.status}: {detail}")

    def _open(self) -> aiohttp.ClientSession:
        tls = ssl.create_default_context(cafile=self.kube.ca_path)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=tls, limit=1),
            timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S),
        )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read().strip()


class PatchRefused(Exception):
    """The API server answered the patch with an error (RBAC, admission, no such pod)."""
