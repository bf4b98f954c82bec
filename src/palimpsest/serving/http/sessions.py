"""Palimpsest's own session routes' logic (sessions, steps, turns, glimpses, audit, outcomes) and the recorder of
chat histories that both chat protocols share (``record_chat``). ``ingress.py`` holds the routes; every
function takes the replica (``replica.py``) and answers in Palimpsest's wire schemas (``schemas.py``).
"""

from __future__ import annotations

import asyncio
import json
import uuid

from fastapi import Request

from palimpsest.platform.types import StepRecord
from palimpsest.serving.http.openai_protocol import new_steps, parse_messages, step_view
from palimpsest.serving.http.schemas import (
    ChatIn,
    GlimpseIn,
    GlimpseOut,
    OutcomeIn,
    SessionIn,
    SessionOut,
    StepIn,
    StepOut,
    TurnIn,
    TurnOut,
)
from palimpsest.serving.http.server import ARM_HEADER, HTTPProblem, Tenant


async def record_chat(replica, body: ChatIn, tenant: Tenant, ext: str, request: Request) -> str:
    """Record a chat request's message list in its session (the chat proxy and the Messages endpoint alike):
    the session is created on first sight, new steps are appended (resent ones must hash the same), and the
    next turn's embeddings are primed. Returns the session's internal id."""
    cfg, ledger = replica.cfg, replica.runtime.ledger
    if len(body.messages) > cfg.limits.max_messages:
        raise HTTPProblem(413, f"messages: {len(body.messages)} messages; at most {cfg.limits.max_messages} are "
                               "accepted")
    if body.tools and body.tool_choice != "none" and not replica.actor_info.get("tool_parser"):
        raise HTTPProblem(422, "tools: this actor reads no tool calls (configure actor.tool_parser and a "
                               "tool-capable actor.chat_template), or send tool_choice \"none\"")
    sid = tenant.internal(ext)
    parsed = parse_messages(body.messages, cfg.proxy.user_messages_after_actions)
    for s in parsed.steps:
        size = len(s.action) + len(s.observation or "")
        if size > cfg.limits.max_step_chars:
            raise HTTPProblem(413, f"messages: step t={s.t} has {size} characters; at most {cfg.limits.max_step_chars}")
    arm = replica.router.choose(sid, request.headers.get(ARM_HEADER))
    # Tool declarations belong to the session's stable prefix: recorded with it, declared in the system message
    # (a later request declaring other tools for the same session is a 409).
    tools = json.dumps(body.tools, sort_keys=True, ensure_ascii=False) if body.tools else None
    await asyncio.to_thread(ledger.create_session, sid, parsed.task, parsed.system, tools, {"arm": arm})

    def record() -> list:
        fresh = new_steps(ledger.hashes(sid), parsed.steps, parsed.alternates)
        return ledger.append_many(sid, fresh) if fresh else []

    appended = await asyncio.to_thread(record)
    if appended:  # the turn's query embeddings and the new steps' keys, before the turn plans (as POST /steps)
        await replica.primed(sid, appended)
    return sid


async def create(replica, tenant: Tenant, body: SessionIn, request: Request) -> SessionOut:
    ext = body.session_id or uuid.uuid4().hex
    sid = tenant.internal(ext)
    arm = replica.router.choose(sid, body.arm or request.headers.get(ARM_HEADER))
    ledger = replica.runtime.ledger
    s = await asyncio.to_thread(ledger.create_session, sid, body.task, body.system, body.tools, {"arm": arm})
    n = await asyncio.to_thread(ledger.count, sid)
    return SessionOut(session_id=ext, arm=replica.arm_of(s), steps=n)


async def append(replica, tenant: Tenant, ext: str, body: StepIn) -> StepOut:
    """A step, durable on return. Without ``t`` it is the next one (assigned under the session's lock, so
    concurrent appends each get their own); with ``t`` the idempotent and conflict rules apply."""
    session_id = tenant.internal(ext)
    size = len(body.thought) + len(body.action) + len(body.observation or "")
    limit = replica.cfg.limits.max_step_chars
    if size > limit:
        raise HTTPProblem(413, f"the step has {size} characters; at most {limit} are accepted")
    ledger = replica.runtime.ledger
    rec = StepRecord(t=body.t or 0, kind=body.kind, thought=body.thought, action=body.action,
                     observation=body.observation, authority=body.authority, tool=body.tool)
    step = await asyncio.to_thread(ledger.append if body.t is not None else ledger.append_next, session_id, rec)
    await replica.primed(session_id, [step])
    return StepOut(session_id=ext, step_id=step.id, t=step.t)


async def turn(replica, tenant: Tenant, ext: str, body: TurnIn | None) -> TurnOut:
    out = await replica.turn((body or TurnIn()).request(tenant.internal(ext)))
    return out.model_copy(update={"session_id": ext})


async def glimpse(replica, tenant: Tenant, ext: str, body: GlimpseIn) -> GlimpseOut:
    text = await asyncio.to_thread(replica.runtime.glimpse, tenant.internal(ext), body.step_id)
    return GlimpseOut(session_id=ext, step_id=body.step_id, text=text)


async def steps(replica, tenant: Tenant, ext: str, start: int, limit: int) -> dict:
    sid = tenant.internal(ext)
    ledger = replica.runtime.ledger
    page = await asyncio.to_thread(ledger.steps, sid, start, limit)
    total = await asyncio.to_thread(ledger.count, sid)
    return {"session_id": ext, "start": start, "total": total,
            "next": start + len(page) if start + len(page) < total else None, "steps": [step_view(s) for s in page]}


async def audit(replica, tenant: Tenant, ext: str, plans: bool) -> dict:
    turns = await asyncio.to_thread(replica.runtime.ledger.audit, tenant.internal(ext))
    if not plans:
        for t in turns:
            t.pop("plan")
    return {"session_id": ext, "turns": turns}


async def outcome(replica, tenant: Tenant, ext: str, body: OutcomeIn) -> dict:
    sid = tenant.internal(ext)
    ledger = replica.runtime.ledger
    s = await asyncio.to_thread(ledger.session, sid)
    arm = replica.arm_of(s)
    await asyncio.to_thread(ledger.record_outcome, sid, arm, body.value, body.note)
    replica.metrics.outcomes.labels(arm=arm).observe(body.value)
    return {"session_id": ext, "arm": arm, "value": body.value}
