from collections import Counter

import pytest

from palimpsest.platform.types import ConfigError
from palimpsest.serving.ab import Router


def test_assignment_is_sticky_and_follows_the_weights():
    r = Router(("a", "b"), (3.0, 1.0))
    ids = [f"session-{i}" for i in range(4000)]
    first = [r.assign(s) for s in ids]
    assert first == [Router(("a", "b"), (3.0, 1.0)).assign(s) for s in ids]  # same answer on any replica
    share = Counter(first)["a"] / len(ids)
    assert 0.72 < share < 0.78


def test_a_zero_weight_arm_gets_no_new_session_and_an_explicit_arm_wins():
    r = Router(("a", "b", "c"), (1.0, 0.0, 1.0))
    assert "b" not in {r.assign(f"s{i}") for i in range(2000)}
    assert r.choose("s1", "b") == "b"
    with pytest.raises(ConfigError, match="unknown arm"):
        r.choose("s1", "zzz")


def test_shifting_weight_moves_only_sessions_across_the_boundary():
    before = Router(("a", "b"), (1.0, 1.0))
    after = Router(("a", "b"), (1.0, 3.0))
    ids = [f"s{i}" for i in range(2000)]
    moved = [s for s in ids if before.assign(s) != after.assign(s)]
    assert all(before.assign(s) == "a" and after.assign(s) == "b" for s in moved)


def test_bad_weights_are_refused():
    with pytest.raises(ConfigError):
        Router(("a",), (0.0,))
    with pytest.raises(ConfigError):
        Router(("a", "b"), (1.0,))


def test_shadow_fidelity_is_zero_for_the_same_distribution_and_grows_with_the_difference():
    import math

    from palimpsest.serving.shadow import fidelity, sampled

    p = [{1: math.log(0.7), 2: math.log(0.2), 3: math.log(0.05)}, {4: math.log(0.9), 5: math.log(0.05)}]
    assert fidelity(p, p) == (0.0, 1.0)
    near = [{1: math.log(0.6), 2: math.log(0.3), 3: math.log(0.05)}, {4: math.log(0.9), 5: math.log(0.05)}]
    far = [{2: math.log(0.7), 1: math.log(0.2), 3: math.log(0.05)}, {5: math.log(0.9), 4: math.log(0.05)}]
    kl_near, top1_near = fidelity(near, p)
    kl_far, top1_far = fidelity(far, p)
    assert 0 < kl_near < kl_far and top1_near == 1.0 and top1_far == 0.0
    with pytest.raises(ValueError):
        fidelity(p[:1], p)
    # sampling is a deterministic draw per (session, t) at the configured rate
    draws = [sampled(f"s{i}", i % 7, 0.25) for i in range(4000)]
    assert draws == [sampled(f"s{i}", i % 7, 0.25) for i in range(4000)] and 0.22 < sum(draws) / 4000 < 0.28
    assert not any(sampled(f"s{i}", 0, 0.0) for i in range(100))
