"""The audit's key set: a digest a key, flags set by listings, each task reported once."""

from __future__ import annotations

from sqsinfer.ops.keyindex import EXISTS, MARKER, DigestBuilder


def test_keys_are_held_once_flagged_and_visited_once():
    builder = DigestBuilder()
    for key in ("s3://b/out/a.npy", "s3://b/out/b.npy", "s3://b/out/a.npy", "s3://b/out/c.npy"):
        builder.add(key)
    index = builder.build()
    assert len(index) == 3  # a key named twice is one key
    # A listing marks what it holds; what no task names is counted, not held.
    assert index.mark(["s3://b/out/a.npy", "s3://b/out/stray.npy"], EXISTS) == 1
    assert index.mark(["s3://b/out/a.npy"], MARKER) == 0
    at = index.positions(["s3://b/out/a.npy", "s3://b/out/b.npy", "s3://b/out/zzz.npy"])
    assert index.flags_at(at) == [EXISTS | MARKER, 0, 0]
    # A task on two lines (even in one chunk) is reported once.
    again = index.positions(["s3://b/out/c.npy", "s3://b/out/c.npy", "s3://b/out/zzz.npy"])
    assert index.first_visits(again) == [True, False, False]
    assert index.first_visits(index.positions(["s3://b/out/c.npy"])) == [False]


def test_an_empty_manifest_makes_an_empty_index():
    index = DigestBuilder().build()
    assert len(index) == 0 and index.mark(["s3://b/out/a.npy"], EXISTS) == 1
    assert index.flags_at(index.positions(["s3://b/out/a.npy"])) == [0]
