"""specjax.shape_reuse: which already-used shape a padded dispatch takes."""
import pytest

from specjax.shape_reuse import ShapeReuse


def test_first_use_is_the_asked_shape_and_is_remembered():
    r = ShapeReuse(slack=4)
    assert r.pick("k", (16, 256)) == (16, 256)
    assert r.pick("k", (16, 256)) == (16, 256) and r.reused == 0
    assert r.used["k"] == {(16, 256)}


def test_reuse_within_slack_and_cover():
    r = ShapeReuse(slack=4)
    r.pick("k", (16, 256))
    assert r.pick("k", (8, 256)) == (16, 256)  # 2x the size
    assert r.pick("k", (4, 256)) == (16, 256)  # 4x: still within slack
    assert r.pick("k", (2, 256)) == (2, 256)  # 8x: a new shape, remembered
    assert r.pick("k", (2, 128)) == (2, 256)
    assert r.pick("k", (16, 512)) == (16, 512)  # not covered in every dimension
    assert r.pick("k", (32, 128)) == (32, 128)  # (16, 256) has as many tokens but fewer rows
    assert r.reused == 3


def test_smallest_cover_wins_and_keys_and_limits_separate():
    r = ShapeReuse(slack=8)
    assert [r.pick("k", d) for d in [(32, 64), (8, 64), (8, 128)]] == [(32, 64), (32, 64), (8, 128)]
    assert r.pick("k", (4, 64)) == (8, 128)  # the smaller of the two covers
    assert r.pick("other", (4, 64)) == (4, 64)  # another program family
    assert r.pick("k", (4, 100), limit=600) == (4, 100)  # (8, 128) = 1024 tokens is over the limit
    assert r.pick("k", (1,)) == (1,)  # another rank never matches


def test_need_widens_the_slack_not_the_limit():
    r = ShapeReuse(slack=4)
    r.pick("k", (4, 128))
    assert r.pick("k", (4, 16)) == (4, 16)  # 8x its size: compiled
    r = ShapeReuse(slack=4)
    r.pick("k", (4, 128))
    assert r.pick("k", (4, 16), need=4 * 128) == (4, 128)  # counted as 4 x 128: reused
    assert r.pick("k", (2, 16), need=2 * 16) == (2, 16)  # a need no larger than the size changes nothing
    assert r.pick("k", (4, 32), need=4 * 128, limit=256) == (4, 32)  # the limit still holds
    assert r.reused == 1


def test_bad_slack():
    with pytest.raises(ValueError, match="slack"):
        ShapeReuse(slack=0.5)
