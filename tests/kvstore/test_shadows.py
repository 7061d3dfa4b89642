"""ShadowCopies: which tier copies are redundant because a faster tier holds the block too."""

from __future__ import annotations

from kvstore.shadows import ShadowCopies

HOST, DISK, REMOTE = 1, 2, 4  # residency bits, fastest first


def test_a_copy_is_a_shadow_only_while_a_faster_tier_holds_the_block():
    shadows = ShadowCopies(3)
    shadows.update(b"k", DISK)  # demoted: the disk copy is the only one
    assert shadows.count(1) == 0
    shadows.update(b"k", HOST | DISK)  # promoted: the disk copy is now redundant
    assert shadows.oldest(1, lambda k: True) == b"k" and shadows.count(0) == 0
    shadows.update(b"k", DISK)  # evicted from the host: the disk copy matters again
    assert shadows.oldest(1, lambda k: True) is None


def test_every_lower_copy_is_a_shadow_and_the_top_copy_never_is():
    shadows = ShadowCopies(3)
    shadows.update(b"k", HOST | DISK | REMOTE)
    assert [shadows.count(t) for t in range(3)] == [0, 1, 1]
    shadows.update(b"k", DISK | REMOTE)  # the disk copy is now the top one
    assert [shadows.count(t) for t in range(3)] == [0, 0, 1]
    shadows.update(b"k", 0)
    assert [shadows.count(t) for t in range(3)] == [0, 0, 0]


def test_oldest_shadow_first_skipping_ineligible_ones():
    shadows = ShadowCopies(2)
    for key in (b"a", b"b", b"c"):
        shadows.update(key, HOST | DISK)
    shadows.update(b"a", HOST | DISK)  # a repeated update keeps its place in line
    assert shadows.oldest(1, lambda k: True) == b"a"
    assert shadows.oldest(1, lambda k: k != b"a") == b"b"  # a is pinned, say
    assert shadows.oldest(1, lambda k: False) is None
