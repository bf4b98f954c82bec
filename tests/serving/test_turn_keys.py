"""A turn that plans waits for the keys the background enrichment has not written yet: a boundary's plan serves
its whole epoch, and one made on missing keys differs between two arms of one configuration (the A/A control
of 2026-12-04 found 5 of 10 such pairs with different prompts). An append-only turn plans nothing and waits
for nothing."""

import asyncio

import pytest

from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.compile.budget import Budget
from palimpsest.serving.turn.request import TurnRequest
from palimpsest.serving.turn.turn import Sized, compile_turn
from tests.helpers import STEPS, TASK, per_turn, step


def _session(rt, sid, n=12):
    rt.ledger.create_session(sid, TASK)
    for t in range(n):
        action, obs = STEPS[t % len(STEPS)]
        rt.append(sid, step(t, f"{action} # {t}", f"{obs}\n" + f"value={t * 7} " * 30), enrich=False)  # no keys yet


@pytest.mark.parametrize("wait", [5.0, 0.0])
def test_a_planning_turn_waits_for_missing_keys_unless_told_not_to(tmp_path, wait):
    rt = Runtime(Ledger(str(tmp_path / "l.db")))
    _session(rt, "s")
    assert rt.missing_keys("s") == 12
    sized = Sized(rt.policy(per_turn("pace")), Budget(900, 16), keys_wait_s=wait)
    ct, spent, fallback = asyncio.run(compile_turn(rt, TurnRequest("s"), sized, None))
    assert fallback is None
    if wait:
        assert ct.snapshot.has_key.all() and spent["keys_missing"] == 12 and rt.missing_keys("s") == 0
        assert not any(ct.plan.reasons[c].startswith("no key") for c in ct.plan.reason_code)
    else:  # the plan of whichever keys existed: none
        assert not ct.snapshot.has_key.any() and spent["keys_missing"] == 0


def test_an_append_only_turn_does_not_wait_and_a_boundary_does(tmp_path):
    rt = Runtime(Ledger(str(tmp_path / "l.db")))
    _session(rt, "s", n=3)
    pace = rt.policy({"type": "pace"})
    rt.turn("s", pace, Budget(6000, 16))  # the epoch starts: everything fits, nothing planned
    action, obs = STEPS[0]
    rt.append("s", step(3, action, obs), enrich=False)
    req, sized = TurnRequest("s"), Sized(pace, Budget(6000, 16), keys_wait_s=5.0)
    ct, spent, _ = asyncio.run(compile_turn(rt, req, sized, None))
    assert not ct.compacted and spent["keys_missing"] == 0 and rt.missing_keys("s") > 0
    for t in range(4, 40):  # past the high watermark: the next turn is a boundary
        rt.append("s", step(t, f"cat f{t}.py", "x = 1\n" * 60), enrich=False)
    ct, spent, _ = asyncio.run(compile_turn(rt, req, sized, None))
    assert ct.compacted and spent["keys_missing"] > 0 and ct.snapshot.has_key.all()
