"""What a worker keeps in /dev/shm: its input segments (made, named so that their owner
can be told, reused between tasks, never more than the tmpfs has room for), the lock
that says their owner lives, and the sweep at start-up of what dead workers left.

A worker's input segments are named `sqsinfer-<pid>-<start>-<nonce>-<random>`: the
creating process's pid, its start time (clock ticks after boot, base 36) and a random
nonce drawn once per process; the first three are its owner tag. The process holds an
exclusive `flock` on `sqsinfer.<pid>-<start>-<nonce>.lock` beside them for its whole
life, made before its first segment. The kernel releases it when the process dies,
however it dies (a SIGKILL of the whole container included), and a lock is seen alike
from every pid namespace that shares the directory: two containers of one pod on one
emptyDir cannot see each other's processes in /proc, but they see each other's locks.
The nonce keeps two processes apart that got one pid at one tick in two namespaces.

A SIGKILL of the whole worker, resource tracker included, leaves its segments behind,
and in Kubernetes `/dev/shm` is a memory-backed emptyDir that outlives container
restarts in the pod, so repeated kills would fill it. `sweep()` at start-up removes the
segments whose owner is dead, and the owner's lock file: dead means its lock can be
taken; where there is no lock file (segments of a version before the locks, or a lock
removed by hand), the owner's pid and start time are looked up in this namespace's
/proc, which only tells for a process of this pid namespace. It touches only names of
these forms and only files of this user.

Writing into a mapped segment is where a full tmpfs hurts: `ftruncate` reserves no
pages, so the page that finds no room raises SIGBUS in the writer, the worker itself.
A segment therefore gets all its pages when it is made (`posix_fallocate`, which a full
tmpfs refuses with ENOSPC), and is made only when statvfs shows the room for it; when
there is none, the input waits for one of this worker's segments to come back, or,
with none out, its task fails as transient (`SharedMemoryFull`) and is retried.

multiprocessing's own semaphores (`sem.mp-*`) carry nothing that says whose they are,
so they are not swept: the pool removes their names as soon as its process has opened
them (pool.py), and leaves none behind to sweep.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import errno
import fcntl
import functools
import logging
import os
import re
import secrets
import weakref
from dataclasses import dataclass
from multiprocessing import shared_memory

from sqsinfer import procfs, sizing
from sqsinfer.logs import Event

log = logging.getLogger("sqsinfer.shm")

SHM_DIR = "/dev/shm"
PREFIX = "sqsinfer-"
_LOCK_PREFIX, _LOCK_SUFFIX = "sqsinfer.", ".lock"
# The owner tag after the prefix: pid, start time and, since the locks, the nonce.
_OWNER = r"(?P<owner>(?P<pid>\d+)-(?P<start>[0-9a-z]+)(?:-[0-9a-f]{8})?)"
_OWNER_TAG = re.compile(_OWNER)
_SEGMENT = re.compile(re.escape(PREFIX) + _OWNER + r"-[0-9a-f]+")
_LOCK = re.compile(re.escape(_LOCK_PREFIX) + _OWNER + re.escape(_LOCK_SUFFIX))
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_CREATE_ATTEMPTS = 3
_LOCK_ATTEMPTS = 3
# Beside the inputs, each inference process's executor keeps five multiprocessing
# semaphores in /dev/shm, a page each (20 KiB measured): what the bound leaves for them.
SEMAPHORE_BYTES_PER_PROCESS = 64 << 10


def segment_bytes(size: int) -> int:
    """What the segment of an input of `size` bytes takes: whole MiB (see `Segments`)."""
    return sizing.mib(max(size, 1)) * sizing.MIB


def mib_text(size: int) -> str:
    """Bytes as MiB for a person: '3', or '1.5'."""
    return f"{size / sizing.MIB:.1f}".removesuffix(".0")


@dataclass(frozen=True)
class Room:
    total_bytes: int
    free_bytes: int


def room(directory: str = SHM_DIR) -> Room | None:
    """The tmpfs's size and what is free in it now; None where it cannot be looked at."""
    try:
        found = os.statvfs(directory)
    except OSError:
        return None
    return Room(found.f_blocks * found.f_frsize, found.f_bavail * found.f_frsize)


class SharedMemoryFull(Exception):
    """No room in /dev/shm for an input's segment, and none of this worker's segments
    out to wait for (another container of the pod fills it, or what a dead worker left
    before the sweep could tell): the task fails as transient and is retried."""

    def __init__(self, wanted_bytes: int, found: Room | None) -> None:
        text = f"no room in {SHM_DIR} for a segment of {mib_text(wanted_bytes)} MiB"
        if found is not None:
            text += f": {mib_text(found.free_bytes)} MiB free of {mib_text(found.total_bytes)} MiB"
        super().__init__(text)
        self.wanted_bytes = wanted_bytes
        self.free_bytes = found.free_bytes if found else 0


def _base36(number: int) -> str:
    text = ""
    while True:
        number, digit = divmod(number, 36)
        text = _DIGITS[digit] + text
        if not number:
            return text


@functools.cache
def _owner_tag(pid: int) -> str:
    """This process's owner tag, its lock taken first (per pid: a fork makes its own)."""
    owner = f"{pid}-{_base36(procfs.start_ticks(pid))}-{secrets.token_hex(4)}"
    _hold_lock(pid, owner)
    return PREFIX + owner


def new_name() -> str:
    """A fresh segment name that says this process made it."""
    return f"{_owner_tag(os.getpid())}-{secrets.token_hex(4)}"


def lock_path(owner: str, directory: str = SHM_DIR) -> str:
    """The lock file of the owner tag `owner` (without the segments' prefix)."""
    return os.path.join(directory, f"{_LOCK_PREFIX}{owner}{_LOCK_SUFFIX}")


def _hold_lock(pid: int, owner: str) -> None:
    """Lock this process's file beside its segments, for the rest of its life."""
    if not os.path.isdir(SHM_DIR):
        return
    path = lock_path(owner)
    try:
        fd = _locked_file(path)
    except OSError as exc:
        # Its segments are then judged by pid, as an older version's: right in its own
        # pid namespace, not from another.
        log.warning(Event.CANNOT_LOCK_SEGMENTS, extra={"path": path, "error": str(exc)})
        return
    atexit.register(_let_go, pid, fd, path)


def _locked_file(path: str) -> int:
    for _ in range(_LOCK_ATTEMPTS):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a sweep holding it lets go within moments
        # A sweep that took it before this process did found no owner alive and removed
        # it: the lock is then on a file nobody else sees. Make another.
        if os.fstat(fd).st_nlink:
            return fd
        os.close(fd)
    raise OSError(errno.EAGAIN, "removed by a sweep each time it was made", path)


def _let_go(pid: int, fd: int, path: str) -> None:
    if os.getpid() != pid:  # a forked child runs its parent's exit hooks: not its lock
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


def exists(name: str) -> bool:
    """Whether a segment still has its name (True where /dev/shm cannot be looked at)."""
    if not os.path.isdir(SHM_DIR):
        return True
    return os.path.exists(os.path.join(SHM_DIR, name))


@dataclass(frozen=True)
class Swept:
    segments: int = 0
    bytes: int = 0
    locks: int = 0


def sweep(directory: str = SHM_DIR) -> Swept:
    """Remove the segments of workers that are no longer running, and their lock files;
    one log line if any."""
    if not os.path.isdir(directory):
        return Swept()
    owners: dict[str, list[str]] = {}
    for name in sorted(os.listdir(directory)):
        found = _SEGMENT.fullmatch(name) or _LOCK.fullmatch(name)
        if found is not None:
            owned = owners.setdefault(found["owner"], [])
            if found.re is _SEGMENT:
                owned.append(name)
    segments = size = locks = 0
    for owner, names in owners.items():
        swept = _sweep_owner(directory, owner, names)
        segments, size, locks = segments + swept.segments, size + swept.bytes, locks + swept.locks
    if segments or locks:
        log.info(
            Event.SWEPT,
            extra={"directory": directory, "segments": segments, "bytes": size, "locks": locks},
        )
    return Swept(segments, size, locks)


def _sweep_owner(directory: str, owner: str, names: list[str]) -> Swept:
    """One owner's segments and lock file, removed if the owner is dead."""
    path = lock_path(owner, directory)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # no lock: an older version's segments, judged by pid
        tag = _OWNER_TAG.fullmatch(owner)
        assert tag is not None  # matched as part of a name
        alive = procfs.alive(int(tag["pid"]), int(tag["start"], 36))
        return Swept() if alive else _remove_all(directory, names)
    except PermissionError:  # another user's
        return Swept()
    try:
        if os.fstat(fd).st_uid != os.getuid() or not _took(fd):
            return Swept()  # another user's, or its owner lives
        # Removed while its lock is held: no other sweep judges it meanwhile.
        swept = _remove_all(directory, names)
        return dataclasses.replace(swept, locks=int(_remove(path) is not None))
    finally:
        os.close(fd)


def _took(fd: int) -> bool:
    """Whether the lock could be taken: its owner is dead (the kernel let go of it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _remove_all(directory: str, names: list[str]) -> Swept:
    sizes = [_remove(os.path.join(directory, name)) for name in names]
    removed = [size for size in sizes if size is not None]
    return Swept(len(removed), sum(removed))


def _remove(path: str) -> int | None:
    """Unlink one file of this user; its size, or None when it was not removed."""
    try:
        info = os.stat(path)
        if info.st_uid != os.getuid():
            return None
        os.unlink(path)
    except FileNotFoundError:  # another worker starting alongside swept it first
        return None
    except PermissionError as exc:
        log.warning(Event.CANNOT_SWEEP, extra={"path": path, "error": str(exc)})
        return None
    return info.st_size


class Segments:
    """One Storage's shared memory segments, kept for reuse between its tasks.

    Creating a segment per task costs more than copying the input into it: the create
    and the unlink each make a round trip to multiprocessing's resource tracker, and
    every page of a new segment is allocated (about 1.3 ms of CPU per 2 MB input here,
    against 0.2 ms for the copy alone). A segment whose task ended is kept for the next
    input that fits; sizes are rounded up to whole MiB so inputs of similar size share
    segments. A new segment is given all its pages at once (`_create`), so that no
    write into it can meet a full tmpfs, and the in-flight bound counts whole MiB.

    Each Storage owns its own (one event loop uses it; nothing here is locked), and
    they go when it does. Segments are named for this process (`new_name`) so that
    a worker starting after this one was killed can sweep them. A kept segment whose
    name has gone from /dev/shm is never handed out again: this process still maps it
    and could not tell, but no inference process can open it any more.
    """

    MAX_KEPT = 16
    MAX_KEPT_BYTES = 64 << 20

    def __init__(self) -> None:
        self._free: list[shared_memory.SharedMemory] = []
        self._out = 0  # taken and not given back yet
        self._given_back = asyncio.Event()
        # At collection or at exit, whichever comes first; never referring to self.
        self._finalizer = weakref.finalize(self, _destroy_all, self._free)

    async def take(self, size: int) -> shared_memory.SharedMemory:
        """A segment of at least `size` bytes. While /dev/shm has no room for it, wait for
        one of this Storage's segments to come back; with none out, SharedMemoryFull."""
        waiting = False
        while True:
            try:
                return self.take_now(size)
            except SharedMemoryFull as exc:
                if not self._out:
                    raise
                if not waiting:
                    waiting = True
                    log.warning(
                        Event.WAITING_FOR_SHM,
                        extra={
                            "segment_bytes": exc.wanted_bytes,
                            "free_bytes": exc.free_bytes,
                            "segments_out": self._out,
                        },
                    )
            await self._given_back.wait()

    def take_now(self, size: int) -> shared_memory.SharedMemory:
        """A kept segment that fits, else a new one; SharedMemoryFull when there is no room."""
        segment = self._kept(size) or self._new(segment_bytes(size))
        self._out += 1
        return segment

    def _kept(self, size: int) -> shared_memory.SharedMemory | None:
        while fitting := [shm for shm in self._free if shm.size >= size]:
            best = min(fitting, key=lambda shm: shm.size)
            self._free.remove(best)
            if exists(best.name):
                return best
            log.warning(Event.KEPT_SEGMENT_LOST, extra={"segment": best.name})
            _destroy(best)
        return None

    def _new(self, size: int) -> shared_memory.SharedMemory:
        if self._free:
            # Trade a kept segment for the new one, so that segments in use plus kept never
            # outnumber the most ever in use at once (the in-flight bound): /dev/shm is
            # sized for that (processes x prefetch x max input) and must not overflow.
            _destroy(self._free.pop())
        while self._free and not _fits(size):
            _destroy(self._free.pop())  # kept segments make room before the task waits
        return _create(size)

    def give(self, shm: shared_memory.SharedMemory) -> None:
        self._out -= 1
        if len(self._free) < self.MAX_KEPT and shm.size <= self.MAX_KEPT_BYTES:
            self._free.append(shm)
        else:
            _destroy(shm)
        self._given_back.set()  # whoever waits for room looks again
        self._given_back = asyncio.Event()

    def clear(self) -> None:
        """Destroy every kept segment (segments in use go when they are given back)."""
        _destroy_all(self._free)


def _fits(size: int) -> bool:
    found = room()
    return found is None or found.free_bytes >= size


def _create(size: int) -> shared_memory.SharedMemory:
    """A new segment of `size` bytes with all its pages, or SharedMemoryFull."""
    if not _fits(size):
        raise SharedMemoryFull(size, room())
    segment = _named(size)
    try:
        _allocate(segment)
    except BaseException:
        _destroy(segment)
        raise
    return segment


def _named(size: int) -> shared_memory.SharedMemory:
    for _ in range(_CREATE_ATTEMPTS - 1):
        with contextlib.suppress(FileExistsError):  # 32 random bits: never, in practice
            return shared_memory.SharedMemory(name=new_name(), create=True, size=size)
    return shared_memory.SharedMemory(name=new_name(), create=True, size=size)


def _allocate(segment: shared_memory.SharedMemory) -> None:
    """Give the segment its pages now. `ftruncate` reserved none: written into later, a
    page that finds the tmpfs full raises SIGBUS in the writer. `posix_fallocate` fails
    with ENOSPC instead, before anything is written (checked room can be taken meanwhile
    by another process)."""
    if not os.path.isdir(SHM_DIR) or not hasattr(os, "posix_fallocate"):
        return  # not Linux: nothing to allocate ahead
    fd = os.open(os.path.join(SHM_DIR, segment.name), os.O_RDWR | os.O_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, segment.size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise SharedMemoryFull(segment.size, room()) from None
    finally:
        os.close(fd)


def _destroy(shm: shared_memory.SharedMemory) -> None:
    with contextlib.suppress(BufferError):
        shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


def _destroy_all(segments: list[shared_memory.SharedMemory]) -> None:
    while segments:
        _destroy(segments.pop())


class SharedInput:
    """An S3 object's bytes in POSIX shared memory, named for a child process to map.

    The segment comes from `segments` and goes back there when closed; without one the
    input has a segment of its own, destroyed with it. The segment may be larger than
    `size` (segments are reused): readers take `size`.
    """

    def __init__(
        self,
        size: int,
        segments: Segments | None = None,
        segment: shared_memory.SharedMemory | None = None,
    ) -> None:
        self.size = size
        self._segments = segments if segments is not None else Segments()
        taken = segment if segment is not None else self._segments.take_now(size)
        self._shm: shared_memory.SharedMemory | None = taken
        self.name = taken.name
        view = taken.buf
        assert view is not None  # a created segment is always mapped
        self._view = view
        # Which version of the object these bytes are, as the read found it (its ETag
        # without quotes, its version id): written into the output's lineage.
        self.etag = ""
        self.version_id = ""

    @classmethod
    async def made(cls, size: int, segments: Segments) -> SharedInput:
        """An input whose segment may have to wait for room (`Segments.take`)."""
        return cls(size, segments, await segments.take(size))

    def write_at(self, offset: int, chunk: bytes) -> None:
        self._view[offset : offset + len(chunk)] = chunk

    def close(self) -> None:
        """Hand the segment back for reuse. Idempotent."""
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        self._segments.give(shm)

    def __enter__(self) -> SharedInput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
