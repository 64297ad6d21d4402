"""The examples in examples/ run as their documentation says, against the moto server."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from examples import producer
from examples.linear_handler import save_linear_model
from sqsinfer.lab import synthetic
from tests.conftest import Stage, eventually, outcome_count, running

ROOT = Path(__file__).resolve().parents[2]


async def test_the_example_handler_and_producer_run_a_batch(
    stage: Stage, make_settings, tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    weights, bias = rng.standard_normal((3, 2)), rng.standard_normal(2)
    model = save_linear_model(str(tmp_path / "linear.npz"), weights, bias)
    inputs = {f"day/{i}": synthetic.make_rows(4, 3, seed=i) for i in range(12)}
    for name, rows in inputs.items():
        stage.put_input(f"{name}.npy", synthetic.encode_input(rows, "npy"))
    messages = producer.task_messages(
        stage.s3, f"s3://{stage.bucket}/in/day/", f"s3://{stage.bucket}/out/scores/"
    )
    assert producer.send_all(stage.sqs, stage.queue_url, messages) == 12
    settings = make_settings(handler="examples.linear_handler:LinearHandler", model_path=model)
    async with running(settings) as worker:
        await eventually(lambda: outcome_count(worker, "committed") == 12)
    outputs = stage.outputs("out/scores/")
    for name, rows in inputs.items():
        got = synthetic.decode_output(outputs[f"out/scores/{name.split('/')[1]}.npy"], "npy")
        expected = rows @ weights.astype(np.float32) + bias.astype(np.float32)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_the_handler_page_shows_the_example_as_it_is() -> None:
    page = (ROOT / "docs" / "handlers.md").read_text()
    example = (ROOT / "examples" / "linear_handler.py").read_text()
    assert f"```python\n{example}```" in page, "docs/handlers.md must quote the example whole"
