"""The chart's alerts, evaluated by Prometheus's own rule engine (`promtool test rules`).

The rule group is rendered from the chart (Helm's engine, as `helm template` would), written
out as a rules file, and each alert is run over synthetic series: a failing one it must
fire on within its `for`, a healthy one it must stay silent on, and for an alert with a
threshold, one just under it. The series carry exactly the names and labels a worker
exports (checked against a live `Metrics` registry) plus what a ServiceMonitor scrape adds
(job, namespace, pod, ...); KEDA's gauge carries its operator's labels.

promtool comes from Debian's prometheus package (`make .venv/bin/promtool` unpacks it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import markdown
import pytest
import yaml

from tests.deploy import promql
from tests.deploy.test_helm_chart import NAMESPACE, render

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "sqsinfer"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
RELEASE = "stage1"
JOB = "stage1-sqsinfer"  # the Service's name: the job a ServiceMonitor gives the series
SCRAPE = "30s"  # serviceMonitor.interval's default
# What a ServiceMonitor scrape of one pod adds to each of its series.
POD = {
    "job": JOB,
    "namespace": NAMESPACE,
    "service": JOB,
    "endpoint": "metrics",
    "container": "worker",
    "pod": "stage1-sqsinfer-5d8f7c9b4-x2x7k",
    "instance": "10.1.2.3:8080",
}
POD_B = POD | {"pod": "stage1-sqsinfer-5d8f7c9b4-q9w4z", "instance": "10.1.2.4:8080"}
# KEDA's operator, scraped by its own ServiceMonitor: the ScaledObject's namespace is moved
# to exported_namespace, since the target's own namespace label wins.
KEDA = {
    "job": "keda-operator",
    "namespace": "keda",
    "exported_namespace": NAMESPACE,
    "scaledObject": JOB,
    "scaler": "awsSqsQueueScaler",
    "metric": "s0-aws-sqs-stage1",
    "type": "scaledobject",
    "triggerIndex": "0",
}
OUTCOMES = ("committed", "duplicate", "rejected", "retried", "released")
DEPTH = "sqsinfer_queue_messages"
RUNBOOK = "https://sqsinfer.github.io/sqsinfer/troubleshooting/"


def promtool() -> str:
    """The promtool binary: $PROMTOOL, beside this interpreter, in the repo's venv, on PATH."""
    explicit = os.environ.get("PROMTOOL")
    if explicit:
        return explicit
    path = os.pathsep.join(
        [str(Path(sys.executable).parent), str(ROOT / ".venv" / "bin"), os.environ["PATH"]]
    )
    found = shutil.which("promtool", path=path)
    if found is None:
        pytest.fail("promtool not found: `make .venv/bin/promtool` unpacks it from Debian's")
    return found


# -- the rendered rules -------------------------------------------------------------------
@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart's rule group with its defaults, as a promtool rules file."""
    helm.disable_logging()
    with helm.Chart.load(CHART) as chart:
        rendered = render(chart, {"prometheusRule": {"enabled": True}}, name=RELEASE)
    groups = rendered.one("PrometheusRule")["spec"]["groups"]
    path = tmp_path_factory.mktemp("rules") / "sqsinfer.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def rules(path: Path) -> dict[str, dict[str, Any]]:
    (group,) = yaml.safe_load(path.read_text())["groups"]
    return {rule.get("alert") or rule["record"]: rule for rule in group["rules"]}


def test_promtool_accepts_the_rules(rules_file: Path) -> None:
    proc = subprocess.run(
        [promtool(), "check", "rules", str(rules_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- synthetic series -------------------------------------------------------------------
def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{inner}}}", "values": values}


def outcomes(pod: dict[str, str], **values: str) -> list[dict[str, str]]:
    """sqsinfer_tasks_total of one pod: every outcome, as the worker exports each from 0."""
    return [
        series("sqsinfer_tasks_total", pod | {"outcome": o}, values.get(o, "0x120"))
        for o in OUTCOMES
    ]


@dataclass
class Case:
    """One promtool test: input series, and when the alert must (not) be firing."""

    name: str
    input_series: list[dict[str, str]]
    firing_at: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    silent_at: list[str] = field(default_factory=list)
    interval: str = SCRAPE

    def promtool_test(self, alert: str) -> dict[str, Any]:
        checks = [{"eval_time": t, "alertname": alert, "exp_alerts": []} for t in self.silent_at]
        checks += [
            {"eval_time": t, "alertname": alert, "exp_alerts": expected}
            for t, expected in self.firing_at.items()
        ]
        return {
            "name": self.name,
            "interval": self.interval,
            "input_series": self.input_series,
            "alert_rule_test": checks,
        }


def every(start_m: int, stop_m: int, step_m: int = 1) -> list[str]:
    return [f"{m}m" for m in range(start_m, stop_m + 1, step_m)]


def fired(labels: dict[str, str], description: str, summary: str, anchor: str) -> dict[str, Any]:
    return {
        "exp_labels": labels | {"severity": "warning"},
        "exp_annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": RUNBOOK + "#" + anchor,
        },
    }


def stage_labels() -> dict[str, str]:
    return {"namespace": NAMESPACE, "job": JOB}


# -- the cases, alert by alert -------------------------------------------------------------
def rejected_ratio() -> list[Case]:
    summary = f"More than 1% of the messages of {JOB} go to the dead-letter queue."

    def fires(percent: str) -> dict[str, Any]:
        description = (
            f"{percent} of the messages that ended were rejected over 15 minutes. Look at "
            "sqsinfer_rejections_total by reason, and at the DLQ with sqsinfer redrive --dry-run."
        )
        return fired(stage_labels(), description, summary, "sqsinferrejectedratio")

    # The condition holds from the first evaluation with two samples (1m): pending for the
    # 15m of `for`, firing from 16m.
    return [
        Case(
            "2% of the messages rejected",
            outcomes(POD, committed="0+98x120", rejected="0+2x120"),
            firing_at={"16m": [fires("2%")], "40m": [fires("2%")]},
            silent_at=["14m"],
        ),
        Case(
            # Retried deliveries come back and end later: they do not dilute the share
            # (2 of 99 that ended, though 2 of 399 outcomes).
            "2% rejected among many retries",
            outcomes(POD, committed="0+97x120", rejected="0+2x120", retried="0+300x120"),
            firing_at={"16m": [fires("2.02%")]},
        ),
        Case(
            "0.9% rejected, just under 1%",
            outcomes(POD, committed="0+991x120", rejected="0+9x120", retried="0+50x120"),
            silent_at=every(1, 60, 3),
        ),
        Case("nothing rejected", outcomes(POD, committed="0+100x120"), silent_at=every(1, 60, 3)),
    ]


def crash_looping() -> list[Case]:
    summary = f"Inference processes of {JOB} keep dying."
    rebuilds = "sqsinfer_pool_rebuilds_total"

    def fires(count: int) -> dict[str, Any]:
        description = (
            f"Pod {POD['pod']} restarted {count} inference processes in 15 minutes: out of "
            "memory (a model per process plus /dev/shm), or a crashing model. Its tasks are "
            "retried."
        )
        return fired(POD, description, summary, "sqsinferprocessescrashlooping")

    # Samples every 30 s: restarts at 5m30s, 6m, 6m30s, 7m (and an 8m one in the reset case).
    return [
        Case(
            "4 restarts in 2 minutes",
            [series(rebuilds, POD, "0x10 1 2 3 4 4x100")],
            firing_at={"7m": [fires(4)], "19m": [fires(4)]},
            silent_at=["6m", "23m"],  # until the fourth; once it left the 15-minute window
        ),
        Case(
            # A restarted container starts its counter again; increase() follows the reset.
            "4 restarts across a container restart",
            [series(rebuilds, POD, "0x10 1 2 0 1 2 2x100")],
            firing_at={"8m": [fires(4)]},
        ),
        Case(
            "3 restarts, just under more than 3",
            [series(rebuilds, POD, "0x10 1 2 3 3x100")],
            silent_at=every(1, 40),
        ),
        Case(
            # Scrapes that do not line up with the evaluations: increase() extrapolates
            # to the ends of its window and reads these 3 as 3.1.
            "3 restarts after 10 earlier ones, scraped every 45 s",
            [series(rebuilds, POD, "10x40 11 12 13 13x60")],
            silent_at=every(1, 75),
            interval="45s",
        ),
        Case("no restarts", [series(rebuilds, POD, "0x120")], silent_at=every(1, 60, 3)),
    ]


def aws_errors() -> list[Case]:
    summary = f"AWS calls of {JOB} fail."
    errors = "sqsinfer_aws_errors_total"

    def fires(operation: str, per_s: str) -> dict[str, Any]:
        description = (
            f"{operation} fails {per_s} times a second: throttling, missing permissions, or "
            "an outage of SQS or S3."
        )
        labels = stage_labels() | {"operation": operation}
        return fired(labels, description, summary, "sqsinferawserrors")

    ok = [
        series(errors, POD | {"operation": "ReceiveMessage"}, "0x160"),
        # every chained task's marker HEAD is a 404 (the link is not there yet): no failure
        series(errors, POD | {"operation": "HeadObject"}, "0+60x160"),
    ]
    # Healthy for 20 minutes, then failing from 20m30s: the 5-minute rate crosses the
    # threshold within 5 minutes, then 10 minutes of `for`.
    return [
        Case(
            "GetObject failing 0.2 times a second",
            [*ok, series(errors, POD | {"operation": "GetObject"}, "0x40 0+6x120")],
            firing_at={"37m": [fires("GetObject", "0.20")], "70m": [fires("GetObject", "0.20")]},
            silent_at=["30m"],
        ),
        Case(
            "two pods at 0.06 a second each: the stage's 0.12",
            [
                *ok,
                series(errors, POD | {"operation": "PutObject"}, "0x40 0+1.8x120"),
                series(errors, POD_B | {"operation": "PutObject"}, "0x40 0+1.8x120"),
            ],
            firing_at={"37m": [fires("PutObject", "0.12")]},
            silent_at=["30m"],
        ),
        Case(
            "0.09 a second, just under 0.1",
            [*ok, series(errors, POD | {"operation": "SendMessageBatch"}, "0x40 0+2.7x120")],
            silent_at=every(1, 80, 3),
        ),
        Case("only the HEAD 404s of a healthy chained stage", ok, silent_at=every(1, 80, 3)),
    ]


def stalled() -> list[Case]:
    summary = f"A pod of {JOB} holds messages but finishes none."
    description = (
        f"Pod {POD['pod']} held messages for 15m without finishing any: a task stuck below "
        "max_task_time_s, or processes that never come back."
    )
    fires = fired(POD, description, summary, "sqsinferstalled")
    in_flight = "sqsinfer_in_flight"
    return [
        Case(
            # The case: 3 messages held for 40 minutes, nothing finished.
            "3 messages held from the start, nothing finished",
            [series(in_flight, POD, "3x80"), *outcomes(POD)],
            firing_at={"16m": [fires], "39m": [fires]},
            silent_at=["14m"],  # a pod younger than stallFor is not judged yet
        ),
        Case(
            "working, then stuck at 10m",
            [series(in_flight, POD, "3x120"), *outcomes(POD, committed="0+1x20 20x100")],
            firing_at={"26m": [fires]},
            silent_at=["24m"],
        ),
        Case(
            # A new pod whose first task is long holds a message and has finished nothing.
            "a young pod on a 10-minute first task",
            [series(in_flight, POD, "1x120"), *outcomes(POD, committed="0x20 1+1x100")],
            silent_at=every(1, 50),
        ),
        Case(
            "nothing finished for 14 minutes, just under 15",
            [series(in_flight, POD, "3x120"), *outcomes(POD, committed="0+1x20 20x27 21+1x80")],
            silent_at=every(1, 55),
        ),
        Case(
            "idle: nothing held, nothing finished",
            [series(in_flight, POD, "0x120"), *outcomes(POD)],
            silent_at=every(1, 60, 3),
        ),
        Case(
            "busy and finishing",
            [series(in_flight, POD, "3x120"), *outcomes(POD, committed="0+2x120")],
            silent_at=every(1, 60, 3),
        ),
    ]


def backlog() -> list[Case]:
    summary = f"Messages wait for {JOB} but none is finished."

    def fires(depth: int) -> dict[str, Any]:
        description = (
            f"KEDA saw at least {depth} messages on the queue throughout 30m and the stage "
            "finished none: scaled to zero and not waking (KEDA's access to the queue?), pods "
            "not starting, or every task failing. sqsinfer status shows the queue."
        )
        return fired(stage_labels(), description, summary, "sqsinferbacklognotdraining")

    depth = "keda_scaler_metrics_value"
    # 0 for the first hour, then 120 messages waiting from 60m on.
    waiting = "0x120 120x200"
    honor_labels = {k: v for k, v in KEDA.items() if k != "exported_namespace"} | {
        "namespace": NAMESPACE
    }
    other_namespace = KEDA | {"exported_namespace": "other"}
    return [
        Case(
            # Scaled to zero: no worker series at all. Waited 30m at 90m, then 5m of `for`.
            "a backlog from 60m, the stage at zero replicas",
            [series(depth, KEDA, waiting)],
            firing_at={"96m": [fires(120)]},
            silent_at=["65m", "89m", "93m"],
        ),
        Case(
            "a backlog from 60m, a pod that finishes nothing",
            [series(depth, KEDA, waiting), *outcomes(POD, retried="0+5x320")],
            firing_at={"96m": [fires(120)]},
            silent_at=["93m"],
        ),
        Case(
            "KEDA scraped with honorLabels: the namespace is its own",
            [series(depth, honor_labels, waiting)],
            firing_at={"96m": [fires(120)]},
        ),
        Case(
            "a backlog draining",
            [series(depth, KEDA, waiting), *outcomes(POD, committed="0x120 0+3x200")],
            silent_at=every(60, 150, 3),
        ),
        Case(
            "a backlog for 29 minutes, just under 30",
            [series(depth, KEDA, "0x120 120x58 0x100")],
            silent_at=every(60, 130),
        ),
        Case(
            "a backlog of a same-named stage in another namespace",
            [series(depth, other_namespace, waiting)],
            silent_at=every(60, 150, 3),
        ),
    ]


def dead_letters() -> list[Case]:
    summary = f"Messages of {JOB} pile up in its dead-letter queue."

    def fires(depth: int) -> dict[str, Any]:
        description = (
            f"The dead-letter queue holds {depth} messages, more than 15m ago: rejected "
            "messages (sqsinfer_rejections_total by reason) or messages whose retries ran out. "
            "sqsinfer redrive --dry-run shows their reasons."
        )
        return fired(stage_labels(), description, summary, "sqsinferdeadletters")

    def dlq(pod: dict[str, str], values: str) -> dict[str, str]:
        return series(DEPTH, pod | {"queue": "dead_letter", "state": "visible"}, values)

    # Sampled every 30 s; from 20m on, one more dead letter a sample.
    return [
        Case(
            "dead letters arriving from 20m",
            [dlq(POD, "0x40 1+1x100"), dlq(POD_B, "0x40 1+1x100")],
            firing_at={"21m": [fires(2)], "40m": [fires(40)]},
            silent_at=["20m"],
        ),
        Case(
            # 10 arrived by 25m, then none: the alert ends once the window holds no growth.
            "dead letters that stopped arriving",
            [dlq(POD, "0x40 1+1x19 20x200")],
            firing_at={"30m": [fires(20)], "44m": [fires(20)]},
            silent_at=["46m", "90m"],
        ),
        Case(
            # A new pod takes over the sampling: the depth is the stage's, whichever pod read it.
            "a steady DLQ of 3 across a pod replaced",
            [dlq(POD, "3x40"), dlq(POD_B, "_x40 3x80")],
            silent_at=every(1, 60, 3),
        ),
        Case("an empty DLQ", [dlq(POD, "0x120")], silent_at=every(1, 60, 3)),
    ]


def messages_too_old() -> list[Case]:
    summary = f"Messages of {JOB} wait longer than 24h."
    age = "sqsinfer_received_message_age_seconds"

    def fires(waited: str) -> dict[str, Any]:
        description = (
            f"Workers of {JOB} take messages {waited} after they were sent: the stage is behind "
            "the 24h you set (too few pods, slow tasks, or messages retried for that long)."
        )
        return fired(stage_labels(), description, summary, "sqsinfermessagestooold")

    # 25 hours old from 10m on: over the limit from 11m, pending for 10m.
    return [
        Case(
            "messages received 25 hours after their send",
            [series(age, POD, "0x20 90000x100")],
            firing_at={"21m": [fires("1d 1h 0m 0s")], "50m": [fires("1d 1h 0m 0s")]},
            silent_at=["19m"],
        ),
        Case(
            "one of two pods far behind",
            [series(age, POD, "60x120"), series(age, POD_B, "0x20 90000x100")],
            firing_at={"21m": [fires("1d 1h 0m 0s")]},
        ),
        Case(
            # A message retried for a day comes back once: one old receive is not a backlog.
            "one old message once",
            [series(age, POD, "0x20 90000 0x100")],
            silent_at=every(1, 60),
        ),
        Case(
            "23 hours, just under 24",
            [series(age, POD, "0x20 82800x100")],
            silent_at=every(1, 60, 3),
        ),
    ]


CASES = {
    "SqsinferRejectedRatio": rejected_ratio,
    "SqsinferProcessesCrashLooping": crash_looping,
    "SqsinferAwsErrors": aws_errors,
    "SqsinferStalled": stalled,
    "SqsinferBacklogNotDraining": backlog,
    "SqsinferDeadLetters": dead_letters,
    "SqsinferMessagesTooOld": messages_too_old,
}


def test_every_rule_has_cases(rules_file: Path) -> None:
    assert set(rules(rules_file)) == set(CASES)


@pytest.mark.parametrize("alert", sorted(CASES))
def test_the_series_are_what_a_scrape_gives(alert: str) -> None:
    """Each input series exists with these labels: the worker's, a scrape's, KEDA's."""
    known = promql.known_series()
    for case in CASES[alert]():
        for entry in case.input_series:
            name, _, labels = entry["series"].partition("{")
            names = set(re.findall(r'(\w+)="', labels))
            assert name in known, name
            assert names <= known[name] | promql.TARGET_LABELS, (name, names - known[name])
            if name.startswith("sqsinfer_"):
                assert names == known[name] | set(POD), (name, names)


@pytest.mark.parametrize("alert", sorted(CASES))
def test_alert_fires_on_failure_and_stays_silent_otherwise(
    rules_file: Path, alert: str, tmp_path: Path
) -> None:
    cases = CASES[alert]()
    assert any(c.firing_at for c in cases) and any(not c.firing_at for c in cases)
    run_promtool(rules_file, alert, cases, tmp_path)


def run_promtool(rules_file: Path, alert: str, cases: list[Case], tmp_path: Path) -> None:
    tests = {
        "rule_files": [str(rules_file)],
        "evaluation_interval": "1m",
        "tests": [case.promtool_test(alert) for case in cases],
    }
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False, width=1000))
    proc = subprocess.run(
        [promtool(), "test", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- runbooks ---------------------------------------------------------------------------
def page_anchors(path: Path) -> set[str]:
    """The ids mkdocs gives the page's headings (Python-Markdown's toc extension)."""
    md = markdown.Markdown(extensions=["toc", "tables"])
    md.convert(path.read_text())

    def walk(tokens: list[dict[str, Any]]) -> Iterator[str]:
        for token in tokens:
            yield token["id"]
            yield from walk(token["children"])

    return set(walk(md.toc_tokens))  # type: ignore[attr-defined]


def test_every_alert_links_to_its_section_of_the_troubleshooting_page(rules_file: Path) -> None:
    anchors = page_anchors(TROUBLESHOOTING)
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["site_url"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["prometheusRule"]["runbookBaseUrl"] == site + "troubleshooting/"
    for name, rule in rules(rules_file).items():
        base, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert base == site + "troubleshooting/", name
        assert anchor == name.lower() and anchor in anchors, name


def test_the_runbook_base_is_a_value(tmp_path: Path) -> None:
    own = "https://wiki.example.com/ml/sqsinfer-runbook"
    with helm.Chart.load(CHART) as chart:
        values = {"prometheusRule": {"enabled": True, "runbookBaseUrl": own}}
        (group,) = render(chart, values).one("PrometheusRule")["spec"]["groups"]
        for bad in ("wiki.example.com/page", "https://wiki.example.com/page#x"):
            values = {"prometheusRule": {"runbookBaseUrl": bad}}
            with pytest.raises(helm.HelmValuesError, match="runbookBaseUrl"):
                chart.validate_schema(values)
    for rule in group["rules"]:
        assert rule["annotations"]["runbook_url"] == f"{own}#{rule['alert'].lower()}"


# -- the stall window follows the task time ----------------------------------------------
@pytest.mark.parametrize(
    ("values", "window"),
    [
        ({}, "15m"),  # the worker's 60 s tasks: at least 15m
        ({"worker": {"task_time_s": 450}}, "15m"),
        ({"worker": {"task_time_s": 451}}, "16m"),  # twice, rounded up to whole minutes
        ({"worker": {"task_time_s": 1200, "max_task_time_s": 1800}}, "40m"),
        ({"worker": {"task_time_s": 1200}, "prometheusRule": {"stallFor": "25m"}}, "25m"),
    ],
)
def test_the_stall_window_is_twice_the_task_time(values: dict[str, Any], window: str) -> None:
    stall = rendered_rules(values)["SqsinferStalled"]
    assert stall["expr"].count(f"[{window}]") == 2 and f"offset {window}" in stall["expr"]
    assert f"for {window} without" in stall["annotations"]["description"]


def rendered_rules(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    values = {**values, "prometheusRule": {"enabled": True, **values.get("prometheusRule", {})}}
    with helm.Chart.load(CHART) as chart:
        (group,) = render(chart, values, name=RELEASE).one("PrometheusRule")["spec"]["groups"]
    return {rule["alert"]: rule for rule in group["rules"]}


def test_a_stage_of_20_minute_tasks_is_not_stalled(tmp_path: Path) -> None:
    """The fixed 15 minutes fired on every pod of 20-minute tasks; its own 40 do not, and
    a pod stuck past them still fires."""
    rules = rendered_rules({"worker": {"task_time_s": 1200, "max_task_time_s": 1800}})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": list(rules.values())}]}))
    description = (
        f"Pod {POD['pod']} held messages for 40m without finishing any: a task stuck below "
        "max_task_time_s, or processes that never come back."
    )
    fires = fired(POD, description, f"A pod of {JOB} holds messages but finishes none.", "")
    fires["exp_annotations"]["runbook_url"] += "sqsinferstalled"
    in_flight = "sqsinfer_in_flight"
    cases = [
        Case(
            # 2 processes, 4 held; each finishes one every 20 minutes, the first at 20m.
            "20-minute tasks",
            [series(in_flight, POD, "4x240"), *outcomes(POD, committed="0x40 1x40 2x40 3x40 4x80")],
            silent_at=every(1, 120),
        ),
        Case(
            "stuck from the start",
            [series(in_flight, POD, "4x240"), *outcomes(POD)],
            firing_at={"41m": [fires]},
            silent_at=["39m"],
        ),
    ]
    run_promtool(path, "SqsinferStalled", cases, tmp_path)
