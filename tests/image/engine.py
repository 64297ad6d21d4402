"""The container engine as the image lane drives it: podman, a Deployment the chart rendered
played as a pod, and the kubelet's own part, which podman does not play.

What a local engine cannot do, and what is done instead (nothing else in the manifest
changes):

- Only the Deployment is played: the chart's other objects (ServiceAccount, Service,
  PodDisruptionBudget, KEDA's ScaledObject and TriggerAuthentication) are cluster
  objects no local engine has. In job mode, a Job as KEDA makes it from the ScaledJob is
  played as its pod (`job_pod`): podman 4.3 plays no Job, and the Job controller's part
  (completion, `backoffLimit`) is judged from the pod's exit. No service account token
  is mounted either way (the chart sets `automountServiceAccountToken: false`); the
  credentials a pod identity webhook would inject come from the chart's `extraEnv`.
- `containerPort`s are removed: under `--network host`, which lets the pods reach a
  stand-in on the host's loopback, podman refuses them ("PortMappings can only be used
  with Bridge or slirp4netns networking"); the health port is bound directly instead.
- Each `emptyDir` becomes a `hostPath` on a tmpfs of the emptyDir's `sizeLimit`, mounted
  here for this pod alone. podman 4.3 makes an emptyDir a named volume on disk, without
  its size, shared by every pod that uses the same volume name; a kubelet gives each pod
  its own, of its size (a memory-backed one is a tmpfs).
- The probes are run here, as the kubelet runs them (`Kubelet`): podman turns them into
  health checks that only a systemd timer would run, with curl, which the image has not.
- The grace period is given to `podman pod stop --time`: podman 4.3 does not take
  `terminationGracePeriodSeconds` from the manifest (it stops after its own 10 s).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from sqsinfer import sizing

PODMAN = "podman"
COMMAND_TIMEOUT_S = 300.0


def podman(*args: str, check: bool = True, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    """Run a podman command; its output (stdout and stderr together)."""
    done = subprocess.run(
        [PODMAN, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}:\n{done.stdout}")
    return done.stdout


def inspect(name: str, template: str) -> str:
    return podman("inspect", name, "--format", template).strip()


# -- what a local engine cannot do ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Localized:
    """A Deployment as a local engine can play it, and what was changed to get there."""

    manifest: dict[str, Any]
    changes: tuple[str, ...]
    tmpfs: dict[str, int]  # volume name → bytes: a tmpfs to mount at volumes/<name>


def pod_spec(manifest: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a Deployment or a Pod."""
    spec: dict[str, Any] = manifest["spec"]
    if manifest["kind"] != "Pod":
        spec = spec["template"]["spec"]
    return spec


def job_pod(scaled_job: dict[str, Any], name: str) -> dict[str, Any]:
    """The pod of a Job KEDA would start from `scaled_job`: its jobTargetRef's template,
    `restartPolicy: Never` and all, as a Pod named `name`."""
    template = copy.deepcopy(scaled_job["spec"]["jobTargetRef"]["template"])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **template["metadata"]},
        "spec": template["spec"],
    }


def localize(deployment: dict[str, Any], volumes: Path) -> Localized:
    manifest = copy.deepcopy(deployment)
    pod = pod_spec(manifest)
    changes = []
    for container in pod["containers"]:
        ports = container.pop("ports", None)
        if ports:
            numbers = ", ".join(str(p["containerPort"]) for p in ports)
            changes.append(f"container {container['name']}: containerPorts {numbers} removed")
    sizes = {}
    for volume in pod.get("volumes", []):
        empty = volume.pop("emptyDir", None)
        if empty is None:
            continue
        size = sizing.parse_quantity(empty["sizeLimit"])
        sizes[volume["name"]] = size
        volume["hostPath"] = {"path": str(volumes / volume["name"]), "type": "Directory"}
        medium = empty.get("medium", "disk")
        changes.append(
            f"volume {volume['name']}: emptyDir ({medium}, {empty['sizeLimit']}) → hostPath "
            f"on a tmpfs of {empty['sizeLimit']}"
        )
    return Localized(manifest, tuple(changes), sizes)


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` at `path`, writable by any user, as a kubelet's emptyDir is."""
    path.mkdir(parents=True)
    options = f"size={size_bytes},mode=0777"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)
        with contextlib.suppress(OSError):
            path.rmdir()


# -- a played pod -----------------------------------------------------------------------
@dataclasses.dataclass
class Pod:
    """One Deployment's pod under podman, its one container the worker."""

    name: str
    container: str
    spec: dict[str, Any]  # the worker container as the chart rendered it
    volumes: dict[str, Path]  # volume name → the tmpfs on the host
    grace_s: int  # the pod's terminationGracePeriodSeconds
    changes: tuple[str, ...]

    def health_port(self) -> int:
        return int(self.spec["startupProbe"]["httpGet"]["port"])

    def pid(self) -> int:
        """PID 1 of the container, as the host sees it (0 when it is not running)."""
        return int(inspect(self.container, "{{.State.Pid}}"))

    def started_at_s(self) -> float:
        """When the engine started the container (the latest start), as Unix time."""
        return int(inspect(self.container, "{{.State.StartedAt.UnixNano}}")) / 1e9

    def finished_at_s(self) -> float:
        return int(inspect(self.container, "{{.State.FinishedAt.UnixNano}}")) / 1e9

    def exit_code(self) -> int:
        return int(inspect(self.container, "{{.State.ExitCode}}"))

    def restarts(self) -> int:
        return int(inspect(self.container, "{{.RestartCount}}"))

    def running(self) -> bool:
        return inspect(self.container, "{{.State.Running}}") == "true"

    def log_records(self) -> list[dict[str, Any]]:
        """Every JSON line the container wrote (all its starts)."""
        records = []
        for line in podman("logs", self.container).splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
        return records

    def get(self, path: str) -> tuple[int, str]:
        return get(self.health_port(), path)

    def metric(self, prefix: str) -> float:
        return metric(self.health_port(), prefix)

    def exec(self, *command: str) -> subprocess.CompletedProcess[str]:
        """A command inside the container, as its own user."""
        return subprocess.run(
            [PODMAN, "exec", self.container, *command],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


def get(port: int, path: str, timeout_s: float = 3.0) -> tuple[int, str]:
    """GET a path of a worker's health server: (status, body); (0, error) unreachable."""
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def metric(port: int, prefix: str) -> float:
    """The sum of a worker's /metrics samples whose line starts with `prefix`."""
    _, text = get(port, "/metrics")
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(prefix))


@contextlib.contextmanager
def played(deployment: dict[str, Any], workdir: Path) -> Iterator[Pod]:
    """`podman kube play --network host` of a rendered Deployment, localized; down after."""
    workdir.mkdir(parents=True, exist_ok=True)
    localized = localize(deployment, workdir / "volumes")
    with contextlib.ExitStack() as stack:
        volumes = {
            name: stack.enter_context(tmpfs(workdir / "volumes" / name, size))
            for name, size in localized.tmpfs.items()
        }
        manifest = workdir / "deployment.yaml"
        manifest.write_text(yaml.safe_dump(localized.manifest, sort_keys=False))
        stack.callback(podman, "kube", "down", str(manifest), check=False)
        output = podman("kube", "play", "--network", "host", str(manifest))
        pod_id = output.split("Pod:\n", 1)[1].split()[0]
        played_spec = pod_spec(localized.manifest)
        (container,) = played_spec["containers"]
        names = json.loads(podman("pod", "inspect", pod_id))
        name = names["Name"] if isinstance(names, dict) else names[0]["Name"]
        yield Pod(
            name=name,
            container=f"{name}-{container['name']}",
            spec=pod_spec(deployment)["containers"][0],
            volumes=volumes,
            grace_s=int(played_spec["terminationGracePeriodSeconds"]),
            changes=localized.changes,
        )


def wait_for(condition: Any, what: str, timeout_s: float = 120.0, every_s: float = 0.1) -> None:
    """Wait until `condition()` is true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


# -- processes seen from the host -------------------------------------------------------
def children(pid: int) -> list[int]:
    """The direct children of a process, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def tree(pid: int) -> list[int]:
    """A process and all its descendants."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children(current)
    return found


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def start_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def alive(pid: int, ticks: int) -> bool:
    """Whether this very process (not a later one given its PID) still runs."""
    try:
        return start_ticks(pid) == ticks
    except (OSError, IndexError):
        return False


def uids(pid: int) -> tuple[int, ...]:
    """Real, effective, saved and filesystem UID."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return tuple(int(v) for v in line.split()[1:])
    raise AssertionError(f"no Uid line for {pid}")


# -- the kubelet's prober ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Probe:
    """An httpGet probe as the manifest gives it, with the kubelet's defaults."""

    kind: str  # startupProbe, readinessProbe, livenessProbe
    path: str
    port: int
    period_s: float
    timeout_s: float
    failure_threshold: int
    success_threshold: int
    initial_delay_s: float

    @classmethod
    def of(cls, container: dict[str, Any], kind: str) -> Probe:
        spec = container[kind]
        return cls(
            kind=kind,
            path=spec["httpGet"]["path"],
            port=int(spec["httpGet"]["port"]),
            period_s=float(spec.get("periodSeconds", 10)),
            timeout_s=float(spec.get("timeoutSeconds", 1)),
            failure_threshold=int(spec.get("failureThreshold", 3)),
            success_threshold=int(spec.get("successThreshold", 1)),
            initial_delay_s=float(spec.get("initialDelaySeconds", 0)),
        )

    def check(self) -> bool:
        """One probe: an HTTP GET answered 200-399 within the timeout passes."""
        url = f"http://127.0.0.1:{self.port}{self.path}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                return 200 <= int(response.status) < 400
        except urllib.error.HTTPError as exc:
            return 200 <= int(exc.code) < 400
        except OSError:
            return False


class Kubelet(threading.Thread):
    """The kubelet's three probes of one container, on their own schedules.

    Each probe runs first at its initialDelaySeconds after the container started, then
    every periodSeconds. Liveness and readiness are not acted on until the startup probe
    passed; the startup probe stops once it did, and readiness is probed at once (as the
    kubelet's prober manager triggers it for a started container). The container is ready after
    successThreshold readiness passes in a row, not ready after failureThreshold failures;
    failureThreshold startup or liveness failures in a row are what would make a kubelet
    kill the container: `failed` says which, and the prober stops.
    """

    def __init__(self, container: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        kinds = ("startupProbe", "readinessProbe", "livenessProbe")
        self.probes = {kind: Probe.of(container, kind) for kind in kinds}
        self.started_at = time.monotonic()
        self.started_wall_s = time.time()
        self.started = threading.Event()
        self.ready = threading.Event()
        self.failed = ""
        self.results: list[tuple[float, str, bool]] = []  # (s after start, kind, passed)
        self._runs = dict.fromkeys(kinds, 0)  # consecutive passes (> 0) or failures (< 0)
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)

    def seconds_to(self, event: str) -> float | None:
        """Seconds after the start at which the first probe of a kind passed."""
        passed = [t for t, kind, ok in self.results if kind == event and ok]
        return passed[0] if passed else None

    def run(self) -> None:
        due = {kind: probe.initial_delay_s for kind, probe in self.probes.items()}
        while not self._halt.is_set() and not self.failed:
            kind = min(due, key=lambda k: due[k])
            wait_s = self.started_at + due[kind] - time.monotonic()
            if wait_s > 0 and self._halt.wait(wait_s):
                return
            due[kind] += self.probes[kind].period_s
            if kind == "startupProbe" and self.started.is_set():
                continue
            if kind != "startupProbe" and not self.started.is_set():
                continue
            self._record(kind, self.probes[kind].check())
            if kind == "startupProbe" and self.started.is_set():
                # The kubelet probes readiness at once when the container has started.
                due["readinessProbe"] = time.monotonic() - self.started_at

    def _record(self, kind: str, passed: bool) -> None:
        probe = self.probes[kind]
        self.results.append((time.monotonic() - self.started_at, kind, passed))
        runs = self._runs[kind]
        self._runs[kind] = max(runs, 0) + 1 if passed else min(runs, 0) - 1
        if kind == "startupProbe" and passed:
            self.started.set()
        elif kind == "readinessProbe":
            if self._runs[kind] >= probe.success_threshold:
                self.ready.set()
            elif -self._runs[kind] >= probe.failure_threshold:
                self.ready.clear()
        fatal = kind in ("startupProbe", "livenessProbe")
        if fatal and not passed and -self._runs[kind] >= probe.failure_threshold:
            self.failed = f"{kind} failed {probe.failure_threshold} times in a row"


# -- a release of the chart, played -----------------------------------------------------
@dataclasses.dataclass
class Release:
    pod: Pod
    kubelet: Kubelet
    deployment: dict[str, Any]  # as the chart rendered it
    manifest: Path  # as it was played

    def new_kubelet(self) -> Kubelet:
        """A kubelet's probes start afresh for a new container of the pod."""
        self.kubelet.stop()
        self.kubelet = Kubelet(self.pod.spec)
        self.kubelet.start()
        return self.kubelet


@contextlib.contextmanager
def released(deployment: dict[str, Any], workdir: Path) -> Iterator[Release]:
    """A rendered Deployment played, with the kubelet's probes running against it."""
    with played(deployment, workdir) as pod:
        kubelet = Kubelet(pod.spec)
        kubelet.start()
        release = Release(pod, kubelet, deployment, workdir / "deployment.yaml")
        try:
            yield release
        finally:
            release.kubelet.stop()


def wait_ready(release: Release) -> None:
    """Until the kubelet's readiness probe passed; fail if a probe would have killed it."""
    kubelet = release.kubelet
    startup = kubelet.probes["startupProbe"]
    budget_s = startup.period_s * startup.failure_threshold
    budget_s += 2 * kubelet.probes["readinessProbe"].period_s
    kubelet.ready.wait(timeout=budget_s)
    if kubelet.failed or not kubelet.ready.is_set():
        logs = podman("logs", "--tail", "20", release.pod.container, check=False)
        raise AssertionError(f"{release.pod.name} not ready: {kubelet.failed}\n{logs}")
