"""Shared memory segments: each Storage owns its own, named for its process; what dead
workers left in /dev/shm is swept."""

from __future__ import annotations

import fcntl
import gc
import os
import subprocess
import sys

import pytest

from sqsinfer import procfs, shm
from sqsinfer.aws.s3 import Storage
from sqsinfer.aws.session import open_clients
from sqsinfer.messages import parse_s3_uri
from tests.conftest import Stage

LIMIT = 1 << 20


def _on_dev_shm(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


async def test_each_storage_owns_its_segments_and_they_go_with_it(stage: Stage):
    uri = parse_s3_uri(stage.put_input("a.bin", b"x" * 1000))
    async with open_clients("us-east-1", stage.endpoint) as clients:
        first, second = Storage(clients.s3), Storage(clients.s3)
        with await first.get_shared(uri, LIMIT) as shared:
            kept = shared.name
        with await second.get_shared(uri, LIMIT) as shared:
            assert shared.name != kept  # not handed the first one's kept segment
        with await first.get_shared(uri, LIMIT) as shared:
            assert shared.name == kept  # reused within its owner
    assert kept.startswith(f"sqsinfer-{os.getpid()}-")
    assert _on_dev_shm(kept)
    del first, shared
    gc.collect()
    assert not _on_dev_shm(kept)


async def test_a_kept_segment_that_lost_its_name_is_not_handed_out_again(stage: Stage):
    uri = parse_s3_uri(stage.put_input("b.bin", b"y" * 1000))
    async with open_clients("us-east-1", stage.endpoint) as clients:
        storage = Storage(clients.s3)
        with await storage.get_shared(uri, LIMIT) as shared:
            lost = shared.name
        os.unlink(os.path.join("/dev/shm", lost))  # removed behind the worker's back
        with await storage.get_shared(uri, LIMIT) as shared:
            assert shared.name != lost
            assert _on_dev_shm(shared.name)  # an inference process can open it


def test_the_sweep_removes_only_segments_of_processes_no_longer_running(tmp_path):
    dead_pid = int(subprocess.check_output([sys.executable, "-c", "import os; print(os.getpid())"]))
    me, my_start = os.getpid(), procfs.start_ticks(os.getpid())
    names = {
        "dead": f"sqsinfer-{dead_pid}-{shm._base36(1)}-0123abcd",
        # this pid, but started at another time: a previous life of the pid
        "reused": f"sqsinfer-{me}-{shm._base36(my_start + 1)}-0123abcd",
        "live": f"sqsinfer-{me}-{shm._base36(my_start)}-0123abcd",
        "foreign": "psm_0123abcd",
        "unlike": "sqsinfer-notapid",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"z" * 10)
    swept = shm.sweep(str(tmp_path))
    assert swept == shm.Swept(segments=2, bytes=20)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("live", "foreign", "unlike")
    )


def test_a_lock_beside_the_segments_decides_over_the_pid(tmp_path):
    """Owners in another pid namespace: their pid here says nothing, their lock does."""
    dead_pid = int(subprocess.check_output([sys.executable, "-c", "import os; print(os.getpid())"]))
    me, my_start = os.getpid(), shm._base36(procfs.start_ticks(os.getpid()))
    # Its pid is dead here, but its owner (elsewhere) holds its lock.
    held = f"{dead_pid}-{shm._base36(1)}-aaaaaaaa"
    # Its pid looks alive here (another process of that pid), but nobody holds its lock.
    let_go = f"{me}-{my_start}-bbbbbbbb"
    for owner in (held, let_go):
        (tmp_path / f"sqsinfer-{owner}-0123abcd").write_bytes(b"z" * 10)
        (tmp_path / f"sqsinfer.{owner}.lock").touch()
    with open(tmp_path / f"sqsinfer.{held}.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        swept = shm.sweep(str(tmp_path))
    assert swept == shm.Swept(segments=1, bytes=10, locks=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"sqsinfer-{held}-0123abcd",
        f"sqsinfer.{held}.lock",
    ]
    assert shm.sweep(str(tmp_path)) == shm.Swept(segments=1, bytes=10, locks=1)  # let go now
    assert list(tmp_path.iterdir()) == []


def test_this_process_holds_the_lock_named_like_its_segments():
    owner = shm.new_name().removeprefix(shm.PREFIX).rsplit("-", 1)[0]
    path = shm.lock_path(owner)
    assert os.path.exists(path)
    with open(path) as lock, pytest.raises(BlockingIOError):
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
