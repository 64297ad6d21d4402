"""What `sqsinfer diff` computes, without I/O: one task's change, and a batch's in bounded memory.

One task: two arrays of one shape (A, the reference, and B), compared as float64.

- `max_abs` = max |a − b| over the cells that are numbers on both sides;
- `max_rel` = max |a − b| / max(|a|, EPS) over the same cells. EPS is float32's machine
  epsilon (2⁻²³ ≈ 1.19e-7): the handlers write float32, whose resolution near 1 it is, so
  a reference at or below it is rounding noise and dividing by it would turn a change
  nothing can see into a huge relative one. Below EPS the relative change is |a − b| / EPS.
- `nan_mismatches`: cells NaN on one side only. A cell NaN on both sides is equal (the
  model gave "missing" both times); one NaN on one side only is a change no number
  measures, so it is counted apart and always counts as beyond the threshold.

A batch (`Tally`): counts by category, the quantiles of the per-task `max_abs` and
`max_rel` from `LogSketch` (fixed size, relative error at most `ALPHA`), their exact
maxima, the top k tasks by `max_abs` (a heap of k), and the first few tasks of each
problem category in input order (a heap each). Its memory does not grow with the batch.
"""

from __future__ import annotations

import heapq
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

EPS = float(np.finfo(np.float32).eps)
ALPHA = 0.005  # the sketch's relative accuracy: every quantile within 0.5% of the true one
QUANTILES = (0.5, 0.9, 0.99)
EXAMPLES = 10  # tasks named per problem category

# The categories of a task that could not be compared, in the order they are reported.
ONLY_A, ONLY_B, MISSING_BOTH = "only_a", "only_b", "missing_both"
SHAPE_MISMATCH, UNREADABLE, BAD_LINE = "shape_mismatch", "unreadable", "bad_line"
PROBLEMS = (ONLY_A, ONLY_B, MISSING_BOTH, SHAPE_MISMATCH, UNREADABLE, BAD_LINE)


@dataclass(frozen=True)
class Change:
    """How B differs from A for one task."""

    max_abs: float
    max_rel: float
    nan_mismatches: int
    cells: int

    @property
    def identical(self) -> bool:
        return self.max_abs == 0 and self.nan_mismatches == 0


def compare(a: np.ndarray, b: np.ndarray) -> Change:
    """The change from `a` to `b`, two arrays of one shape."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} and {b.shape}")
    a64 = a.astype(np.float64, copy=False)
    b64 = b.astype(np.float64, copy=False)
    nan_a, nan_b = np.isnan(a64), np.isnan(b64)
    numbers = ~(nan_a | nan_b)
    with np.errstate(over="ignore"):  # two float64s of opposite sign near the limit: inf
        delta = np.abs(a64[numbers] - b64[numbers])
    if delta.size == 0:
        max_abs = max_rel = 0.0
    else:
        max_abs = float(delta.max())
        max_rel = float((delta / np.maximum(np.abs(a64[numbers]), EPS)).max())
    return Change(max_abs, max_rel, int(np.count_nonzero(nan_a ^ nan_b)), int(a.size))


# -- quantiles in fixed memory ----------------------------------------------------------
_GAMMA = (1 + ALPHA) / (1 - ALPHA)
_LOG_GAMMA = math.log(_GAMMA)
_SMALLEST = 5e-324  # the smallest positive float64 (a subnormal)
_LOW = math.floor(math.log(_SMALLEST) / _LOG_GAMMA)
_HIGH = math.ceil(math.log(sys.float_info.max) / _LOG_GAMMA)


class LogSketch:
    """Counts of non-negative values in log-spaced buckets over the whole float64 range.

    Bucket i holds (γ^(i−1), γ^i] with γ = (1 + α) / (1 − α), and stands for 2γ^i / (γ + 1),
    within α of everything in it (the DDSketch construction). Zeros are counted apart. A
    quantile q is the value of rank ceil(q × n) (numpy's `inverted_cdf`), returned within
    α relative error; the maximum is kept exactly. Fixed size: about 145,000 buckets,
    1.2 MB, whatever the number of values.
    """

    def __init__(self) -> None:
        self.counts = np.zeros(_HIGH - _LOW + 1, dtype=np.int64)
        self.zeros = 0
        self.count = 0
        self.max = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.max = max(self.max, value)
        if value == 0:
            self.zeros += 1
            return
        bucket = math.ceil(math.log(value) / _LOG_GAMMA) if math.isfinite(value) else _HIGH
        self.counts[min(max(bucket, _LOW), _HIGH) - _LOW] += 1

    def quantile(self, q: float) -> float | None:
        if not self.count:
            return None
        rank = max(1, math.ceil(q * self.count))
        if rank <= self.zeros:
            return 0.0
        bucket = int(np.searchsorted(np.cumsum(self.counts), rank - self.zeros))
        return min(_estimate(bucket + _LOW), self.max)

    def buckets(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, counts) of the non-empty buckets: each bucket's value and its count."""
        (filled,) = np.nonzero(self.counts)
        values = 2 * np.power(_GAMMA, (filled + _LOW).astype(np.float64)) / (_GAMMA + 1)
        return values, self.counts[filled]

    def summary(self) -> dict[str, float | None]:
        found: dict[str, float | None] = {f"p{round(q * 100)}": self.quantile(q) for q in QUANTILES}
        return found | {"max": self.max if self.count else None}


def _estimate(bucket: int) -> float:
    return 2 * _GAMMA**bucket / (_GAMMA + 1)


# -- bounded lists ----------------------------------------------------------------------
class FirstN:
    """The `n` items of the lowest index seen, whatever order they come in."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._heap: list[tuple[int, dict[str, Any]]] = []  # (−index, item): the largest on top

    def add(self, index: int, item: dict[str, Any]) -> None:
        if len(self._heap) < self.n:
            heapq.heappush(self._heap, (-index, item))
        elif -self._heap[0][0] > index:
            heapq.heapreplace(self._heap, (-index, item))

    def items(self) -> list[dict[str, Any]]:
        return [item for _, item in sorted(self._heap, key=lambda pair: -pair[0])]


class TopK:
    """The `k` tasks of largest `max_abs`; of equal ones, the earliest in input order."""

    def __init__(self, k: int) -> None:
        self.k = k
        self._heap: list[tuple[float, int, dict[str, Any]]] = []  # the smallest on top

    def add(self, index: int, change: Change, item: dict[str, Any]) -> None:
        if not self.k:
            return
        entry = (change.max_abs, -index, item)
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, entry)
        elif entry[:2] > self._heap[0][:2]:
            heapq.heapreplace(self._heap, entry)

    def items(self) -> list[dict[str, Any]]:
        return [item for *_, item in sorted(self._heap, key=lambda e: (-e[0], -e[1]))]


# -- the batch --------------------------------------------------------------------------
@dataclass
class Tally:
    """Everything `sqsinfer diff` reports about a batch, gathered one task at a time."""

    threshold: float | None = None
    top_k: int = 10
    tasks: int = 0
    compared: int = 0
    identical: int = 0
    beyond: int = 0  # max_abs above the threshold, or a NaN on one side
    nan_tasks: int = 0  # tasks with a cell NaN on one side only
    problems: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROBLEMS, 0))
    max_abs: LogSketch = field(default_factory=LogSketch)
    max_rel: LogSketch = field(default_factory=LogSketch)
    top: TopK = field(init=False)
    examples: dict[str, FirstN] = field(init=False)

    def __post_init__(self) -> None:
        self.top = TopK(self.top_k)
        self.examples = {name: FirstN(EXAMPLES) for name in PROBLEMS}

    def changed(
        self, index: int, named: dict[str, Any], change: Change, shape: tuple[int, ...]
    ) -> None:
        """A task compared; `named` names it (its task id, its outputs)."""
        self.tasks += 1
        self.compared += 1
        self.identical += change.identical
        self.nan_tasks += change.nan_mismatches > 0
        self.beyond += self.is_beyond(change)
        self.max_abs.add(change.max_abs)
        self.max_rel.add(change.max_rel)
        item = named | {
            "max_abs": change.max_abs,
            "max_rel": change.max_rel,
            "nan_mismatches": change.nan_mismatches,
            "shape": list(shape),
        }
        self.top.add(index, change, item)

    def is_beyond(self, change: Change) -> bool:
        if self.threshold is None:
            return False
        return change.max_abs > self.threshold or change.nan_mismatches > 0

    def problem(self, category: str, index: int, item: dict[str, Any]) -> None:
        """A task that could not be compared (a bad line is not a task: it names no id)."""
        self.tasks += category != BAD_LINE
        self.problems[category] += 1
        self.examples[category].add(index, item)

    @property
    def ok(self) -> bool:
        """Every task present on both sides, compared, and within the threshold if given."""
        return not any(self.problems.values()) and not self.beyond

    @property
    def beyond_share(self) -> float | None:
        if self.threshold is None or not self.compared:
            return None
        return self.beyond / self.compared

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "tasks": self.tasks,
            "compared": self.compared,
            "identical": self.identical,
            "nan_mismatch_tasks": self.nan_tasks,
            "threshold": self.threshold,
            "beyond_threshold": None if self.threshold is None else self.beyond,
            "beyond_threshold_share": self.beyond_share,
            **self.problems,
            "max_abs": self.max_abs.summary(),
            "max_rel": self.max_rel.summary(),
            "eps": EPS,
            "quantile_relative_error": ALPHA,
            "top": self.top.items(),
            "examples": {name: self.examples[name].items() for name in PROBLEMS},
        }
