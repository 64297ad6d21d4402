"""Benchmark workloads: the regimes, and their model and inputs, generated from a seed.

Every scenario of one regime runs on the same model file and the same input bytes.
Models are cached by their parameters: training is deterministic (one thread), so a
cached file is the file the same command would have trained.

Each regime has two models of about the same cost per task: an XGBoost model (the
default) and, for `--handler onnx`, a multi-layer perceptron in ONNX (random weights:
its cost depends on its shape only), so the worker's overhead can be read for a second
model kind. Measured on one thread: the medium MLP (256, 256) predicts 10,000 rows in
about 23 ms, as the medium XGBoost model does; the heavy one (4 × 1024) in about 0.8 s.

The heavy model is large by construction: a small model is trained, and its trees are
repeated until the model has the regime's tree count. Prediction costs the same per
tree as a model trained to that size (each copy is its own tree in memory), and it
takes seconds to build instead of many minutes of training.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sqsinfer.lab import synthetic

TRAIN_ROWS = 5000


@dataclass(frozen=True)
class Regime:
    name: str
    description: str
    rows: int  # rows in each task's input
    features: int
    trees: int
    depth: int
    distinct_inputs: int  # input files; tasks cycle through them
    warmup_tasks: int  # completed before the measurement window opens
    tasks: int  # completed inside the window (unless max_window_s comes first)
    max_window_s: float
    mlp_hidden: tuple[int, ...]  # the ONNX model's hidden layers, sized to the same cost
    trained_trees: int = 0  # trees actually trained; 0: all of them

    def describe(self) -> dict[str, Any]:
        return asdict(self)


REGIMES: dict[str, Regime] = {
    "heavy": Regime(
        "heavy",
        "about 1 s of compute per task: 10,000 rows x 50 features, 3,000 trees of depth 8",
        rows=10_000,
        features=50,
        trees=3000,
        depth=8,
        trained_trees=100,
        distinct_inputs=4,
        warmup_tasks=4,
        tasks=30,
        max_window_s=45.0,
        mlp_hidden=(1024, 1024, 1024, 1024),
    ),
    "medium": Regime(
        "medium",
        "about 25 ms of compute per task: 10,000 rows x 50 features, 200 trees of depth 6",
        rows=10_000,
        features=50,
        trees=200,
        depth=6,
        distinct_inputs=8,
        warmup_tasks=40,
        tasks=500,
        max_window_s=25.0,
        mlp_hidden=(256, 256),
    ),
    "chained": Regime(
        "chained",
        "two stages, the second fed by the first: stage 1 2,000 rows x 50 features, 50 "
        "trees of depth 6; stage 2 its 2,000 predictions, 20 trees of one feature",
        rows=2000,
        features=50,
        trees=50,
        depth=6,
        distinct_inputs=4,
        warmup_tasks=20,
        tasks=300,
        max_window_s=300.0,  # the longest a batch may take to go through both stages
        mlp_hidden=(128, 128),
    ),
    "quick": Regime(
        "quick",
        "smoke run: 2,000 rows x 50 features, 50 trees of depth 6",
        rows=2000,
        features=50,
        trees=50,
        depth=6,
        distinct_inputs=4,
        warmup_tasks=3,
        tasks=12,
        max_window_s=5.0,
        mlp_hidden=(128, 128),
    ),
}

# Small tasks on the medium model: the row count is each of the small regime's own
# (`bench.small.ROWS`), set as it runs them.
REGIMES["small"] = dataclasses.replace(
    REGIMES["medium"],
    name="small",
    description="small tasks, coalesced or each alone: 10 and 100 rows x 50 features per "
    "task, the medium model (200 trees of depth 6)",
    rows=100,
)


def _train(path: str, regime: Regime, trees: int, seed: int) -> None:
    import xgboost

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((TRAIN_ROWS, regime.features)).astype(np.float32)
    # Noisy labels keep every tree growing to full depth, as a real model's would.
    y = x @ rng.standard_normal(regime.features) + rng.standard_normal(TRAIN_ROWS)
    booster = xgboost.train(
        {"max_depth": regime.depth, "eta": 0.3, "nthread": 1, "seed": seed},
        xgboost.DMatrix(x, label=y),
        num_boost_round=trees,
    )
    booster.save_model(path)


def _repeat_trees(json_path: str, target_trees: int) -> None:
    """Grow a saved JSON model to `target_trees` trees by repeating the ones it has."""
    with open(json_path) as fh:
        doc = json.load(fh)
    model = doc["learner"]["gradient_booster"]["model"]
    base = model["trees"]
    trees = []
    for i in range(target_trees):
        tree = dict(base[i % len(base)])
        tree["id"] = i
        trees.append(tree)
    model["trees"] = trees
    model["tree_info"] = [0] * target_trees
    if "iteration_indptr" in model:
        model["iteration_indptr"] = list(range(target_trees + 1))
    model["gbtree_model_param"]["num_trees"] = str(target_trees)
    with open(json_path, "w") as fh:
        json.dump(doc, fh)


def model_path(regime: Regime, seed: int, cache_dir: str) -> str:
    """The regime's model as `.ubj`, built on first use and cached in `cache_dir`."""
    import xgboost

    name = f"{regime.name}-f{regime.features}-t{regime.trees}-d{regime.depth}-s{seed}.ubj"
    path = os.path.join(cache_dir, name)
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        trained = os.path.join(tmp, "model.json")
        _train(trained, regime, regime.trained_trees or regime.trees, seed)
        if regime.trained_trees and regime.trained_trees < regime.trees:
            _repeat_trees(trained, regime.trees)
        booster = xgboost.Booster()
        booster.load_model(trained)
        staged = os.path.join(tmp, "model.ubj")
        booster.save_model(staged)
        os.replace(staged, path)  # atomic: a concurrent run never sees half a file
    return path


def onnx_model_path(regime: Regime, seed: int, cache_dir: str) -> str:
    """The regime's MLP as `.onnx`, built on first use and cached in `cache_dir`."""
    hidden = "x".join(map(str, regime.mlp_hidden))
    path = os.path.join(cache_dir, f"{regime.name}-f{regime.features}-mlp{hidden}-s{seed}.onnx")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        staged = os.path.join(tmp, "model.onnx")
        synthetic.onnx_mlp_model(staged, regime.features, tuple(regime.mlp_hidden), seed=seed)
        os.replace(staged, path)
    return path


def for_handler(regime: Regime, handler: str, seed: int, cache_dir: str) -> tuple[Regime, str]:
    """The regime as run with `handler` (its description says which model) and the model."""
    if handler == "xgboost":
        return regime, model_path(regime, seed, cache_dir)
    hidden = " x ".join(map(str, regime.mlp_hidden))
    described = dataclasses.replace(
        regime,
        description=f"ONNX MLP, hidden layers {hidden} (MatMul, Add, Relu), "
        f"{regime.rows:,} rows x {regime.features} features per task: about the cost of "
        f"the XGBoost model of this regime ({regime.trees} trees of depth {regime.depth})",
    )
    return described, onnx_model_path(regime, seed, cache_dir)


def input_bytes(regime: Regime, seed: int) -> list[bytes]:
    """The regime's distinct task inputs as `.npy` files (float32), deterministic."""
    return [
        synthetic.encode_input(
            synthetic.make_rows(regime.rows, regime.features, seed=seed * 1000 + i), "npy"
        )
        for i in range(regime.distinct_inputs)
    ]
