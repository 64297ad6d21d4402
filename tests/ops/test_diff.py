"""`sqsinfer diff`: every figure it reports, checked against numpy on the same arrays.

A and B outputs are written by the worker's own encoders (npy, json, parquet) to a moto
server, with known changes: identical tasks, changes spread over decades, NaN on both
sides and on one side, tasks missing on either side or both, a shape mismatch, an
unreadable object and bad manifest lines. The command runs in-process over HTTP.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sqsinfer import cli
from sqsinfer.compute import formats
from sqsinfer.ops.changes import ALPHA, LogSketch
from tests.conftest import Stage, make_stage

EPS = np.finfo(np.float32).eps  # what docs/operating.md says max relative divides by at least
FORMATS = ("npy", "json", "parquet")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPORT_FIELDS = {
    "a",
    "b",
    "source",
    "ok",
    "tasks",
    "compared",
    "identical",
    "nan_mismatch_tasks",
    "threshold",
    "beyond_threshold",
    "beyond_threshold_share",
    "only_a",
    "only_b",
    "missing_both",
    "shape_mismatch",
    "unreadable",
    "bad_line",
    "max_abs",
    "max_rel",
    "eps",
    "quantile_relative_error",
    "top",
    "examples",
    "elapsed_s",
    "tasks_per_s",
}


@dataclass
class Batch:
    """What was written, and the manifest naming it."""

    stage: Stage
    manifest: Path
    pairs: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # compared
    order: list[str] = field(default_factory=list)  # every task id, in manifest order
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    neither: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)

    @property
    def a(self) -> str:
        return f"s3://{self.stage.bucket}/scores/model-a/"

    @property
    def b(self) -> str:
        return f"s3://{self.stage.bucket}/scores/model-b/"

    def put(self, prefix: str, task_id: str, fmt: str, array: np.ndarray) -> None:
        self.put_bytes(prefix, f"{task_id}.{fmt}", formats.encode(array, fmt))

    def put_bytes(self, prefix: str, name: str, body: bytes) -> None:
        key = prefix.removeprefix(f"s3://{self.stage.bucket}/") + name
        self.stage.s3.put_object(Bucket=self.stage.bucket, Key=key, Body=body)


def _line(batch: Batch, task_id: str, fmt: str) -> str:
    doc: dict[str, Any] = {"task_id": task_id, "input": f"s3://features/in/{task_id}.npy"}
    if fmt != "npy":  # npy outputs are derived from the task id, the others named
        doc["output"] = f"{batch.a}{task_id}.{fmt}"
    return json.dumps(doc)


def _arrays(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Task n's A and B: B changed by a known amount, spread over decades."""
    rows = 5 + n % 7
    a = rng.normal(0, 1, (rows, 2)).astype(np.float32)
    a[0, 0] = 0.0  # a reference of zero: the relative change divides by EPS there
    b = a.copy()
    if n % 6 == 0:
        return a, b  # identical
    cell = (0, 0) if n % 4 == 1 else (n % rows, n % 2)  # some at the zero reference
    b[cell] += np.float32(10.0 ** (-(n % 9)) * (1 + n / 100))
    if n % 5 == 0:
        a[1, 1] = b[1, 1] = np.nan  # missing on both sides: equal
    if n % 11 == 0:
        b[2, 0] = np.nan  # missing on one side only
    return a, b


def _batch(stage: Stage, tmp_path: Path, tasks: int = 36) -> Batch:
    batch = Batch(stage, tmp_path / "tasks.jsonl")
    rng = np.random.default_rng(7)
    lines = []
    for n in range(tasks):
        task_id, fmt = f"user-{n:03d}", FORMATS[n % 3]
        a, b = _arrays(rng, n)
        lines.append(_line(batch, task_id, fmt))
        batch.order.append(task_id)
        if n in (3, 17):
            batch.put(batch.a, task_id, fmt, a)
            batch.only_a.append(task_id)
        elif n in (8, 22):
            batch.put(batch.b, task_id, fmt, b)
            batch.only_b.append(task_id)
        elif n == 13:
            batch.neither.append(task_id)
        elif n == 25:  # the new model writes three outputs where the old wrote two
            wide = np.hstack([b, b[:, :1]])
            batch.put(batch.a, task_id, fmt, a)
            batch.put(batch.b, task_id, fmt, wide)
            batch.shapes[task_id] = (a.shape, wide.shape)
        elif n == 27:  # not an .npy at all
            batch.put(batch.a, task_id, fmt, a)
            batch.put_bytes(batch.b, f"{task_id}.{fmt}", b"\x93NUMPY garbage")
            batch.unreadable.append(task_id)
        else:
            batch.put(batch.a, task_id, fmt, a)
            batch.put(batch.b, task_id, fmt, b)
            batch.pairs[task_id] = (a, b)
    batch.put_bytes(batch.a, "user-000.npy.chain", b"{}")  # a chain marker: not an output
    lines.insert(10, "{not json")  # a bad line: reported, not a task
    lines.insert(
        20,
        json.dumps({"task_id": "x", "input": "s3://features/x.npy", "output": "s3://other/x.npy"}),
    )
    batch.manifest.write_text("\n".join(lines) + "\n")
    return batch


@pytest.fixture(scope="module")
def batch(moto, tmp_path_factory) -> Batch:
    """One batch for the module's tests: none of them writes under its prefixes."""
    return _batch(make_stage(moto.url), tmp_path_factory.mktemp("diff"))


def _expected(a: np.ndarray, b: np.ndarray) -> tuple[float, float, int]:
    """max |a-b|, max relative, NaN-on-one-side cells: straight from the arrays."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    both = ~np.isnan(a64) & ~np.isnan(b64)
    delta = np.abs(a64 - b64)[both]
    rel = delta / np.maximum(np.abs(a64[both]), EPS)
    one_sided = int((np.isnan(a64) != np.isnan(b64)).sum())
    return float(delta.max(initial=0.0)), float(rel.max(initial=0.0)), one_sided


def _run(capsys, *argv: str) -> tuple[int, dict[str, Any], str]:
    code = cli.main(["diff", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if "--json" in argv else {}, err


def _check_quantiles(found: dict[str, Any], values: list[float]) -> None:
    for q in (50, 90, 99):
        exact = float(np.quantile(values, q / 100, method="inverted_cdf"))
        assert found[f"p{q}"] == pytest.approx(exact, rel=ALPHA * 1.0001, abs=0), q
    assert found["max"] == max(values)


def _check_figures(doc: dict[str, Any], batch: Batch, threshold: float, top: int) -> None:
    """Every figure the report gives, against numpy on the arrays that were written."""
    order = {task_id: i for i, task_id in enumerate(batch.order)}
    expected = {task_id: _expected(a, b) for task_id, (a, b) in batch.pairs.items()}
    assert doc["compared"] == len(expected)
    assert max(e[1] for e in expected.values()) > 1e3  # a change at a zero reference: ÷ EPS
    assert doc["identical"] == sum(1 for e in expected.values() if e[0] == 0 and e[2] == 0)
    assert doc["nan_mismatch_tasks"] == sum(1 for e in expected.values() if e[2]) > 0
    beyond = [t for t, e in expected.items() if e[0] > threshold or e[2]]
    assert 0 < len(beyond) < len(expected)
    assert doc["beyond_threshold"] == len(beyond)
    assert doc["beyond_threshold_share"] == pytest.approx(len(beyond) / len(expected))
    _check_quantiles(doc["max_abs"], [e[0] for e in expected.values()])
    _check_quantiles(doc["max_rel"], [e[1] for e in expected.values()])
    ranked = sorted(expected, key=lambda t: (-expected[t][0], order[t]))[:top]
    assert [t["task_id"] for t in doc["top"]] == ranked
    for t in doc["top"]:
        max_abs, max_rel, one_sided = expected[t["task_id"]]
        assert (t["max_abs"], t["max_rel"], t["nan_mismatches"]) == (max_abs, max_rel, one_sided)
        assert tuple(t["shape"]) == batch.pairs[t["task_id"]][0].shape
    assert doc["eps"] == EPS


def test_every_figure_matches_numpy_over_a_manifest(batch, capsys):
    argv = [batch.a, batch.b, "--manifest", str(batch.manifest), "--threshold", "1e-3"]
    argv += ["--top", "5", "--json", "--endpoint-url", batch.stage.endpoint, "--concurrency", "4"]
    code, doc, err = _run(capsys, *argv)
    assert code == 1  # tasks are missing, one shape differs, some are beyond the threshold
    assert set(doc) == REPORT_FIELDS
    assert (doc["a"], doc["b"], doc["source"], doc["ok"]) == (batch.a, batch.b, "manifest", False)
    _check_figures(doc, batch, threshold=1e-3, top=5)
    assert doc["tasks"] == len(batch.order)
    examples = doc["examples"]
    for key, ids in (("only_a", batch.only_a), ("only_b", batch.only_b)):
        assert doc[key] == len(ids)
        assert [e["task_id"] for e in examples[key]] == ids
    assert [e["task_id"] for e in examples["missing_both"]] == batch.neither
    ((task_id, (shape_a, shape_b)),) = batch.shapes.items()
    assert examples["shape_mismatch"] == [
        {
            "task_id": task_id,
            "a": f"{batch.a}{task_id}.json",
            "b": f"{batch.b}{task_id}.json",
            "shape_a": list(shape_a),
            "shape_b": list(shape_b),
        }
    ]
    (unreadable,) = examples["unreadable"]
    assert (unreadable["task_id"], unreadable["side"]) == (batch.unreadable[0], "b")
    assert unreadable["reason"].startswith("undecodable_input: not a valid .npy file")
    assert [(e["where"], e["reason"]) for e in examples["bad_line"]] == [
        (f"{batch.manifest}:11", "malformed_json"),
        (f"{batch.manifest}:21", "output_not_allowed"),
    ]
    assert f"bad line {batch.manifest}:11: malformed_json" in err
    assert (
        "only in A 2, only in B 2, in neither 1, shape mismatch 1, unreadable 1, bad lines 2" in err
    )


def test_a_listing_pairs_outputs_by_relative_key(batch, capsys):
    argv = [batch.a, batch.b, "--listing", "--threshold", "1e-3", "--top", "7", "--json"]
    code, doc, _ = _run(capsys, *argv, "--endpoint-url", batch.stage.endpoint)
    assert code == 1
    assert doc["source"] == "listing"
    _check_figures(doc, batch, threshold=1e-3, top=7)
    # One-sided outputs are known from the listings; neither a missing nor a bad line is.
    listed = {key: [e["task_id"] for e in doc["examples"][key]] for key in ("only_a", "only_b")}
    assert listed == {"only_a": batch.only_a, "only_b": batch.only_b}
    assert (doc["missing_both"], doc["bad_line"], doc["shape_mismatch"]) == (0, 0, 1)
    assert doc["tasks"] == len(batch.order) - len(batch.neither)


def test_a_clean_run_exits_0_and_the_threshold_gates(batch, tmp_path, capsys):
    clean = tmp_path / "clean.csv"
    ids = [t for t in batch.pairs if _expected(*batch.pairs[t])[2] == 0]
    rows = [f"{t},s3://features/in/{t}.npy,{batch.a}{t}.{FORMATS[int(t[-3:]) % 3]}" for t in ids]
    clean.write_text("task_id,input,output\n" + "\n".join(rows) + "\n")
    largest = max(_expected(*batch.pairs[t])[0] for t in ids)
    base = [batch.a, batch.b, "--manifest", str(clean), "--endpoint-url", batch.stage.endpoint]
    code, doc, err = _run(capsys, *base, "--json")
    assert (code, doc["ok"], doc["compared"], err) == (0, True, len(ids), "")  # no threshold
    code, doc, _ = _run(capsys, *base, "--json", "--threshold", repr(largest))
    assert (code, doc["beyond_threshold"]) == (0, 0)  # at the threshold is within it
    code, doc, err = _run(capsys, *base, "--json", "--threshold", repr(largest * 0.999))
    assert (code, doc["beyond_threshold"]) == (1, 1)
    assert f"diff: beyond {largest * 0.999:g} 1\n" in err


def test_the_table_shows_what_the_json_says(batch, capsys):
    argv = [batch.a, batch.b, "--manifest", str(batch.manifest), "--threshold", "1e-3"]
    argv += ["--top", "3", "--endpoint-url", batch.stage.endpoint]
    _, doc, _ = _run(capsys, *argv, "--json")
    assert cli.main(["diff", *argv]) == 1
    out = capsys.readouterr().out
    rows = {
        "compared": f"{doc['compared']}",
        "identical": f"{doc['identical']}",
        "NaN on one side only": f"{doc['nan_mismatch_tasks']}",
        "beyond 0.001": f"{doc['beyond_threshold']} \\({doc['beyond_threshold_share']:.2%}\\)",
        "only in A": "2",
        "only in B": "2",
        "in neither": "1",
        "shape mismatch": "1",
        "unreadable": "1",
        "bad lines": "2",
    }
    for name, value in rows.items():
        assert re.search(rf"^ *{re.escape(name)} +{value} *$", out, re.MULTILINE), name
    for key, name in (("max_abs", "max |a-b|"), ("max_rel", "max relative")):
        figures = " +".join(re.escape(f"{doc[key][q]:.4g}") for q in ("p50", "p90", "p99", "max"))
        assert re.search(rf"^ *{re.escape(name)} +{figures} *$", out, re.MULTILINE), name
    listed = re.findall(r"^ *(user-\d+) +[\d.e+-]+ +", out, re.MULTILINE)
    assert listed == [t["task_id"] for t in doc["top"]]
    assert f"only in A: {', '.join(batch.only_a)}\n" in out
    ((shape_a, shape_b),) = batch.shapes.values()
    assert f"shape mismatch: user-025 ({shape_a[0]}×2 in A, {shape_b[0]}×3 in B)\n" in out


def test_plot_writes_a_png(batch, tmp_path, capsys):
    png = tmp_path / "changes.png"
    argv = [batch.a, batch.b, "--listing", "--plot", str(png), "--threshold", "1e-3"]
    code, _, _ = _run(capsys, *argv, "--endpoint-url", batch.stage.endpoint)
    assert code == 1
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_plot_without_matplotlib_names_the_extra(stage, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    png = tmp_path / "changes.png"
    code, _, err = _run(capsys, "s3://bkt/x/", "s3://bkt/y/", "--listing", "--plot", str(png))
    assert code == 2
    assert "pip install 'sqsinfer[plot]'" in err
    assert not png.exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["s3://bkt/a/", "s3://bkt/b/"], "give --manifest FILE (- for stdin) or --listing"),
        (["s3://bkt/a/", "s3://bkt/b/", "--listing", "--manifest", "m.jsonl"], "one of them"),
        (["s3://bkt/a/", "s3://bkt/a", "--listing"], "are the same prefix"),
        (["s3://bkt/a/", "s3://bkt/a/new/", "--listing"], "neither prefix may lie inside"),
        (["bkt/a/", "s3://bkt/b/", "--listing"], "PREFIX_A must start with s3://"),
        (["s3://bkt/a/", "s3://bkt/b/", "--manifest", "/nonexistent.jsonl"], "cannot read"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, says):
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert says in err


def test_a_bad_threshold_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["diff", "s3://bkt/a/", "s3://bkt/b/", "--listing", "--threshold", "-1"])
    assert exit_.value.code == 2
    assert "must be 0 or more" in capsys.readouterr().err


def test_no_such_bucket_stops_the_run(stage, tmp_path, capsys):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"task_id": "t", "input": "s3://features/t.npy"}) + "\n")
    argv = ["s3://no-such-bucket-here/a/", f"s3://{stage.bucket}/b/", "--manifest", str(manifest)]
    code, _, err = _run(capsys, *argv, "--endpoint-url", stage.endpoint)
    assert code == 1
    assert "cannot read s3://no-such-bucket-here/a/t.npy" in err and "NoSuchBucket" in err


def test_a_listing_that_fails_stops_the_run(stage, capsys):
    argv = ["s3://no-such-bucket-here/a/", f"s3://{stage.bucket}/b/", "--listing"]
    code, _, err = _run(capsys, *argv, "--endpoint-url", stage.endpoint)
    assert code == 1
    assert "NoSuchBucket" in err


# -- the sketch, on its own ------------------------------------------------------------------
def test_sketch_quantiles_are_within_alpha_over_many_decades():
    rng = np.random.default_rng(3)
    values = np.concatenate([np.zeros(50), 10.0 ** rng.uniform(-30, 30, 5000)])
    sketch = LogSketch()
    for value in values:
        sketch.add(float(value))
    for q in (0.001, 0.01, 0.5, 0.9, 0.99, 0.999):
        exact = float(np.quantile(values, q, method="inverted_cdf"))
        assert sketch.quantile(q) == pytest.approx(exact, rel=ALPHA * 1.0001, abs=0)
    assert sketch.max == values.max()
    assert sketch.counts.nbytes < 2 * 2**20  # fixed, whatever the number of values
