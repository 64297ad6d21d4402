"""The proving ground: the tools that try to make the worker lose work, kept beside the
package and never installed with it.

    python -m proving.chaos      a two-stage chain under fire, checked from S3 and the queues
    python -m proving.soak       a long run that watches memory, descriptors and /dev/shm
    python -m proving.faults     the fault proxy in front of an AWS endpoint
    python -m proving.localstack LocalStack in host mode, for the stricter stand-in's tests
    python -m proving.fleetsim   a fleet under KEDA, simulated beside `sqsinfer plan`

They import the package (its stand-in kit in `sqsinfer.lab` included); the package never
imports them.
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for `python -m proving.<tool>` in a child process: this folder's
    parent on PYTHONPATH, since the proving ground is run from a checkout, not installed."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env
