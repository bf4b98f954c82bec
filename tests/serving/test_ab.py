from collections import Counter

import pytest

from palimpsest.platform.types import ConfigError
from palimpsest.serving.turn.router import Router


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


def test_shadow_fidelity_is_the_exact_kl_over_the_whole_vocabulary():
    """Two distributions that differ where a top-k list cannot see: each puts its mass on its own 20 tokens, so
    a KL over {both top-20 lists, the rest} collapses towards 0. The measure must be the exact KL(q || p)."""
    import math

    import torch

    from palimpsest.models.scorer import fidelity
    from palimpsest.serving.turn.shadow import sampled

    V = 500
    q = torch.full((2, V), -6.0, dtype=torch.float64)
    p = torch.full((2, V), -6.0, dtype=torch.float64)
    q[:, :20] = 4.0  # the student's mass on tokens 0-19
    p[:, 20:40] = 4.0  # the teacher's on tokens 20-39
    p[1, :20] = 1.0  # at the second position the teacher gives the student's tokens some mass too

    def exact(a, b):  # by hand, in plain floats
        total = 0.0
        for j in range(a.shape[0]):
            za = math.log(sum(math.exp(x) for x in a[j].tolist()))
            zb = math.log(sum(math.exp(x) for x in b[j].tolist()))
            total += sum(math.exp(x - za) * ((x - za) - (y - zb)) for x, y in zip(a[j].tolist(), b[j].tolist()))
        return total / a.shape[0]

    kl, top1 = fidelity(q.float(), p.float())
    assert kl == pytest.approx(exact(q, p), rel=1e-4) and kl > 5.0
    assert top1 == 0.0  # tokens 0 and 20 lead
    assert fidelity(q, q) == (pytest.approx(0.0, abs=1e-12), 1.0)
    near = q.clone()
    near[:, 0] += 0.5
    assert 0 < fidelity(near, q)[0] < fidelity(p, q)[0]
    with pytest.raises(ValueError):
        fidelity(q[:1], q)
    # sampling is a deterministic draw per (session, t) at the configured rate
    draws = [sampled(f"s{i}", i % 7, 0.25) for i in range(4000)]
    assert draws == [sampled(f"s{i}", i % 7, 0.25) for i in range(4000)] and 0.22 < sum(draws) / 4000 < 0.28
    assert not any(sampled(f"s{i}", 0, 0.0) for i in range(100))


def test_a_turn_that_served_its_reference_is_recorded_identical_and_never_scored(tmp_path):
    """The lane compares the served ids with the reference's: the `full` arm (and any policy while everything
    fits) serves the reference itself, a KL of 0 by construction; that turn is recorded `identical`, the
    scorer is not called, and a turn that changed something is scored."""
    import asyncio

    from palimpsest.platform import Ledger, Runtime
    from palimpsest.platform.compile.budget import Budget
    from palimpsest.serving.serve_config import ABConfig
    from palimpsest.serving.turn.shadow import ShadowLane
    from tests.helpers import STEPS, TASK, per_turn, step

    rt = Runtime(Ledger(str(tmp_path / "l.db")))
    for sid in ("s@full", "s@last2"):
        rt.ledger.create_session(sid, TASK)
        for t, (action, obs) in enumerate(STEPS):
            rt.append(sid, step(t, action, obs))
    calls = []

    async def scorer(reference, reply, threads=None):
        calls.append(len(reference))
        return 0.25, 0.5

    async def run():
        lane = ShadowLane(rt, ABConfig(shadow_rate=1.0, shadow_queue=8), window=4096, busy=lambda: False)
        for sid, policy in (("s@full", rt.policy("full")), ("s@last2", rt.policy(per_turn("window", k=2)))):
            ct = rt.turn(sid, policy, Budget(4000, 8))
            lane.offer(sid, sid.split("@")[1], ct, [1, 2, 3], 1, False, policy, scorer)
        assert await lane.drained(60)
        return lane.state()

    state = asyncio.run(run())
    rows = {r["session_id"]: r for r in rt.ledger.shadows()}
    assert rows["s@full"]["status"] == "identical" and rows["s@full"]["kl"] is None
    assert rows["s@full"]["reference"] == "full"
    assert rows["s@last2"]["status"] == "scored" and rows["s@last2"]["kl"] == 0.25
    assert len(calls) == 1 and state["identical"] == 1 and state["scored"] == 1


def test_the_full_reference_is_the_whole_history_uncompacted_whenever_it_fits(tmp_path):
    """Between 0.9 and 1.0 of the window the whole history still fits: the reference is every step raw (a
    default `full` policy in compaction epochs would have compacted it to the low watermark). Past the window,
    the reference is the arm's policy planned per turn at the window, labelled so, never smaller than a
    per-turn plan at a smaller budget; a reference smaller than the served prompt is noted."""
    from palimpsest.platform import Ledger, Runtime
    from palimpsest.platform.compile.budget import Budget
    from palimpsest.platform.types import Resolution
    from palimpsest.serving.turn.shadow import reference, smaller_note
    from tests.helpers import TASK, per_turn, step

    rt = Runtime(Ledger(str(tmp_path / "l.db")))
    rt.ledger.create_session("s", TASK)
    for t in range(30):
        rt.append("s", step(t, f"cat src/module_{t}.py", f"line {t} " * 40))
    snap = rt.snapshot("s")
    whole = rt.turn("s", per_turn("full"), Budget(10**6, 8), record=False)
    n = len(whole.prompt.ids)
    assert (whole.plan.resolution == Resolution.FULL).all()
    window = int(n / 0.95) + 8  # the history takes 95% of what the window leaves beside the reply
    label, ids = reference(rt, snap, rt.policy("pace"), window, 8)
    assert label == "full" and ids == list(whole.prompt.ids)
    # a default (epochs) `full` at that window compacts: what the reference must not be
    assert len(rt.compile(snap, rt.policy("full"), Budget(window, 8)).prompt.ids) < n

    small = n // 2
    label, ids = reference(rt, snap, rt.policy("pace"), small, 8)
    assert label == f"pace per turn@{small}" and len(ids) <= small - 8
    planned = rt.turn("s", per_turn("pace"), Budget(small, 8), record=False)
    assert ids == list(planned.prompt.ids)
    assert len(ids) >= len(rt.turn("s", per_turn("pace"), Budget(small // 2, 8), record=False).prompt.ids)
    assert smaller_note(10, 12) == "reference smaller than served: 10 < 12 ids" and smaller_note(12, 12) == ""
