"""Write the podman configuration `make test-image` runs under, into its own state folder.

    python scripts/podman_conf.py build/image

Two files, pointed at by CONTAINERS_CONF and CONTAINERS_STORAGE_CONF:

- `storage.conf`: images, containers and podman's own state live under the folder, not in
  the machine's /var/lib/containers. Two checkouts running the lane at once (or another
  user of podman on the machine) then never see each other's pods, whose names come from
  the chart and are the same in every run; and a CI run starts from nothing.
- `containers.conf`: the runc runtime with podman's default ulimits off. Where podman
  itself runs inside a container that may not raise resource limits (as on some CI
  runners), crun fails with `setrlimit RLIMIT_NOFILE: Operation not permitted`, and so
  does runc until podman stops asking for its default ulimits. Elsewhere this changes
  nothing a test looks at.
"""

from __future__ import annotations

import argparse
from pathlib import Path

CONTAINERS_CONF = """\
[containers]
default_ulimits = []

[engine]
runtime = "runc"
tmp_dir = "{state}/libpod-tmp"
"""

STORAGE_CONF = """\
[storage]
driver = "overlay"
graphroot = "{state}/storage"
runroot = "{state}/run"
"""


def write(state: Path) -> tuple[Path, Path]:
    """Write both files under `state` (made absolute); their paths."""
    state = state.resolve()
    state.mkdir(parents=True, exist_ok=True)
    containers, storage = state / "containers.conf", state / "storage.conf"
    containers.write_text(CONTAINERS_CONF.format(state=state))
    storage.write_text(STORAGE_CONF.format(state=state))
    return containers, storage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("state", type=Path, help="the folder, e.g. build/image")
    args = parser.parse_args(argv)
    for path in write(args.state):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
