"""A set of S3 keys in 17 bytes each: a sorted array of 16-byte digests and a byte of flags.

The audit holds one per stage: the output keys of every task in a manifest, against which
the stage's listing is marked (exists, written more than once, its chain marker exists)
and from which each task's facts are read back. A digest instead of the key keeps a
million keys in 17 MB whatever their length; at 16 bytes (BLAKE2b), two keys of a
billion-key manifest share one with a chance below 10^-20.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 16
_DTYPE = np.dtype(f"S{DIGEST_BYTES}")

# Flags of one key.
EXISTS = 1  # the listing has it (its latest version is an object, not a delete marker)
WRITTEN_TWICE = 2  # the listing has more than one version of it (never a delete marker)
MARKER = 4  # its chain marker `<key>.chain` exists
VISITED = 8  # the audit has reported the task of this key (a repeated line is not)


def digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=DIGEST_BYTES).digest()


class DigestBuilder:
    """Collects the digests of keys as they stream by (16 bytes each, nothing else)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def add(self, key: str) -> None:
        self._buffer += digest(key)

    def build(self) -> KeyIndex:
        """The index: sorted, each key once (a task on two lines is one key). For a moment
        it takes about twice its size: the collected digests and their sorted copy."""
        digests = np.frombuffer(self._buffer, dtype=_DTYPE).copy()
        self._buffer = bytearray()
        digests.sort()
        return KeyIndex(digests[_first_of_each(digests)])


class TaggedDigestBuilder(DigestBuilder):
    """The same, each key with a small number (its group): 4 bytes more a key."""

    def __init__(self) -> None:
        super().__init__()
        self._tags = array.array("I")

    def add(self, key: str, tag: int = 0) -> None:
        super().add(key)
        self._tags.append(tag)

    def build(self) -> KeyIndex:
        """The index; a key added twice keeps its first tag."""
        digests = np.frombuffer(self._buffer, dtype=_DTYPE)
        tags = np.frombuffer(self._tags, dtype=np.uint32)
        order = np.argsort(digests, kind="stable")
        digests, tags = digests[order], tags[order]
        self._buffer, self._tags = bytearray(), array.array("I")
        first = _first_of_each(digests)
        return KeyIndex(digests[first], tags[first])


def _first_of_each(sorted_digests: np.ndarray) -> np.ndarray:
    """Which places of a sorted array hold the first of their run of equal digests."""
    first = np.ones(len(sorted_digests), dtype=bool)
    first[1:] = sorted_digests[1:] != sorted_digests[:-1]
    return first


class KeyIndex:
    def __init__(self, sorted_digests: np.ndarray, tags: np.ndarray | None = None) -> None:
        self._digests = sorted_digests
        self.flags = np.zeros(len(sorted_digests), dtype=np.uint8)
        self.tags = tags  # each key's tag (TaggedDigestBuilder), in the digests' order

    def count_by_tag(self, tags: int, flag: int = 0) -> np.ndarray:
        """Keys per tag 0..tags-1: all of them, or those with `flag` set."""
        assert self.tags is not None
        weights = None if not flag else (self.flags & flag) > 0
        return np.bincount(self.tags, weights=weights, minlength=tags).astype(np.int64)

    def __len__(self) -> int:
        return len(self._digests)

    def positions(self, keys: Sequence[str]) -> np.ndarray:
        """Each key's place in the index, or -1 for a key it does not hold."""
        if not keys or not len(self._digests):
            return np.full(len(keys), -1, dtype=np.int64)
        wanted = np.array([digest(k) for k in keys], dtype=_DTYPE)
        at = np.searchsorted(self._digests, wanted)
        inside = at < len(self._digests)
        found = np.zeros(len(keys), dtype=bool)
        found[inside] = self._digests[at[inside]] == wanted[inside]
        return np.where(found, at, -1)

    def mark(self, keys: Sequence[str], flag: int) -> int:
        """Set `flag` on the keys it holds; how many of `keys` it does not hold."""
        at = self.positions(keys)
        held = at[at >= 0]
        self.flags[held] |= flag
        return int(len(keys) - len(held))

    def flags_at(self, positions: np.ndarray) -> list[int]:
        """The flags at places `positions` gave (0 for a key it does not hold)."""
        held = self.flags[np.maximum(positions, 0)] if len(self.flags) else positions * 0
        return np.where(positions >= 0, held, 0).tolist()  # type: ignore[no-any-return]

    def first_visits(self, positions: np.ndarray) -> list[bool]:
        """For each place, whether this is the first time its key's task is reported (a
        repeated line is not): marks them visited."""
        first = []
        for at in positions.tolist():
            new = at >= 0 and not self.flags[at] & VISITED
            if new:
                self.flags[at] |= VISITED
            first.append(bool(new))
        return first
