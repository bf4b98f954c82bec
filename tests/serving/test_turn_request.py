"""A turn as asked is one type from the route to the actor (``serving.turn.request.TurnRequest``): every route
builds it, the replica and the turn service carry it, and the actor is sent its fields beside the compiled ids."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

from palimpsest.platform import Ledger, Runtime
from palimpsest.platform.compile.budget import Budget
from palimpsest.serving.http.schemas import TurnIn
from palimpsest.serving.turn.replica import Replica
from palimpsest.serving.turn.request import TurnRequest
from palimpsest.serving.turn.turn import Sized, TurnService, run_turn
from tests.helpers import STEPS, TASK, step

HTTP = Path(__file__).resolve().parents[2] / "src" / "palimpsest" / "serving" / "http"
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]


def test_the_actor_is_sent_the_requests_own_fields_and_the_reply_the_budget_set(tmp_path):
    rt = Runtime(Ledger(str(tmp_path / "l.db")))
    rt.ledger.create_session("s", TASK)
    for t, (action, obs) in enumerate(STEPS[:3]):
        rt.append("s", step(t, action, obs))
    req = TurnRequest("s", max_tokens=99, temperature=0.5, seed=3, top_p=0.9, stop=["\n\n"], tool_choice="auto",
                      parallel_tool_calls=False, noted={"metadata": "{}"})
    sent = []

    async def generate(request, memory):
        sent.append(request)
        return {"text": "ls", "token_ids": [1], "prompt_tokens": 1, "actor_ms": 0.0, "soft_tokens": 0,
                "cached_tokens": 0}

    sized = Sized(rt.policy({"type": "pace"}), Budget(900, 16), tools=TOOLS)
    res = asyncio.run(run_turn(rt, req, sized, generate, 0))
    (request,) = sent
    ids = {k: request.pop(k) for k in ("context", "bridge", "messages")}
    assert ids["context"] == list(res.compiled.prompt.context_ids)
    assert request == {"max_tokens": 16, "temperature": 0.5, "seed": 3, "top_p": 0.9, "stop": ["\n\n"],
                       "kind": "turn", "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False}
    # no tools declared (or an actor without a tool parser): no tool fields, and unset sampling fields are not sent
    assert TurnRequest("s").actor_fields(16, None) == {"max_tokens": 16, "temperature": 0.0, "seed": None,
                                                       "kind": "turn"}
    noted = {"metadata": "{}"}
    one = TurnRequest("s", stop="END", noted=noted)
    noted["user_named"] = "x"  # the route's dict changes after the request was built: the request does not
    assert one.stop == ("END",) and one.noted == {"metadata": "{}"}


def test_the_native_body_reads_into_the_same_request():
    edits = {"kind": "clear_tool_uses", "keep_tool_uses": 2}
    body = TurnIn.model_validate({"budget": 900, "max_tokens": 8, "stop": ["x"], "edits": edits})
    req = body.request("t::s")
    assert isinstance(req, TurnRequest) and req.session_id == "t::s"
    assert (req.budget, req.max_tokens, req.stop, req.edits) == (900, 8, ("x",), body.edits)
    assert set(TurnIn.model_fields) <= {f.name for f in TurnRequest.__dataclass_fields__.values()}


def _calls(name: str) -> list[tuple[str, ast.Call]]:
    out = []
    for path in sorted(HTTP.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "replica"):
                out.append((path.name, node))
    return out


def test_every_route_hands_the_replica_one_turn_request():
    """The replica's turn and its size check take the request alone (and, for a stream, where to send it); nothing
    of the request travels beside it."""
    assert list(inspect.signature(Replica.turn).parameters) == ["self", "req", "emit", "started"]
    assert list(inspect.signature(Replica.check_turn).parameters) == ["self", "req"]
    assert list(inspect.signature(TurnService.serve).parameters) == ["self", "session", "arm", "req", "emit",
                                                                     "started"]
    turns, checks = _calls("turn"), _calls("check_turn")
    assert {f for f, _ in turns} == {"sessions.py", "openai_proxy.py", "anthropic_proxy.py", "responses_proxy.py"}
    for where, call in turns + checks:
        assert len(call.args) == 1, f"{where}:{call.lineno} passes more than the request"
        assert {k.arg for k in call.keywords} <= {"emit", "started"}, f"{where}:{call.lineno}"
