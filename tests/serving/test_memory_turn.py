"""A memory arm's turn where the memory sends nothing (the prompt left nothing out, or its span gate is shut) is
its policy's own turn: the soft positions' room goes back to the text, so such a memory costs the actor nothing
(``serving.turn.turn._with_memory``). Where it sends a span, the turn keeps the room and carries the span."""

from __future__ import annotations

import asyncio

from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.compile.budget import Budget
from palimpsest.serving.turn.request import TurnRequest
from palimpsest.serving.turn.turn import Sized, run_turn
from tests.helpers import STEPS, TASK, step

TOTAL, REPLY, SOFT = 600, 16, 64


def _runtime(path) -> Runtime:
    rt = Runtime(Ledger(str(path)))
    rt.ledger.create_session("s", TASK)
    for t in range(14):
        action, obs = STEPS[t % len(STEPS)]
        rt.append("s", step(t, f"{action} # {t}", f"{obs}\n" + f"value={t * 7} " * 30))
    return rt


def _served(rt: Runtime, soft: int, span=None):
    """The ids the actor got, the soft positions the stream's opening named, the span sent, and the result."""
    got: dict = {}

    async def generate(request, memory):
        got["ids"], got["memory"] = request["context"] + request["bridge"], memory
        return {"text": "ok", "token_ids": [1], "prompt_tokens": 1, "actor_ms": 0.0, "soft_tokens": 0,
                "cached_tokens": 0}

    async def memory_for(ct):
        got["read_from"] = list(ct.prompt.ids)
        return span

    async def started(ct, n):
        got["opening_soft"] = n

    sized = Sized(rt.policy({"type": "pace"}), Budget(TOTAL, REPLY, soft))
    res = asyncio.run(run_turn(rt, TurnRequest("s"), sized, generate, 0, memory_for if soft else None,
                               started=started))
    return got, res


def test_a_memory_that_sends_nothing_serves_the_policys_own_prompt(tmp_path):
    plain, _ = _served(_runtime(tmp_path / "plain.db"), 0)
    rt = _runtime(tmp_path / "mem.db")
    shut, res = _served(rt, SOFT, span=None)
    assert shut["ids"] == plain["ids"] and shut["memory"] is None and shut["opening_soft"] == 0
    assert res.sized.budget == Budget(TOTAL, REPLY) and res.compiled.prompt.reserve == REPLY
    assert shut["read_from"] != plain["ids"]  # the span was read from a prompt with its room: the check can fail
    # the preview with room was neither audited nor stored: one turn recorded, at the budget it was served at
    assert rt.ledger.turns_recorded("s", res.compiled.plan.config_hash, TOTAL) == 1


def test_a_memory_that_sends_a_span_keeps_its_room_and_the_span_reaches_the_actor(tmp_path):
    plain, _ = _served(_runtime(tmp_path / "plain.db"), 0)
    span = {"soft": [[0.0]] * 4}
    sent, res = _served(_runtime(tmp_path / "mem.db"), SOFT, span=span)
    assert sent["memory"] is span and sent["opening_soft"] == 4
    assert sent["ids"] == sent["read_from"] != plain["ids"] and res.sized.budget == Budget(TOTAL, REPLY, SOFT)


def test_without_the_room_the_policy_is_the_one_for_that_budget():
    """A request's context edit puts the budget's reserve in the policy's watermarks: a turn served without the
    soft positions takes the policy resolved for that budget, not the one for the budget with the room."""
    sized = Sized("with room", Budget(TOTAL, REPLY, SOFT), policy_at=lambda b: ("at", b.total, b.reserve))
    plain = sized.without_soft()
    assert plain.budget == Budget(TOTAL, REPLY) and plain.policy == ("at", TOTAL, REPLY)
    assert Sized("p", Budget(TOTAL, REPLY, SOFT)).without_soft().policy == "p"  # no edit: the arm's own
