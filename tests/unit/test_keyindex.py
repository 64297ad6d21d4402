"""The audit's key set: a digest a key, flags set by listings, each task reported once."""

from __future__ import annotations

from sqsinfer.ops.keyindex import EXISTS, MARKER, DigestBuilder, TaggedDigestBuilder


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


def test_tagged_keys_count_by_tag_and_keep_their_first_tag():
    builder = TaggedDigestBuilder()
    keys = [f"s3://b/out/{i}.npy" for i in range(1000)]
    for i, key in enumerate(keys):
        builder.add(key, i % 3)
    builder.add(keys[0], 2)  # the same task again, under another group: its first counts
    index = builder.build()
    assert len(index) == 1000
    assert index.count_by_tag(4).tolist() == [334, 333, 333, 0]
    index.mark(keys[:10], EXISTS)  # tags 0,1,2,0,1,2,0,1,2,0
    assert index.count_by_tag(4, EXISTS).tolist() == [4, 3, 3, 0]
    index.flags[:] = 0
    assert index.count_by_tag(3, EXISTS).tolist() == [0, 0, 0]
    assert TaggedDigestBuilder().build().count_by_tag(2).tolist() == [0, 0]
